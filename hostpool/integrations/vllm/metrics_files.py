"""The directory and files of the vLLM metrics route (`metrics_route`): written by a
worker, read by its API server, and read only as written.

A worker's file is `<pid>.json` (the pid in ASCII digits, as `str(pid)` writes it), a
regular file of this uid holding `{"pid": PID, "start": T, "samples": {...}}`, where `T`
is the process's start time (field 22 of /proc/PID/stat, clock ticks since boot: exact and
fixed for the process's life, unlike a wall-clock time derived from it) so that a file
left by a dead worker whose pid was reused is told apart from the new process's.

The reader opens a file with `O_NONBLOCK | O_NOFOLLOW` beside the directory's fd, checks
with fstat that it is a regular file of this uid, reads at most MAX_FILE_BYTES, and checks
every sample's shape against the contract's metric table before any of it is summed.
What does not pass is skipped and counted by reason in
`hostpool_vllm_route_skipped_files_total{reason}` (each reason logged once per process as
`hostpool.vllm_metrics_file_skipped`):

- `name`: a `.json` name that is not a pid in ASCII digits (`².json` is `isdigit()`);
- `not_regular`: a FIFO, a directory, a device, a socket;
- `owner`: a file of another uid;
- `too_large`: over MAX_FILE_BYTES;
- `malformed`: not JSON, or not the shape written here;
- `stale_pid`: written by an earlier process with the same pid.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import stat
import tempfile
import threading
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil

from hostpool.base import events
from hostpool.errors import ConfigError
from hostpool.metrics.collector import METRICS

# A worker's file is a few KiB (one row per pool and label set; a histogram per pool):
# this leaves room for hundreds of pools and bounds what one scrape reads per worker.
MAX_FILE_BYTES = 1 << 20
SKIP_REASONS = ("name", "not_regular", "owner", "too_large", "malformed", "stale_pid")
SKIPPED_METRIC = "hostpool_vllm_route_skipped_files"
_PID_NAME = re.compile(r"([1-9][0-9]*)\.json")  # [0-9] is ASCII only, unlike str.isdigit
_TMP_NAME = re.compile(r"([1-9][0-9]*)\.[0-9]+\.tmp")  # a publish cut short by a SIGKILL
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC

Rows = dict[tuple[str, ...], Any]


def file_name(pid: int) -> str:
    return f"{pid}.json"


def pid_of(name: str) -> int | None:
    """The pid a file name stands for, or None (not `<pid>.json` in ASCII digits)."""
    match = _PID_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


def process_start(pid: int) -> int | None:
    """The process's start time as the file records it; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_line = f.read()
    except OSError:
        return None
    # "PID (COMM) STATE ...": COMM may hold spaces and ')'; field 22 is the 20th after it
    fields = stat_line.rpartition(b")")[2].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def document(samples: Mapping[str, Mapping[tuple[str, ...], Any]]) -> dict[str, Any]:
    """This process's file content for `measure()` output."""
    return {
        "pid": os.getpid(),
        "start": process_start(os.getpid()),
        "samples": {
            name: [[list(labels), value] for labels, value in values.items()]
            for name, values in samples.items()
        },
    }


