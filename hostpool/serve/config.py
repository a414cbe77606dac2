"""What `hostpool serve` runs: pools and server settings, from TOML, flags or defaults.

Every bad value is a ConfigError naming its key (`pools.kv.size`), so the CLI exits 2
with a message an operator can act on.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hostpool.base.config import load_file
from hostpool.base.units import parse_size
from hostpool.core.podplan import Backing, PoolNeed
from hostpool.errors import ConfigError, HostPoolError, InvalidRequestError
from hostpool.memory.options import RegionOptions, validate_pool_name

if TYPE_CHECKING:  # ssl is imported only when a web config file is given
    from hostpool.net.webconfig import WebConfig

DEFAULT_CHUNK = 256 << 20
# Small enough for any laptop, shaped like a hybrid model's host cache.
DEFAULT_POOLS: dict[str, dict[str, Any]] = {
    "kv": {"size": "64MiB", "allocator": "shm"},
    "swa": {"size": "16MiB", "allocator": "shm"},
    "mamba": {"size": "8MiB", "allocator": "mmap"},
}
_POOL_KEYS = {"size", "allocator", "chunk"} | {
    "hugepages",
    "hugepage_size",
    "populate",
    "populate_threads",
    "pin",
    "pin_chunk_bytes",
    "numa_node",
    "shm_backend",
    "fallback_dir",
}
# The [server] table; `hostpool serve` has a flag named after each key.
SERVER_KEYS = {
    "host",
    "port",
    "budget",
    "host_budget",
    "budget_dir",
    "share_socket",
    "share_group",
    "demo_load",
    "web_config_file",
}
DEFAULT_BUDGET_DIR = "/dev/shm/hostpool-budget"
# hostpool.core.allocators' own registry, known without importing torch (a test keeps the two
# equal); allocators registered in-process are seen once hostpool.core.allocators is imported.
BUILTIN_ALLOCATORS = ("default", "mmap", "shm")


def allocator_names() -> list[str]:
    module = sys.modules.get("hostpool.core.allocators")
    if module is None:
        return sorted(BUILTIN_ALLOCATORS)
    names: list[str] = module.allocator_names()
    return names


@dataclass(frozen=True)
class PoolSpec:
    name: str
    size: int
    allocator: str = "shm"
    chunk: int = DEFAULT_CHUNK
    options: RegionOptions = field(default_factory=RegionOptions)  # parsed once, here

    def need(self) -> PoolNeed:
        """What the pool asks of a host or pod: `shm` is a memfd (a /dev/shm file with
        `shm_backend = "devshm"`), any other allocator private anonymous memory; one
        mapping per chunk."""
        options = self.options
        backing: Backing = "anon"
        if self.allocator == "shm":
            backing = "devshm" if options.shm_backend == "devshm" else "memfd"
        return PoolNeed(
            name=self.name,
            size_bytes=self.size,
            backing=backing,
            hugepages=options.hugepages,
            hugepage_size=options.hugepage_size,
            pinned=options.pin,
            mappings=-(-self.size // self.chunk),
            numa_node=options.numa_node,
            source=f"pools.{self.name}",
        )


@dataclass(frozen=True)
class ServeConfig:
    pools: tuple[PoolSpec, ...]
    host: str = "127.0.0.1"
    port: int = 9464
    budget: int | None = None
    host_budget: int | None = None  # shared by every process using the same budget_dir
    budget_dir: str = DEFAULT_BUDGET_DIR
    share_socket: str | None = None
    # uids of server.share_group's members (at start): they may connect and lease
    share_uids: tuple[int, ...] = ()
    demo_load: bool = False
    # TLS and basic auth of the listener, loaded and checked from server.web_config_file
    web: WebConfig | None = field(default=None, compare=False)


def _size(value: object, key: str) -> int:
    try:
        n = parse_size(value, what=key)
    except HostPoolError as exc:
        raise ConfigError(str(exc)) from None
    if n <= 0:
        raise ConfigError(f"{key} must be positive, got {value!r}")
    return n


def pool_spec(name: str, table: dict[str, Any], defaults: dict[str, Any] | None = None) -> PoolSpec:
    """A PoolSpec from one `[pools.NAME]` table; options are validated now."""
    prefix = f"pools.{name}"
    try:
        validate_pool_name(name)
    except HostPoolError as exc:
        raise ConfigError(f"{prefix}: {exc}") from None
    merged = {**(defaults or {}), **table}
    unknown = sorted(set(merged) - _POOL_KEYS)
    if unknown:
        raise ConfigError(f"{prefix}: unknown key(s) {unknown}; known: {sorted(_POOL_KEYS)}")
    if "size" not in merged:
        raise ConfigError(f'{prefix}.size is required (e.g. size = "4GiB")')
    size = _size(merged.pop("size"), f"{prefix}.size")
    chunk = _size(merged.pop("chunk", DEFAULT_CHUNK), f"{prefix}.chunk")
    allocator = merged.pop("allocator", "shm")
    if allocator not in allocator_names():
        raise ConfigError(f"{prefix}.allocator: unknown {allocator!r}; known: {allocator_names()}")
    try:
        options = RegionOptions.parse(**merged)
    except InvalidRequestError as exc:
        where = f"{prefix}.{exc.option}" if exc.option else prefix
        raise ConfigError(f"{where}: {exc}") from None
    except HostPoolError as exc:
        raise ConfigError(f"{prefix}: {exc}") from None
    return PoolSpec(name=name, size=size, allocator=allocator, chunk=chunk, options=options)


def from_mapping(data: dict[str, Any], base_dir: str | None = None) -> ServeConfig:
    """The ServeConfig of a `{"server": ..., "pools": ...}` mapping, checked whole; the
    web config file it names is loaded now (a relative path is taken from `base_dir`, the
    directory of the file the mapping came from). Raises ConfigError naming the key."""
    unknown = sorted(set(data) - {"server", "pools"})
    if unknown:
        raise ConfigError(f"unknown top-level key(s) {unknown}; known: ['pools', 'server']")
    server = data.get("server", {})
    if not isinstance(server, dict):
        raise ConfigError("server must be a table")
    bad = sorted(set(server) - SERVER_KEYS)
    if bad:
        raise ConfigError(f"server: unknown key(s) {bad}; known: {sorted(SERVER_KEYS)}")
    pools_table = data.get("pools", DEFAULT_POOLS)
    if not isinstance(pools_table, dict) or not pools_table:
        raise ConfigError("pools must be a non-empty table of [pools.NAME] tables")
    pools = []
    for name, table in pools_table.items():
        if not isinstance(table, dict):
            raise ConfigError(f"pools.{name} must be a table")
        pools.append(pool_spec(name, table))
    port = server.get("port", 9464)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"server.port must be an int in 0..65535, got {port!r}")
    host = server.get("host", "127.0.0.1")
    if not isinstance(host, str):
        raise ConfigError(f"server.host must be a string, got {host!r}")
    budget = server.get("budget")
    share = server.get("share_socket")
    if share is not None and not isinstance(share, str):
        raise ConfigError(f"server.share_socket must be a path, got {share!r}")
    share_uids = group_uids(server.get("share_group"), share)
    host_budget = server.get("host_budget")
    budget_dir = server.get("budget_dir", DEFAULT_BUDGET_DIR)
    if not isinstance(budget_dir, str) or not budget_dir:
        raise ConfigError(f"server.budget_dir must be a directory path, got {budget_dir!r}")
    if host_budget is not None and budget is not None:
        raise ConfigError("server.budget and server.host_budget: set one of them")
    demo = server.get("demo_load", False)
    if not isinstance(demo, bool):
        raise ConfigError(f"server.demo_load must be true or false, got {demo!r}")
    web_file = server.get("web_config_file")
    if web_file is not None and (not isinstance(web_file, str) or not web_file):
        raise ConfigError(f"server.web_config_file must be a path, got {web_file!r}")
    web = None
    if web_file:
        from hostpool.net import webconfig

        web = webconfig.load(os.path.join(base_dir or "", os.path.expanduser(web_file)))
    return ServeConfig(
        pools=tuple(pools),
        host=host,
        port=port,
        budget=_size(budget, "server.budget") if budget is not None else None,
        host_budget=_size(host_budget, "server.host_budget") if host_budget is not None else None,
        budget_dir=budget_dir,
        share_socket=share,
        share_uids=share_uids,
        demo_load=demo,
        web=web,
    )


def group_uids(group: object, share_socket: str | None) -> tuple[int, ...]:
    """The uids of `group` (a name or a gid): its listed members and the users whose
    primary group it is, resolved now (a member added later is not one until a restart).
    ConfigError for an unknown group, or a group without a share socket."""
    if group is None:
        return ()
    if not isinstance(group, str | int) or isinstance(group, bool) or group == "":
        raise ConfigError(f"server.share_group must be a group name or gid, got {group!r}")
    if share_socket is None:
        raise ConfigError("server.share_group goes with server.share_socket")
    import grp
    import pwd

    try:
        entry = grp.getgrgid(int(group)) if str(group).isdigit() else grp.getgrnam(str(group))
    except (KeyError, OverflowError):
        raise ConfigError(f"server.share_group: no group {group!r} on this host") from None
    uids = {u.pw_uid for u in pwd.getpwall() if u.pw_gid == entry.gr_gid}
    for name in entry.gr_mem:
        try:
            uids.add(pwd.getpwnam(name).pw_uid)
        except KeyError:
            continue  # a member the user database no longer knows
    return tuple(sorted(uids))


def from_file(path: str) -> ServeConfig:
    if not os.path.splitext(path)[1]:
        raise ConfigError(f"{path}: config files end in .toml, .json or .yaml")
    return from_mapping(load_file(path, what="serve config"), os.path.dirname(path))


def attributed(message: str, flags: dict[str, str], path: str | None) -> str:
    """A ConfigError's `message` as the operator wrote it: each config key a flag set
    (`flags`: `server.port` -> `--port`) named as that flag; otherwise, when the mapping
    came from the file `path`, the file named first."""
    if flags:
        keys = "|".join(re.escape(k) for k in sorted(flags, key=len, reverse=True))
        named = re.sub(rf"(?<![\w.])({keys})(?!\w)", lambda m: flags[m.group(1)], message)
        if named != message:
            return named
    return f"{path}: {message}" if path else message


def parse_pool_flag(flag: str) -> tuple[str, str]:
    """`kv=4GiB` -> ("kv", "4GiB")."""
    name, sep, size = flag.partition("=")
    if not sep or not name or not size:
        raise ConfigError(f"--pool takes NAME=SIZE (e.g. kv=4GiB), got {flag!r}")
    return name, size
