"""Changes to what a replica serves, made by every rank at the same step or by none.

LoRA adapters loaded and unloaded (AdapterMsg), the weights reloaded from a checkpoint
(WeightsMsg) or pushed by a trainer's process group (GroupMsg, GroupWeightsMsg), sleep and
wake-up (SleepMsg, WakeMsg). Every rank runs the same change on the same message at the same
step (the scheduler sees to that); each attempt that can fail on one rank alone (files, memory,
a network) is followed by a gloo vote, and where any rank failed, the ranks that made the change
undo it, so that every rank of a replica serves the same thing. Each method returns None, or
why nothing changed (rank 0's reply); a rank that cannot undo raises (it must not serve a mix).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterable, Optional, Tuple, TypeVar

from torch.distributed import ProcessGroup

from minisgl.core import LoraBinding, WeightsRefused
from minisgl.distributed import agreed_error
from minisgl.distributed.weight_group import GroupSpec
from minisgl.distributed.tensor_payload import deserialize
from minisgl.message.types import GroupMsg, GroupWeightsMsg, SleepMsg, TensorWeightsMsg, WakeMsg
from minisgl.models.lora_config import RUNTIME_OFF
from minisgl.scheduler.adapters import AdapterTable
from minisgl.scheduler.engine_api import StepEngine

logger = logging.getLogger(__name__)
T = TypeVar("T")
WEIGHTS_ASLEEP = "the weights are asleep: wake them up (wake_up with tag 'weights') first"


def _error(e: Exception) -> str:
    """An exception as a reply's text: a ValueError's message, else its type too."""
    return str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"


class Changes:
    """One rank's side of the changes (see the module doc)."""

    def __init__(self, engine: StepEngine, adapters: AdapterTable, lora_runtime: bool,
                 rank: int, global_rank: int, cpu_group: Optional[ProcessGroup],
                 weights_path: Optional[str]) -> None:
        """`global_rank`: this rank among every replica's (replica * tp + rank), its place
        in a trainer's group after the trainer's ranks; `weights_path`: the checkpoint
        served (None: dummy weights), which a failed reload restores."""
        self.engine, self.adapters, self.lora_runtime = engine, adapters, lora_runtime
        self.rank, self.global_rank, self.cpu_group = rank, global_rank, cpu_group
        self.weights_path = weights_path

    def _attempt(self, run: Callable[[], T], what: str) -> Tuple[Optional[str], Optional[T]]:
        """(None, what `run()` returned), or (its error, None), the error logged as `what`
        failing on this rank."""
        try:
            return None, run()
        except Exception as e:  # the files', memory's, network's too: every rank must vote
            logger.warning("rank %d: %s failed: %s", self.rank, what, _error(e))
            return _error(e), None

    # --- LoRA adapters --------------------------------------------------------------------
    def load_adapter(self, name: str, path: str, bound: Iterable[Optional[LoraBinding]]
                     ) -> Optional[str]:
        """Adapter `name` from `path` into a slot none of `bound` (the live requests'
        bindings) holds: kept only where every rank loaded it."""
        if not self.lora_runtime:
            return RUNTIME_OFF
        if "weights" in self.engine.asleep:
            return WEIGHTS_ASLEEP
        if name in self.adapters.loaded:
            return f"LoRA adapter {name!r} is already loaded"
        slot = self.adapters.free_slot(bound)
        if slot is None:
            return self.adapters.full_error()
        error, _ = self._attempt(lambda: self.engine.load_adapter(slot, name, path),
                                 f"LoRA adapter {name!r} from {path}")
        agreed = agreed_error(error, self.cpu_group, f"loading LoRA adapter {name!r}")
        if agreed is not None:
            self.engine.clear_adapter(slot)
            return agreed
        self.adapters.add(name, slot)
        logger.info("rank %d: LoRA adapter %r loaded from %s into slot %d", self.rank, name,
                    path, slot)
        return None

    def unload_adapter(self, name: str) -> Optional[str]:
        if not self.adapters.remove(name):
            return f"LoRA adapter {name!r} is not loaded"
        logger.info("rank %d: LoRA adapter %r unloaded", self.rank, name)
        return None

    # --- weights --------------------------------------------------------------------------
    def reload(self, path: str) -> Optional[str]:
        """Every rank's weights from `path`, or (some rank failed) those served before."""
        error = self._load_or_restore(lambda: self.engine.reload_weights(path),
                                      f"weights from {path}", path)
        if error is None:
            self.weights_path = path
        return error

    def _load_or_restore(self, load: Callable[[], None], what: str,
                         path: Optional[str] = None) -> Optional[str]:
        """`load()` on every rank, or, where some rank failed, each rank whose weights it
        changed (not one refused before loading: core.WeightsRefused) reloads the checkpoint
        it served from disk. None, or why the weights did not change (naming `path`)."""
        error, changed = None, True
        try:
            load()
        except Exception as e:  # the files' errors too: every rank must reach the vote below
            changed, error = not isinstance(e, WeightsRefused), _error(e)
            if path is not None and path not in error:
                error = f"{path}: {error}"
            logger.warning("rank %d: %s not loaded: %s", self.rank, what, error)
        agreed = agreed_error(error, self.cpu_group, "loading the weights")
        if agreed is not None and changed:
            self.engine.reload_weights(self.weights_path)
        return agreed

    def group(self, msg: GroupMsg) -> Optional[str]:
        """Join (or leave) a trainer's weight update group; a join some rank failed is left
        by the ranks that made it."""
        if msg.leave:
            try:
                self.engine.leave_weight_group(msg.group_name)
            except ValueError as e:  # the same on every rank: they joined together
                return str(e)
            logger.info("rank %d: left weight update group %r", self.rank, msg.group_name)
            return None
        spec = GroupSpec(msg.master_address, msg.master_port, msg.rank_offset, msg.world_size,
                         msg.group_name, msg.backend)
        error, _ = self._attempt(lambda: self.engine.join_weight_group(
            spec, msg.rank_offset + self.global_rank), f"joining group {msg.group_name!r}")
        agreed = agreed_error(error, self.cpu_group, "joining the group")
        if agreed is not None and error is None:
            self.engine.leave_weight_group(msg.group_name)
        return agreed

    def from_group(self, msg: GroupWeightsMsg) -> Optional[str]:
        """The tensors the group's trainer broadcasts into every rank's weights, or, where
        some rank failed, the disk checkpoint again where they changed (the group's earlier
        updates with it)."""
        return self._load_or_restore(lambda: self.engine.weights_from_group(
            msg.group_name, list(zip(msg.names, msg.dtypes, msg.shapes))),
            f"weights from group {msg.group_name!r}")

    def from_tensors(self, msg: TensorWeightsMsg) -> Optional[str]:
        """The tensors a trainer on this machine handed over (this rank's payload) into every
        rank's weights, or, where some rank failed, the disk checkpoint again where they
        changed. A payload that does not open refuses the update before any change."""
        def load() -> None:
            if len(msg.payloads) <= self.rank:
                raise WeightsRefused(f"serialized_named_tensors holds {len(msg.payloads)} "
                                     f"payloads: one per tensor-parallel rank is needed")
            try:
                named = deserialize(msg.payloads[self.rank])
            except ValueError as e:
                raise WeightsRefused(str(e)) from None
            self.engine.load_some_weights(named)
        return self._load_or_restore(load, "weights from tensors")

    # --- sleep mode -----------------------------------------------------------------------
    def sleep(self, msg: SleepMsg, dropped: int = 0) -> Optional[str]:
        """Every rank's engine asleep at `msg.level` (the parts `msg.tags` names), or none:
        a rank that slept where another did not wakes again. `dropped`: the cached pages the
        caller dropped first (for the log)."""
        before, start = self.engine.asleep, time.perf_counter()
        error, freed = self._attempt(lambda: self.engine.sleep(msg.level, tuple(msg.tags)),
                                     "sleep")
        agreed = agreed_error(error, self.cpu_group, "sleep")
        if agreed is not None:
            slept = tuple(t for t in self.engine.asleep if t not in before)
            if slept:
                self.engine.wake_up(slept)
            return agreed
        logger.info("rank %d: asleep (level %d; %s): %.2f GiB freed in %.2f s, %d cached "
                    "pages dropped", self.rank, msg.level, ", ".join(sorted(self.engine.asleep)),
                    (freed or 0) / 2**30, time.perf_counter() - start, dropped)
        return None

    def wake(self, msg: WakeMsg) -> Optional[str]:
        """The parts `msg.tags` names awake on every rank, or on none: a rank that woke where
        another did not goes back to sleep, each part at the level it slept at."""
        before, start = self.engine.asleep, time.perf_counter()
        levels = {tag: self.engine.sleep_level(tag) for tag in before}
        error, _ = self._attempt(lambda: self.engine.wake_up(tuple(msg.tags)), "wake-up")
        agreed = agreed_error(error, self.cpu_group, "wake-up")
        if agreed is not None:
            for tag in (t for t in before if t not in self.engine.asleep):
                self.engine.sleep(levels[tag], (tag,))
            return agreed
        logger.info("rank %d: %s in %.2f s", self.rank, "awake" if not self.engine.asleep else
                    "woke " + ", ".join(t for t in before if t not in self.engine.asleep),
                    time.perf_counter() - start)
        return None
