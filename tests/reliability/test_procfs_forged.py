"""Forged output: memfd names (and a command name) carrying a newline, terminal escape
sequences, `key=value` text and an undecodable byte. Every text output escapes them:
`inspect`'s plain lines and table, the leak report and the exporter's log lines; JSON
carries them exactly."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from hostpool.proc.textsafe import field, printable
from hostpool.testing import ShmLeakError, assert_no_leaks
from tests import helpers
from tests.exporting import running_exporter
from tests.reliability.results import record_procfs_attack as record

FORGED_LINE = (
    "pool prefix=hostpool. pool=FAKE objects=999 fds=1 mappings=1 mapped=1TiB "
    "resident=1TiB page_sizes=4KiB"
)
EVIL_NAMES = [
    f"hostpool.kv.1.1\n{FORGED_LINE}\n",  # a whole forged line
    "hostpool.x\x1b]0;owned\x07\x1b[2J\x1b[31mred",  # retitle, clear, colour the terminal
    'hostpool.y name=forged fds=0 "quoted" \\ \udcff',  # fields, a quote, a raw 0xff byte
]
EVIL_COMMAND = "\x1b[2Jx\ny=1"  # 15 bytes at most: the kernel truncates comm

CHILD = """
import ctypes, json, os, sys
fds = [os.memfd_create(name) for name in json.loads(sys.argv[1])]
ctypes.CDLL(None).prctl(15, sys.argv[2].encode(), 0, 0, 0)  # PR_SET_NAME: the comm
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def evil_child() -> Iterator[subprocess.Popen[str]]:
    proc = helpers.python_child(CHILD, json.dumps(EVIL_NAMES), EVIL_COMMAND)
    yield proc
    proc.kill()
    proc.wait()


def hostpool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hostpool", *args],
        capture_output=True,
        text=True,
        errors="surrogateescape",
        timeout=60,
    )


_totals: dict[str, Any] = {"outputs": [], "raw": 0, "forged": 0}


@pytest.fixture(scope="module", autouse=True)
def record_totals() -> Iterator[None]:
    yield
    record(
        "forged_output",
        names=len(EVIL_NAMES),
        outputs=_totals["outputs"],
        raw_control_characters=_totals["raw"],
        forged_lines=_totals["forged"],
    )


def checked(output: str, text: str) -> None:
    """No raw control character and no line that starts with text from inside a name."""
    lines = text.splitlines()
    bad = [ch for line in lines for ch in line if not ch.isprintable()]
    forged = [line for line in lines if line.startswith((FORGED_LINE[:30], "y=1"))]
    _totals["outputs"].append(output)
    _totals["raw"] += len(bad)
    _totals["forged"] += len(forged)
    assert not bad, f"raw control characters reached the output: {set(bad)!r}"
    assert not forged, forged


def test_inspect_plain_lines_cannot_be_forged(evil_child: subprocess.Popen[str]) -> None:
    result = hostpool("inspect", str(evil_child.pid))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    checked("inspect (plain)", result.stdout)
    # a process line, one pool line (all three objects are pool "-"), a finding per name
    assert [line.split()[0] for line in lines] == ["process", "pool", *["finding"] * 3]
    assert not any("pool=FAKE" in line.split(" name=")[0] for line in lines)
    assert lines[0].startswith(f"process pid={evil_child.pid} command={field(EVIL_COMMAND)} ")
    # each name is one field that reads back as its escaped form: nothing added
    finding = re.compile(
        r'finding kind=\S+ prefix=hostpool\. pool=- name=(?P<name>"(?:[^"\\]|\\.)*"|[^ "=]+) '
        r'fds=\d+ detail="[^"]*"'
    )
    names = []
    for line in lines[2:]:
        match = finding.fullmatch(line)
        assert match is not None, line
        names.append(match["name"])
    assert sorted(names) == sorted(field(n) for n in EVIL_NAMES)


def test_inspect_table_sends_no_escape_sequence_to_the_terminal(
    evil_child: subprocess.Popen[str],
) -> None:
    code, text = helpers.hostpool_on_tty("inspect", str(evil_child.pid))
    assert code == 0
    checked("inspect (table on a TTY)", text.replace("\r\n", "\n"))
    assert not any(line.startswith(("pool prefix=", "y=1")) for line in text.splitlines())
    assert text.startswith(f"pid {evil_child.pid} ({printable(EVIL_COMMAND)}) at ")
    for name in EVIL_NAMES:
        assert printable(name) in text


def test_inspect_json_keeps_the_exact_names(evil_child: subprocess.Popen[str]) -> None:
    result = hostpool("inspect", str(evil_child.pid), "--json")
    doc = json.loads(result.stdout)
    assert sorted(o["name"] for o in doc["objects"]) == sorted(EVIL_NAMES)
    assert doc["command"] == EVIL_COMMAND


def test_the_leak_report_escapes_names() -> None:
    check = assert_no_leaks()
    fds = [os.memfd_create(name, os.MFD_CLOEXEC) for name in EVIL_NAMES]
    try:
        with pytest.raises(ShmLeakError) as caught:
            check.verify()
    finally:
        for fd in fds:
            os.close(fd)
    report = str(caught.value)
    checked("the leak report", report)
    lines = report.splitlines()
    assert lines[0] == "3 shared-memory object(s) leaked:"
    assert len(lines) == 4 and not any(line.startswith("pool prefix=") for line in lines)
    for name in EVIL_NAMES:
        assert printable(name) in report


def test_the_exporter_log_line_escapes_the_command_name(
    evil_child: subprocess.Popen[str],
) -> None:
    with running_exporter("--pid", str(evil_child.pid)) as exporter:
        log = exporter.stop()
    assert exporter.serving["command"] == printable(EVIL_COMMAND)  # JSON log, off a TTY
    # and the console log on a TTY
    leader, follower = os.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "hostpool", "exporter", "--pid", str(evil_child.pid),
         "--port", "0"],
        stderr=follower,
    )  # fmt: skip
    os.close(follower)
    try:
        first = b""
        while not first.endswith(b"\n"):
            first += os.read(leader, 1)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        os.close(leader)
    # the console renderer colours fields with SGR sequences of its own: drop those
    line = re.sub(r"\x1b\[[0-9;]*m", "", first.decode(errors="replace").rstrip("\r\n"))
    checked("the exporter's log (console on a TTY)", line)
    assert "command=" in line, repr(line)
    assert "x1b[2Jx" in line and "y=1" in line  # escaped, and on the same line
    assert "Traceback" not in log
