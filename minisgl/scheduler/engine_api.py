"""What the scheduler needs from one rank's engine: the `StepEngine` protocol.

`minisgl.engine.Engine` satisfies it without naming it; the scheduler's tests drive the scheduler
with a CPU fake and no model (tests/fake_engine.py). The contract, per step:

1. The scheduler admits a request into a page-table row and calls `start_request` before any
   batch of it launches.
2. It writes the slots of the batch's new tokens into `page_table`, sets `batch.out_slots`, and
   calls `launch` (the requests' lengths are not yet advanced; a decode batch's input token may
   be one the host has not seen yet, the engine keeps it).
   A `batch.masked` batch (a constrained request is sampled) runs its forward only: the
   scheduler then calls `sample(handle, bitmask)` once, after processing the previous batch's
   tokens, and uses the handle it returns from then on.
3. It calls `collect` on the handle exactly once, possibly after launching the next batch
   (overlap scheduling: at most one batch is in flight then).
"""

from __future__ import annotations

from typing import Any, FrozenSet, Iterable, List, Optional, Protocol, Sequence, Tuple

import torch

from minisgl.core import Batch, Req, StepResult
from minisgl.distributed.weight_group import GroupSpec
from minisgl.layers.readback import Piece


class StepEngine(Protocol):
    @property
    def device(self) -> torch.device:
        """Where `page_table` lives (the scheduler's index tensors go there)."""

    @property
    def page_table(self) -> torch.Tensor:
        """[max_running_requests + 1, max_context] int32: entry (r, p) is the KV slot of
        position p of the request in row r (a slot is page * page_size + offset). The scheduler
        writes it; `launch` reads it."""

    @property
    def num_pages(self) -> int:
        """KV pages in the pool (identical on every rank)."""

    @property
    def max_context(self) -> int:
        """The most tokens (prompt + output) one request may hold."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def hidden_size(self) -> int:
        """The model's final hidden state width (return_hidden_states' rows)."""

    @property
    def long_rope_from(self) -> int:
        """Longrope's pretraining length k (0: none): every token of a sequence longer than k
        rotates otherwise than a shorter one's (`Req.long_rope`): the scheduler keeps their
        prefix-cache entries apart and prefills a sequence again as it grows past k."""

    @property
    def eos_token_ids(self) -> Tuple[int, ...]:
        """Token ids that end a request (unless its params ignore EOS)."""

    def start_request(self, req: Req) -> None:
        """`req` was admitted into page-table row `req.table_row`: set up the row's
        per-request state (e.g. penalty counts from `req.token_ids`)."""

    def mixes(self, prefill: Batch, num_decode: int) -> bool:
        """Whether to run `prefill` (a prefill batch) with `num_decode` running requests'
        decode rows appended, as one mixed step (SchedulerConfig.mixed_steps), rather than
        the two steps apart. Must depend only on the batch and the config (ranks agree)."""

    def launch(self, batch: Batch) -> Any:
        """Start `batch` (without waiting for it, where the device allows); the returned handle is
        opaque to the scheduler, which passes it to `collect`."""

    def sample(self, launched: Any, bitmask: torch.Tensor) -> Any:
        """Sample a masked batch's tokens, row i of the sampled requests restricted to the
        tokens bitmask row i allows (int32 [rows, ceil(vocab_size / 32)], xgrammar's layout, on
        the host); returns the handle for `collect`."""

    def collect(self, launched: Any) -> StepResult:
        """Wait for a launched batch and return its tokens and log-probabilities."""

    def keep(self, reqs: List[Req], kept: List[List[int]]) -> None:
        """After a verify batch: `kept[i]` are the tokens running request `reqs[i]` kept (its
        penalties count them; the last is the input of its next decode step)."""

    def load_adapter(self, slot: int, name: str, path: str) -> None:
        """Load LoRA adapter `name` (PEFT directory `path`) into `slot`, which no live
        request is bound to; an exception says why not (the slot is left empty)."""

    def clear_adapter(self, slot: int) -> None:
        """Empty LoRA `slot` (its load failed on another rank)."""

    def reload_weights(self, path: Optional[str]) -> None:
        """The weights of checkpoint directory `path` (None: the start-up dummy weights) in
        place of the served ones, with no request live; an exception says why not
        (core.WeightsRefused: before any weight changed)."""

    @property
    def asleep(self) -> FrozenSet[str]:
        """Sleep mode: the parts asleep ("weights", "kv_cache"); empty while serving."""

    def sleep_level(self, tag: str) -> int:
        """The level part `tag` sleeps at (1: the weights kept in host memory, 2: forgotten);
        0 where it is awake."""

    def sleep(self, level: int, tags: Tuple[str, ...] = ()) -> int:
        """Hand back the memory of the awake parts `tags` names (empty: all) at sleep `level`
        (1: the weights kept in host memory; 2: forgotten), with no request live and the
        prefix cache dropped; the bytes freed. An exception says why not (nothing asleep that
        was not)."""

    def wake_up(self, tags: Tuple[str, ...] = ()) -> None:
        """Take the memory of the parts `tags` names (empty: all) again; an exception says
        why not, with the parts asleep as before."""

    def join_weight_group(self, spec: GroupSpec, rank: int) -> None:
        """Join a trainer's weight update group as `rank` (blocks until every member has);
        an exception says why not."""

    def leave_weight_group(self, name: str) -> None:
        """Leave group `name`; ValueError where none of that name was joined."""

    def load_some_weights(self, named: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Whole checkpoint tensors into the served weights, this rank's shards; the others
        stay. ValueError naming a tensor that does not fit; WeightsRefused before any change."""

    def read_back(self, name: str, rows: int, max_values: int) -> List[Piece]:
        """This rank's pieces of the first `rows` rows of checkpoint tensor `name` as served
        (models/decoder.read_back); ValueError why not."""

    def weights_from_group(self, name: str, tensors: Sequence[Tuple[str, str, Tuple[int, ...]]]
                           ) -> None:
        """Receive (name, dtype, shape) `tensors` from group `name`'s trainer into the served
        weights, with no request live; WeightsRefused before any weight changed, another
        exception after (the weights mixed)."""
