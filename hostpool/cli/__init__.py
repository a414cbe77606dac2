"""The `hostpool` command: serve, inspect, exporter, doctor, run, shm, reap.

Exit codes, one rule for every subcommand (hostpool.cli.exitcodes): 0 ok (a check
passed); 1 the input is right but this host cannot do it now (port in use, share socket
held by a live server, not enough memory or hugepages, /dev/shm short, a failed check,
a failure at run time); 2 the input is wrong (a bad flag or value, a missing or
malformed config, pools over their own budget). Logs go to stderr, data to stdout.
Each subcommand lives in its own module, declared there as `COMMAND` (a
`hostpool.cli.command.Subcommand`: help, flags, `run(args) -> int`). The global flags
(`--log-level`, `--log-format`) are accepted before or after the subcommand.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import textwrap
from collections.abc import Sequence
from typing import NoReturn

from hostpool.cli.exitcodes import EPILOG, for_error
from hostpool.cli.logsetup import FORMATS, LEVELS
from hostpool.errors import HostPoolError

# Subcommand name -> module under hostpool.cli. Imported lazily so `hostpool doctor`
# does not pay for torch when it does not need it.
SUBCOMMANDS: dict[str, str] = {
    "serve": "hostpool.cli.serve",
    "inspect": "hostpool.cli.inspect",
    "exporter": "hostpool.cli.exporter",
    "doctor": "hostpool.cli.doctor",
    "run": "hostpool.cli.run",
    "reap": "hostpool.cli.reap",
    "shm": "hostpool.cli.shm",
}


class Parser(argparse.ArgumentParser):
    """Usage errors are one line (and exit 2), not the usage block plus a line."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hostpool")
    except PackageNotFoundError:
        return "unknown"


def _global_flags(parser: argparse.ArgumentParser, *, default: bool) -> None:
    """--log-level / --log-format. On subcommands their default is SUPPRESS, so a flag
    given after the subcommand overrides the top-level value and its absence does not."""

    def dflt(value: str) -> str:
        return value if default else argparse.SUPPRESS

    parser.add_argument(
        "--log-level", default=dflt("info"), type=str.lower, choices=LEVELS, help="default info"
    )
    parser.add_argument(
        "--log-format",
        default=dflt("auto"),
        choices=FORMATS,
        help="console or json lines on stderr (auto: console on a terminal, json otherwise)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="hostpool", description=__doc__.splitlines()[0], epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"hostpool {_version()}")
    _global_flags(parser, default=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for _name, module_name in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        module.COMMAND.add_to(sub)
    for subparser in sub.choices.values():
        _global_flags(subparser, default=False)
        if subparser.epilog is None:  # pre-wrapped: some keep their text as written
            subparser.epilog = textwrap.fill(EPILOG, 79)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from hostpool.cli.logsetup import configure_logging

    configure_logging(args.log_level, args.log_format)
    try:
        code: int = args.run(args)
        sys.stdout.flush()  # a closed pipe shows here, not as a traceback at exit
    except HostPoolError as exc:  # one line; the status by cause (exitcodes.for_error)
        print(f"hostpool {args.command}: {exc}", file=sys.stderr)
        return for_error(exc)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader stopped reading (`| head`): not this command's failure to report, but
        # its output is incomplete. Python's own advice: point stdout at /dev/null so the
        # flush at exit cannot raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return code
