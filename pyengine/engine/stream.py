"""RequestStream: the iterator Engine.stream() returns -- one request's outputs, step by step."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Iterator

from pyengine.engine.outputs import RequestOutput
from pyengine.engine.requests import RequestId

if TYPE_CHECKING:
    from pyengine.engine.engine import Engine


class RequestStream(Iterator[RequestOutput]):
    """Yields one request's outputs; each next() steps the engine until one is there (other
    requests advance in the same steps). An exception from a step (a failed step, or a call
    refused because another thread is inside the engine) reaches the caller and leaves the
    stream usable: next() again continues. close() -- or dropping the stream before its final
    output -- aborts the request."""

    def __init__(self, engine: "Engine", request_id: RequestId, queue: deque[RequestOutput]) -> None:
        self._engine, self.request_id, self._queue = engine, request_id, queue
        self._finished = False

    def __next__(self) -> RequestOutput:
        if self._finished:
            raise StopIteration
        while not self._queue:
            self._engine.step()
        out = self._queue.popleft()
        if out.finished:
            self._finished = True
            self._engine._streams.pop(self.request_id, None)
        return out

    def close(self) -> None:
        """Stops the stream; a request that has not finished is aborted (its final output, with
        finish_reason "abort", comes from a later step())."""
        if self._finished:
            return
        self._finished = True
        engine = self._engine
        engine._streams.pop(self.request_id, None)
        if not engine._closed and engine._requests.core_id(self.request_id) is not None:
            engine.abort_request(self.request_id)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - a finalizer must not raise (e.g. the engine is busy in another thread)
            pass
