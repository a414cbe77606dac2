"""The `hostpool` command as a whole: global flags, help, exit codes shared by every
subcommand."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

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


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "HOSTPOOL_INSTRUMENT"}
    return subprocess.run(
        [sys.executable, "-m", "hostpool", "run", *argv],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )  # fmt: skip


SHOW = "import os; print(os.environ['HOSTPOOL_INSTRUMENT'])"


@pytest.mark.parametrize(
    ("only", "names"),
    [([], "sglang,vllm"), (["--only", "VLLM"], "vllm"), (["--only", "sglang,vllm"], "sglang,vllm")],
)
def test_run_activates_every_integration_unless_only(only: list[str], names: str) -> None:
    out = _run(*only, "--", sys.executable, "-c", SHOW)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == names


def test_run_refuses_an_unknown_only_name_in_one_line() -> None:
    out = _run("--only", "sglang,vlm", "--", sys.executable, "-c", SHOW)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "vlm" in out.stderr and "sglang, vllm" in out.stderr


def _bare_python(tmp_path: Path) -> Path:
    """A real venv without hostpool: an interpreter that lacks the hook."""
    venv = tmp_path / "bare"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    return venv / "bin" / "python"


def test_run_refuses_an_interpreter_without_the_hook_and_says_how_to_fix_it(
    tmp_path: Path,
) -> None:
    python = _bare_python(tmp_path)
    out = _run("--", str(python), "-c", SHOW)
    assert out.returncode == 1 and out.stdout == ""  # right input, this host lacks the hook
    line = out.stderr.strip()
    assert out.stderr.count("\n") == 1, out.stderr
    assert str(python) in line and "hostpool-instrument.pth" in line and "pip install" in line


def test_run_checks_the_interpreter_a_script_names_on_its_first_line(tmp_path: Path) -> None:
    python = _bare_python(tmp_path)
    script = tmp_path / "server"
    script.write_text(f"#!{python}\nprint('served')\n")
    script.chmod(0o755)
    assert _run("--", str(script)).returncode == 1
    good = tmp_path / "good"
    good.write_text(f"#!/usr/bin/env {sys.executable}\n{SHOW}\n")
    good.chmod(0o755)
    out = _run("--", str(good))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "sglang,vllm"


def test_run_runs_a_command_that_is_not_python_as_given() -> None:
    out = _run("--", "sh", "-c", 'echo "$HOSTPOOL_INSTRUMENT"; exit 7')
    assert out.returncode == 7
    assert out.stdout.strip() == "sglang,vllm"


def test_a_reader_that_stops_early_gets_no_traceback() -> None:
    """`hostpool shm --json | head` once head has gone: exit 1 (the output is incomplete),
    no traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first write
    try:
        done = subprocess.run(
            [sys.executable, "-m", "hostpool", "shm", "--json"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
            check=False,
        )
    finally:
        os.close(write_end)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr


# ---------------------------------------------------------------- a command line read one way


def _all_parsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {"hostpool": parser, **{f"hostpool {n}": p for n, p in sub.choices.items()}}


def test_no_parser_takes_an_abbreviated_long_option() -> None:
    parsers = _all_parsers()
    assert set(parsers) == {"hostpool", *(f"hostpool {n}" for n in SUBCOMMANDS)}
    assert [name for name, p in parsers.items() if p.allow_abbrev] == []


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["reap", "--y"], "hostpool reap: unknown option --y (did you mean --yes?)"),
        (["reap", "--yess"], "hostpool reap: unknown option --yess (did you mean --yes?)"),
        (["shm", "--jsn"], "hostpool shm: unknown option --jsn (did you mean --json?)"),
        (["doctor", "--kubernetes", "--container", "x", "--engine-mem=4GiB", "--", "vllm"],
         "hostpool doctor: unknown option --engine-mem (did you mean --engine-memory?)"),
        (["shm", "--zzzzzz"], "hostpool shm: unknown option --zzzzzz (see hostpool shm --help)"),
        (["--verison"], "hostpool: unknown option --verison (did you mean --version?)"),
        (["--log-levl", "debug", "shm"],
         "hostpool: unknown option --log-levl (did you mean --log-level?)"),
    ],
)  # fmt: skip
def test_an_unknown_option_names_its_subcommand_and_the_closest_flag(
    argv: list[str], line: str
) -> None:
    """`reap --y` once meant `reap --yes` (argparse's prefix matching): a dry run's
    abbreviation removed files. Refused now, one line, exit 2, before anything runs."""
    out = hostpool(*argv)
    assert (out.returncode, out.stdout, out.stderr) == (2, "", line + "\n")


EXIT_CAUSES = {
    "serve": "port in use",
    "inspect": "no such process",
    "exporter": "--pid process may not be read",
    "doctor": "a size without a unit",
    "run": "CMD's own",
    "shm": "the scan could not run here",
    "reap": "a candidate could not be removed",
}


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_each_help_ends_with_its_own_exit_statuses(command: str) -> None:
    epilog = " ".join(hostpool(command, "--help").stdout.rstrip().rsplit("\n\n", 1)[1].split())
    assert epilog.startswith("exit status: 0 ok")
    assert EXIT_CAUSES[command] in epilog
    others = [c for name, c in EXIT_CAUSES.items() if name != command]
    assert [c for c in others if c in epilog] == []
