"""`hostpool reap` and `hostpool run --reap` (issue 33, items 4 and 5): real files on
/dev/shm and on private tmpfs mounts in other mount namespaces (kept alive by a sleeping
process), real holders (fds, mappings), real SysV segments, the real host scan.

Other tests run beside these on the same host and leave their own orphans: the library
is only ever handed this test's objects, and `--yes` on the command line only ever runs
with `--dir` on a private namespace's tmpfs."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from hostpool.base.units import format_duration, parse_duration
from hostpool.cli import build_parser
from hostpool.errors import InvalidRequestError
from hostpool.host import reap, scan, sysv
from hostpool.host.model import ENGINES, HostObject, HostView
from tests import helpers, hostobjects

ROOT = Path(__file__).resolve().parents[1]
DROP_IN = ROOT / "deploy" / "systemd" / "vllm.service.d" / "hostpool-reap.conf"
EVERY_ENGINE = frozenset(ENGINES)
ANY_AGE = reap.Selection(min_age=0.0)
TIMEOUT = 300  # an upper bound for a busy host, never a timing assumption

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, others' /proc)")


def orphan_name(engine_prefix: str = "vllm_offload_") -> str:
    return f"{engine_prefix}reaptest_{secrets.token_hex(6)}.mmap"


def plant(path: str, size: int = 64 << 10) -> os.stat_result:
    """A file of `size` resident bytes at `path`, closed: an orphan."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, b"\x01" * size)
    finally:
        os.close(fd)
    return os.stat(path)


@pytest.fixture
def shm_files() -> Iterator[list[str]]:
    """Paths the test plants in /dev/shm (or anywhere): removed at the end if still there."""
    paths: list[str] = []
    yield paths
    for path in paths:
        with suppress(FileNotFoundError):
            os.unlink(path)


def object_of(view: HostView, st: os.stat_result) -> HostObject:
    found = [o for o in view.objects if o.identity == (st.st_dev, st.st_ino)]
    assert len(found) == 1, f"the scan found {len(found)} objects for the planted file"
    return found[0]


def _orphan(shm_files: list[str], name: str | None = None) -> tuple[str, os.stat_result]:
    """An orphan planted on /dev/shm as `name` (else `orphan_name()`), removed at the end if
    still there: its path and stat."""
    path = f"/dev/shm/{name or orphan_name()}"
    shm_files.append(path)
    return path, plant(path)


def _scanned(st: os.stat_result) -> tuple[HostView, HostObject]:
    """A host scan and the planted file's object in it."""
    view = scan.scan_host()
    return view, object_of(view, st)


def _mine(plan: reap.Plan, *objects: HostObject) -> tuple[HostObject, ...]:
    """The plan's candidates that are this test's (never another test's orphans)."""
    ids = {o.identity for o in objects}
    return tuple(c for c in plan.candidates if c.identity in ids)


@contextmanager
def holder(path: str, how: str) -> Iterator[subprocess.Popen[str]]:
    """A process holding `path` by an fd only (`fd`) or by a mapping only (`mapping`)."""
    code = (
        "import mmap, os, sys\n"
        "fd = os.open(sys.argv[1], os.O_RDWR)\n"
        "if sys.argv[2] == 'mapping':\n"
        "    m = mmap.mmap(fd, 0)\n"
        "    os.close(fd)\n"
        "print('ready', flush=True)\n"
        "sys.stdin.read()\n"
    )
    with hostobjects.ready_sleeper([sys.executable, "-c", code, path, how],
                                   stdin=subprocess.PIPE) as proc:  # fmt: skip
        yield proc


@contextmanager
def private_tmpfs(mountpoint: str = "/dev/shm") -> Iterator[tuple[int, str]]:
    """A private mount namespace with its own tmpfs on `mountpoint`, kept alive by a
    sleeping process: (its pid, the path this process reaches that tmpfs by). Killing the
    sleeper at the end takes the namespace, and the tmpfs with whatever is left on it."""
    script = (
        f"mount -t tmpfs -o size=16m hostpool-reaptest {mountpoint} && echo ready && exec sleep 600"
    )
    argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]
    with hostobjects.ready_sleeper(argv) as proc:
        yield proc.pid, f"/proc/{proc.pid}/root{mountpoint}"


