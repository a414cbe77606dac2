"""The `hostpool` command as a whole: global flags, help, exit codes shared by every
subcommand."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hostpool.cli import SUBCOMMANDS, build_parser


def hostpool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hostpool", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize(
    ("argv", "level", "fmt"),
    [
        (["doctor"], "info", "auto"),
        (["--log-level", "debug", "doctor"], "debug", "auto"),
        (["doctor", "--log-level", "DEBUG", "--log-format", "json"], "debug", "json"),
        # After the subcommand wins over before it, as the later flag on a line does.
        (["--log-format", "console", "doctor", "--log-format", "json"], "info", "json"),
        (["--log-format", "console", "inspect", "--self"], "info", "console"),
    ],
)
def test_global_flags_are_accepted_before_or_after_the_subcommand(
    argv: list[str], level: str, fmt: str
) -> None:
    args = build_parser().parse_args(argv)
    assert (args.log_level, args.log_format) == (level, fmt)


def test_a_global_flag_after_the_subcommand_runs_it() -> None:
    out = hostpool("doctor", "--json", "--log-format", "json", "--log-level", "warning")
    assert out.returncode == 0, out.stderr
    assert "unrecognized arguments" not in out.stderr


def test_a_bad_global_flag_after_the_subcommand_is_one_usage_line_and_exit_2() -> None:
    out = hostpool("doctor", "--log-level", "loud")
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "invalid choice: 'loud'" in out.stderr


def test_top_level_help_names_every_subcommand() -> None:
    text = hostpool("--help").stdout
    first = text.split("positional arguments")[0]
    for name in SUBCOMMANDS:
        assert name in first, f"the description omits {name}"
        assert f"\n    {name} " in text, f"the command list omits {name}"
