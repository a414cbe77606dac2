"""`hostpool serve`: allocate pools, serve /metrics, /debug/pools and /healthz until signalled."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from types import FrameType
from typing import Any

from hostpool import events
from hostpool.errors import ConfigError, HostPoolError
from hostpool.serve import config as serve_config


def add_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="hold host pools and serve their metrics")
    p.add_argument("--config", help="TOML (or JSON/YAML) file with [server] and [pools.NAME]")
    p.add_argument("--pool", action="append", default=[], metavar="NAME=SIZE")
    p.add_argument("--allocator", default=None, help="allocator for --pool pools (shm)")
    p.add_argument("--hugepages", default=None, choices=("off", "prefer", "required"))
    p.add_argument("--host", default=None, help="listen address (127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="listen port (9464; 0 picks one)")
    p.add_argument("--budget", default=None, help="bytes the pools may hold, e.g. 8GiB")
    p.add_argument("--host-budget", default=None, help="bytes all ranks on this host may hold")
    p.add_argument("--budget-dir", default=None, help="directory the ranks share the budget in")
    p.add_argument("--share-socket", default=None, metavar="PATH")
    p.add_argument("--demo-load", action="store_true", help="run a demo workload")
    p.set_defaults(run=run)


def build_config(args: argparse.Namespace) -> serve_config.ServeConfig:
    data: dict[str, Any] = {"server": {}}
    if args.config:
        from hostpool.config import load_file

        data = load_file(args.config, what="serve config")
        data.setdefault("server", {})
    if args.pool:
        pools: dict[str, Any] = {}
        for flag in args.pool:
            name, size = serve_config.parse_pool_flag(flag)
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
    for key in ("host", "port", "budget", "host_budget", "budget_dir", "share_socket"):
        value = getattr(args, key)
        if value is not None:
            server[key] = value
    if args.demo_load:
        server["demo_load"] = True
    return serve_config.from_mapping(data)


class _Progress:
    """A bar on a TTY, a log line per quarter otherwise."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self._last: dict[str, int] = {}

    def __call__(self, pool: str, done: int, total: int) -> None:
        if self.tty:
            width = 30
            filled = width * done // total
            sys.stderr.write(
                f"\r{pool:>12} [{'#' * filled}{'.' * (width - filled)}] "
                f"{done >> 20}/{total >> 20} MiB"
            )
            if done == total:
                sys.stderr.write("\n")
            sys.stderr.flush()
            return
        quarter = 4 * done // total
        if quarter > self._last.get(pool, 0):
            self._last[pool] = quarter
            events.info("hostpool.populate_progress", pool=pool, done=done, total=total)


def run(args: argparse.Namespace) -> int:
    cfg = build_config(args)
    from hostpool.serve.http import ServiceHTTP
    from hostpool.serve.service import PoolService

    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        events.info("hostpool.serve_stopping", signal=signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)

    service = PoolService(cfg)
    share = None
    demo = None
    http = None
    try:
        try:
            service.allocate_all(_Progress())
        except HostPoolError as exc:
            events.warning("hostpool.serve_failed", error=str(exc))
            print(f"hostpool serve: {exc}", file=sys.stderr)
            return 1
        try:
            http = ServiceHTTP(
                cfg.host, cfg.port, debug=service.debug_document, healthy=lambda: not stop.is_set()
            ).start()
        except OSError as exc:
            raise ConfigError(f"cannot listen on {cfg.host}:{cfg.port}: {exc.strerror}") from exc
        if cfg.share_socket:
            from hostpool.share import PoolShareServer

            share = PoolShareServer(service.manager, cfg.share_socket).start()
        if cfg.demo_load:
            from hostpool.serve.demo import DemoLoad

            demo = DemoLoad(service).start()
        host, port = http.address
        events.warning(  # the one line an operator needs, printed even unconfigured
            "hostpool.serving",
            url=f"http://{host}:{port}/metrics",
            pools=[p.name for p in cfg.pools],
            bytes=sum(p.size for p in cfg.pools),
        )
        stop.wait()
    finally:
        if demo is not None:
            demo.stop()
        if share is not None:
            share.close()
        if http is not None:
            http.stop()
        report = service.close()
        if report:
            events.warning("hostpool.serve_leaks", report=str(report))
    events.info("hostpool.serve_stopped")
    return 0