def hostpool(*args: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "HOSTPOOL_INSTRUMENT"}
    return subprocess.run(
        [sys.executable, "-m", "hostpool", "--log-format", "json", *args],
        capture_output=True, text=True, timeout=timeout, env=env, check=False,
    )  # fmt: skip


# -- durations ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"), [("0", 0.0), ("30s", 30.0), ("10m", 600.0), ("2h", 7200.0),
                          ("1.5h", 5400.0), ("1d", 86400.0), ("45", 45.0)],
)  # fmt: skip
def test_durations_as_people_write_them(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "-1m", "10 minutes", "m", "1w", "1e3"])
def test_a_bad_duration_is_refused(text: str) -> None:
    with pytest.raises(InvalidRequestError, match="duration"):
        parse_duration(text)


def test_durations_print_short() -> None:
    assert [format_duration(s) for s in (0, 45, 600, 7380, 90000)] == [
        "0s", "45s", "10m", "2h3m", "1d1h",
    ]  # fmt: skip


# -- the library: plan and reap ----------------------------------------------------------


def test_an_orphan_on_dev_shm_is_removed_with_one_event(shm_files: list[str]) -> None:
    path, st = _orphan(shm_files)
    obj = object_of(scan.scan_host(), st)
    assert (obj.kind, obj.engine, obj.orphan, obj.path) == ("file", "vllm", True, path)
    mine = _mine(reap.plan(scan.scan_host(), ANY_AGE), obj)
    assert [c.identity for c in mine] == [obj.identity]
    with capture_logs() as logs:
        results = reap.reap(mine)
    assert [r.outcome for r in results] == ["removed"]
    assert not os.path.exists(path)
    reaped = [e for e in logs if e["event"] == "hostpool.reaped"]
    assert len(reaped) == 1
    event = reaped[0]
    assert (event["engine"], event["kind"], event["path"]) == ("vllm", "file", path)
    assert event["bytes"] == obj.resident_bytes >= 64 << 10
    assert event["size_bytes"] == 64 << 10
    assert isinstance(event["age_seconds"], float) and event["age_seconds"] >= 0


@pytest.mark.parametrize("how", ["fd", "mapping"])
def test_a_held_file_is_never_a_candidate(shm_files: list[str], how: str) -> None:
    path, st = _orphan(shm_files)
    with holder(path, how) as proc:
        view, obj = _scanned(st)
        assert not obj.orphan and [h.pid for h in obj.holders] == [proc.pid]
        assert _mine(reap.plan(view, reap.Selection(min_age=0.0, engines=EVERY_ENGINE)), obj) == ()
        assert os.path.exists(path)


@pytest.mark.parametrize("how", ["fd", "mapping"])
def test_a_file_opened_after_the_scan_is_kept(shm_files: list[str], how: str) -> None:
    """The race: the scan saw an orphan, a process opens (or maps) it before the unlink;
    the holders read again right before the unlink keep it."""
    path, st = _orphan(shm_files)
    mine = _mine(reap.plan(scan.scan_host(), ANY_AGE), object_of(scan.scan_host(), st))
    assert len(mine) == 1
    with holder(path, how) as proc:
        with capture_logs() as logs:
            results = reap.reap(mine)
        assert [r.outcome for r in results] == ["kept_held"]
        assert f"pid {proc.pid}" in results[0].detail
        assert os.path.exists(path)
        assert not [e for e in logs if e["event"] == "hostpool.reaped"]


def test_an_orphan_in_another_mount_namespace_is_removed_through_proc_root() -> None:
    with private_tmpfs() as (pid, shm):
        name = orphan_name()
        st = plant(f"{shm}/{name}")
        assert os.stat("/dev/shm").st_dev != st.st_dev  # really another tmpfs
        obj = object_of(scan.scan_host(), st)
        assert obj.orphan and obj.path is not None
        assert obj.path.startswith(f"/proc/{pid}/root/") and obj.path.endswith(f"/{name}")
        # out of the default reach (this mount namespace's): asked for, it is reached
        assert _mine(reap.plan(scan.scan_host(), ANY_AGE), obj) == ()
        every = dataclasses.replace(ANY_AGE, all_namespaces=True)
        results = reap.reap(_mine(reap.plan(scan.scan_host(), every), obj))
        assert [r.outcome for r in results] == ["removed"]
        assert os.listdir(shm) == []


