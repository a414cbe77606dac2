"""The share protocol: SOCK_SEQPACKET, one message per packet, fds by SCM_RIGHTS.

A packet is a 4-byte big-endian length, then that many bytes of UTF-8 JSON. Every
message carries `"v": PROTOCOL_VERSION`. Requests: `list`, `attach` (pool, access:
`read`, `write` or `any`; the server decides what each uid gets), `detach` (pool). An
`attach` reply is a manifest (saying `readonly` and, when the server narrowed the access,
why) followed by `fd_packets` packets of at most 253 fds each (the kernel's SCM_MAX_FD).
Anything else is malformed: the receiver raises ProtocolError, and the server drops that
connection only.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import socket
import struct
from typing import Any

PROTOCOL_VERSION = 2  # 2: the server decides access (`access` replaces `readonly`)
MAX_MESSAGE = 1 << 20  # a manifest of thousands of regions still fits
MAX_REQUEST = 16384  # requests are a few dozen bytes; the server reads no more
ACCESS = ("read", "write", "any")
MAX_FDS_PER_PACKET = 253
_HEADER = struct.Struct(">I")


class ProtocolError(ValueError):
    """Malformed traffic: wrong framing, JSON, version or fd count."""


def encode(message: dict[str, Any]) -> bytes:
    body = json.dumps({"v": PROTOCOL_VERSION, **message}, separators=(",", ":")).encode()
    if len(body) > MAX_MESSAGE:
        raise ProtocolError(f"message of {len(body)} bytes exceeds {MAX_MESSAGE}")
    return _HEADER.pack(len(body)) + body


def decode(packet: bytes, limit: int = MAX_MESSAGE) -> dict[str, Any]:
    if len(packet) < _HEADER.size:
        raise ProtocolError(f"truncated packet of {len(packet)} bytes")
    (length,) = _HEADER.unpack_from(packet)
    if length > limit or length != len(packet) - _HEADER.size:
        raise ProtocolError(f"length prefix {length} does not match a {len(packet)}-byte packet")
    try:
        message = json.loads(packet[_HEADER.size :])
    except (ValueError, RecursionError) as exc:
        # ValueError covers bad UTF-8, bad JSON and integers past Python's digit limit;
        # RecursionError, nesting deeper than the interpreter's stack.
        raise ProtocolError(
            f"not acceptable JSON: {type(exc).__name__}: {str(exc)[:120]}"
        ) from None
    if not isinstance(message, dict):
        raise ProtocolError("a message must be a JSON object")
    if message.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {message.get('v')!r}, expected {PROTOCOL_VERSION}")
    return message


def send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> int:
    """Send one packet (with fds, if any); returns the bytes sent."""
    return send_packet(sock, encode(message), fds or [])


def send_packet(sock: socket.socket, data: bytes, fds: list[int]) -> int:
    """Send one encoded packet with `fds` (at most MAX_FDS_PER_PACKET) attached."""
    if not fds:
        return sock.send(data)
    if len(fds) > MAX_FDS_PER_PACKET:
        raise ProtocolError(f"{len(fds)} fds in one packet (max {MAX_FDS_PER_PACKET})")
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
    return sock.sendmsg([data], ancillary)


def receive(
    sock: socket.socket, *, max_fds: int = 0, limit: int = MAX_MESSAGE
) -> tuple[dict[str, Any], list[int], int]:
    """One packet of at most `limit` bytes of JSON: (message, fds received as CLOEXEC,
    bytes received).

    Raises ConnectionError when the other side is gone, ProtocolError when malformed
    (any fds that came with a malformed packet are closed first).
    """
    fd_space = socket.CMSG_SPACE(max(1, max_fds) * array.array("i").itemsize)
    data, ancdata, flags, _ = sock.recvmsg(
        limit + _HEADER.size + 1, fd_space, socket.MSG_CMSG_CLOEXEC
    )
    fds: list[int] = []
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(payload[: len(payload) - len(payload) % arr.itemsize])
            fds.extend(arr)
    if not data and not fds:
        raise ConnectionError("peer closed the connection")
    try:
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            raise ProtocolError("packet or its fds were truncated")
        if len(fds) > max_fds:
            raise ProtocolError(f"{len(fds)} unexpected fds")
        message = decode(data, limit)
    except ProtocolError:
        close_all(fds)
        raise
    return message, fds, len(data)


def close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
