"""Typed errors. Every failure hostpool reports is one of these; messages say what to do."""

from __future__ import annotations

from typing import Any

from hostpool.words import FAILURE_REASONS, FailureReason


class HostPoolError(Exception):
    """Base of every error hostpool raises on purpose."""


class InvalidRequestError(HostPoolError, ValueError):
    """A request that can never succeed as written: bad dims, dtype, device, option or name.
    `option`: the allocator option that is wrong, where one is (so a caller can name it
    as its user wrote it: a config key, a flag)."""

    def __init__(self, message: str, *, option: str | None = None) -> None:
        super().__init__(message)
        self.option = option


class ConfigError(HostPoolError, ValueError):
    """A configuration (server args, extra config, TOML/YAML/JSON file) that is malformed."""


__all__ = ["FAILURE_REASONS", "FailureReason"]  # re-exported: the public home of the reasons


class AllocationError(HostPoolError, MemoryError):
    """A well-formed request the host could not satisfy now (memory, fds, budget, tmpfs).

    The message says what happened and what to do; the figures are attributes too:
    - `reason`: one of FAILURE_REASONS (an unknown value is stored as "other");
    - `pool`: the pool the request was for (None when not known where it was raised);
    - `need_bytes`: bytes the request needed;
    - `available_bytes`: bytes the refusing limit had left for it (may be 0);
    - `limit_bytes`: the limit that refused it (a budget, a cgroup limit), when one did.
    Each figure is None where the failure has none (an fd limit has no bytes available).
    """

    def __init__(
        self,
        message: str,
        *,
        reason: FailureReason = "other",
        pool: str | None = None,
        need_bytes: int | None = None,
        available_bytes: int | None = None,
        limit_bytes: int | None = None,
    ) -> None:
        super().__init__(message)
        self.reason: FailureReason = reason if reason in FAILURE_REASONS else "other"
        self.pool = pool
        self.need_bytes = need_bytes
        self.available_bytes = available_bytes
        self.limit_bytes = limit_bytes


class HugepageUnavailableError(AllocationError):
    """`hugepages="required"` and the hugepage pool cannot hold the request; the figures
    as for AllocationError (`available_bytes`: free hugepages of the size, in bytes)."""

    def __init__(
        self, message: str, *, reason: FailureReason = "hugepages", **figures: Any
    ) -> None:
        super().__init__(message, reason=reason, **figures)


class Cancelled(BaseException):
    """Work stopped on request (a stop signal while populating): not a failure, so not a
    HostPoolError; like KeyboardInterrupt it passes `except Exception` handlers."""


class ShareError(HostPoolError):
    """A pool could not be shared or attached: refused, unsafe to map, or malformed."""


class UnavailableError(HostPoolError):
    """A well-formed request that something on this host, held or short now, refuses: a
    listen port in use (or an address not assigned), a live server at a socket path.
    Retrying once it is free can succeed (the CLI exits 1, as for AllocationError)."""


class ShareSocketInUseError(ShareError, UnavailableError):
    """A live server already answers at the share socket's path; it is left alone."""


class TorchUnavailableError(UnavailableError, ImportError):
    """A tensor API called where torch cannot be imported. hostpool does not install
    torch: an engine's environment brings its own build, which hostpool must not replace
    (`hostpool.require_torch`). An ImportError too, so code that treats torch as optional
    keeps working; the CLI exits 1 (the environment, not the input, lacks it)."""
