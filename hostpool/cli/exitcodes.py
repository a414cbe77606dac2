"""What the `hostpool` command's exit status means: one rule for every subcommand.

- 0 (OK): done; for a check (`serve --check`, `doctor --need`, `inspect --check`), it passed.
- 1 (NOT_NOW): the input is right, but this host cannot do it now: the port is in use
  (or the address is not assigned here), a live server holds the share socket's path,
  too little memory (available now, the host's total, the cgroup limit), too few
  hugepages (none of that size, too few reserved or free), /dev/shm too small or
  read-only, a process it may not read; a check that found a problem; any failure at run
  time. The same input can succeed once the host changes, so a supervisor retries it.
- 2 (INVALID): the input is wrong: an unknown flag, a malformed value (a size such as
  `4 potatoes`, a port out of range), a config file that is missing or malformed, a
  configuration that contradicts itself (pools over its own budget), a file or process
  it names that does not exist. Retrying cannot help: fix the command or the config.

A pool bigger than this host's memory (`--pool kv=10TiB`) and one bigger than what is
available now (`kv=22GiB` on a 24 GiB host) have one cause, this host's memory, and both
exit 1; pools over `server.budget` exit 2. systemd units name only 2 in
`RestartPreventExitStatus=`.
"""

from __future__ import annotations

from hostpool.errors import ConfigError, InvalidRequestError

OK = 0
NOT_NOW = 1
INVALID = 2

EPILOG = (
    "exit status: 0 ok (a check passed); 1 the input is right but this host cannot do it "
    "now (port in use, share socket held by a live server, not enough memory or "
    "hugepages, /dev/shm short, a failed check); 2 the input is wrong (a bad flag or "
    "value, a missing or malformed config, pools over their own budget)"
)
# Each subcommand's own causes, the end of its --help (the rule is the same for all;
# a subcommand may declare its own epilog instead: hostpool.cli.command.Subcommand).
EPILOGS = {
    "serve": EPILOG,
    "exporter": (
        "exit status: 0 ok (stopped by a signal); 1 the input is right but this host cannot "
        "do it now (the port is in use, the --pid process may not be read); 2 the input is "
        "wrong (a bad flag or value, a malformed web config file)"
    ),
    "doctor": (
        "exit status: 0 ok (a check passed); 1 the input is right but a check failed (--need "
        "or --hugepages required on this host; with --kubernetes, a --pod spec short of what "
        "the engine needs, or this node or pod with --check-host); 2 the input is wrong (a "
        "bad flag, a size without a unit, a command line or config it cannot size, "
        "--container missing or naming no container of --pod)"
    ),
    "shm": (
        "exit status: 0 ok; 1 the input is right but this host cannot do it now (the scan "
        "could not run here); 2 the input is wrong (a bad flag or engine name)"
    ),
    "reap": (
        "exit status: 0 ok (done, or nothing to do; an object a process holds now is kept, "
        "not a failure); 1 the input is right but this host cannot do it now (a candidate "
        "could not be removed, or the kernel could not prove it unheld: kept_unprovable); "
        "2 the input is wrong (a bad duration, an unknown engine, a --dir that is not a "
        "directory on tmpfs or hugetlbfs)"
    ),
}


def for_error(exc: BaseException) -> int:
    """The exit status for an error the command reports: INVALID for a request or
    configuration that is wrong as written, NOT_NOW for everything else (AllocationError,
    UnavailableError, ShareError, OSError...)."""
    if isinstance(exc, InvalidRequestError | ConfigError):
        return INVALID
    return NOT_NOW
