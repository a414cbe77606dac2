"""`hostpool exporter`: serve Prometheus metrics of other processes' shm, read from /proc.

What it watches: `--pid` (one process) or `--match` (every process holding a prefix),
and/or `--node` (the node view: every shared-memory object on the host, any engine's,
held or orphaned: hostpool.metrics.host); at least one of them.

Endpoints: `/metrics` (only there), `/healthz` (200 while it serves), `/` a page listing
them; any other path is a 404. `--pid` of a process that does not exist (yet) is
accepted: `hostpool_exporter_target_up` is 0 until it does (and again once it exits).
With `--web-config-file`, TLS and basic auth (hostpool.net.webconfig). Exit status as
every subcommand (hostpool.cli.exitcodes): 1 when the port is in use or the --pid process
may not be read, 2 for a wrong flag or value or web config file.
"""

from __future__ import annotations

import argparse
import os
import pwd
import signal
import socket
import sys
import threading
from types import FrameType
from typing import TYPE_CHECKING

from hostpool.base import events, sandbox
from hostpool.cli.command import Subcommand
from hostpool.cli.exitcodes import INVALID, NOT_NOW
from hostpool.proc import procfs
from hostpool.proc.textsafe import printable

if TYPE_CHECKING:
    from hostpool.net.webconfig import WebConfig

# the collector's default, without importing prometheus_client for --help
DEFAULT_SCRAPE_BUDGET = 5.0

# Real servers have a handful of pools (kv, swa, mamba, ...); sglang's raw names all
# count as one (pool "-").
DEFAULT_MAX_POOLS = 32

