"""One rank's forward pass: model + KV pool + attention backend + sampler.

`EngineConfig` imports without torch (the launcher builds and checks it before any rank starts);
`Engine` loads on first use (a module `__getattr__`, PEP 562)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from minisgl.engine.config import PDL_MODES, EngineConfig

if TYPE_CHECKING:
    from minisgl.engine.engine import Engine


def __getattr__(name: str) -> Any:
    if name == "Engine":
        return importlib.import_module(f"{__name__}.engine").Engine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Engine", "EngineConfig", "PDL_MODES"]
