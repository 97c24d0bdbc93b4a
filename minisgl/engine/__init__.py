"""One rank's forward pass: model + KV pool + attention backend + sampler."""

from minisgl.engine.config import PDL_MODES, EngineConfig
from minisgl.engine.engine import Engine

__all__ = ["Engine", "EngineConfig", "PDL_MODES"]
