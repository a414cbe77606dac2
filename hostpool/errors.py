"""Typed errors. Every failure hostpool reports is one of these; messages say what to do."""

from __future__ import annotations


class HostPoolError(Exception):
    """Base of every error hostpool raises on purpose."""


class InvalidRequestError(HostPoolError, ValueError):
    """A request that can never succeed as written: bad dims, dtype, device, option or name."""


class ConfigError(HostPoolError, ValueError):
    """A configuration (server args, extra config, TOML/YAML/JSON file) that is malformed."""


# The fixed set of `reason` values (the `reason` label of
# hostpool_allocation_failures_total); documented in metrics/README.md.
FAILURE_REASONS = ("budget", "hugepages", "no_memory", "no_space", "fd_limit", "invalid", "other")


class AllocationError(HostPoolError, MemoryError):
    """A well-formed request the host could not satisfy now (memory, fds, budget, tmpfs).

    `reason` is one of FAILURE_REASONS.
    """

    def __init__(self, message: str, *, reason: str = "other") -> None:
        super().__init__(message)
        self.reason = reason if reason in FAILURE_REASONS else "other"


class HugepageUnavailableError(AllocationError):
    """`hugepages="required"` and the hugepage pool cannot hold the request."""

    def __init__(self, message: str, *, reason: str = "hugepages") -> None:
        super().__init__(message, reason=reason)


class Cancelled(BaseException):
    """Work stopped on request (a stop signal while populating): not a failure, so not a
    HostPoolError; like KeyboardInterrupt it passes `except Exception` handlers."""


class ShareError(HostPoolError):
    """A pool could not be shared or attached: refused, unsafe to map, or malformed."""


class ShareSocketInUseError(ShareError):
    """A live server already answers at the share socket's path; it is left alone."""
