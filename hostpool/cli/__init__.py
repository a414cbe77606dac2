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
import difflib
import importlib
import os
import sys
import textwrap
from collections.abc import Sequence
from typing import Any, NoReturn

from hostpool.cli.exitcodes import EPILOG, EPILOGS, for_error
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
    """Usage errors are one line (and exit 2), not the usage block plus a line. No long
    option is abbreviated (`--y` is not `--yes`: a flag added later would change what an
    old command line means); an unknown one is named with its subcommand and the closest
    valid flag."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)
        self._argv: list[str] = []  # the top level's command line, for error()

    def error(self, message: str) -> NoReturn:
        # `hostpool --verison`: the unknown option, not the subcommand it then lacks
        for arg in self._argv:
            if arg in SUBCOMMANDS:
                break
            if arg.startswith("--") and arg.split("=", 1)[0] not in self._option_string_actions:
                self.unknown([arg])
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if self.prog == "hostpool":
            self._argv = list(sys.argv[1:] if args is None else args)
        parsed, extras = super().parse_known_args(args, namespace)
        if extras and self.prog == "hostpool":  # the top level: say whose flag it is not
            chosen = _subparser(self, getattr(parsed, "command", None))
            (chosen or self).unknown(extras)
        return parsed, extras

    def unknown(self, extras: list[str]) -> NoReturn:
        """One line for what this parser does not take: an option, with the closest of
        its own flags, or else the first stray argument."""
        option = next((a for a in extras if a.startswith("-") and a != "-"), None)
        if option is None:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        flag = option.split("=", 1)[0]
        known = [s for s in self._option_string_actions if s.startswith("--")]
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else f"see {self.prog} --help"
        self.exit(2, f"{self.prog}: unknown option {flag} ({hint})\n")


def _subparser(parser: argparse.ArgumentParser, name: str | None) -> Parser | None:
    """The parser of subcommand `name` under `parser`, if there is one."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            chosen = action.choices[name]
            return chosen if isinstance(chosen, Parser) else None
    return None


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
    for name, subparser in sub.choices.items():
        _global_flags(subparser, default=False)
        if subparser.epilog is None:  # pre-wrapped: some keep their text as written
            subparser.epilog = textwrap.fill(EPILOGS.get(name, EPILOG), 79)
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
