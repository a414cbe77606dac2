"""SysV shared-memory segments of this IPC namespace, from /proc/sysvipc/shm."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

SYSVIPC_SHM: Final = "/proc/sysvipc/shm"


@dataclass(frozen=True, slots=True)
class Segment:
    """One line of /proc/sysvipc/shm (sizes in bytes, times in seconds since the epoch,
    0 for never)."""

    key: int
    shmid: int
    size: int
    cpid: int
    lpid: int
    nattch: int
    atime: int
    dtime: int
    ctime: int
    rss: int
    swap: int

    @property
    def name(self) -> str:
        """The key as `ipcs` prints it."""
        return f"0x{self.key & 0xFFFFFFFF:08x}"

    @property
    def changed(self) -> int:
        """The last attach, detach or change."""
        return max(self.atime, self.dtime, self.ctime)


def read_segments(path: str = SYSVIPC_SHM) -> list[Segment]:
    """Every segment; [] where SysV IPC is compiled out or /proc/sysvipc is hidden."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return []
    lines = data.split(b"\n")
    header = lines[0].split()
    at = {name: i for i, name in enumerate(header)}
    wanted = ("key", "shmid", "size", "cpid", "lpid", "nattch", "atime", "dtime", "ctime")
    if not all(w.encode() in at for w in wanted):
        return []
    columns = [at[w.encode()] for w in wanted]
    rss, swap = at.get(b"rss"), at.get(b"swap")
    out = []
    for line in lines[1:]:
        fields = line.split()
        if len(fields) < len(header):
            continue
        values = [int(fields[i]) for i in columns]
        values.append(0 if rss is None else int(fields[rss]))
        values.append(0 if swap is None else int(fields[swap]))
        out.append(Segment(*values))
    return out
