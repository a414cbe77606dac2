"""Attribution by holder, not by name: which of the objects a scan read count in the pool
their names say.

A name is a claim: any process may name a memfd `hostpool.kv.<pid>.<seq>` after another
process's pid. The rule:

- A name without a pid (sglang's own `sglang_host_pool_<hex>`: pool `-`) claims no
  process's pool: it counts by its name.
- A name whose pid is the holder's own counts: a process names its own pools.
- Otherwise the object counts only when the process whose pid the name carries (its
  owner) holds that very object (the same inode; a named anonymous region: the same
  name), by an fd or a mapping, as this scan reads it. Every other holder of it then
  counts too, whatever its uid: a share client that attached it (the server handed it
  over; a read-only share is a reopening of the same inode), a worker forked with it.
- An owner this process may not read (an exporter without the right to read another
  user's processes) cannot be checked: its name counts for holders of the owner's uid
  (who could read and forge in the owner itself), not for holders of another uid.

Otherwise the object is ignored (not in any pool's sums, and its holder does not count
as a process holding the pool, unless it holds objects that count), for one reason:

- `owner_gone`: no process has the name's pid (a made-up name, or its creator exited:
  what others still hold is no running process's pool);
- `not_held_by_owner`: that process holds no such object (a forged name, a reused pid);
- `owner_other_uid`: that process may not be read here (the exporter lacks the right),
  and the holder's uid (the owner of /proc/PID) is not its uid;
- `unverified`: the scan's time budget ran out before that process was read.
"""

from __future__ import annotations

import os
import time
from collections.abc import Collection, Iterable
from typing import Final, Literal

from hostpool.proc.names import ShmName
from hostpool.proc.procfs import ProcessAccessError, ProcessNotFoundError
from hostpool.proc.scan import ROW_MATCH, ROW_PATH, Holdings, Key, Matcher, Row, read_holdings

Reason = Literal["owner_gone", "not_held_by_owner", "owner_other_uid", "unverified"]
REASONS: Final[tuple[Reason, ...]] = (
    "owner_gone",
    "not_held_by_owner",
    "owner_other_uid",
    "unverified",
)
Ignored = dict[tuple[str, Reason], set[Key]]  # (prefix, reason) -> the objects ignored

_UNREADABLE: Final = "unreadable"


class Owners:
    """The processes that names name, each read at most once per scan.

    `read` are the holdings the scan read; `read_pids` every process it read in full
    (holding a match or not), `unreadable` those it may not read. A named process the
    scan did not read is read here (until `deadline`, a time.monotonic() value).
    """

    def __init__(
        self,
        matcher: Matcher,
        read: Iterable[Holdings],
        *,
        read_pids: Collection[int] = (),
        unreadable: Collection[int] = (),
        deadline: float | None = None,
    ) -> None:
        self.matcher, self.deadline = matcher, deadline
        self.read_pids, self.unreadable = read_pids, frozenset(unreadable)
        self._owners: dict[int, Holdings | str] = {h.pid: h for h in read}
        self._uids: dict[int, int | None] = {}
        self.extra: list[Holdings] = []  # the owners read here, besides the scan
        self.paths: list[bytes] = []  # the paths (links) of the objects ignored

    def attribute(self, holdings: Holdings, ignored: Ignored) -> None:
        """Drop from `holdings` the objects that do not count (`ignored` says which, and
        why): its rows and unmapped fds then hold only what counts."""
        pid = holdings.pid
        rows, unmapped = holdings.rows, holdings.unmapped_fds
        dropped: list[tuple[Key, ShmName, Reason]] = []
        for key, row in rows.items():
            name: ShmName = row[ROW_MATCH][1]
            if name.owner_pid is not None and name.owner_pid != pid:  # else: the fast path
                self._judge(pid, key, name, dropped)
        for key, (_link, name, _fds) in unmapped.items():
            if name.owner_pid is not None and name.owner_pid != pid:
                self._judge(pid, key, name, dropped)
        for key, name, reason in dropped:
            mapped: Row | None = rows.pop(key, None)
            self.paths.append(unmapped.pop(key)[0] if mapped is None else mapped[ROW_PATH])
            ignored.setdefault((name.prefix, reason), set()).add(key)

    def _judge(
        self, holder: int, key: Key, name: ShmName, dropped: list[tuple[Key, ShmName, Reason]]
    ) -> None:
        assert name.owner_pid is not None
        reason = self._verdict(holder, name.owner_pid, key)
        if reason is not None:
            dropped.append((key, name, reason))

    def _verdict(self, holder: int, owner: int, key: Key) -> Reason | None:
        found = self._owner(owner)
        if isinstance(found, Holdings):
            if key in found.rows or key in found.unmapped_fds:
                return None
            return "not_held_by_owner" if found.complete else "unverified"
        if found == _UNREADABLE:
            theirs = self._uid(owner)
            if theirs is None:
                return "owner_gone"
            return None if self._uid(holder) == theirs else "owner_other_uid"
        return found  # type: ignore[return-value]

    def _owner(self, pid: int) -> Holdings | str:
        found = self._owners.get(pid)
        if found is None:
            found = self._owners[pid] = self._read(pid)
        return found

    def _read(self, pid: int) -> Holdings | str:
        if pid in self.read_pids:
            return "not_held_by_owner"  # read in full: it holds no match at all
        if pid in self.unreadable:
            return _UNREADABLE
        if self.deadline is not None and time.monotonic() > self.deadline:
            return "unverified"
        if pid <= 0:
            return "owner_gone"
        try:
            holdings = read_holdings(pid, self.matcher, deadline=self.deadline)
        except ProcessNotFoundError:
            return "owner_gone"
        except ProcessAccessError:
            return _UNREADABLE
        self.extra.append(holdings)
        return holdings

    def _uid(self, pid: int) -> int | None:
        """The uid that owns /proc/PID (the process's effective uid), None once gone."""
        if pid not in self._uids:
            try:
                self._uids[pid] = os.stat(f"/proc/{pid}").st_uid
            except OSError:
                self._uids[pid] = None
        return self._uids[pid]


def ignored_counts(ignored: Ignored) -> dict[tuple[str, Reason], int]:
    """Objects ignored per (prefix, reason), each object once however many hold it."""
    return {key: len(objects) for key, objects in ignored.items()}
