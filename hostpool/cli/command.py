"""What each `hostpool` subcommand declares: its help, its flags and how it runs."""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Subcommand:
    """One subcommand. `help` is its line in `hostpool --help`, `description` the text of
    `hostpool NAME --help` (kept as written when `raw_description`), `add_arguments` adds
    its flags, `run` runs it and returns the exit status (hostpool.cli.exitcodes);
    `epilog`, what its exit statuses mean when the shared text (serve's causes) does not
    fit it."""

    name: str
    help: str
    description: str | None
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    raw_description: bool = False
    epilog: str | None = None

    def add_to(self, subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
        """Its parser, added to `subparsers`, with `run` as the `run` default."""
        parser: argparse.ArgumentParser = subparsers.add_parser(
            self.name,
            help=self.help,
            description=self.description,
            epilog=textwrap.fill(self.epilog, 79) if self.epilog else None,
            allow_abbrev=False,  # `--y` is no `--yes` (hostpool.cli.Parser)
            formatter_class=(
                argparse.RawDescriptionHelpFormatter
                if self.raw_description
                else argparse.HelpFormatter
            ),
        )
        self.add_arguments(parser)
        parser.set_defaults(run=self.run)
        return parser
