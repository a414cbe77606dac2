"""What hostpool does at fork, in one place: every module's fork hooks are registered
here (`on_fork`), and this module alone calls `os.register_at_fork`, once.

Order is the contract: `after_in_child` and `after_in_parent` hooks run by `stage`, then
in registration order; `before` hooks in the reverse, as CPython runs its own. The
locks are fresh (`base.locks`, stage `LOCKS`) before the ledger, the host budget or a
publisher (stage `STATE`) uses one, whatever order they were imported in. A hook that raises is
printed on stderr (as CPython reports its own fork hooks' errors) and the
others still run: one broken hook must not leave a child with the parent's lock held.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass

Hook = Callable[[], None]

LOCKS = 0  # re-create locks: nothing else is safe in the child before this
STATE = 1  # reset module state (which may take those locks)


@dataclass(frozen=True)
class ForkHooks:
    """One module's hooks (any may be None); `owner` names it (its module)."""

    owner: str
    stage: int = STATE
    before: Hook | None = None
    after_in_parent: Hook | None = None
    after_in_child: Hook | None = None


_registered: list[ForkHooks] = []


def on_fork(
    owner: str,
    *,
    stage: int = STATE,
    before: Hook | None = None,
    after_in_parent: Hook | None = None,
    after_in_child: Hook | None = None,
) -> None:
    """Register `owner`'s fork hooks (call once, at import of the owning module)."""
    _registered.append(ForkHooks(owner, stage, before, after_in_parent, after_in_child))
    _registered.sort(key=lambda hooks: hooks.stage)  # stable: registration order within


def registered() -> tuple[ForkHooks, ...]:
    """Every module's hooks, in the order the child runs them."""
    return tuple(_registered)


def _run(hooks: list[ForkHooks], phase: str) -> None:
    for entry in hooks:
        hook: Hook | None = getattr(entry, phase)
        if hook is None:
            continue
        try:
            hook()
        except Exception:  # reported as CPython reports its own, and the next hook runs
            print(f"Exception ignored in hostpool's fork hook of {entry.owner}:", file=sys.stderr)
            traceback.print_exc(file=sys.stderr)


def _before() -> None:
    _run(list(reversed(_registered)), "before")


def _after_in_parent() -> None:
    _run(list(_registered), "after_in_parent")


def _after_in_child() -> None:
    _run(list(_registered), "after_in_child")


os.register_at_fork(
    before=_before, after_in_parent=_after_in_parent, after_in_child=_after_in_child
)