class Skipped(Exception):
    """A file the reader does not use; `reason` is one of SKIP_REASONS."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def read(dir_fd: int, pid: int, start: int) -> dict[str, Rows] | None:
    """The samples of the worker `pid` (started at `start`) from its file beside `dir_fd`:
    None when it has no file (not a hostpool worker); Skipped when it is not one to use."""
    import json

    try:
        fd = os.open(file_name(pid), _READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:  # ELOOP: a symlink
        raise Skipped("not_regular", f"{exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Skipped("not_regular", f"mode {stat.filemode(st.st_mode)}")
        if st.st_uid != os.geteuid():
            raise Skipped("owner", f"uid {st.st_uid}")
        if st.st_size > MAX_FILE_BYTES:
            raise Skipped("too_large", f"{st.st_size} bytes")
        data = _read_bounded(fd)
    finally:
        os.close(fd)
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise Skipped("malformed", f"not JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("pid") != pid:
        raise Skipped("malformed", "no matching pid")
    if doc.get("start") != start:
        raise Skipped("stale_pid", f"written by an earlier process {pid}")
    return _checked(doc.get("samples"))


def _read_bounded(fd: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while chunk := os.read(fd, MAX_FILE_BYTES + 1 - size):
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_FILE_BYTES:  # grew since fstat
            raise Skipped("too_large", f"over {MAX_FILE_BYTES} bytes")
    return b"".join(chunks)


def _checked(samples: Any) -> dict[str, Rows]:
    """The samples as rows by label values, for the contract's metrics only; Skipped
    ("malformed") if any has a shape `measure()` does not write."""
    if not isinstance(samples, dict):
        raise Skipped("malformed", "samples is not an object")
    out: dict[str, Rows] = {}
    for name, rows in samples.items():
        if name not in METRICS:
            continue  # a newer worker's metric: not this reader's contract
        kind, labelnames, _ = METRICS[name]
        if not isinstance(rows, list):
            raise Skipped("malformed", f"{name}: not a list")
        target: Rows = {}
        for row in rows:
            if not (isinstance(row, list) and len(row) == 2 and isinstance(row[0], list)):
                raise Skipped("malformed", f"{name}: a row is not [labels, value]")
            labels = row[0]
            if len(labels) != len(labelnames) or not all(isinstance(x, str) for x in labels):
                raise Skipped("malformed", f"{name}: labels {labels!r}")
            target[tuple(labels)] = _value(name, kind, row[1])
        out[name] = target
    return out


def _value(name: str, kind: str, value: Any) -> Any:
    if kind != "histogram":
        if not _number(value):
            raise Skipped("malformed", f"{name}: value {value!r}")
        return float(value)
    if not (isinstance(value, list) and len(value) == 2 and _number(value[1])):
        raise Skipped("malformed", f"{name}: histogram {value!r:.80}")
    buckets = value[0]
    if not isinstance(buckets, list) or not all(
        isinstance(b, list) and len(b) == 2 and isinstance(b[0], str) and _number(b[1])
        for b in buckets
    ):
        raise Skipped("malformed", f"{name}: buckets {buckets!r:.80}")
    return ([(b, float(n)) for b, n in buckets], float(value[1]))


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class SkipCounts:
    """Files skipped by this process's reader, by reason; each reason logged once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def count(self, skipped: Skipped, path: str) -> None:
        with self._lock:
            first = skipped.reason not in self._counts
            self._counts[skipped.reason] += 1
        if first:
            events.warning(
                "hostpool.vllm_metrics_file_skipped",
                path=path,
                reason=skipped.reason,
                detail=str(skipped),
                action=f"not summed; counted in {SKIPPED_METRIC}_total (logged once per reason)",
            )

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {reason: self._counts[reason] for reason in SKIP_REASONS}

    def any(self) -> bool:
        with self._lock:
            return bool(self._counts)


def metrics_dir(extra_config: Mapping[str, Any] | None = None) -> Path:
    """The directory workers publish into (created 0700 if missing; checked)."""
    configured = (extra_config or {}).get("hostpool_metrics_dir")
    if configured:
        path = Path(str(configured))
    elif os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "hostpool-vllm"
    else:
        path = Path(tempfile.gettempdir()) / f"hostpool-vllm-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"hostpool metrics dir {path} is not a directory (or is a symlink)")
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise ConfigError(
            f"hostpool metrics dir {path} must belong to uid {os.getuid()} with mode 0700 "
            f"(uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):o})"
        )
    return path


def prune_dead(directory: Path, skips: SkipCounts | None = None) -> list[int]:
    """Remove the files of workers that no longer exist (a SIGKILLed worker, e.g. under
    vLLM's default `--shutdown-timeout 0`, never removes its own; nor a publish's
    temporary file it was writing). A file whose pid is alive is left alone, whoever that
    process is. Returns the pids whose `<pid>.json` was removed."""
    removed: list[int] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        pid = pid_of(name)
        tmp = _TMP_NAME.fullmatch(name)
        writer = pid if pid is not None else int(tmp.group(1)) if tmp is not None else None
        if writer is None:
            if name.endswith(".json") and skips is not None:
                skips.count(Skipped("name", "not a pid"), str(directory / name))
            continue
        if psutil.pid_exists(writer):
            continue
        with contextlib.suppress(OSError):  # gone meanwhile, or not a file to unlink
            os.unlink(directory / name)
            if pid is not None:
                removed.append(pid)
    return removed
