"""The exporter cannot be turned against its node (issue 43, points 1, 2, 4, 5).

The real `hostpool exporter` in a subprocess: /proc/PID/status of its two processes (the
listener it was started as, the reader it forked), scrapes from real sockets, real
signals. The trial's three writes are repeated by a process that enters the reader's
sandbox by the very function the exporter calls (`sandbox.enter_reader`), after the same
writes succeeded from a process with the same capabilities and no filter (the trial).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from hostpool.base import sandbox
from tests import exporting, waiting

ROOT = Path(__file__).resolve().parents[1]
READER_CAPS = f"{(1 << 19) | (1 << 2):016x}"  # CAP_SYS_PTRACE, CAP_DAC_READ_SEARCH
NONE = f"{0:016x}"

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (uids, capabilities)")


@contextmanager
def exporter(*args: str, prefix: tuple[str, ...] = ()) -> Iterator[exporting.Exporter]:
    """`hostpool exporter ARGS --port 0` (behind `prefix`), once it serves; its log read
    to the end meanwhile (`.log`: a flood's warnings must not fill the pipe); killed at
    the end if still running, its reader gone too."""
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-m", "hostpool", "exporter", *args, "--port", "0"],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    line = proc.stderr.readline()
    event = json.loads(line) if line.startswith("{") else {}
    reader = event.get("reader_pid")
    log: list[str] = []
    drain = threading.Thread(target=lambda: log.extend(proc.stderr or ()), daemon=True)
    drain.start()
    try:
        assert event.get("event") == "hostpool.exporter_serving", line
        served = exporting.Exporter(proc, event["url"], event)
        served.log = log  # type: ignore[attr-defined]
        yield served
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=waiting.DEADLINE)
        drain.join(waiting.DEADLINE)
        if reader is not None:
            waiting.wait_for(lambda: gone(reader), f"reader {reader} gone")


def gone(pid: int) -> bool:
    """The process has exited (a zombie counts: it holds nothing and runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except FileNotFoundError:
        return True


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=waiting.DEADLINE) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@root_only
def test_the_listener_holds_nothing_and_the_reader_only_reads() -> None:
    with exporter("--node") as served:
        listener = sandbox.state(served.proc.pid)
        reader = sandbox.state(served.serving["reader_pid"])
    assert listener["Uid"] == "65534 65534 65534 65534", listener
    assert listener["Gid"] == "65534 65534 65534 65534", listener
    for caps in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert listener[caps] == NONE, (caps, listener)
        assert reader[caps] == (NONE if caps in ("CapInh", "CapAmb") else READER_CAPS), reader
    assert listener["NoNewPrivs"] == reader["NoNewPrivs"] == "1"
    assert reader["Seccomp"] == "2", reader  # the filter
    # real, effective, saved, fs: the saved uid lets the listener kill it
    assert reader["Uid"] == "0 0 65534 0", reader


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="no setpriv")
def test_without_privileges_the_split_still_happens() -> None:
    """Started without a capability (a laptop, a test): the same two processes, the same
    uid, none held, the reader filtered all the same."""
    no_caps = ["setpriv", "--bounding-set=-all", "--inh-caps=-all"]
    with exporter("--match", "hostpool.", prefix=tuple(no_caps)) as served:
        assert exporting.scrape(served.url)[1]
        listener = sandbox.state(served.proc.pid)
        reader = sandbox.state(served.serving["reader_pid"])
    assert listener["Uid"] == reader["Uid"] == f"{os.geteuid()} " * 3 + f"{os.geteuid()}"
    for caps in ("CapPrm", "CapEff", "CapBnd"):
        assert listener[caps] == reader[caps] == NONE, (listener, reader)
    assert reader["Seccomp"] == "2" and reader["NoNewPrivs"] == "1"


# The trial's three writes, from a process with the reader's capabilities; SANDBOX says
# whether it enters the reader's sandbox first. One line per write: ok or the errno.
WRITES = textwrap.dedent(
    """
    import errno, os, sys
    from hostpool.base import sandbox
    victim, host_file, new_file = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    sandbox.keep_only(sandbox.READER_CAPS)
    sandbox.no_new_privs()
    if sys.argv[4] == "sandbox":
        sandbox.enter_reader(listener_uid=65534)
    def attempt(what, write):
        try:
            write()
            print(what, "ok", flush=True)
        except OSError as exc:
            print(what, errno.errorcode[exc.errno], flush=True)
    def through_root():
        with open(f"/proc/{victim}/root{host_file}", "w") as f:
            f.write("written by the reader\\n")
    def into_memory():
        with open(f"/proc/{victim}/maps") as maps:
            start = int(next(l for l in maps if "rw-p" in l).split("-")[0], 16)
        fd = os.open(f"/proc/{victim}/mem", os.O_RDWR)
        try:
            os.pwrite(fd, os.pread(fd, 1, start), start)  # its own byte back: harmless
        finally:
            os.close(fd)
    def create():
        os.close(os.open(new_file, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o644))
    attempt("root", through_root)
    attempt("mem", into_memory)
    attempt("create", create)
    """
)


