"""`hostpool reap`: remove orphaned shared memory that no process holds (a dry run
unless --yes).

Orphans are regular files on tmpfs (/dev/shm and every other tmpfs mount, in every mount
namespace /proc shows: a container's /dev/shm through /proc/PID/root) that no process
holds by an fd or a mapping, and with --sysv SysV segments with no attachment. By default
only the known engines' files (the engine table of `hostpool shm`; `--engine unknown`
widens it to any name) unchanged for 10 minutes. Each file is re-checked right before
its unlink: still the same inode, a regular file, on tmpfs, reached without following a
symlink, and held by no process (one that opened it since the scan keeps it). memfds are
never touched: they die with their last holder.

Output: one line per object (what it would do or did, engine, resident bytes, age,
path), then a summary; `--json`: one document. Each removal is a `hostpool.reaped`
event on stderr.

Exit codes: 0 done or nothing to do (an object a process took since the scan is kept
and is not a failure); 1 a candidate could not be removed; 2 bad input (a bad duration,
an unknown engine, a --dir that is not a directory on tmpfs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from typing import TYPE_CHECKING, Any, TextIO

from hostpool.base.units import format_duration, format_size, parse_duration
from hostpool.cli.command import Subcommand
from hostpool.cli.exitcodes import NOT_NOW, OK
from hostpool.errors import InvalidRequestError
from hostpool.host.model import ENGINES, HostObject
from hostpool.proc.textsafe import printable

if TYPE_CHECKING:
    from hostpool.host.reap import Plan

# what people read for each outcome
_SAID = {
    "would_remove": "would remove",
    "removed": "removed",
    "kept_held": "kept",
    "kept_changed": "kept",
    "failed": "FAILED",
}


def min_age(value: str) -> float:
    """`--min-age`: a duration (argparse turns InvalidRequestError's ValueError into a
    one-line usage error, exit 2)."""
    try:
        return parse_duration(value, what="--min-age")
    except InvalidRequestError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Its flags."""
    p.add_argument(
        "--min-age",
        type=min_age,
        default=None,
        metavar="D",
        help="only orphans unchanged for at least D (30s, 10m, 2h, 1d, 0; default 10m)",
    )
    p.add_argument(
        "--engine",
        action="append",
        choices=ENGINES,
        metavar="NAME",
        help="only this engine's orphans (repeatable; default: every engine but unknown; "
        f"one of {', '.join(ENGINES)})",
    )
    p.add_argument(
        "--dir",
        action="append",
        metavar="DIR",
        help="only files in DIR, a directory on tmpfs (repeatable; a mount's root means "
        "every file of that tmpfs)",
    )
    p.add_argument("--sysv", action="store_true", help="also SysV segments with no attachment")
    p.add_argument("--yes", action="store_true", help="remove them (without it: a dry run)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    from hostpool.host import reap, scan

    selection = reap.Selection(
        min_age=reap.DEFAULT_MIN_AGE if args.min_age is None else args.min_age,
        engines=frozenset(args.engine or reap.KNOWN_ENGINES),
        # InvalidRequestError (exit 2) for a --dir that is not a directory on tmpfs
        dirs=tuple(reap.reap_dir(d) for d in args.dir) if args.dir else None,
        sysv=args.sysv,
    )
    planned = reap.plan(scan.scan_host(), selection)
    results = reap.reap(planned.candidates, min_age=selection.min_age) if args.yes else None
    rows: list[tuple[HostObject, str, str]] = (
        [(r.obj, r.outcome, r.detail) for r in results]
        if results is not None
        else [(o, "would_remove", "") for o in planned.candidates]
    )
    try:
        if args.json:
            json.dump(document(planned, rows, dry_run=not args.yes), sys.stdout, indent=2)
            sys.stdout.write("\n")
        else:
            render(planned, rows, sys.stdout, dry_run=not args.yes)
        sys.stdout.flush()
    except BrokenPipeError:  # `hostpool reap | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return NOT_NOW if any(outcome == "failed" for _, outcome, _ in rows) else OK


def document(
    planned: Plan, rows: list[tuple[HostObject, str, str]], *, dry_run: bool
) -> dict[str, Any]:
    """The `--json` document: the selection, one entry per candidate (the `hostpool shm`
    object plus `outcome` and `detail`), the orphans left alone with their reason, and
    totals."""
    sel = planned.selection
    removed = [o for o, outcome, _ in rows if outcome in ("removed", "would_remove")]
    return {
        "dry_run": dry_run,
        "min_age_seconds": sel.min_age,
        "engines": sorted(sel.engines),
        "dirs": None if sel.dirs is None else [d.path for d in sel.dirs],
        "sysv": sel.sysv,
        "unreadable_processes": planned.unreadable,
        "objects": [
            {**o.as_json(), "outcome": outcome, "detail": detail or None}
            for o, outcome, detail in rows
        ],
        "skipped": [
            {
                "kind": s.obj.kind,
                "name": s.obj.name,
                "path": s.obj.path,
                "engine": s.obj.engine,
                "resident_bytes": s.obj.resident_bytes,
                "age_seconds": s.obj.age_seconds,
                "reason": s.reason,
            }
            for s in planned.skipped
        ],
        "totals": {
            "candidates": len(rows),
            "removed": 0 if dry_run else len(removed),
            "removed_bytes": 0 if dry_run else sum(o.resident_bytes for o in removed),
            "would_remove_bytes": sum(o.resident_bytes for o in removed) if dry_run else 0,
            "outcomes": dict(Counter(outcome for _, outcome, _ in rows)),
        },
    }


def render(
    planned: Plan, rows: list[tuple[HostObject, str, str]], out: TextIO, *, dry_run: bool
) -> None:
    """One line per candidate, then the summary (names escaped: they are anyone's)."""
    for obj, outcome, detail in rows:
        where = obj.path if obj.path is not None else f"shmid {obj.shmid} key {obj.name}"
        age = "age ?" if obj.age_seconds is None else f"age {format_duration(obj.age_seconds)}"
        line = (
            f"{_SAID[outcome]:<12} {obj.engine:<9} {obj.kind:<4} "
            f"{format_size(obj.resident_bytes):>8}  {age:<10} {printable(where)}"
        )
        out.write(line + (f"  ({printable(detail)})" if detail else "") + "\n")
    out.write(summary(planned, rows, dry_run=dry_run) + "\n")


def summary(planned: Plan, rows: list[tuple[HostObject, str, str]], *, dry_run: bool) -> str:
    """The last line: what was (or would be) freed, what was kept, what was left alone."""
    gone = [o for o, outcome, _ in rows if outcome in ("removed", "would_remove")]
    freed = format_size(sum(o.resident_bytes for o in gone))
    if dry_run:
        text = (
            f"dry run: would remove {len(gone)} orphan(s), {freed} resident; "
            "nothing removed (add --yes to remove them)"
            if gone
            else "nothing to reap"
        )
    else:
        counts = Counter(outcome for _, outcome, _ in rows)
        text = f"removed {len(gone)} orphan(s), {freed} resident"
        kept = counts["kept_held"] + counts["kept_changed"]
        if kept:
            text += f"; kept {kept} taken or changed since the scan"
        if counts["failed"]:
            text += f"; {counts['failed']} could not be removed"
    if planned.unreadable:
        text += (
            f"; {planned.unreadable} process(es) could not be read: a file only they hold "
            "looks orphaned"
        )
    reasons = Counter(s.reason for s in planned.skipped)
    if reasons:
        text += "; left alone: " + ", ".join(f"{n} {why}" for why, n in reasons.most_common())
    return text


HELP = "remove orphaned shared memory no process holds (dry run unless --yes)"
COMMAND = Subcommand("reap", HELP, __doc__, add_arguments, run, raw_description=True)
