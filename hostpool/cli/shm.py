"""`hostpool shm`: every shared-memory object on this host, whoever made it, who holds
it, and what is orphaned (hostpool.host.scan).

For people: one line per object, grouped by engine (sizes in units, orphans marked,
every name read from /proc escaped), the totals last. `--json`: the document of
docs/host-view.md (`{"objects": [...], "totals": {...}}`, exact bytes). `--engine`
(repeatable) and `--orphans` filter the objects listed; the totals are the host's.
`--by pod` groups by the Kubernetes pod each object belongs to (`pod_uid`; objects of no
pod, or of holders in different pods, last): text one group per pod, `--json` adds
`"pods"`, one summary per pod of the objects listed (`pod_uid`, `objects`,
`resident_bytes`, `orphaned_bytes`), most resident first, and lists the objects in that
order.

Exit codes: 0 ok; 2 bad usage; 1 the scan could not run here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, BinaryIO, TextIO

from hostpool.base.units import format_duration, format_size
from hostpool.cli.command import Subcommand
from hostpool.host.model import ENGINES, HostObject, HostView
from hostpool.proc.textsafe import printable

_HOLDERS_SHOWN = 3  # holders named per line; the rest counted


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Its flags."""
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--engine",
        action="append",
        choices=ENGINES,
        metavar="NAME",
        help=f"list only this engine's objects (repeatable; one of {', '.join(ENGINES)})",
    )
    p.add_argument("--orphans", action="store_true", help="list only orphaned objects")
    p.add_argument(
        "--by",
        choices=("engine", "pod"),
        default="engine",
        help="group the objects by engine (default) or by the Kubernetes pod they belong to",
    )


def run(args: argparse.Namespace) -> int:
    view = scan()
    objects = select(view.objects, engines=args.engine, orphans=args.orphans)
    pods = by_pod(objects) if args.by == "pod" else None
    if args.json:
        extra = None if pods is None else {"pods": [p.as_json() for p in pods]}
        listed = objects if pods is None else [o for p in pods for o in p.objects]
        write_json(sys.stdout.buffer, view, listed, extra)
    elif pods is not None:
        render_pods(view, pods, sys.stdout)
    else:
        render(view, objects, sys.stdout)
    return 0


@dataclass(frozen=True, slots=True)
class PodGroup:
    """The objects listed that belong to one pod (`pod_uid` None: to none, or to holders
    in different pods)."""

    pod_uid: str | None
    objects: tuple[HostObject, ...]

    @property
    def resident_bytes(self) -> int:
        return sum(o.resident_bytes for o in self.objects)

    @property
    def orphaned_bytes(self) -> int:
        return sum(o.resident_bytes for o in self.objects if o.orphan)

    def as_json(self) -> dict[str, Any]:
        return {
            "pod_uid": self.pod_uid,
            "objects": len(self.objects),
            "resident_bytes": self.resident_bytes,
            "orphaned_bytes": self.orphaned_bytes,
        }


def by_pod(objects: Iterable[HostObject]) -> list[PodGroup]:
    """The objects by pod: the pods most resident first (then by uid), no pod's last;
    within a group, the scan's order."""
    groups: dict[str | None, list[HostObject]] = {}
    for o in objects:
        groups.setdefault(o.pod_uid, []).append(o)
    pods = [PodGroup(uid, tuple(group)) for uid, group in groups.items()]
    pods.sort(key=lambda p: (p.pod_uid is None, -p.resident_bytes, p.pod_uid or ""))
    return pods


def scan() -> HostView:
    """One scan of the host, with the cyclic garbage collector paused: it allocates an
    object or more per object and holder and makes no cycles (its passes found nothing
    and cost a quarter of a 20,000-object scan)."""
    from hostpool.host.scan import scan_host  # lazy: `hostpool --help` reads no /proc
    from hostpool.metrics.flight import gc_paused

    with gc_paused():
        return scan_host()


def encode(
    view: HostView,
    objects: Iterable[HostObject] | None = None,
    extra: dict[str, Any] | None = None,
) -> bytes:
    """The `--json` document of `view` (with `objects` instead of all of them, and the
    keys of `extra` added), compact
    UTF-8. orjson encodes it ~10x faster where installed (a host lists tens of
    thousands of objects); the standard encoder otherwise, and for names orjson refuses
    (bytes /proc showed that are not UTF-8: escaped as `\\udcXX`, as json does)."""
    doc = dataclasses.replace(view, objects=()).as_json()
    doc["objects"] = [o.as_json() for o in (view.objects if objects is None else objects)]
    doc.update(extra or {})
    return _dumps(doc)


