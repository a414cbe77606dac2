"""`hostpool inspect`: a process's shared-memory fds and mappings per pool, from /proc.

Flags only what /proc can decide: a memfd held open but not mapped, a mapping whose
object no fd of the process holds, and one object mapped twice. A table on a TTY,
`key=value` lines otherwise (both with human sizes and times, every name read from /proc
escaped), JSON with `--json` (exact bytes, times in ISO 8601 UTC as /debug/pools and the
logs have them; one line per snapshot with `--watch`).

Exit codes: 0 ok; 2 no such process or bad usage; 1 not allowed to read it, it exited
while being watched, or `--check` found something.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from datetime import datetime
from typing import Any, TextIO

from hostpool.base.units import format_size, iso_utc
from hostpool.cli.command import Subcommand
from hostpool.proc import names, procfs, procgroup
from hostpool.proc.textsafe import field, printable

CLEAR_SCREEN = "\033[H\033[2J"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Its flags."""
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("pid", nargs="?", type=int, help="the process to inspect")
    target.add_argument("--self", dest="inspect_self", action="store_true",
                        help="inspect this command's own process")  # fmt: skip
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--prefix",
        action="append",
        metavar="P",
        help="shm name prefix to report (repeatable; default: the engines' prefixes of the "
        f"engine table, {', '.join(default_prefixes())})",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--watch", type=_positive_seconds, metavar="SECONDS",
                      help="repeat every SECONDS until interrupted")  # fmt: skip
    mode.add_argument("--check", action="store_true",
                      help="exit 1 when there are findings (for scripts)")  # fmt: skip


# Rows of the engine table that are any program's, not an engine's: torch's and Python's
# own shared memory (only with --prefix)
_LIBRARIES = ("torch", "python")


def default_prefixes() -> tuple[str, ...]:
    """The prefixes of the engine table's rows (hostpool.host.engines) whose pattern is a
    prefix (`vllm_offload_*`), libraries' rows left out; hostpool's own first."""
    from hostpool.host.engines import ENGINE_PATTERNS

    found = [
        row.pattern[:-1]
        for row in ENGINE_PATTERNS
        if row.engine not in _LIBRARIES
        and row.pattern.endswith("*")
        and not any(c in row.pattern[:-1] for c in "*?[")
    ]
    return tuple(dict.fromkeys([*names.KNOWN_PREFIXES, *found]))


def run(args: argparse.Namespace) -> int:
    pid: int = os.getpid() if args.inspect_self else args.pid
    prefixes = tuple(args.prefix) if args.prefix else default_prefixes()
    if not all(prefixes):
        return _fail(2, "--prefix must not be empty")
    try:
        procfs.check_readable(pid)
    except procfs.ProcessNotFoundError as exc:
        return _fail(2, str(exc))
    except procfs.ProcessAccessError as exc:
        return _fail(1, str(exc))
    try:
        return _loop(pid, prefixes, args)
    except BrokenPipeError:  # `hostpool inspect ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _loop(pid: int, prefixes: Sequence[str], args: argparse.Namespace) -> int:
    out = sys.stdout
    tty = out.isatty()
    while True:
        try:
            snapshot = report(pid, prefixes)
        except procfs.ProcessNotFoundError:
            return _fail(1, f"process {pid} exited")
        except procfs.ProcessAccessError as exc:
            return _fail(1, str(exc))
        if args.json:
            json.dump(snapshot, out, indent=None if args.watch else 2)
            out.write("\n")
        else:
            if args.watch and tty:
                out.write(CLEAR_SCREEN)
            (render_table if tty else render_plain)(snapshot, out)
        out.flush()
        if not args.watch:
            break
        time.sleep(args.watch)
    found = len(snapshot["findings"])
    if args.check and found:
        return _fail(1, f"{found} finding(s) in pid {pid}")
    return 0


def report(pid: int, prefixes: Sequence[str]) -> dict[str, Any]:
    """The JSON document: per-pool totals, every object, and the findings."""
    objects = procgroup.group_objects(procgroup.read_process(pid, prefixes))
    return {
        "pid": pid,
        "command": procfs.command_name(pid),
        "time": iso_utc(time.time()),
        "prefixes": list(prefixes),
        "pools": [
            {
                "prefix": u.prefix,
                "pool": u.pool,
                "objects": u.objects,
                "open_fds": u.open_fds,
                "mappings": u.mappings,
                "mapped_bytes": u.mapped_bytes,
                "resident_bytes": u.resident_bytes,
                "page_sizes": list(u.page_sizes),
            }
            for u in procgroup.pool_usage(objects)
        ],
        "objects": [
            {
                "kind": o.kind,
                "name": o.name.name,
                "prefix": o.name.prefix,
                "pool": o.name.pool,
                "size": o.size,
                "fds": [f.fd for f in o.fds],
                "mappings": [
                    {
                        "address": f"{m[0].start:x}-{m[-1].end:x}",
                        "bytes": sum(v.size for v in m),
                        "resident_bytes": sum(v.usage.resident_bytes for v in m if v.usage),
                        "vmas": len(m),
                    }
                    for m in o.mappings
                ],
                "page_sizes": sorted(o.page_sizes),
            }
            for o in objects
        ],
        "findings": [
            {
                "kind": f.kind,
                "prefix": f.prefix,
                "pool": f.pool,
                "name": f.name,
                "fds": list(f.fds),
                "addresses": list(f.addresses),
                "detail": f.detail,
            }
            for f in procgroup.findings(objects)
        ],
    }


