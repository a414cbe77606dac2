"""The host scan as the exporter's reader makes it: in a forked child holding only the
reader's capabilities (CAP_SYS_PTRACE, CAP_DAC_READ_SEARCH; `sandbox.enter_reader`), so
a test comparing a scrape with its own scans compares like with like (root's
CAP_SYS_ADMIN reads /proc/PID/map_files, the reader falls back to smaps)."""

from __future__ import annotations

import os
import pickle

from hostpool.host.model import HostView


def scan_as_reader() -> HostView:
    """`scan_host()` from a child in the reader's sandbox."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        status = 1
        try:
            os.close(r)
            from hostpool.base import sandbox
            from hostpool.host.scan import scan_host

            sandbox.enter_reader()
            data = pickle.dumps(scan_host())
            with os.fdopen(w, "wb") as out:
                out.write(data)
            status = 0
        finally:
            os._exit(status)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    assert status == 0 and data, f"the reader's scan failed (status {status})"
    view = pickle.loads(data)
    assert isinstance(view, HostView)
    return view
