"""One rank's forward pass: model + KV pool + attention backend + sampler."""

from minisgl.engine.config import EngineConfig
from minisgl.engine.engine import Engine

__all__ = ["Engine", "EngineConfig"]
