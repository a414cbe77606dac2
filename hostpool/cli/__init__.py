"""The `hostpool` command: serve, inspect, exporter, doctor, run.

Exit codes: 0 ok, 1 runtime failure or failed check, 2 usage or bad input.
Logs go to stderr, data to stdout. Each subcommand lives in its own module with
`add_parser(subparsers)` and `run(args) -> int`. The global flags (`--log-level`,
`--log-format`) are accepted before or after the subcommand.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

from hostpool.cli.logsetup import FORMATS, LEVELS
from hostpool.errors import ConfigError, InvalidRequestError

# Subcommand name -> module under hostpool.cli. Imported lazily so `hostpool doctor`
# does not pay for torch when it does not need it.
SUBCOMMANDS: dict[str, str] = {
    "serve": "hostpool.cli.serve",
    "inspect": "hostpool.cli.inspect",
    "exporter": "hostpool.cli.exporter",
    "doctor": "hostpool.cli.doctor",
    "run": "hostpool.cli.run",
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
    parser = Parser(prog="hostpool", description=__doc__.splitlines()[0])
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
        module.add_parser(sub)
    for subparser in sub.choices.values():
        _global_flags(subparser, default=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from hostpool.cli.logsetup import configure_logging

    configure_logging(args.log_level, args.log_format)
    try:
        code: int = args.run(args)
    except (InvalidRequestError, ConfigError) as exc:
        print(f"hostpool {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code