@root_only
def test_the_reader_cannot_write_what_the_trial_wrote(tmp_path: Path) -> None:
    """Issue 43's trial: with CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH as root, a process
    wrote a root-owned file through /proc/PID/root, another process's memory through
    /proc/PID/mem, and created a file. Without the filter the writes succeed here too
    (the control); inside the reader's sandbox each is refused (EPERM)."""
    victim = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        results = {}
        for mode in ("trial", "sandbox"):
            host_file = tmp_path / f"{mode}.conf"
            host_file.write_text("root's\n")
            host_file.chmod(0o644)
            new_file = tmp_path / f"{mode}.new"
            done = subprocess.run(
                [sys.executable, "-c", WRITES, str(victim.pid), str(host_file), str(new_file),
                 mode],
                cwd=ROOT, capture_output=True, text=True, timeout=waiting.DEADLINE,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
            results[mode] = dict(line.split() for line in done.stdout.splitlines())
            written = host_file.read_text() != "root's\n"
            assert written == (mode == "trial"), (mode, results[mode])
            assert new_file.exists() == (mode == "trial"), (mode, results[mode])
        assert results["trial"] == {"root": "ok", "mem": "ok", "create": "ok"}
        assert results["sandbox"] == {"root": "EPERM", "mem": "EPERM", "create": "EPERM"}
    finally:
        victim.kill()
        victim.wait()


def scans_in_flood(url: str, clients: int, seconds: float) -> tuple[list[float], int]:
    """Every answer's `hostpool_exporter_scans_total` from `clients` threads scraping as
    fast as they can for `seconds`, and how many answers there were."""
    seen: list[float] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def flood() -> None:
        try:
            while time.monotonic() < end:
                _, samples = exporting.scrape(url)
                with lock:
                    seen.append(exporting.value(samples, "hostpool_exporter_scans_total"))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=flood) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return seen, len(seen)


def test_a_flood_of_scrapes_costs_one_scan_per_interval() -> None:
    """Issue 43, point 5: 8 clients scraping for 5 s ran 644-1438 host scans (one per
    answer); now one scan's result answers every scrape for --min-scan-interval (1 s):
    at most 6 scans in 5 s, however long each takes (a busy host's scan may take the
    whole budget), each answer naming its scan; and a scrape after the interval gets a
    new one."""
    with exporter("--node", "--min-scan-interval", "1") as served:
        seen, answers = scans_in_flood(served.url, clients=8, seconds=5.0)
        scans = sorted(set(seen))
        assert 1 <= len(scans) <= 6, (scans, answers)
        assert answers >= 8, answers  # every client was answered, none waited for long

        def next_scan() -> float | None:
            count = exporting.value(
                exporting.scrape(served.url)[1], "hostpool_exporter_scans_total"
            )
            return count if count > max(scans) else None

        newer = waiting.wait_for(next_scan, "a new scan once the interval passed", interval=0.2)
    assert newer == max(scans) + 1  # one scan at a time: none ran unasked


@root_only
def test_a_stuck_reader_turns_healthz_unhealthy_and_sigterm_still_ends_both() -> None:
    """Issue 43, point 4: the reader stopped (as in a stalled filesystem): /metrics answers
    503 in bounded time, /healthz turns 503 saying why, and a SIGTERM to the listener
    ends it within 2 s; the kernel kills the reader (it was not waited for)."""
    with exporter("--node", "--scrape-budget", "0.2", "--min-scan-interval", "0.1") as served:
        base = served.url.removesuffix("/metrics")
        reader = served.serving["reader_pid"]
        assert get(served.url)[0] == 200
        assert get(base + "/healthz") == (200, "ok\n")
        os.kill(reader, signal.SIGSTOP)

        def refused() -> str | None:  # once the last answer is older than the interval
            status, body = get(served.url)  # waits answer_within at most, then 503
            return body if status == 503 else None

        waiting.wait_for(refused, "/metrics 503", alive=served.proc)

        def unhealthy() -> str | None:
            status, body = get(base + "/healthz")
            return body if status == 503 else None

        why = waiting.wait_for(unhealthy, "/healthz 503", alive=served.proc)
        assert "no scan finished" in why, why
        started = time.monotonic()
        served.proc.terminate()
        served.proc.wait(timeout=waiting.DEADLINE)
        assert time.monotonic() - started < 2.0
        assert served.proc.returncode == 0
        waiting.wait_for(lambda: gone(reader), "the stopped reader killed")


