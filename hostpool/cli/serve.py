"""`hostpool serve`: allocate pools, serve /metrics, /debug/pools, /healthz and /readyz
until signalled.

Order matters to an operator: the whole configuration is checked (sizes against the
budget, the host and /dev/shm included) and the port is bound before the allocators are
imported or a page is allocated, so every mistake is reported in well under a second. HTTP is
served from the start of populate: /healthz is 200 while the process runs, /readyz 503
with what is still populating until every pool is, then 200 (both 503 once stopping). A
stop signal during populate stops it within a span, releases what was made and exits 0
like any stop; after the releases the process leaves at once (`_exit_now`). A stop while
waiting for a lock another process holds (the host budget's, the share socket
directory's) ends the wait too (`base.shareddir.stop_waits_on`): those waits poll, since
Python retries a blocking flock after the signal handler returns.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from types import FrameType
from typing import Any, NoReturn

from hostpool.base import events, shareddir
from hostpool.cli.command import Subcommand
from hostpool.errors import (
    Cancelled,
    ConfigError,
    HostPoolError,
    ShareSocketInUseError,
    UnavailableError,
)
from hostpool.serve import config as serve_config

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_STOP_POLL_S = 0.2  # the longest a stop signal taken by another thread waits to be seen


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Its flags."""
    p.add_argument("--config", help="TOML (or JSON/YAML) file with [server] and [pools.NAME]")
    p.add_argument(
        "--pool",
        action="append",
        default=[],
        metavar="NAME=SIZE",
        help="a pool to allocate, repeatable, e.g. --pool kv=4GiB --pool swa=512MiB. NAME: "
        "letters, digits, _ and - (at most 64). SIZE: bytes, or a number with a unit: "
        "KiB, MiB, GiB, TiB (KB, MB, GB, TB and K, M, G, T mean the same: powers of 1024, "
        "as in 2MB hugepages). Replaces the pools of --config.",
    )
    p.add_argument(
        "--allocator",
        default=None,
        help="allocator for every pool: "
        + ", ".join(serve_config.BUILTIN_ALLOCATORS)
        + " (default shm: memfd-backed, shareable)",
    )
    p.add_argument(
        "--hugepages",
        default=None,
        choices=("off", "prefer", "required"),
        help="for every pool: prefer (hugetlb pages if free, else THP or 4 KiB pages), off, "
        "or required (refused, exit 1, unless enough hugepages are reserved and free); "
        "default: each pool's own setting, else prefer",
    )
    p.add_argument("--host", default=None, help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="listen port (default 9464; 0 picks one)")
    p.add_argument("--budget", default=None, help="bytes the pools may hold, e.g. 8GiB")
    p.add_argument("--host-budget", default=None, help="bytes all ranks on this host may hold")
    p.add_argument("--budget-dir", default=None, help="directory the ranks share the budget in")
    p.add_argument(
        "--share-socket",
        default=None,
        metavar="PATH",
        help="also share the pools with other processes over a Unix socket at PATH (e.g. "
        "/run/hostpool/share.sock); peers call hostpool.share.attach(PATH, POOL). A missing "
        "parent directory is created private (0700); an existing one is left as it is. A "
        "path that cannot be used is refused before any pool is allocated, and by --check: "
        "exit 2 when the path is wrong (too long, on /proc), 1 when a live server holds it",
    )
    p.add_argument(
        "--share-group",
        default=None,
        metavar="GROUP",
        help="with --share-socket: the members of GROUP (a name or gid, resolved at start) "
        "may also connect, attach and lease (docs/broker.md); the socket is then 0666 in "
        "a directory others can traverse, SO_PEERCRED decides",
    )
    p.add_argument("--demo-load", action="store_true", help="run a demo workload")
    p.add_argument(
        "--check",
        action="store_true",
        help="validate the configuration, the sizes against this host, the port and the "
        "share socket, then exit without allocating: 0 ok, 1 this host cannot run it now "
        "(memory, hugepages, the port or share socket in use), 2 the configuration is wrong",
    )
    p.add_argument(
        "--no-port-check",
        action="store_true",
        help="with --check: do not check that the listen port and the share socket are free "
        "(to check a new configuration beside the running service, which holds both); "
        "everything else is checked, and the output line says what was not",
    )
    p.add_argument(
        "--web-config-file",
        "--web.config.file",
        dest="web_config_file",
        type=os.path.abspath,
        metavar="FILE",
        help="YAML file of TLS and basic auth settings for the listener, node_exporter's "
        "format (tls_server_config, basic_auth_users; also [server] web_config_file); "
        "relative paths in it are resolved against its directory. Checked before anything "
        "is allocated, and by --check",
    )


