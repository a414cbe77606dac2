"""Before anything is allocated: does the whole configuration fit this host?

Runs without torch, in milliseconds, so a typo such as `--pool kv=10TiB` is refused
before a single page is populated. What contradicts the configuration itself (pools
over its own `server.budget` or `server.host_budget`) is a ConfigError (the CLI exits
2); what this host cannot hold is an AllocationError (exit 1), whether it never could
(more than MemTotal, the cgroup limit, no hugepages of the size or too few reserved:
the host must change) or cannot now (MemAvailable, free hugepages: the error the first
allocation would have raised, from the same admission check the manager uses).

Pools whose shm files go to a directory (`shm_backend = "devshm"`, or `auto` where this
kernel has no memfd) need that tmpfs, `/dev/shm` by default (the pool's `fallback_dir`),
to be writable by this process and to have their bytes free: an AllocationError naming
the directory, the bytes needed and those free (exit 1), before a page is allocated.

So is every problem of the share socket's path (too long, on /proc or a read-only
filesystem, an unsafe directory, one this user cannot write in, something else or a live
server there): ConfigError, or ShareSocketInUseError, found without creating anything.

Two limits of this process are checked against what the pools will hold: the cgroup's
free memory (limit minus usage, the tightest of this cgroup and its ancestors) for the
normal pages, and RLIMIT_NOFILE for the fds the regions keep open (one per chunk of a
shm pool) on top of those open now: an AllocationError (exit 1) each, with the figures.
"""

from __future__ import annotations

import os
import resource

from hostpool.base.units import format_size
from hostpool.core import hostbudget
from hostpool.core.budget import Admission
from hostpool.errors import (
    AllocationError,
    ConfigError,
    HugepageUnavailableError,
    ShareSocketInUseError,
)
from hostpool.memory import cgroup, kernel
from hostpool.serve.config import PoolSpec, ServeConfig
from hostpool.share.socketpath import SocketPath


def _hugetlb_size(spec: PoolSpec) -> int | None:
    """The hugetlb page size a pool must get (hugepages="required"), else None."""
    options = spec.options
    return options.hugepage_size if options.hugepages == "required" else None


def _shm_directory(spec: PoolSpec, has_memfd: bool) -> str | None:
    """The directory the pool's shm files are created in (the /dev/shm-style backend),
    or None when its regions are memfds or not shm at all."""
    if spec.allocator != "shm":
        return None
    options = spec.options
    if options.shm_backend == "devshm" or (options.shm_backend == "auto" and not has_memfd):
        return options.fallback_dir
    return None


