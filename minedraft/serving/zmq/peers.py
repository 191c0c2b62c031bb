"""Which connection each client is on, and which clients the server has stopped listening to.

A ROUTER names a client by its routing identity and says nothing when the client's connection closes. The socket
monitor does report accepted and closed connections, by file descriptor, and libzmq tags every received message
with the descriptor it came in on (SRCFD). Joining the two tells the server which identities a closed connection
carried, so their requests can be aborted at once instead of running until a reply to them fails.

Descriptors are reused: a new connection may get the number of one that just closed. Each accepted connection
therefore gets a generation per descriptor, and a message is tagged (fd, generation) only after the monitor's
queued events have been read: libzmq queues a connection's "disconnected" event before it closes the descriptor,
so before any later connection can be accepted on it, let alone deliver a message.
"""

from __future__ import annotations

import time

DROP_S = 10.0                  # messages from a client dropped as a slow reader are discarded this long
MAX_DROPPED_REMEMBERED = 10000


class Peers:
    def __init__(self) -> None:
        self.open = 0                                     # connections accepted and not yet closed
        self._gen: dict[int, int] = {}                    # fd -> generation of the connection now on it
        self._conn_of: dict[bytes, tuple[int, int]] = {}  # identity -> the connection its messages came on
        self._on_conn: dict[tuple[int, int], set[bytes]] = {}
        self._closed: set[tuple[int, int]] = set()        # closed connections whose fd has not been reused yet
        self._dropped: dict[bytes, float] = {}            # slow readers dropped -> when they are heard again

    # -- connections ---------------------------------------------------------------------------------------------
    def accepted(self, fd: int) -> None:
        self.open += 1
        self._closed.discard((fd, self._gen.get(fd, 0)))
        self._gen[fd] = self._gen.get(fd, 0) + 1

    def disconnected(self, fd: int) -> set[bytes]:
        """A connection closed: returns the identities that spoke on it (each is forgotten)."""
        self.open -= 1
        conn = (fd, self._gen.get(fd, 0))
        self._closed.add(conn)
        idents = self._on_conn.pop(conn, set())
        for ident in idents:
            self._conn_of.pop(ident, None)
        return idents

    def seen(self, ident: bytes, fd: int | None) -> bool:
        """A message from `ident` came in on descriptor `fd` (None: unknown, e.g. inproc). False when that
        connection has already closed: nobody can read a reply to it."""
        if fd is None or fd < 0:
            return True
        conn = (fd, self._gen.get(fd, 0))
        if conn in self._closed:
            return False
        old = self._conn_of.get(ident)
        if old != conn:
            if old is not None:
                self._on_conn.get(old, set()).discard(ident)
            self._conn_of[ident] = conn
            self._on_conn.setdefault(conn, set()).add(ident)
        return True

    # -- slow readers --------------------------------------------------------------------------------------------
    def ban(self, ident: bytes) -> bool:
        """Ignore `ident` for DROP_S seconds. False when it is already banned."""
        if ident in self._dropped:
            return False
        now = time.monotonic()
        if len(self._dropped) >= MAX_DROPPED_REMEMBERED:
            self._dropped = {k: t for k, t in self._dropped.items() if t > now}
            while len(self._dropped) >= MAX_DROPPED_REMEMBERED:
                self._dropped.pop(next(iter(self._dropped)))
        self._dropped[ident] = now + DROP_S
        return True

    def banned(self, ident: bytes) -> bool:
        until = self._dropped.get(ident)
        if until is None:
            return False
        if time.monotonic() < until:
            return True
        del self._dropped[ident]
        return False
