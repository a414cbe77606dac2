"""The two sides of the exporter's socketpair (hostpool.metrics.privsep), in one process:
the reader's loop in a thread on one end of a real socketpair, the listener's link on the
other, clocks moved by hand. Every wait is on an event or a state (issue 43, points 4, 5).
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from hostpool.metrics.privsep import ASK, ReadingLink, answer_questions
from tests import waiting


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@contextmanager
def linked(
    render: Callable[[], bytes], clock: Clock, *, min_interval: float = 1.0
) -> Iterator[tuple[ReadingLink, list[str]]]:
    """A reader loop answering with `render` and the listener's link to it; yields the link
    and the reasons it was told the reader is gone."""
    ours, theirs = socket.socketpair()
    reader = threading.Thread(
        target=answer_questions, args=(theirs, render), kwargs={"min_interval": min_interval,
                                                              "clock": clock}, daemon=True
    )  # fmt: skip
    reader.start()
    link = ReadingLink(ours, min_interval=min_interval, answer_within=waiting.DEADLINE,
                       stall_after=5.0, clock=clock)  # fmt: skip
    gone: list[str] = []
    link.start(gone.append)
    try:
        yield link, gone
    finally:
        link.close()
        reader.join(waiting.DEADLINE)
        theirs.close()
        assert not reader.is_alive()


def counting() -> tuple[Callable[[], bytes], list[int]]:
    scans: list[int] = []

    def render() -> bytes:
        scans.append(len(scans) + 1)
        return f"scan {len(scans)}\n".encode()

    return render, scans


def test_one_scan_answers_every_reading_for_the_interval() -> None:
    clock = Clock()
    render, scans = counting()
    with linked(render, clock) as (link, _gone):
        assert [link.reading() for _ in range(50)] == [b"scan 1\n"] * 50
        clock.now += 0.99
        assert link.reading() == b"scan 1\n" and scans == [1]
        clock.now += 0.02
        assert link.reading() == b"scan 2\n" and scans == [1, 2]


def test_the_reader_keeps_the_interval_against_a_listener_that_asks_too_often() -> None:
    """A compromised listener asking in a loop gets the reader's last answer again."""
    clock = Clock()
    render, scans = counting()
    ours, theirs = socket.socketpair()
    reader = threading.Thread(target=answer_questions, args=(theirs, render),
                              kwargs={"min_interval": 1.0, "clock": clock})  # fmt: skip
    reader.start()
    try:
        for _ in range(20):
            ours.sendall(ASK)
            (length,) = struct.unpack(">Q", ours.recv(8, socket.MSG_WAITALL))
            assert ours.recv(length, socket.MSG_WAITALL) == b"scan 1\n"
        assert scans == [1]
        ours.sendall(b"x")  # not a question: the reader ends, taking nothing else
        reader.join(waiting.DEADLINE)
        assert not reader.is_alive()
    finally:
        ours.close()
        theirs.close()


def test_a_failed_scan_is_a_503_and_the_reader_goes_on() -> None:
    clock = Clock()
    fail = threading.Event()
    fail.set()

    def render() -> bytes:
        if fail.is_set():
            raise OSError("a stalled mount")
        return b"fine\n"

    with linked(render, clock) as (link, gone):
        assert link.reading() is None
        fail.clear()
        assert link.reading() == b"fine\n"  # asked again at once: a failure is not kept
        assert link.health() is None and gone == []


def test_a_scan_that_does_not_finish_turns_health_bad_until_it_does() -> None:
    clock = Clock()
    entered, release = threading.Event(), threading.Event()

    def render() -> bytes:
        entered.set()
        release.wait(waiting.DEADLINE)
        return b"late\n"

    with linked(render, clock) as (link, _gone):
        link.answer_within = 0.0  # the scrape gives up at once; the question stays asked
        assert link.reading() is None
        assert entered.wait(waiting.DEADLINE)
        assert link.health() is None  # asked, not stalled yet
        clock.now += 5.1
        why = link.health()
        assert why is not None and "no scan finished for 5 s" in why, why
        release.set()
        waiting.wait_for(lambda: link.health() is None, "health back once the scan finished")
        link.answer_within = waiting.DEADLINE
        assert link.reading() == b"late\n"


def test_an_oversized_answer_ends_the_link() -> None:
    ours, theirs = socket.socketpair()
    link = ReadingLink(ours, min_interval=1.0, answer_within=waiting.DEADLINE, stall_after=5.0)
    told = threading.Event()
    link.start(lambda why: told.set())
    try:
        theirs.sendall(struct.pack(">Q", 1 << 40))
        assert told.wait(waiting.DEADLINE)
        assert link.reading() is None
        why = link.health()
        assert why is not None and "the reader is gone" in why and "bytes" in why, why
    finally:
        link.close()
        theirs.close()
