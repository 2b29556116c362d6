"""Connection slots of the HTTP server: at most `limit` connections held at once, an
idle one giving its slot to a new connection (server.py's APIServer, and one slot per
connection when the server is embedded, server_embedding.py)."""

import logging
import socket
import threading
import time
from typing import Dict, Optional

log = logging.getLogger("mlx_lm.server")


class Evicted(Exception):
    """In a handler whose waiting connection gave its slot to a newer one."""


class ConnectionSlot:
    """One open connection. `waiting_since`: when it began waiting for its next request
    (accepted, or its last answer sent); None while a request is served."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.waiting_since: Optional[float] = time.monotonic()
        self.evicted = False


class ConnectionSlots:
    """At most `limit` connections held at once. One waiting for a request holds its
    slot only until a new connection needs it: at the limit the one waiting longest is
    shut down, which ends its thread's read. Only if every connection is being served
    is a new one refused. Admission runs on the accepting thread, the rest on handlers."""

    def __init__(self, limit: int):
        self.limit = limit
        self._lock = threading.Lock()
        self._open: Dict[socket.socket, ConnectionSlot] = {}  # evicted ones too, until their threads end
        self._num_held = 0  # the open ones not evicted

    def admit(self, sock: socket.socket) -> bool:
        with self._lock:
            if self._num_held >= self.limit:
                waiting = [slot for slot in self._open.values() if slot.waiting_since is not None and not slot.evicted]
                if not waiting:
                    return False
                self._evict(min(waiting, key=lambda slot: slot.waiting_since))
            self._open[sock] = ConnectionSlot(sock)
            self._num_held += 1
            return True

    def _evict(self, slot: ConnectionSlot) -> None:
        slot.evicted = True
        self._num_held -= 1
        log.debug("At --max-connections (%d): closing a connection idle for %.1f s to make room", self.limit,
                  time.monotonic() - slot.waiting_since)
        try:
            slot.sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # already closed by its peer or its thread
            pass

    def slot(self, sock: socket.socket) -> ConnectionSlot:
        with self._lock:
            return self._open[sock]

    def wait_for_request(self, slot: ConnectionSlot) -> float:
        """Since when `slot` has waited for its next request."""
        with self._lock:
            if slot.waiting_since is None:
                slot.waiting_since = time.monotonic()
            return slot.waiting_since

    def serve(self, slot: ConnectionSlot) -> None:
        """Its request's headers are in: from now on it cannot be evicted."""
        with self._lock:
            if slot.evicted:  # the headers completed as its slot was given away
                raise Evicted()
            slot.waiting_since = None

    def release(self, sock: socket.socket) -> None:
        with self._lock:
            slot = self._open.pop(sock, None)
            if slot is not None and not slot.evicted:
                self._num_held -= 1