# One scan's result serves every scrape for this long (a flood costs one scan a second).
DEFAULT_MIN_SCAN_INTERVAL = 1.0
# /healthz turns 503 when a scan asked for has not finished after this many times the
# longer of the minimum interval and the scrape budget (15 s by default).
STALL_FACTOR = 3
DEFAULT_LISTENER_USER = "65534"  # nobody


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Its flags."""
    target = p.add_mutually_exclusive_group()
    target.add_argument(
        "--pid",
        type=_pid,
        action=_Once,
        help="one process, every known name prefix (it may start later: target_up 0 till "
        "then); given once: --match PREFIX watches several",
    )
    target.add_argument(
        "--match",
        action="append",
        metavar="PREFIX",
        help="every process holding a shm fd or mapping named PREFIX... (repeatable)",
    )
    p.add_argument(
        "--node",
        action="store_true",
        help="the node view: every shared-memory object on the host (memfds, tmpfs files in "
        "every mount namespace, SysV, shared anonymous), whoever holds it, and Shmem no "
        "object accounts for (hostpool_host_*); alone or with --pid/--match",
    )
    p.add_argument("--host", default="127.0.0.1", help="listen address (127.0.0.1)")
    p.add_argument("--port", type=_port, default=9465, help="listen port (9465; 0 picks one)")
    p.add_argument(
        "--max-pools",
        type=_max_pools,
        default=DEFAULT_MAX_POOLS,
        metavar="N",
        help=f"pool series per prefix at most ({DEFAULT_MAX_POOLS}); the smallest pools past "
        'it are summed into pool="_other" (any user can name memfds after a prefix)',
    )
    p.add_argument(
        "--scrape-budget",
        type=_budget,
        default=DEFAULT_SCRAPE_BUDGET,
        metavar="SECONDS",
        help=f"time one scrape may spend reading /proc ({DEFAULT_SCRAPE_BUDGET:g}); past it the "
        "scrape answers with what it read and hostpool_exporter_scrape_truncated 1 "
        "(keep it below Prometheus' scrape_timeout); --node with --pid/--match: half each",
    )
    p.add_argument(
        "--min-scan-interval",
        type=_interval,
        default=DEFAULT_MIN_SCAN_INTERVAL,
        metavar="SECONDS",
        help=f"one scan's result answers every scrape for this long "
        f"({DEFAULT_MIN_SCAN_INTERVAL:g}); at most one scan runs at a time; 0: a scan per "
        "scrape (still one at a time)",
    )
    p.add_argument(
        "--listener-user",
        type=_user,
        default=DEFAULT_LISTENER_USER,
        metavar="USER",
        help=f"the user (name or uid) the process that answers HTTP runs as, without any "
        f"capability ({DEFAULT_LISTENER_USER}); started as another user than root, it stays "
        "that user",
    )
    p.add_argument(
        "--web-config-file",
        "--web.config.file",
        dest="web_config_file",
        metavar="FILE",
        help="YAML file of TLS and basic auth settings, node_exporter's format "
        "(tls_server_config, basic_auth_users); relative paths in it are resolved against "
        "its directory. Without it: plain HTTP, no auth",
    )


def run(args: argparse.Namespace) -> int:
    from prometheus_client import CollectorRegistry
    from prometheus_client.exposition import generate_latest

    from hostpool.metrics.exporter import ProcfsCollector
    from hostpool.metrics.host import HostCollector
    from hostpool.metrics.privsep import ScanCount, answer_questions, end_reader, split
    from hostpool.net.listener import bind
    from hostpool.net.webconfig import load

    watched = args.pid is not None or args.match is not None
    if not (watched or args.node):
        print(
            "hostpool exporter: say what to watch: --pid PID, --match PREFIX, --node, "
            "or --node with one of the others",
            file=sys.stderr,
        )
        return INVALID
    if args.match is not None and not all(args.match):
        print("hostpool exporter: --match needs a non-empty prefix", file=sys.stderr)
        return INVALID
    # a wrong web config is a ConfigError: one line and exit 2, from main(), before binding.
    # Read now, before the split: its files (a 0600 key) are read once, as nginx does;
    # what the listener does with them (TLS, auth) runs unprivileged
    web: WebConfig | None = load(args.web_config_file) if args.web_config_file else None
    absent: procfs.ProcessNotFoundError | None = None
    if args.pid is not None:
        try:
            procfs.check_readable(args.pid)
        except procfs.ProcessNotFoundError as exc:
            absent = exc  # served as target_up 0 until a process has that pid
        except procfs.ProcessAccessError as exc:
            print(f"hostpool exporter: cannot read pid {args.pid}: {exc}", file=sys.stderr)
            return NOT_NOW

    registry = CollectorRegistry(auto_describe=True)
    # one scrape reads both views in turn: together they keep to the one budget
    budget = args.scrape_budget / 2 if watched and args.node else args.scrape_budget
    if watched:
        registry.register(
            ProcfsCollector(
                pid=args.pid,
                match=args.match or (),
                max_pools=args.max_pools,
                scrape_budget=budget,
            )
        )
    if args.node:
        registry.register(HostCollector(scrape_budget=budget))
    scans = ScanCount()
    registry.register(scans)
    # a port in use is an UnavailableError: one line and exit 1, from main(); bound before
    # the split, so a port below 1024 needs no capability afterwards
    listening = bind(args.host, args.port)

    def prepare() -> None:
        listening.close()  # the reader holds no socket but its end of the pair
        sandbox.enter_reader(listener_uid=args.listener_user[0])

    def render() -> bytes:
        scans.scans += 1
        return generate_latest(registry)

    def reader(end: socket.socket) -> None:
        answer_questions(end, render, min_interval=args.min_scan_interval)

    end, reader_pid = split(prepare, reader)
    try:
        return _listen(args, listening, end, reader_pid, web, absent)
    finally:
        end.close()
        end_reader(reader_pid)


def _listen(
    args: argparse.Namespace,
    listening: socket.socket,
    end: socket.socket,
    reader_pid: int,
    web: WebConfig | None,
    absent: procfs.ProcessNotFoundError | None,
) -> int:
    """The listener's side: drop to the listener user, serve until a signal or until the
    reader is gone."""
    from hostpool.metrics.privsep import ReadingLink, health_app, metrics_app
    from hostpool.net.listener import Listener
    from hostpool.net.routes import Route, routed_app

    if web is not None and web.users:
        import bcrypt  # noqa: F401  (imported while the files are ours to read)
    sandbox.enter_listener(*args.listener_user)
    stop = threading.Event()
    stopped_by: list[str] = ["?"]
    gone: list[str] = []

    def on_gone(why: str) -> None:
        gone.append(why)
        stop.set()

    link = ReadingLink(
        end,
        min_interval=args.min_scan_interval,
        answer_within=args.scrape_budget * 1.5 + 1.0,
        stall_after=STALL_FACTOR * max(args.min_scan_interval, args.scrape_budget),
    )
    app = routed_app(
        "hostpool exporter",
        [
            Route("/metrics", "Prometheus metrics of the watched processes", metrics_app(link)),
            Route("/healthz", "200 ok while scans finish, else 503 and why", health_app(link)),
        ],
    )
    http = Listener(listening, web_config=web).serve(app)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stopped_by[0] = signal.Signals(signum).name
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    link.start(on_gone)
    events.info(
        "hostpool.exporter_serving",
        url=http.url("/metrics"),
        pid=args.pid,
        # chosen by the watched process: escaped, it cannot forge or garble a log line
        command=printable(procfs.command_name(args.pid) or "?") if args.pid else None,
        match=args.match,
        node=args.node,
        web=web.describe() if web is not None else None,
        listener_uid=os.getuid(),
        reader_pid=reader_pid,
        min_scan_interval_s=args.min_scan_interval,
    )
    if absent is not None:
        events.info(
            "hostpool.exporter_waiting",
            pid=args.pid,
            detail="no process has this pid yet: hostpool_exporter_target_up is 0 until one "
            "does" + (f" ({absent.hint})" if absent.hint else ""),
        )
    url = http.url("/metrics")
    # Bounded waits: a stop signal the kernel gave another thread (a listener's) leaves a
    # wait without end uninterrupted; its handler runs once this thread runs Python.
    while not stop.wait(0.2):
        pass
    http.stop(drain=False)  # a scrape in flight is not waited for: the process ends now
    if gone and stopped_by[0] == "?":
        events.error("hostpool.exporter_reader_gone", url=url, reader_pid=reader_pid, why=gone[0])
        return NOT_NOW
    events.info("hostpool.exporter_stopped", url=url, signal=stopped_by[0])
    return 0


class _Once(argparse.Action):
    """A flag that may be given once: a second value is a usage error, not a silent
    replacement of the first."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        before = getattr(namespace, self.dest, None)
        if before is not None:
            parser.error(
                f"{option_string} is given twice ({before} and {values}): the exporter watches "
                "one pid; --match PREFIX watches every process holding PREFIX"
            )
        setattr(namespace, self.dest, values)


