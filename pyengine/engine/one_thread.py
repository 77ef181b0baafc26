"""The engine's threading contract: one thread drives an engine. A call that arrives from a
second thread while another thread is inside the engine raises RuntimeError instead of racing
on the batch manager, the KV pool and the sampler state. Calls made on the same thread while a
call is in progress (a logits processor that aborts a request, a stream() iterator stepping the
engine from inside generate()) are allowed."""

from __future__ import annotations

import functools
import threading
from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)


class OneThreadGuard:
    """Admits calls from one thread at a time, re-entrant on that thread."""

    __slots__ = ("_lock", "_owner", "_depth", "_call")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None  # only the owning thread writes its own id here
        self._depth = 0
        self._call = ""

    def enter(self, call: str) -> None:
        me = threading.get_ident()
        if self._owner == me:
            self._depth += 1
            return
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(
                f"Engine.{call}() was called from thread {threading.current_thread().name!r} while another "
                f"thread is inside Engine.{self._call}(): one thread drives an engine (stream() iterators "
                f"included); serialize the calls or give each thread its own engine")
        self._owner, self._depth, self._call = me, 1, call

    def exit(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._owner = None
            self._lock.release()


def one_thread(method: F) -> F:
    """Runs an Engine method under the engine's OneThreadGuard (``self._guard``)."""
    call = method.__name__

    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        guard = self._guard
        guard.enter(call)
        try:
            return method(self, *args, **kwargs)
        finally:
            guard.exit()

    return guarded  # type: ignore[return-value]