def build_config(args: argparse.Namespace) -> tuple[serve_config.ServeConfig, dict[str, str]]:
    """The configuration, and which flag set each config key (`server.port` -> `--port`)
    so that errors name what the operator typed."""
    data: dict[str, Any] = {"server": {}}
    if args.config:
        from hostpool.base.config import load_file

        data = load_file(args.config, what="serve config")
        data.setdefault("server", {})
    if args.pool:
        pools: dict[str, Any] = {}
        for flag in args.pool:
            name, size = serve_config.parse_pool_flag(flag)
            if name in pools:
                raise ConfigError(
                    f"--pool {name} is given twice ({pools[name]['size']} and {size}); "
                    "give each pool once"
                )
            table: dict[str, Any] = {"size": size}
            if args.allocator:
                table["allocator"] = args.allocator
            if args.hugepages:
                table["hugepages"] = args.hugepages
            pools[name] = table
        data["pools"] = pools
    elif args.allocator or args.hugepages:
        if "pools" not in data:
            data["pools"] = {k: dict(v) for k, v in serve_config.DEFAULT_POOLS.items()}
        for table in data["pools"].values():
            if args.allocator:
                table["allocator"] = args.allocator
            if args.hugepages:
                table["hugepages"] = args.hugepages
    server = data["server"]
    # Every [server] key has a flag of the same name (--demo-load a store_true one).
    flags: dict[str, str] = {}  # config key -> the flag that set it, for error messages
    for key in serve_config.SERVER_KEYS:
        value = getattr(args, key)
        if value is not None and value is not False:
            server[key] = value
            flags[f"server.{key}"] = "--" + key.replace("_", "-")
    for name in data.get("pools", {}) if isinstance(data.get("pools"), dict) else ():
        if args.pool:
            flags[f"pools.{name}.size"] = f"--pool {name}=SIZE"
            flags[f"pools.{name}"] = f"--pool {name}"
        if args.allocator:
            flags[f"pools.{name}.allocator"] = "--allocator"
        if args.hugepages:
            flags[f"pools.{name}.hugepages"] = "--hugepages"
    try:
        return serve_config.from_mapping(data, os.path.dirname(args.config or "")), flags
    except ConfigError as exc:
        raise ConfigError(serve_config.attributed(str(exc), flags, args.config)) from None


class _Stop:
    """SIGINT/SIGTERM set an event; `announce` logs only while no stop was asked for."""

    def __init__(self) -> None:
        self.event = threading.Event()
        for sig in _STOP_SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if not self.event.is_set():
            events.info("hostpool.serve_stopping", signal=signal.Signals(signum).name)
        self.event.set()

    def wait(self) -> None:
        """Until a stop is asked. Not one wait without end: a stop signal that came while
        `announce` held it blocked was taken by another thread, which leaves a wait of
        this thread uninterrupted; the handler runs once this thread runs Python again."""
        while not self.event.wait(_STOP_POLL_S):
            pass

    def announce(self, event: str, **fields: Any) -> bool:
        # Signals are held while checking and logging: no `serving` line after a stop.
        signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            if self.event.is_set():
                return False
            events.info(event, **fields)
            return True
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)


def run(args: argparse.Namespace) -> int:
    from hostpool.net import listener
    from hostpool.serve import preflight

    if args.no_port_check and not args.check:
        raise ConfigError("--no-port-check goes with --check (serve itself needs the port)")
    cfg, flags = build_config(args)
    skip_addresses = args.check and args.no_port_check
    try:
        preflight.check(cfg)
    except ShareSocketInUseError as exc:
        # the last thing preflight checks: everything before it passed
        if not skip_addresses:
            raise ShareSocketInUseError(_beside(exc, args.check)) from None
    except ConfigError as exc:  # pools over --budget: named as the flag that set it
        raise ConfigError(serve_config.attributed(str(exc), flags, None)) from None
    # Errors go to main(): one line, exit 1 (this host, now) or 2 (the input), by type.
    if args.check:
        from hostpool.base.units import format_size

        if skip_addresses:
            where = f"listen {cfg.host}:{cfg.port} not checked (--no-port-check)"
            if cfg.share_socket:
                where += f", share socket {cfg.share_socket} not checked for a live server"
        else:
            try:
                listener.bind(cfg.host, cfg.port).close()
            except UnavailableError as exc:
                raise UnavailableError(_beside(exc, True)) from None
            where = f"listen {cfg.host}:{cfg.port}"
        pools = ", ".join(f"{p.name} {format_size(p.size)} ({p.allocator})" for p in cfg.pools)
        web = f"; {cfg.web.describe()}" if cfg.web is not None else ""
        print(f"ok: {len(cfg.pools)} pools ({pools}); {where}{web}")
        return 0
    sock = listener.bind(cfg.host, cfg.port)
    stop = _Stop()
    try:
        # Lock waits (the host budget's, the share socket directory's) end at a stop.
        with shareddir.stop_waits_on(stop.event):
            code = _serve(cfg, sock, stop)
    finally:
        for sig in _STOP_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
    _exit_now(code)


