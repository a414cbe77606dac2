"""`hostpool run -- CMD...`: run CMD with hostpool's sglang integration active in every
Python process it starts (spawned workers included), through HOSTPOOL_INSTRUMENT and the
`.pth` hook the hostpool wheel installs in that interpreter's site-packages.

CMD replaces this process (exec), so the exit status is CMD's own. When CMD cannot be
started: 2 if none or an empty one is given, or it is not found or not executable, 1 for
any other failure; one line on stderr each."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from hostpool.integrations import ENV


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "run",
        help="run a command with the sglang integration active (HOSTPOOL_INSTRUMENT=sglang)",
        description=__doc__,
    )
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...")
    p.set_defaults(run=run)


def instrumented_env(environ: dict[str, str]) -> dict[str, str]:
    """`environ` with sglang added to HOSTPOOL_INSTRUMENT (other entries kept)."""
    wanted = [w for w in environ.get(ENV, "").split(",") if w.strip()]
    if "sglang" not in (w.strip() for w in wanted):
        wanted.append("sglang")
    return {**environ, ENV: ",".join(wanted)}


def run(args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd or not cmd[0]:
        # execve refuses an empty program name with a ValueError, not an OSError
        print("hostpool run: no command given (hostpool run -- CMD ...)", file=sys.stderr)
        return 2
    try:
        os.execvpe(cmd[0], cmd, instrumented_env(dict(os.environ)))
    except OSError as exc:  # only returns on failure
        print(f"hostpool run: cannot run {cmd[0]!r}: {exc.strerror}", file=sys.stderr)
        return 2 if isinstance(exc, FileNotFoundError | PermissionError) else 1
    return 1