def test_a_symlink_put_in_its_place_is_never_followed(shm_files: list[str], tmp_path: Path) -> None:
    """After the scan, the orphan's name becomes a symlink to a file on disk: the file
    survives and the symlink is left as it is."""
    path, st = _orphan(shm_files)
    mine = _mine(reap.plan(scan.scan_host(), ANY_AGE), object_of(scan.scan_host(), st))
    target = tmp_path / "precious"
    target.write_bytes(b"keep me")
    os.unlink(path)
    os.symlink(target, path)
    results = reap.reap(mine)
    assert [r.outcome for r in results] == ["kept_changed"]
    assert target.read_bytes() == b"keep me" and os.path.islink(path)


def test_a_symlinked_directory_in_the_path_refuses_the_file() -> None:
    """An object whose path runs through a symlinked directory (planted inside a
    container's /dev/shm) is refused, though the inode behind it is the planned one."""
    with private_tmpfs() as (_pid, shm):
        os.mkdir(f"{shm}/real")
        st = plant(f"{shm}/real/{orphan_name()}")
        os.symlink("real", f"{shm}/link")
        obj = object_of(scan.scan_host(), st)
        assert obj.path is not None and "/real/" in obj.path
        forged = dataclasses.replace(obj, path=obj.path.replace("/real/", "/link/"))
        results = reap.reap([forged])
        assert [r.outcome for r in results] == ["failed"]
        assert "symlink" in results[0].detail and results[0].errno is not None
        assert os.stat(f"{shm}/real/{os.path.basename(obj.path)}").st_ino == st.st_ino


def test_a_file_off_tmpfs_is_refused(tmp_path: Path) -> None:
    """A candidate whose directory is not on tmpfs (on disk here) is never unlinked."""
    path = str(tmp_path / orphan_name())
    st = plant(path)
    fake = HostObject("file", os.path.basename(path), path, "vllm", None, st.st_size,
                      st.st_size, (), True, 3600.0, identity=(st.st_dev, st.st_ino),
                      area="dev_shm")  # fmt: skip
    results = reap.reap([fake])
    assert [r.outcome for r in results] == ["failed"]
    assert "tmpfs" in results[0].detail and os.path.exists(path)


def test_a_fresh_orphan_under_min_age_is_left(shm_files: list[str]) -> None:
    path, st = _orphan(shm_files)
    view, obj = _scanned(st)
    planned = reap.plan(view, reap.Selection(min_age=600.0))
    assert _mine(planned, obj) == ()
    assert [s.reason for s in planned.skipped if s.obj.identity == obj.identity] == [
        "younger than --min-age"
    ]
    # and the re-check before the unlink holds to min_age on the file's own times
    assert [r.outcome for r in reap.reap([obj], min_age=600.0)] == ["kept_changed"]
    assert os.path.exists(path)


def test_a_scan_cut_short_plans_nothing(shm_files: list[str]) -> None:
    """Holders of processes a deadline left unread are missing: its orphans may not be."""
    _, st = _orphan(shm_files)
    view, obj = _scanned(st)
    assert len(_mine(reap.plan(view, ANY_AGE), obj)) == 1
    planned = reap.plan(dataclasses.replace(view, complete=False), ANY_AGE)
    assert planned.candidates == ()
    assert [s.reason for s in planned.skipped if s.obj.identity == obj.identity] == [
        "the scan was cut short"
    ]


def test_unknown_engines_only_when_asked(shm_files: list[str]) -> None:
    _, st = _orphan(shm_files, f"reaptest_{secrets.token_hex(6)}")
    view, obj = _scanned(st)
    assert obj.engine == "unknown"
    assert _mine(reap.plan(view, ANY_AGE), obj) == ()
    widened = reap.Selection(min_age=0.0, engines=frozenset({"unknown"}))
    assert len(_mine(reap.plan(view, widened), obj)) == 1


