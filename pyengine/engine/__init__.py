"""The engine: the facade applications drive (Engine), its start-up, its step loop, and the
request and output handling around the C++ batch manager."""

from pyengine.engine.engine import Engine, StartupError

__all__ = ["Engine", "StartupError"]