def _int_in(text: str, what: str, low: int, high: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} must be a whole number, got {text!r}") from None
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"{what} must be {low}..{high}, got {value}")
    return value


def _port(text: str) -> int:
    return _int_in(text, "port", 0, 65535)


def _pid(text: str) -> int:
    return _int_in(text, "pid", 1, 2**22)  # the kernel's PID_MAX_LIMIT


def _max_pools(text: str) -> int:
    return _int_in(text, "--max-pools", 2, 10_000)


def _seconds_in(text: str, what: str, low: float, high: float) -> float:
    """A number of seconds in [low, high] (nan and inf refused), else one usage error."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{what} must be a number of seconds, got {text!r}"
        ) from None
    if not low <= value <= high:  # also refuses nan and inf
        raise argparse.ArgumentTypeError(f"{what} must be {low:g}..{high:g} seconds, got {text}")
    return value


def _interval(text: str) -> float:
    return _seconds_in(text, "--min-scan-interval", 0, 3600)


def _user(text: str) -> tuple[int, int]:
    """(uid, gid) of a user name or uid; a uid without a name gets the gid of its number."""
    try:
        entry = pwd.getpwuid(int(text)) if text.isdigit() else pwd.getpwnam(text)
    except KeyError:
        if text.isdigit():
            uid = _int_in(text, "--listener-user", 0, 2**32 - 2)
            return uid, uid
        raise argparse.ArgumentTypeError(f"--listener-user: no user {text!r} here") from None
    return entry.pw_uid, entry.pw_gid


def _budget(text: str) -> float:
    return _seconds_in(text, "--scrape-budget", 0.001, 300)


COMMAND = Subcommand(
    name="exporter",
    help="metrics of other processes' shared-memory fds and mappings, from /proc",
    description=(
        "Serve /metrics for processes that do not embed hostpool: per prefix and "
        "pool, their shm fds, mapped and resident bytes, read at scrape time. Also /healthz, "
        "and / lists the endpoints. --pid of a process that does not exist yet is accepted "
        "(hostpool_exporter_target_up 0 until it does). --node adds the node view: every "
        "shared-memory object on the host by engine, kind and state (held or orphaned), "
        "and the Shmem no object accounts for."
    ),
    add_arguments=add_arguments,
    run=run,
)
