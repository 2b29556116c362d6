"""A connection's input, for `mlx_lm.server`'s handler: the reader that holds a request's
line and headers to a deadline, and the framing of a request body (Content-Length).
"""

import io
import socket
import time
from typing import Optional

from .connection_slots import ConnectionSlot, Evicted
from .openai_api import MAX_BODY_BYTES, RequestError


class RequestLate(Exception):
    """A request line and headers not all there by the connection's deadline."""


class RequestReader(io.RawIOBase):
    """A connection's input under the handler's buffered `rfile`. While `deadline` is
    set (reading a request line and headers) each read waits only for what is left of
    it, so a client trickling a byte at a time cannot stretch the wait; otherwise each
    read waits at most `timeout` (the socket's own)."""

    def __init__(self, sock: socket.socket, slot: ConnectionSlot, timeout: float):
        self._sock, self._slot, self._timeout = sock, slot, timeout
        self.deadline: Optional[float] = None  # time.monotonic() seconds
        self.received = 0  # bytes read since the deadline was set

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self.deadline is None:
            return self._sock.recv_into(buffer)
        if self._slot.evicted:
            raise Evicted()
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RequestLate()
        self._sock.settimeout(left)
        try:
            count = self._sock.recv_into(buffer)
        except TimeoutError:
            raise RequestLate() from None
        finally:
            self._sock.settimeout(self._timeout)
        if self._slot.evicted:  # its end of input came from the eviction, not the peer
            raise Evicted()
        self.received += count
        return count


def body_size(headers) -> int:
    """The byte count of a request body from its headers; RequestError unless exactly
    one Content-Length (of ASCII digits, and no Transfer-Encoding) gives it."""
    if headers.get("Transfer-Encoding") is not None:
        raise RequestError(411, "chunked request bodies are not supported: send a Content-Length header")
    lengths = headers.get_all("Content-Length", [])
    if not lengths:
        raise RequestError(411, "a Content-Length header is required")
    if len(lengths) > 1:  # which one frames the body is exactly what request smuggling plays on
        raise RequestError(400, f"the request has {len(lengths)} Content-Length headers: send exactly one")
    length = lengths[0].strip()
    if not (length.isascii() and length.isdigit()):  # str.isdigit() alone takes "\u00b2"
        shown = repr(length) if len(length) <= 40 else repr(length[:40]) + "..."
        raise RequestError(400, f"invalid Content-Length header {shown}: expected a byte count")
    digits = length.lstrip("0") or "0"  # int() refuses over 4300 digits, even zeros
    if len(digits) > 18:
        raise RequestError(400, f"invalid Content-Length header: {len(digits)} digits, more than 18 digits "
                                "(no body is that long)")
    size = int(digits)
    if size > MAX_BODY_BYTES:
        raise RequestError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes")
    return size
