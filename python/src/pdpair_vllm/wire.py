"""The engine API's framing (docs/engine-api.md): a 4-byte big-endian length, then one JSON object
with a ``"type"`` field; a pool's file descriptor travels with a frame's first bytes
(``SCM_RIGHTS``). The same limits as the agent's ``wire.rs``: a frame longer than ``MAX_FRAME`` or
one that is not a JSON object with a string ``type`` is refused before anything acts on it.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import List, Sequence, Tuple

#: The largest frame either side accepts (the agent's ``wire::MAX_FRAME``).
MAX_FRAME = 16 << 20


class FrameError(Exception):
    """A frame could not be read or written: the connection is unusable."""


class Closed(FrameError):
    """The agent closed the connection (between frames, or in one)."""


def encode(message: dict) -> bytes:
    """One frame's bytes."""
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME:
        raise FrameError(f"frame of {len(body)} bytes exceeds {MAX_FRAME}")
    return struct.pack(">I", len(body)) + body


def decode_body(body: bytes) -> dict:
    """A frame's JSON body, checked to be an object with a string ``type``."""
    try:
        message = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FrameError(f"malformed frame: {e}") from None
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise FrameError("malformed frame: not a JSON object with a string 'type'")
    return message


def send(sock: socket.socket, message: dict, fds: Sequence[int] = ()) -> None:
    """Writes one frame, with ``fds`` attached to its first bytes (in order) when given."""
    data = encode(message)
    if not fds:
        sock.sendall(data)
        return
    sent = socket.send_fds(sock, [data], list(fds))
    if sent < len(data):
        sock.sendall(data[sent:])


def _read_exact(sock: socket.socket, n: int, start: bytes = b"") -> bytes:
    buf = bytearray(start)
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise Closed("the agent closed the connection")
        buf += chunk
    return bytes(buf)


def recv(sock: socket.socket) -> dict:
    """Reads one frame."""
    head = _read_exact(sock, 4)
    (length,) = struct.unpack(">I", head)
    if length > MAX_FRAME:
        raise FrameError(f"frame of {length} bytes exceeds {MAX_FRAME}")
    return decode_body(_read_exact(sock, length))


#: The most descriptors one frame carries (the agent's ``wire::MAX_FDS``: a pool's regions).
MAX_FDS = 128


def recv_with_fds(sock: socket.socket) -> Tuple[dict, List[int]]:
    """Reads one frame and the descriptors that came with its first bytes, in order (more than
    ``MAX_FDS`` is an error; what arrived is closed)."""
    data, fds, flags, _ = socket.recv_fds(sock, 4, MAX_FDS)
    if flags & socket.MSG_CTRUNC:
        for fd in fds:
            _close(fd)
        raise FrameError("too many file descriptors attached")
    try:
        if not data:
            raise Closed("the agent closed the connection")
        head = _read_exact(sock, 4, data)
        (length,) = struct.unpack(">I", head)
        if length > MAX_FRAME:
            raise FrameError(f"frame of {length} bytes exceeds {MAX_FRAME}")
        message = decode_body(_read_exact(sock, length))
    except BaseException:
        for fd in fds:
            _close(fd)
        raise
    return message, list(fds)


def _close(fd: int) -> None:
    import os

    try:
        os.close(fd)
    except OSError:
        pass