def test_memfds_are_never_candidates_nor_reapable() -> None:
    code = (
        "import os, sys\n"
        "fd = os.memfd_create(sys.argv[1])\n"
        "os.ftruncate(fd, 65536)\n"
        "os.write(fd, b'x' * 65536)\n"
        "print(fd, flush=True)\n"
        "sys.stdin.read()\n"
    )
    name = orphan_name()
    proc = subprocess.Popen([sys.executable, "-c", code, name], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        fd = int(proc.stdout.readline())
        view = scan.scan_host()
        memfds = [o for o in view.objects if o.kind == "memfd" and o.name == name]
        assert len(memfds) == 1 and not memfds[0].orphan and memfds[0].engine == "vllm"
        everything = reap.Selection(min_age=0.0, engines=EVERY_ENGINE, sysv=True)
        assert _mine(reap.plan(view, everything), memfds[0]) == ()
        with pytest.raises(InvalidRequestError, match="memfd"):
            reap.reap(memfds)
        # by its /proc fd link: /proc is not tmpfs, and the link is never followed
        forged = dataclasses.replace(
            memfds[0], kind="file", path=f"/proc/{proc.pid}/fd/{fd}", area="dev_shm"
        )
        assert [r.outcome for r in reap.reap([forged])] == ["failed"]
        assert os.stat(f"/proc/{proc.pid}/fd/{fd}").st_size == 65536  # still there
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def segment() -> Iterator[int]:
    """A real SysV segment (1 MiB, touched), no attachment; removed at the end."""
    with helpers.sysv_segment(1 << 20, 1 << 20) as shmid:
        yield shmid


def _segment_object(view: HostView, shmid: int) -> HostObject:
    found = [o for o in view.objects if o.kind == "sysv" and o.shmid == shmid]
    assert len(found) == 1
    return found[0]


def test_sysv_only_with_sysv(segment: int) -> None:
    view = scan.scan_host()
    obj = _segment_object(view, segment)
    assert obj.orphan
    without = reap.plan(view, reap.Selection(min_age=0.0, engines=EVERY_ENGINE))
    assert _mine(without, obj) == ()
    assert [s.reason for s in without.skipped if s.obj.shmid == segment] == [
        "SysV segment (reaped only with --sysv)"
    ]
    mine = _mine(reap.plan(view, reap.Selection(min_age=0.0, engines=EVERY_ENGINE, sysv=True)), obj)
    assert len(mine) == 1
    with capture_logs() as logs:
        assert [r.outcome for r in reap.reap(mine)] == ["removed"]
    assert segment not in {s.shmid for s in sysv.read_segments()}
    assert [e["shmid"] for e in logs if e["event"] == "hostpool.reaped"] == [segment]


def test_a_segment_attached_after_the_scan_is_kept(segment: int) -> None:
    view = scan.scan_host()
    obj = _segment_object(view, segment)
    with helpers.sysv_attached(segment):
        assert [r.outcome for r in reap.reap([obj])] == ["kept_held"]
    assert segment in {s.shmid for s in sysv.read_segments()}


# -- the command -------------------------------------------------------------------------


def test_dry_run_removes_nothing_and_yes_removes() -> None:
    with private_tmpfs() as (_pid, shm):
        names = [orphan_name(), orphan_name("psm_")]
        for name in names:
            plant(f"{shm}/{name}")
        plant(f"{shm}/keep_{secrets.token_hex(4)}")  # unknown engine: left alone
        dry = hostpool("reap", "--min-age", "0", "--dir", shm)
        assert dry.returncode == 0, dry.stderr
        lines = dry.stdout.splitlines()
        assert [li.split()[2] for li in lines[:-1]] == ["python", "vllm"]
        assert lines[-1].startswith("dry run: would remove 2 orphan(s)") and "--yes" in lines[-1]
        assert "1 engine unknown not selected" in dry.stdout
        assert len(os.listdir(shm)) == 3
        done = hostpool("reap", "--yes", "--min-age", "0", "--dir", shm)
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert [li.split()[0] for li in lines[:-1]] == ["removed", "removed"]
        assert lines[-1].startswith("removed 2 orphan(s)")
        assert [n for n in os.listdir(shm) if n.startswith("keep_")] == os.listdir(shm)
        events = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
        assert sorted(e["path"] for e in events if e["event"] == "hostpool.reaped") == sorted(
            f"{shm}/{n}" for n in names
        )


def test_json_output_shape() -> None:
    with private_tmpfs() as (_pid, shm):
        name = orphan_name()
        plant(f"{shm}/{name}")
        out = hostpool(
            "reap", "--json", "--yes", "--min-age", "0", "--dir", shm, "--engine", "vllm"
        )
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        assert set(doc) == {"dry_run", "min_age_seconds", "engines", "dirs", "all_namespaces",
                            "sysv", "unreadable_processes", "objects", "skipped",
                            "totals"}  # fmt: skip
        assert (doc["dry_run"], doc["engines"], doc["dirs"], doc["sysv"]) == (
            False, ["vllm"], [shm], False,
        )  # fmt: skip
        [obj] = doc["objects"]
        assert set(obj) == {"kind", "name", "path", "area", "engine", "pool", "size_bytes",
                            "resident_bytes", "links", "holders", "pod_uid", "container_id",
                            "orphan", "age_seconds", "outcome", "detail",
                            "freed_bytes"}  # fmt: skip
        assert (obj["path"], obj["outcome"], obj["detail"]) == (f"{shm}/{name}", "removed", None)
        assert (obj["area"], obj["links"]) == ("dev_shm", 1)
        assert doc["totals"]["removed"] == 1
        assert doc["totals"]["removed_bytes"] == obj["freed_bytes"] == obj["resident_bytes"] > 0
        assert doc["totals"]["outcomes"] == {"removed": 1}


def test_names_are_escaped_in_text_output() -> None:
    """A file name is anyone's: a newline in it cannot forge a line, an escape sequence
    cannot reach the terminal."""
    with private_tmpfs() as (_pid, shm):
        plant(f"{shm}/psm_x\nremoved      vllm forged\x1b[31m")
        out = hostpool("reap", "--min-age", "0", "--dir", shm)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert len(lines) == 2 and "\x1b" not in out.stdout
        assert lines[0].endswith("/psm_x\\nremoved      vllm forged\\x1b[31m")


def test_a_fresh_orphan_survives_the_default_min_age() -> None:
    with private_tmpfs() as (_pid, shm):
        plant(f"{shm}/{orphan_name()}")
        out = hostpool("reap", "--yes", "--dir", shm)
        assert out.returncode == 0, out.stderr
        assert "removed 0" in out.stdout and "younger than --min-age" in out.stdout
        assert len(os.listdir(shm)) == 1


def test_a_candidate_that_cannot_be_removed_is_exit_1() -> None:
    """The tmpfs turned read-only after the file was planted: the unlink fails (EROFS)."""
    with private_tmpfs() as (pid, shm):
        name = orphan_name()
        plant(f"{shm}/{name}")
        remount = ["nsenter", "-t", str(pid), "-m", "mount", "-o", "remount,ro", "/dev/shm"]
        subprocess.run(remount, check=True, timeout=60)
        out = hostpool("reap", "--yes", "--min-age", "0", "--dir", shm)
        assert out.returncode == 1, out.stdout + out.stderr
        assert out.stdout.startswith("FAILED") and "EROFS" in out.stdout
        assert "1 could not be removed" in out.stdout.splitlines()[-1]
        failed = [json.loads(li) for li in out.stderr.splitlines() if li.startswith("{")]
        assert [e["event"] for e in failed] == ["hostpool.reap_failed"]
        assert os.listdir(shm) == [name]


def test_a_subdirectory_limits_by_path() -> None:
    with private_tmpfs() as (_pid, shm):
        os.mkdir(f"{shm}/a")
        os.mkdir(f"{shm}/b")
        inside, outside = orphan_name(), orphan_name()
        plant(f"{shm}/a/{inside}")
        plant(f"{shm}/b/{outside}")
        out = hostpool("reap", "--yes", "--min-age", "0", "--dir", f"{shm}/a/")
        assert out.returncode == 0, out.stderr
        assert (os.listdir(f"{shm}/a"), os.listdir(f"{shm}/b")) == ([], [outside])
        # (other tests' orphans on the host are outside it too)
        assert re.search(r"left alone: .*\b[1-9]\d* outside --dir", out.stdout.splitlines()[-1])


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--dir", "/proc"], "not on tmpfs"),
        (["--dir", "/nonexistent-reaptest"], "No such file"),
        (["--min-age", "soon"], "--min-age"),
        (["--engine", "nonsense"], "invalid choice"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], says: str) -> None:
    out = hostpool("reap", *args)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and says in out.stderr, out.stderr
    assert out.stdout == ""


