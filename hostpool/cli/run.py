"""`hostpool run [--only NAME,...] [--reap] -- CMD...`: run CMD with hostpool's server integrations
(all of them unless `--only`) active in every Python process it starts (spawned workers
included), through HOSTPOOL_INSTRUMENT and the `.pth` hook the hostpool wheel installs in
an interpreter's site-packages.

When CMD is a Python interpreter, or a script whose `#!` line names one, that interpreter
must have the hook: otherwise nothing would be instrumented and nothing would say so, so
`run` refuses with one line saying how to fix it. Other commands (a shell script that
starts Python, say) are run as given.

With `--reap` it first removes the known engines' orphaned shared memory (tmpfs and
hugetlbfs files no process holds, any age) on this mount namespace's mounts of them, so
a container restarted in place starts clean; a reap failure is reported and CMD runs anyway.

CMD replaces this process (exec), so the exit status is CMD's own. When CMD cannot be
started (`hostpool.cli.exitcodes`): 2 if none or an empty one is given, an `--only` name
is unknown, or CMD is not found or not executable; 1 if its interpreter lacks the hook
(install hostpool into it) and for any other failure; one line on stderr each."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

from hostpool.cli.command import Subcommand
from hostpool.cli.exitcodes import INVALID, NOT_NOW
from hostpool.integrations import ENV, KNOWN, requested
from hostpool.proc.textsafe import printable

HOOK_FILE = "hostpool-instrument.pth"
# Asked of the target interpreter: is the hook in one of its site directories?
_HAS_HOOK = (
    "import os, site, sys; "
    "dirs = site.getsitepackages() + [site.getusersitepackages()]; "
    f"sys.exit(0 if any(os.path.isfile(os.path.join(d, {HOOK_FILE!r})) for d in dirs) else 3)"
)


class RunError(Exception):
    """CMD cannot be run as asked; `code` is the exit status."""

    def __init__(self, message: str, code: int = INVALID) -> None:
        super().__init__(message)
        self.code = code


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Its flags."""
    p.add_argument(
        "--only",
        metavar="NAME,...",
        help=f"only these integrations (known: {', '.join(KNOWN)}; default: all)",
    )
    p.add_argument(
        "--reap",
        action="store_true",
        help="first remove the known engines' orphaned shared memory in this mount "
        "namespace, of any age (hostpool reap --yes --min-age 0 on its own tmpfs and "
        "hugetlbfs mounts); a failure is a warning and CMD runs anyway",
    )
    p.add_argument(
        "cmd",
        nargs=argparse.REMAINDER,
        metavar="-- CMD ...",
        help="the command to run, after --, e.g. -- python -m sglang.launch_server ...",
    )


def instrumented_env(environ: dict[str, str], names: list[str]) -> dict[str, str]:
    """`environ` with `names` added to HOSTPOOL_INSTRUMENT (its other entries kept)."""
    wanted = [w.strip() for w in environ.get(ENV, "").split(",") if w.strip()]
    have = {w.lower() for w in wanted}
    wanted += [name for name in names if name not in have]
    return {**environ, ENV: ",".join(wanted)}


def interpreter_of(program: str) -> str | None:
    """The Python interpreter that will run `program` (a path), or None if it is not
    Python: the program itself when its name starts with `python`, else its `#!` line's."""
    if os.path.basename(program).startswith("python"):
        return program
    try:
        with open(program, "rb") as f:
            first = f.readline(256)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    words = first[2:].decode(errors="replace").split()
    if words and os.path.basename(words[0]) == "env":
        words = [w for w in words[1:] if not w.startswith("-")]
    if not words or not os.path.basename(words[0]).startswith("python"):
        return None
    return shutil.which(words[0]) or words[0]