def write_json(
    out: BinaryIO, view: HostView, objects: Iterable[HostObject], extra: dict[str, Any] | None
) -> None:
    """`encode(view, objects, extra)`'s document and a newline, written object by object
    (one object's dict and a 1 MiB buffer held at a time: a node may list a million)."""
    rest = dataclasses.replace(view, objects=()).as_json()
    del rest["objects"]
    rest.update(extra or {})
    buf = bytearray(b'{"objects":[')
    for i, o in enumerate(objects):
        buf += b"," + _dumps(o.as_json()) if i else _dumps(o.as_json())
        if len(buf) >= 1 << 20:
            out.write(buf)
            buf.clear()
    buf += b"]," + _dumps(rest)[1:] + b"\n"
    out.write(buf)


def _dumps(doc: dict[str, Any]) -> bytes:
    """Compact UTF-8 JSON: orjson where installed and able, else the standard encoder."""
    try:
        import orjson
    except ImportError:
        pass
    else:
        try:
            return orjson.dumps(doc)
        except TypeError:
            pass  # a lone surrogate: the standard encoder escapes it
    return json.dumps(doc, separators=(",", ":")).encode()


def select(
    objects: Iterable[HostObject], *, engines: list[str] | None, orphans: bool
) -> list[HostObject]:
    """The objects the filters keep, in the scan's order."""
    return [
        o for o in objects if (not engines or o.engine in engines) and (not orphans or o.orphan)
    ]


def render(view: HostView, objects: list[HostObject], out: TextIO) -> None:
    """The text for people (see the module's docstring)."""
    by_engine: dict[str, list[HostObject]] = {}
    for o in objects:
        by_engine.setdefault(o.engine, []).append(o)
    for engine in ENGINES:
        group = by_engine.get(engine)
        if not group:
            continue
        resident = sum(o.resident_bytes for o in group)
        out.write(f"{engine}: {len(group)} object(s), {format_size(resident)} resident\n")
        for o in group:
            out.write("  " + _line(o) + "\n")
    _render_totals(view, out)


def render_pods(view: HostView, pods: list[PodGroup], out: TextIO) -> None:
    """`--by pod` for people: a heading per pod, each object with its engine."""
    for pod in pods:
        name = f"pod {pod.pod_uid}" if pod.pod_uid is not None else "no pod"
        out.write(
            f"{name}: {len(pod.objects)} object(s), {format_size(pod.resident_bytes)}"
            f" resident, {format_size(pod.orphaned_bytes)} orphaned\n"
        )
        for o in pod.objects:
            out.write(f"  {o.engine:<9} " + _line(o, pod=False) + "\n")
    _render_totals(view, out)


def _render_totals(view: HostView, out: TextIO) -> None:
    t = view.totals
    out.write(
        f"Shmem {format_size(t.shmem_bytes)}: attributed {format_size(t.attributed_bytes)},"
        f" unattributed {format_size(t.unattributed_bytes)},"
        f" orphaned {format_size(t.orphaned_bytes)}"
    )
    if t.hugetlb_bytes:
        out.write(
            f"; hugetlb {format_size(t.hugetlb_bytes)}"
            f" (orphaned {format_size(t.hugetlb_orphaned_bytes)})"
        )
    out.write("\n")
    if view.unreadable or not view.complete:
        out.write(
            f"note: {view.unreadable} process(es) unreadable"
            + ("" if view.complete else "; the scan was cut short")
            + ": objects only they hold show as orphans\n"
        )


def _line(o: HostObject, *, pod: bool = True) -> str:
    """One object for people; `pod`: with its pod's uid, where it has one."""
    where = printable(o.path) if o.path is not None else printable(o.name) or "-"
    state = "ORPHAN" if o.orphan else _holders(o)
    extra = f" shmid={o.shmid}" if o.shmid is not None else ""
    extra += " hugetlb" if o.hugetlb else ""
    extra += f" pool={printable(o.pool)}" if o.pool is not None else ""
    extra += f" pod={o.pod_uid}" if pod and o.pod_uid is not None else ""  # uid-shaped only
    age = "" if o.age_seconds is None else f" age {format_duration(o.age_seconds)}"
    # resident counts whole pages (a 1000-byte file holds a 4 KiB page): "4KiB of 1000B"
    # reads as a wrong figure, so a line says at most the size (the totals and --json are
    # the pages themselves: docs/cli.md)
    resident = min(o.resident_bytes, o.size_bytes)
    return (
        f"{o.kind:<11} {format_size(resident):>10} of {format_size(o.size_bytes):<10}"
        f" {where}{extra}{age}  {state}"
    )


def _holders(o: HostObject) -> str:
    shown = ", ".join(f"{h.pid}/{printable(h.comm)}" for h in o.holders[:_HOLDERS_SHOWN])
    more = len(o.holders) - _HOLDERS_SHOWN
    return f"held by {shown}" + (f" +{more}" if more > 0 else "")


COMMAND = Subcommand(
    name="shm",
    help="every shared-memory object on this host: engine, holders, orphans, totals",
    description=__doc__.split("\n\n")[0].replace("\n", " ") if __doc__ else None,
    add_arguments=add_arguments,
    run=run,
)