def test_a_directory_on_disk_is_refused(tmp_path: Path) -> None:
    st = plant(str(tmp_path / orphan_name()))
    out = hostpool("reap", "--yes", "--min-age", "0", "--dir", str(tmp_path))
    assert out.returncode == 2 and "not on tmpfs" in out.stderr and out.stdout == ""
    assert [p.stat().st_ino for p in tmp_path.iterdir()] == [st.st_ino]


# -- hostpool run --reap, and the systemd recipe -----------------------------------------

CHECK = (
    "import os, sys; d = '/dev/shm'; names = sorted(os.listdir(d)); print(names); "
    "sys.exit(0 if names and all(n.startswith('keep_') for n in names) else 3)"
)


def _in_private_shm(
    plant: str, then: str, *, read_only: bool = False
) -> subprocess.CompletedProcess[str]:
    """`then` run in a private mount namespace whose /dev/shm is a fresh tmpfs holding an
    orphaned vLLM file and a file of no known engine (`plant`: their names), remounted
    read-only first if asked."""
    script = (
        "mount -t tmpfs -o size=16m hostpool-reaptest /dev/shm && "
        f"head -c 65536 /dev/zero > /dev/shm/{plant} && "
        f"head -c 4096 /dev/zero > /dev/shm/keep_{plant} && "
        + ("mount -o remount,ro /dev/shm && " if read_only else "")
        + then
    )
    env = {k: v for k, v in os.environ.items() if k != "HOSTPOOL_INSTRUMENT"}
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        capture_output=True, text=True, timeout=TIMEOUT, env=env, check=False,
    )  # fmt: skip


