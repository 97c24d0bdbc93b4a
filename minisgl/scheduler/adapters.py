"""Which LoRA adapter each of the engine's adapter slots holds, on one rank.

Every rank keeps its own table and changes it only on `AdapterMsg`s, which reach every rank
in the same order at the same step, so the tables (slots, load numbers) stay identical. A
request's adapter name is bound to (slot, load) as the scheduler takes the request
(`core.LoraBinding`); the request keeps that binding until it retires, so unloading an adapter
takes its name at once but frees its slot only when no live request is bound to it.
"""

from __future__ import annotations

from typing import Dict, Iterable, Optional, Sequence

from minisgl.core import LoraBinding, RequestError


class AdapterTable:
    """Loaded adapters by name, in `slots` slots. Starts with `names` in slots 0.. (load
    numbers 0..); each later load takes the next number."""

    def __init__(self, slots: int, names: Sequence[str]) -> None:
        if len(names) > slots:
            raise ValueError(f"{len(names)} LoRA adapters for {slots} slots")
        self.slots = slots
        self.loaded: Dict[str, LoraBinding] = {n: LoraBinding(i, i) for i, n in enumerate(names)}
        self.loads = len(names)

    def bind(self, name: Optional[str]) -> Optional[LoraBinding]:
        """The binding of a request naming adapter `name` (None: no adapter); RequestError
        (param "model") for a name not loaded now."""
        if name is None:
            return None
        binding = self.loaded.get(name)
        if binding is None:
            raise RequestError(f"LoRA adapter {name!r} is not loaded (loaded: "
                               f"{', '.join(self.loaded) or 'none'})", "model")
        return binding

    def free_slot(self, bound: Iterable[Optional[LoraBinding]]) -> Optional[int]:
        """The lowest slot neither loaded nor bound to a live request (`bound`: every live
        request's binding), or None."""
        taken = {b.slot for b in self.loaded.values()}
        taken.update(b.slot for b in bound if b is not None)
        return next((s for s in range(self.slots) if s not in taken), None)

    def add(self, name: str, slot: int) -> LoraBinding:
        """Record adapter `name` as loaded into `slot` (the caller found it free)."""
        binding = LoraBinding(slot, self.loads)
        self.loads += 1
        self.loaded[name] = binding
        return binding

    def remove(self, name: str) -> bool:
        """Forget adapter `name` (its slot frees once its requests retire); False where it was
        not loaded."""
        return self.loaded.pop(name, None) is not None

    def full_error(self) -> str:
        """Why no slot is free, for a load's reply."""
        names = ", ".join(self.loaded) or "none"
        return (f"every one of the {self.slots} LoRA adapter slots is taken (loaded: {names}; "
                f"an unloaded adapter's slot frees when its last request finishes): unload "
                f"one first, or start with a larger --max-loras")