def render_plain(snapshot: dict[str, Any], out: TextIO) -> None:
    """A `process` line, then one `key=value` line per pool and per finding: for grep and
    awk. Names are escaped and quoted when needed (`--json` has exact bytes)."""
    pools, found = snapshot["pools"], snapshot["findings"]
    when = _local(snapshot["time"]).isoformat(timespec="seconds")
    head = (
        f"process pid={snapshot['pid']} command={field(snapshot['command'] or '?')} "
        f"time={when} pools={len(pools)} findings={len(found)}"
    )
    if not pools:
        head += f" note={field('no shared memory named ' + _prefixes(snapshot))}"
    out.write(head + "\n")
    for p in pools:
        page_sizes = ",".join(format_size(s) for s in p["page_sizes"]) or "-"
        out.write(
            f"pool prefix={field(p['prefix'])} pool={field(p['pool'])} objects={p['objects']} "
            f"fds={p['open_fds']} mappings={p['mappings']} mapped={format_size(p['mapped_bytes'])} "
            f"resident={format_size(p['resident_bytes'])} page_sizes={page_sizes}\n"
        )
    for f in found:
        fds = ",".join(map(str, f["fds"])) or "-"
        out.write(
            f"finding kind={f['kind']} prefix={field(f['prefix'])} pool={field(f['pool'])} "
            f"name={field(f['name'])} fds={fds} detail={field(f['detail'])}\n"
        )


def render_table(snapshot: dict[str, Any], out: TextIO) -> None:
    pools = snapshot["pools"]
    when = _local(snapshot["time"]).strftime("%Y-%m-%d %H:%M:%S %Z")
    who = f"pid {snapshot['pid']} ({printable(snapshot['command'] or '?')}) at {when}"
    if not pools:
        out.write(f"{who}: no shared memory named {_prefixes(snapshot)}\n")
        return
    out.write(f"{who}\n")
    header = ("PREFIX", "POOL", "OBJECTS", "FDS", "MAPPINGS", "MAPPED", "RESIDENT", "PAGE")
    rows = [
        (
            printable(p["prefix"]),
            printable(p["pool"]),
            str(p["objects"]),
            str(p["open_fds"]),
            str(p["mappings"]),
            format_size(p["mapped_bytes"]),
            format_size(p["resident_bytes"]),
            ",".join(format_size(s) for s in p["page_sizes"]) or "-",
        )
        for p in pools
    ]
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        cells = [
            c.ljust(w) if i < 2 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        out.write("  ".join(cells).rstrip() + "\n")
    if snapshot["findings"]:
        out.write("\nfindings:\n")
        for f in snapshot["findings"]:
            fds = f" (fd {', '.join(map(str, f['fds']))})" if f["fds"] else ""
            out.write(
                f"  {f['kind']}: {printable(f['name'])} [pool {printable(f['pool'])}]: "
                f"{f['detail']}{fds}\n"
            )


def _prefixes(snapshot: dict[str, Any]) -> str:
    return " or ".join(printable(p) for p in snapshot["prefixes"])


def _local(iso: str) -> datetime:
    """A snapshot's ISO 8601 UTC time in this host's time zone, for people."""
    return datetime.fromisoformat(iso).astimezone()


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError("--watch needs a positive number of seconds")
    return value


def _fail(code: int, message: str) -> int:
    print(f"hostpool inspect: {message}", file=sys.stderr)
    return code


COMMAND = Subcommand(
    name="inspect",
    help="a process's shared-memory fds and mappings per pool, from /proc",
    description=__doc__.splitlines()[0] if __doc__ else None,
    add_arguments=add_arguments,
    run=run,
    epilog="exit status: 0 ok; 1 the input is right but this host cannot do it now (the "
    "process may not be read, it exited while watched, --check found something); 2 the "
    "input is wrong (no such process, a bad flag)",
)