def check_hook(interpreter: str) -> None:
    """Raise RunError unless `interpreter` has hostpool's `.pth` hook."""
    try:
        probe = subprocess.run(
            [interpreter, "-I", "-c", _HAS_HOOK], capture_output=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RunError(f"cannot ask {interpreter} for its site-packages: {exc}", NOT_NOW) from exc
    if probe.returncode == 3:
        raise RunError(
            f"{interpreter} has no hostpool hook ({HOOK_FILE} is not in its site-packages), "
            f"so nothing would be instrumented: install hostpool into it "
            f"({interpreter} -m pip install {_source()}) or run CMD with the Python that has it",
            NOT_NOW,
        )
    if probe.returncode != 0:
        raise RunError(f"cannot ask {interpreter} for its site-packages", NOT_NOW)


def reap_orphans() -> None:
    """`--reap`: remove the known engines' orphans on this mount namespace's tmpfs mounts,
    of any age, each proven unheld by the kernel's lease (`host.reap`): CMD has not
    started, so nothing of the engine in this container can be about to open them; other
    namespaces (other containers' engines, running) are left alone. A failure, or a file
    the kernel could not prove unheld, is one line on stderr (each object a
    `hostpool.reap_failed` or `hostpool.reap_unprovable` event), never a refusal: the
    operator asked for the engine to start, an orphan left costs RAM the engine reports
    itself if it runs short, and a cleanup must not become the outage (a CrashLoop of
    its own)."""
    from hostpool.host import reap, scan

    try:
        selection = reap.Selection(min_age=0.0, dirs=reap.local_dirs())
        results = reap.reap(reap.plan(scan.scan_host(), selection).candidates)
    except Exception as exc:  # any reason: reported, and CMD still runs
        print(f"hostpool run: --reap failed ({exc}); running CMD anyway", file=sys.stderr)
        return
    # kept_unprovable: the kernel could not say nobody holds it (not the file's owner,
    # say): kept, and said like a failure
    failed = [r for r in results if r.outcome in ("failed", "kept_unprovable")]
    if failed:
        first = failed[0]
        print(
            f"hostpool run: --reap could not remove {len(failed)} orphan(s) (first: "
            f"{printable(first.obj.path or first.obj.name)}: {first.detail}); running CMD anyway",
            file=sys.stderr,
        )


def _source() -> str:
    """What to pip-install hostpool from: this checkout when this hostpool runs from one
    (`make run` installs it editable), else the distribution this one came from."""
    here = os.path.abspath(__file__)  # CHECKOUT/hostpool/cli/run.py
    checkout = os.path.dirname(os.path.dirname(os.path.dirname(here)))
    if os.path.isfile(os.path.join(checkout, "pyproject.toml")):
        return f"-e {checkout}"
    return "/path/to/hostpool (its checkout or wheel)"


def _names(only: str | None) -> list[str]:
    if only is None:
        return list(KNOWN)
    known, unknown = requested(only)
    if unknown or not known:
        raise RunError(
            f"--only names unknown integration(s) {', '.join(unknown) or '(none)'}; "
            f"known: {', '.join(KNOWN)}"
        )
    return known


def run(args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    try:
        names = _names(args.only)
        if not cmd or not cmd[0]:
            # execve refuses an empty program name with a ValueError, not an OSError
            raise RunError("no command given (hostpool run -- CMD ...)")
        program = shutil.which(cmd[0])
        if program is None:
            raise RunError(f"cannot run {cmd[0]!r}: not found or not executable")
        interpreter = interpreter_of(program)
        if interpreter is not None:
            check_hook(interpreter)
        if args.reap:
            reap_orphans()
        os.execvpe(program, cmd, instrumented_env(dict(os.environ), names))
    except RunError as exc:
        print(f"hostpool run: {exc}", file=sys.stderr)
        return exc.code
    except OSError as exc:  # only returns on failure
        print(f"hostpool run: cannot run {cmd[0]!r}: {exc.strerror}", file=sys.stderr)
        return 2 if isinstance(exc, FileNotFoundError | PermissionError) else 1
    return 1


COMMAND = Subcommand(
    name="run",
    help="run a command with the server integrations active (HOSTPOOL_INSTRUMENT)",
    description=__doc__,
    add_arguments=add_arguments,
    run=run,
    raw_description=True,
    epilog="exit status: 0 ok (once CMD runs, the status is CMD's own); 1 the input is right "
    "but this host cannot do it now (CMD's interpreter lacks the hostpool hook, any other "
    "failure to start it); 2 the input is wrong (no CMD, an unknown --only name, CMD not "
    "found or not executable)",
)
