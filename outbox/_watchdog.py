"""One daemon thread that shuts down sockets whose exchange ran past its deadline: a socket's
timeout bounds each read, and a peer sending a byte at a time just inside it held a thread for
as long as it liked. The checker's client and the check-back server use it."""

from __future__ import annotations

import contextlib
import heapq
import itertools
import socket
import threading
import time


class Watch:
    __slots__ = ("active", "fired", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.active = True
        self.fired = False


class Watchdog:
    """One daemon thread that shuts down sockets whose exchange ran past its deadline."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Watch]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, sock: socket.socket, deadline: float) -> Watch:
        watch = Watch(sock)
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            heapq.heappush(self._heap, (deadline, next(self._seq), watch))
            self._cond.notify()
        return watch

    def disarm(self, watch: Watch) -> bool:
        """Stop watching; True if the deadline had already fired (the socket is shut down)."""
        with self._cond:
            watch.active = False
            return watch.fired

    def _run(self) -> None:
        with self._cond:
            while True:
                while self._heap and not self._heap[0][2].active:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                deadline, _, watch = self._heap[0]
                left = deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                heapq.heappop(self._heap)
                watch.fired = True
                watch.active = False
                # Under the lock: the owner cannot disarm and reuse the socket meanwhile.
                with contextlib.suppress(OSError):
                    watch.sock.shutdown(socket.SHUT_RDWR)