@root_only
def test_sigterm_to_the_reader_ends_the_listener_too() -> None:
    with exporter("--node") as served:
        reader = served.serving["reader_pid"]
        assert get(served.url)[0] == 200
        started = time.monotonic()
        os.kill(reader, signal.SIGTERM)
        served.proc.wait(timeout=waiting.DEADLINE)
        assert time.monotonic() - started < 2.0
        assert served.proc.returncode == 1
        log = served.log  # type: ignore[attr-defined]
        waiting.wait_for(lambda: any("hostpool.exporter_reader_gone" in e for e in log), "log")


@root_only
def test_a_killed_listener_takes_a_stopped_reader_with_it() -> None:
    """SIGKILL to the listener (nothing of it runs after): the kernel's parent-death
    signal, sent with the listener's credentials (uid 65534), kills the root reader, even
    stopped."""
    with exporter("--node") as served:
        reader = served.serving["reader_pid"]
        assert get(served.url)[0] == 200
        os.kill(reader, signal.SIGSTOP)
        served.proc.kill()
        served.proc.wait(timeout=waiting.DEADLINE)
        waiting.wait_for(lambda: gone(reader), "the reader killed with its listener")


def test_the_scan_count_is_in_the_catalogue() -> None:
    from tests import dashboard_lint as lint

    documented = lint.load_catalogue()["hostpool_exporter_scans_total"]
    assert (documented.type, documented.labels) == ("counter", ())
    with exporter("--match", "hostpool.") as served:
        text, samples = exporting.scrape(served.url)
    assert "# TYPE hostpool_exporter_scans_total counter" in text
    assert exporting.value(samples, "hostpool_exporter_scans_total") == 1


@root_only
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="no setpriv")
def test_with_the_daemonsets_capabilities_the_split_is_the_same() -> None:
    """As deploy/kubernetes runs it: uid 0 with only the capabilities the manifest adds
    (bounding, permitted, effective): the listener still becomes 65534 with none, the
    reader keeps the two it reads with."""
    import yaml

    manifest = yaml.safe_load((ROOT / "deploy/kubernetes/exporter-daemonset.yaml").read_text())
    (container,) = manifest["spec"]["template"]["spec"]["containers"]
    added = [c.lower() for c in container["securityContext"]["capabilities"]["add"]]
    only = ["setpriv", "--bounding-set=-all," + ",".join(f"+{c}" for c in added)]
    with exporter("--node", "--listener-user", "65534", prefix=tuple(only)) as served:
        assert get(served.url)[0] == 200
        listener = sandbox.state(served.proc.pid)
        reader = sandbox.state(served.serving["reader_pid"])
    assert listener["Uid"] == "65534 65534 65534 65534", listener
    assert listener["CapPrm"] == listener["CapEff"] == NONE, listener
    assert reader["Uid"] == "0 0 65534 0", reader
    assert reader["CapPrm"] == reader["CapEff"] == READER_CAPS, reader
    # without CAP_SETPCAP the bounding set stays the container's (no_new_privs and the
    # filter's refused execve make it grant nothing)
    numbers = {"sys_ptrace": 19, "dac_read_search": 2, "setuid": 7, "setgid": 6}
    assert reader["CapBnd"] == f"{sum(1 << numbers[c] for c in added):016x}", reader
    assert reader["Seccomp"] == "2" and reader["NoNewPrivs"] == "1"


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--listener-user", "no-such-user-here", "--listener-user: no user 'no-such-user-here'"),
        ("--min-scan-interval", "-1", "--min-scan-interval must be 0..3600 seconds"),
        ("--min-scan-interval", "nan", "--min-scan-interval must be 0..3600 seconds"),
    ],
)
def test_a_wrong_split_flag_is_one_line_and_exit_2(flag: str, value: str, message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "hostpool", "exporter", "--node", flag, value, "--port", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=waiting.DEADLINE,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert message in done.stderr, done.stderr


# pyseccomp's import fails (as where libseccomp is missing); then the hostpool command line
WITHOUT_SECCOMP = """
import runpy, sys
class NoSeccomp:
    def find_spec(self, name, path=None, target=None):
        if name == "pyseccomp":
            raise ImportError("libseccomp is not on this machine")
sys.meta_path.insert(0, NoSeccomp())
sys.argv = ["hostpool", *sys.argv[1:]]
runpy.run_module("hostpool", run_name="__main__")
"""


def test_without_its_filter_the_reader_does_not_start_and_nothing_is_served() -> None:
    """Fails closed: no seccomp, no reader, no listener (exit 1, the reason logged)."""
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_SECCOMP, "exporter", "--node", "--port", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=waiting.DEADLINE,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "hostpool.exporter_reader_failed" in done.stderr, done.stderr
    assert "libseccomp is not on this machine" in done.stderr, done.stderr
    assert "hostpool.exporter_serving" not in done.stderr, done.stderr