def check_shm_directories(pools: list[PoolSpec], *, has_memfd: bool | None = None) -> None:
    """Raise AllocationError unless every directory the pools put shm files in is writable
    by this process, on a filesystem mounted read-write, with the pools' bytes free
    (statvfs f_bavail, whole pages). `has_memfd`: whether memfd_create works here (probed
    when None); it decides where `shm_backend = "auto"` puts the files."""
    if has_memfd is None:
        has_memfd = any(p.allocator == "shm" for p in pools) and kernel.probe_memfd()
    by_directory: dict[str, list[PoolSpec]] = {}
    for spec in pools:
        directory = _shm_directory(spec, has_memfd)
        if directory is not None:
            by_directory.setdefault(os.path.realpath(directory), []).append(spec)
    page = os.sysconf("SC_PAGE_SIZE")
    need_by_fs: dict[int, tuple[str, list[PoolSpec], int]] = {}
    for directory, specs in by_directory.items():
        where = f"pools {_listing(specs)} (shm_backend devshm) put their shm files in {directory}"
        try:
            st = os.statvfs(directory)
            device = os.stat(directory).st_dev
        except OSError as exc:
            raise AllocationError(f"{where}: cannot read it ({exc.strerror})") from None
        if st.f_flag & os.ST_RDONLY:
            raise AllocationError(f"{where}, which is mounted read-only")
        if not os.access(directory, os.W_OK):
            raise AllocationError(f"{where}, which this process (uid {os.getuid()}) cannot write")
        need = sum(-(-p.size // page) * page for p in specs)
        first, before, total = need_by_fs.get(device, (directory, [], 0))
        need_by_fs[device] = (first, before + specs, total + need)
        available = st.f_bavail * st.f_frsize
        if total + need > available:
            listed = before + specs
            raise AllocationError(
                f"pools {_listing(listed)} (shm_backend devshm) need {format_size(total + need)} "
                f"in {directory}, which has {format_size(available)} free",
                reason="no_space",
                need_bytes=total + need,
                available_bytes=available,
            )


def _listing(pools: list[PoolSpec]) -> str:
    return ", ".join(f"{p.name} {format_size(p.size)}" for p in pools)


def check(cfg: ServeConfig) -> None:
    """Raise ConfigError (the configuration contradicts itself) or AllocationError (this
    host cannot hold it) unless every pool can be allocated now, and
    ConfigError or ShareSocketInUseError unless the share socket can be claimed."""
    total = sum(p.size for p in cfg.pools)
    every = _listing(list(cfg.pools))
    for key, limit in (("server.budget", cfg.budget), ("server.host_budget", cfg.host_budget)):
        if limit is not None and total > limit:
            raise ConfigError(
                f"pools need {format_size(total)} ({every}), more than {key} {format_size(limit)}"
            )
    if cfg.host_budget is not None:  # its directory, as the budget will check it
        hostbudget.check_directory(cfg.budget_dir)
    huge: dict[int, list[PoolSpec]] = {}
    normal: list[PoolSpec] = []
    for spec in cfg.pools:
        size = _hugetlb_size(spec)
        (huge.setdefault(size, []) if size is not None else normal).append(spec)
    normal_bytes = sum(p.size for p in normal)
    mem_total = kernel.meminfo().get("MemTotal", 0)
    if normal_bytes > mem_total:
        raise AllocationError(
            f"pools need {format_size(normal_bytes)} ({_listing(normal)}), more than this "
            f"host's memory ({format_size(mem_total)} MemTotal)",
            reason="no_memory",
            need_bytes=normal_bytes,
            available_bytes=mem_total,
            limit_bytes=mem_total,
        )
    cg = cgroup.memory_limit()
    if cg is not None and normal_bytes > cg.limit:
        raise AllocationError(
            f"pools need {format_size(normal_bytes)} ({_listing(normal)}), more than the "
            f"cgroup memory limit {format_size(cg.limit)} ({cg.source})",
            reason="no_memory",
            need_bytes=normal_bytes,
            limit_bytes=cg.limit,
        )
    if cg is not None and normal_bytes > cg.free:
        raise AllocationError(
            f"pools need {format_size(normal_bytes)} ({_listing(normal)}), more than the "
            f"cgroup has free: {format_size(cg.free)} (limit {format_size(cg.limit)} minus "
            f"usage {format_size(cg.usage)}, {cg.source})",
            reason="no_memory",
            need_bytes=normal_bytes,
            available_bytes=cg.free,
            limit_bytes=cg.limit,
        )
    check_fd_limit(list(cfg.pools))
    pools = kernel.hugepage_pools()
    for size, specs in huge.items():
        need = sum(-(-p.size // size) * size for p in specs)
        pool = pools.get(size)
        if pool is None:
            raise HugepageUnavailableError(
                f"pools {_listing(specs)} require {format_size(size)} hugepages; this host "
                f"has none of that size (sizes: {[format_size(s) for s in sorted(pools)]})",
                need_bytes=need,
                available_bytes=0,
            )
        if need > pool.total * size:
            raise HugepageUnavailableError(
                f"pools {_listing(specs)} require {need // size} hugepages of "
                f"{format_size(size)}; {pool.total} are reserved in /sys/kernel/mm/hugepages/"
                f"hugepages-{size // 1024}kB/nr_hugepages",
                need_bytes=need,
                limit_bytes=pool.total * size,
            )
    check_shm_directories(list(cfg.pools))
    # What fits now: the manager's own admission check, for the whole configuration.
    admission = Admission(None, lambda: 0)
    with admission.reserve(normal_bytes, None):
        pass
    for size, specs in huge.items():
        with admission.reserve(sum(p.size for p in specs), size):
            pass
    if cfg.share_socket:
        # `hostpool serve` lets only its own uid attach (PoolShareServer's default).
        where = SocketPath(cfg.share_socket, open_to_others=False)
        try:
            where.check()
        except ShareSocketInUseError:  # always the last problem found: report others first
            check_socket_directory(where.directory)
            raise
        check_socket_directory(where.directory)


def check_socket_directory(directory: str) -> None:
    """ConfigError if the share socket's directory exists and this user cannot create the
    socket in it (SocketPath.check() accepts a root-owned 0755 directory for any uid, and
    listen() would then fail with EACCES after the pools were populated)."""
    if os.path.isdir(directory) and not os.access(directory, os.W_OK | os.X_OK):
        st = os.stat(directory)
        raise ConfigError(
            f"share socket directory {directory} (owner uid {st.st_uid}, mode "
            f"{st.st_mode & 0o7777:o}) is not writable by this user (uid {os.geteuid()}): "
            "use a directory of this user, or a missing one, which is created private"
        )


def regions_with_fds(pools: list[PoolSpec]) -> int:
    """The fds the pools' regions keep open: one per chunk of a shm pool (memfd, or a
    file in its shm directory); mmap and default pools keep none."""
    return sum(-(-p.size // p.chunk) for p in pools if p.allocator == "shm")


def check_fd_limit(pools: list[PoolSpec]) -> None:
    """AllocationError (reason fd_limit) unless the regions' fds fit RLIMIT_NOFILE (soft)
    beside the fds this process has open now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = regions_with_fds(pools)
    if soft == resource.RLIM_INFINITY or need == 0:
        return
    try:
        open_now = len(os.listdir("/proc/self/fd")) - 1  # the listing's own fd
    except OSError:
        return  # no /proc: the first region past the limit says it (EMFILE)
    if open_now + need > soft:
        shm = [p for p in pools if p.allocator == "shm"]
        listed = ", ".join(f"{p.name} {-(-p.size // p.chunk)}" for p in shm)
        raise AllocationError(
            f"the pools' regions keep {need} fds open ({listed}: one per chunk), and "
            f"{open_now} are open already, more than RLIMIT_NOFILE {soft} (hard {hard}): "
            "raise it (ulimit -n, LimitNOFILE= in a systemd unit) or give the pools a "
            "larger chunk",
            reason="fd_limit",
        )
