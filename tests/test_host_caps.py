"""What the host view needs in a container (docs/host-view.md): `scan_host` run as uid
65534 with a set of capabilities, against root's objects (one of each kind, an orphan in
a 0700 directory, a file in a private mount namespace). CAP_SYS_PTRACE and
CAP_DAC_READ_SEARCH see everything; without CAP_SYS_PTRACE other mount namespaces are
out of reach; without CAP_DAC_READ_SEARCH no holder is seen. Root only."""

from __future__ import annotations

import ctypes
import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import hostobjects

PAGE = 4096
CAPS = {"SYS_PTRACE": 19, "DAC_READ_SEARCH": 2, "SYS_ADMIN": 21}
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
_PR_SET_KEEPCAPS = 8
NOBODY = 65534


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def scan_as_nobody(caps: tuple[str, ...]) -> dict[str, Any]:
    """scan_host() in a forked child that became uid 65534 keeping only `caps`."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.close(r)
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_KEEPCAPS, 1, 0, 0, 0)
            os.setgroups([])
            os.setresgid(NOBODY, NOBODY, NOBODY)
            os.setresuid(NOBODY, NOBODY, NOBODY)
            bits = sum(1 << CAPS[c] for c in caps)
            data = (_Data * 2)()
            data[0].effective = data[0].permitted = bits
            header = _Header(_LINUX_CAPABILITY_VERSION_3, 0)
            assert libc.capset(ctypes.byref(header), data) == 0, ctypes.get_errno()
            from hostpool.host.scan import scan_host

            view = scan_host()
            doc = {"objects": [o.as_json() for o in view.objects], "unreadable": view.unreadable}
            os.write(w, json.dumps(doc).encode())
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 1 << 20):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    out: dict[str, Any] = json.loads(b"".join(chunks))
    return out


@pytest.fixture
def objects(root: None, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Root's objects: a holder's four kinds, a 0600 orphan in a 0700 directory, an orphan
    in a private mount namespace."""
    closed = f"/dev/shm/hostpool-test-{secrets.token_hex(4)}"
    os.mkdir(closed, 0o700)
    mnt = tmp_path / "ns"
    mnt.mkdir()
    tmp_path.chmod(0o700)
    try:
        hostobjects.write_file(f"{closed}/f", 3 * PAGE)
        with (
            hostobjects.holder(4 * PAGE) as held,
            hostobjects.private_tmpfs(str(mnt), {"lost": 5 * PAGE}) as sleeper,
        ):
            yield {"held": held.info, "closed": f"{closed}/f", "sleeper": sleeper.pid}
    finally:
        if os.path.exists(f"{closed}/f"):
            os.unlink(f"{closed}/f")
        os.rmdir(closed)


def seen(doc: dict[str, Any], objects: dict[str, Any]) -> set[str]:
    """Which of root's objects the scan found with their holders."""
    pid = objects["held"]["pid"]
    out = set()
    for o in doc["objects"]:
        held = pid in {h["pid"] for h in o["holders"]}
        if held and o["kind"] in ("memfd", "sysv", "anon_shared"):
            out.add(o["kind"])
        if held and o["path"] == objects["held"]["path"]:
            out.add("file")
        if o["path"] == objects["closed"]:
            out.add("closed_dir")
        if (o["path"] or "").startswith(f"/proc/{objects['sleeper']}/root/"):
            out.add("other_namespace")
    return out


EVERYTHING = {"memfd", "sysv", "anon_shared", "file", "closed_dir", "other_namespace"}


@pytest.mark.parametrize(
    ("caps", "expected"),
    [
        (("SYS_PTRACE", "DAC_READ_SEARCH"), EVERYTHING),
        (("DAC_READ_SEARCH", "SYS_ADMIN"), EVERYTHING - {"other_namespace"}),
        (("SYS_PTRACE", "SYS_ADMIN"), set()),
        ((), set()),
    ],
    ids=["ptrace+dac_read_search", "dac_read_search+sys_admin", "ptrace+sys_admin", "none"],
)
def test_what_each_set_of_capabilities_sees(
    objects: dict[str, Any], caps: tuple[str, ...], expected: set[str]
) -> None:
    doc = scan_as_nobody(caps)
    assert seen(doc, objects) == expected
    if expected == EVERYTHING:
        assert doc["unreadable"] <= 1  # at most a process that exited or changed meanwhile
