"""`hostpool reap`: remove orphaned shared memory that no process holds (a dry run
unless --yes).

Orphans are regular files in a /dev/shm, a Memory emptyDir or on hugetlbfs (never a
kubelet secret or projected volume, nor /run or another system tmpfs) that no process holds by
an fd or a mapping, and with --sysv SysV segments with no attachment. By default only
this mount namespace's files (`--all-namespaces`: every namespace /proc shows, a
container's /dev/shm through /proc/PID/root; `--dir`: only the directories named), of
the known engines (the engine table of `hostpool shm`; `--engine unknown` widens it to
any name), unchanged (mtime and ctime) for 10 minutes. Each file is re-checked right
before its unlink: still the same inode, a regular file, on tmpfs or hugetlbfs, reached without
following a symlink, held by no process /proc shows, and the kernel grants a write lease
on it (refused while any process of any PID namespace has it open or mapped); the name
is unlinked while the lease is held. memfds are never touched: they die with their
last holder.

Output: one line per object (what it would do or did, engine, resident bytes, age,
path), then a summary; `--json`: one document. Each removal is a `hostpool.reaped`
event on stderr.

Exit codes: 0 done or nothing to do (a file kept because a process holds it now, or
changed, is not a failure; nor is one whose other hard link keeps it); 1 a candidate
could not be removed, or could not be proven unheld (the kernel refused to answer:
`kept_unprovable`); 2 bad input (a bad duration, an unknown engine, a --dir that is not
a directory on tmpfs or hugetlbfs).
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
    "unlinked": "unlinked",
    "kept_held": "kept",
    "kept_changed": "kept",
    "kept_unprovable": "KEPT",
    "failed": "FAILED",
}
# outcomes that exit 1: the kernel or the OS would not do it, or could not answer
_FAILURES = ("failed", "kept_unprovable")
# a row: the object, its outcome, the detail, the bytes freed (None in a dry run)
Row = tuple[HostObject, str, str, int | None]


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
        help="only files in DIR, a directory on tmpfs or hugetlbfs (repeatable; a mount's "
        "root means every file of that filesystem)",
    )
    p.add_argument(
        "--all-namespaces",
        action="store_true",
        help="files of every mount namespace /proc shows (a node-wide clean); default: "
        "this mount namespace's only",
    )
    p.add_argument("--sysv", action="store_true", help="also SysV segments with no attachment")
    p.add_argument("--yes", action="store_true", help="remove them (without it: a dry run)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    from hostpool.host import reap, scan

    selection = reap.Selection(
        min_age=reap.DEFAULT_MIN_AGE if args.min_age is None else args.min_age,
        engines=frozenset(args.engine or reap.KNOWN_ENGINES),
        # InvalidRequestError (exit 2) for a --dir that is not a directory on tmpfs or hugetlbfs
        dirs=tuple(reap.reap_dir(d) for d in args.dir) if args.dir else None,
        sysv=args.sysv,
        all_namespaces=args.all_namespaces,
    )
    planned = reap.plan(scan.scan_host(), selection)
    results = reap.reap(planned.candidates, min_age=selection.min_age) if args.yes else None
    rows: list[Row] = (
        [(r.obj, r.outcome, r.detail, r.freed_bytes) for r in results]
        if results is not None
        else [(o, "would_remove", "", None) for o in planned.candidates]
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
    return NOT_NOW if any(row[1] in _FAILURES for row in rows) else OK


def _would_free(obj: HostObject) -> int:
    """What removing `obj` would free: nothing while another hard link stays."""
    return 0 if obj.links is not None and obj.links > 1 else obj.resident_bytes


def document(planned: Plan, rows: list[Row], *, dry_run: bool) -> dict[str, Any]:
    """The `--json` document: the selection, one entry per candidate (the `hostpool shm`
    object plus `outcome`, `detail` and `freed_bytes`), the orphans left alone with their
    reason, and totals."""
    sel = planned.selection
    gone = [row for row in rows if row[1] in ("removed", "unlinked")]
    return {
        "dry_run": dry_run,
        "min_age_seconds": sel.min_age,
        "engines": sorted(sel.engines),
        "dirs": None if sel.dirs is None else [d.path for d in sel.dirs],
        "all_namespaces": sel.all_namespaces,
        "sysv": sel.sysv,
        "unreadable_processes": planned.unreadable,
        "objects": [
            {**o.as_json(), "outcome": outcome, "detail": detail or None, "freed_bytes": freed}
            for o, outcome, detail, freed in rows
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
            "removed": len(gone),
            "removed_bytes": sum(row[3] or 0 for row in gone),
            "would_remove_bytes": sum(_would_free(row[0]) for row in rows) if dry_run else 0,
            "outcomes": dict(Counter(row[1] for row in rows)),
        },
    }


def render(planned: Plan, rows: list[Row], out: TextIO, *, dry_run: bool) -> None:
    """One line per candidate, then the summary (names escaped: they are anyone's)."""
    for obj, outcome, detail, _freed in rows:
        where = obj.path if obj.path is not None else f"shmid {obj.shmid} key {obj.name}"
        age = "age ?" if obj.age_seconds is None else f"age {format_duration(obj.age_seconds)}"
        line = (
            f"{_SAID[outcome]:<12} {obj.engine:<9} {obj.kind:<4} "
            f"{format_size(obj.resident_bytes):>8}  {age:<10} {printable(where)}"
        )
        out.write(line + (f"  ({printable(detail)})" if detail else "") + "\n")
    out.write(summary(planned, rows, dry_run=dry_run) + "\n")


def summary(planned: Plan, rows: list[Row], *, dry_run: bool) -> str:
    """The last line: what was (or would be) freed, what was kept, what was left alone."""
    if dry_run:
        would = format_size(sum(_would_free(row[0]) for row in rows))
        text = (
            f"dry run: would remove {len(rows)} orphan(s), {would} resident; "
            "nothing removed (add --yes to remove them)"
            if rows
            else "nothing to reap"
        )
    else:
        counts = Counter(row[1] for row in rows)
        freed = format_size(sum(row[3] or 0 for row in rows if row[1] == "removed"))
        text = f"removed {counts['removed'] + counts['unlinked']} orphan(s), {freed} freed"
        if counts["unlinked"]:
            text += f" ({counts['unlinked']} kept by another hard link: nothing freed)"
        kept = counts["kept_held"] + counts["kept_changed"]
        if kept:
            text += f"; kept {kept} held or changed since the scan"
        if counts["kept_unprovable"]:
            text += f"; kept {counts['kept_unprovable']} the kernel could not prove unheld"
        if counts["failed"]:
            text += f"; {counts['failed']} could not be removed"
    if planned.unreadable:
        text += (
            f"; {planned.unreadable} process(es) could not be read (a file only they hold "
            "looks orphaned; the kernel's lease keeps it)"
        )
    reasons = Counter(s.reason for s in planned.skipped)
    if reasons:
        text += "; left alone: " + ", ".join(f"{n} {why}" for why, n in reasons.most_common())
    return text


HELP = "remove orphaned shared memory no process holds (dry run unless --yes)"
COMMAND = Subcommand("reap", HELP, __doc__, add_arguments, run, raw_description=True)