def test_run_reap_removes_the_orphans_before_cmd_starts() -> None:
    py = sys.executable
    name = orphan_name()
    out = _in_private_shm(
        name, f'exec {py} -m hostpool --log-format json run --reap -- {py} -c "{CHECK}"'
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == f"['keep_{name}']"
    reaped = [json.loads(line) for line in out.stderr.splitlines() if line.startswith("{")]
    assert [e["path"] for e in reaped if e["event"] == "hostpool.reaped"] == [f"/dev/shm/{name}"]


def test_run_reap_that_fails_warns_and_runs_cmd() -> None:
    py = sys.executable
    name = orphan_name()
    show = "import os; print(sorted(os.listdir('/dev/shm')))"
    out = _in_private_shm(
        name, f'exec {py} -m hostpool run --reap -- {py} -c "{show}"', read_only=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == str(sorted([name, f"keep_{name}"]))  # CMD ran
    assert (
        "--reap could not remove 1 orphan(s)" in out.stderr and "running CMD anyway" in out.stderr
    )
    assert "EROFS" in out.stderr


def test_run_reap_with_a_bad_flag_reaps_nothing() -> None:
    py = sys.executable
    name = orphan_name()
    out = _in_private_shm(
        name, f"{py} -m hostpool run --reap --only nonsense -- {py} -c pass; "
        f"echo rc=$?; ls /dev/shm",
    )  # fmt: skip
    assert "rc=2" in out.stdout and name in out.stdout.split(), out.stdout + out.stderr


def test_the_systemd_drop_in_runs_a_reap_that_parses() -> None:
    text = DROP_IN.read_text()
    [line] = [li for li in text.splitlines() if li.startswith("ExecStartPre=")]
    command = line.removeprefix("ExecStartPre=").lstrip("-").split()
    assert command[0].endswith("/bin/hostpool")
    args = build_parser().parse_args(command[1:])
    assert (args.command, args.yes, args.min_age, args.engine) == ("reap", True, 0.0, ["vllm"])
    assert [reap.reap_dir(d).path for d in args.dir] == ["/dev/shm"]
    operations = (ROOT / "docs" / "operations.md").read_text()
    assert str(DROP_IN.relative_to(ROOT)) in operations
    # The README's recipe is the drop-in's reap (its log format aside).
    readme = (ROOT / "README.md").read_text()
    [shown] = [li for li in readme.splitlines() if li.startswith("ExecStartPre=")]
    assert shown == line.replace(" --log-format json", "")


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_systemd_analyze_verifies_the_drop_in(tmp_path: Path) -> None:
    unit = tmp_path / "vllm.service"
    unit.write_text("[Unit]\nDescription=an engine\n[Service]\nExecStart=/bin/true\n")
    (tmp_path / "vllm.service.d").mkdir()
    venv_bin = str(Path(sys.executable).parent)
    (tmp_path / "vllm.service.d" / DROP_IN.name).write_text(
        DROP_IN.read_text().replace("/opt/hostpool/.venv/bin", venv_bin)
    )
    proc = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stderr.strip() == "", proc.stderr
