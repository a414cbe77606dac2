"""The internals of prometheus_client hostpool relies on to publish in its multiprocess
mode, here once: read from prometheus_client 0.26.0 and checked against 0.20.0's source;
`tests/test_promvalues.py` pins them.

In multiprocess mode a server's `/metrics` reads the files each worker's metric values
write, and ignores custom collectors. hostpool publishes its ledger's figures through the
same storage prometheus_client's own metric classes write through, not through a second
set of metric objects (their names would collide with a registered collector's):
- `prometheus_client.values.ValueClass`, chosen once when prometheus_client is imported
  (its per-process mmap'd files when PROMETHEUS_MULTIPROC_DIR was set then, a plain
  float otherwise), constructed as `ValueClass(type, metric name, sample name, label
  names, label values, help text, multiprocess_mode=...)`, with `set(value)`;
- its `_multiprocess` class attribute, True only for the file-backed class.

Outside `GATE` hostpool publishes nothing into the multiprocess directory, after one
`hostpool.untested_version` warning: a server's `/metrics` then lacks hostpool's series
(an in-process `HostPoolCollector` is unaffected).
"""

from __future__ import annotations

from typing import Protocol

from prometheus_client import values

from hostpool.base.versiongate import VersionGate, distribution_version

RELIES_ON = "prometheus_client.values.ValueClass and its _multiprocess flag"
FALLBACK = "hostpool's series are not published to the multiprocess directory"
GATE = VersionGate("prometheus_client", (0, 20), (0, 27), relies_on=RELIES_ON, fallback=FALLBACK)


class Value(Protocol):
    """One sample's storage, as prometheus_client's metric classes write it."""

    def set(self, value: float) -> None: ...


def supported() -> bool:
    """Whether the installed prometheus_client is one this module was read from."""
    return GATE.check(distribution_version("prometheus_client"))


def writes_files() -> bool:
    """Whether prometheus_client's values write multiprocess files in this process (it
    was imported with PROMETHEUS_MULTIPROC_DIR set)."""
    return bool(getattr(values.ValueClass, "_multiprocess", False))


def new_value(
    typ: str,
    mode: str,
    metric: str,
    sample: str,
    labelnames: tuple[str, ...],
    labelvalues: tuple[str, ...],
    help_text: str,
) -> Value:
    """The storage of one sample of `metric` (a gauge's `mode`: livesum, livemax...)."""
    kwargs = {"multiprocess_mode": mode} if typ == "gauge" else {}
    value: Value = values.ValueClass(
        typ, metric, sample, labelnames, labelvalues, help_text, **kwargs
    )
    return value