def _beside(exc: Exception, check: bool) -> str:
    """The error's text, plus for --check how to check the rest beside a running service."""
    hint = " (beside the running service, --check --no-port-check checks everything else)"
    return f"{exc}{hint if check else ''}"


def _serve(cfg: serve_config.ServeConfig, sock: Any, stop: _Stop) -> int:
    from hostpool.cli.progress import PopulateProgress
    from hostpool.memory import populate
    from hostpool.net.listener import Listener
    from hostpool.serve.broker_metrics import BrokerCollector
    from hostpool.serve.http import service_app, service_registry
    from hostpool.serve.progress_metrics import PopulateState
    from hostpool.serve.service import PoolService

    http = Listener(sock, web_config=cfg.web)
    if stop.event.is_set():  # stopped while the modules above were imported
        sock.close()
        events.info("hostpool.serve_stopped")
        return 0
    service = PoolService(cfg)
    state = PopulateState(((p.name, p.size) for p in cfg.pools), stop.event)
    registry = service_registry(state)
    broker_metrics = BrokerCollector(p.name for p in cfg.pools)  # its book once it lends
    registry.register(broker_metrics)
    share = None
    demo = None
    served = False
    try:
        # Served from the start of populate: /healthz is live, /readyz says what is left.
        http.serve(
            service_app(
                debug=service.debug_document,
                healthy=lambda: not stop.event.is_set(),
                readiness=state.readiness,
                registry=registry,
            )
        )
        served = True
        events.info("hostpool.listening", url=http.url("/"))
        progress = PopulateProgress(sum(p.size for p in cfg.pools))

        def chunk_done(pool: str, done: int, total: int) -> None:
            state.chunk_done(pool, done, total)
            progress(pool, done, total)

        def populated(nbytes: int) -> None:
            state.populated(nbytes)
            progress.populated(nbytes)

        try:
            with progress, populate.cancel_on(stop.event, on_bytes=populated):
                service.allocate_all(chunk_done, stop=stop.event)
        except Cancelled:
            pass
        except HostPoolError as exc:
            return _failed(exc)
        if stop.event.is_set():
            return 0
        if cfg.share_socket:
            from hostpool.broker.server import Broker  # the share server that also lends

            try:
                members = cfg.share_uids  # server.share_group's
                broker = Broker(
                    service.manager,
                    cfg.share_socket,
                    allowed_uids=members,
                    writable_uids=members,
                )
                share = broker.start()
                broker_metrics.book = broker.book
            except Cancelled:  # stopped while waiting for the socket directory's lock
                return 0
            except HostPoolError as exc:
                # preflight found the path usable; something took or broke it since
                return _failed(exc)
        if cfg.demo_load:
            from hostpool.serve.demo import DemoLoad

            demo = DemoLoad(service).start()
        state.set_ready()
        stop.announce(
            "hostpool.serving",
            url=http.url("/metrics"),
            pools=[p.name for p in cfg.pools],
            bytes=sum(p.size for p in cfg.pools),
        )
        stop.wait()
    finally:
        stop.event.set()  # /healthz and /readyz say `stopping` from here on
        if demo is not None:
            demo.stop()
        if share is not None:
            share.close()
        if served:
            http.stop()
        else:
            sock.close()
        report = service.close()
        if report:
            events.warning("hostpool.serve_leaks", report=str(report))
        events.info("hostpool.serve_stopped")
    return 0


def _failed(exc: HostPoolError) -> int:
    """A failure after which serve exits 1: logged at error, and one line on stderr."""
    events.error("hostpool.serve_failed", error=str(exc))
    print(f"hostpool serve: {exc}", file=sys.stderr)
    return 1


def _exit_now(code: int) -> NoReturn:
    """Leave the process with `code` once the pools are released and the stop is logged.

    The interpreter's own teardown (module and object clean-up, torch's where loaded) costs
    a few hundred ms after the releases and does nothing hostpool needs: the pools, the
    share socket and the host budget's reservation file are released explicitly before
    this point, hostpool registers no atexit hook, and the HTTP thread is joined. So the
    log handlers and the standard streams are flushed and the process ends with
    os._exit, which runs no atexit hook of anyone else either (none is registered by
    what `hostpool serve` loads that must run).
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


COMMAND = Subcommand(
    name="serve",
    help="hold host pools and serve their metrics",
    description=(
        "Allocate the configured pools (memfd-backed by default) and serve, from the start "
        "of populate until SIGINT or SIGTERM: / (the endpoints), /metrics, /healthz "
        "(liveness), /readyz (503 until every pool is populated) and /debug/pools. With "
        "neither --config nor --pool, three small demo pools (kv 64MiB, swa 16MiB, mamba "
        "8MiB) are used."
    ),
    add_arguments=add_arguments,
    run=run,
)
