"""Where a Ctrl-C may land in a step.

A KeyboardInterrupt is raised by Python at whatever bytecode runs when SIGINT arrives. In the
middle of a step's bookkeeping (the batch manager's schedule, the sampler rows, the update,
the outputs) that would leave the engine half-changed. So a step holds SIGINT back
(`InterruptGate`) and lets it through only in windows where an interrupt is safe to raise --
the forward and the sampler, which change nothing and which a failed step undoes -- and at the
end of a step that completed. Only the main thread receives SIGINT: elsewhere the gate does
nothing. A handler the application installed is honoured: it runs where the interrupt is let
through, instead of where it arrived; SIG_IGN and SIG_DFL are left alone.
"""

from __future__ import annotations

import signal
import sys
import threading

# The C module behind `signal`: its wrappers convert handlers to and from enums, which costs a
# step ~0.1 ms (four calls, run with caches cold from the forward's weight stream).
import _signal


class InterruptGate:
    """Holds SIGINT back while entered; `window()` lets it through for a block; `deliver()`
    runs a held-back one's handler. Used once per step."""

    __slots__ = ("_handler", "_active", "_held")

    def __init__(self) -> None:
        self._handler = None   # the application's SIGINT handler, saved on entry
        self._active = False   # holding SIGINT back (entered, on the main thread)
        self._held = 0

    def __enter__(self) -> "InterruptGate":
        if threading.current_thread() is threading.main_thread():
            handler = _signal.getsignal(signal.SIGINT)
            if callable(handler):
                self._handler, self._active = handler, True
                _signal.signal(signal.SIGINT, self._hold)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._active:
            self._active = False
            _signal.signal(signal.SIGINT, self._handler)

    def _hold(self, signum: int, frame: object) -> None:
        self._held += 1

    @property
    def held(self) -> bool:
        """A SIGINT arrived while held back and has not been delivered."""
        return self._held > 0

    def deliver(self) -> None:
        """Runs the held-back SIGINT's handler now (Python's default raises KeyboardInterrupt)."""
        if self._held:
            self._held = 0
            self._handler(signal.SIGINT, sys._getframe(1))

    def window(self) -> "_Window":
        """A block in which SIGINT goes through: one held so far is delivered on entry, and the
        gate holds again on exit (exception or not)."""
        return _Window(self)


class _Window:
    __slots__ = ("_gate",)

    def __init__(self, gate: InterruptGate) -> None:
        self._gate = gate

    def __enter__(self) -> None:
        g = self._gate
        if g._active:
            g.deliver()  # raises here, still holding, if the default handler runs
            _signal.signal(signal.SIGINT, g._handler)

    def __exit__(self, *exc: object) -> None:
        g = self._gate
        if g._active:
            _signal.signal(signal.SIGINT, g._hold)
