"""The real `hostpool exporter` in a subprocess, and its /metrics parsed: for the CLI tests
and the reliability attacks."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@dataclass
class Exporter:
    proc: subprocess.Popen[str]
    url: str
    serving: dict[str, Any]  # its first log line, `hostpool.exporter_serving`

    def stop(self) -> str:
        """SIGTERM (a clean stop: exit 0); returns what it logged after its first line."""
        self.proc.terminate()
        _, err = self.proc.communicate(timeout=30)
        assert self.proc.returncode == 0, err
        return err


def start_exporter(*args: str) -> Exporter:
    """`hostpool exporter ARGS --port 0`, once it logged the URL it serves. A scan per
    scrape (`--min-scan-interval 0`) unless ARGS say otherwise: these tests change the
    host between two scrapes (the interval has its own tests, test_node_guard_*)."""
    if not any(arg.startswith("--min-scan-interval") for arg in args):
        args = (*args, "--min-scan-interval", "0")
    proc = subprocess.Popen(
        [sys.executable, "-m", "hostpool", "exporter", *args, "--port", "0"],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    line = proc.stderr.readline()
    try:
        event = json.loads(line)  # stderr is not a TTY: JSON log lines
        assert event["event"] == "hostpool.exporter_serving", line
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    url: str = event["url"]
    assert url.startswith("http://127.0.0.1:")
    return Exporter(proc, url, event)


@contextmanager
def running_exporter(*args: str) -> Iterator[Exporter]:
    exporter = start_exporter(*args)
    try:
        yield exporter
    finally:
        if exporter.proc.poll() is None:
            exporter.proc.kill()
            exporter.proc.communicate()


def scrape(url: str, timeout: float = 30) -> tuple[str, Samples]:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        text = response.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return text, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]
