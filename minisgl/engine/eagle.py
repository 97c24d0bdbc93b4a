"""EAGLE-3 speculative decoding (vLLM's speculative_config `{"method": "eagle3", "model":
PATH}`, SGLang's EAGLE3): the head of models/eagle3.py drafts each request's next tokens from
the target's own hidden states, and the target verifies them as any drafts
(scheduler/speculative.py), so the tokens are the target's whatever it proposes.

The head's sequence is the target's shifted by one token: at position i it reads the target's
hidden states at i (kept by the target's forward: DecoderModel.keep_aux) and the token after
i. So it runs after the target's forward and sampling, in the same launch (`shadow`), over
every position the target just computed, each with the token that follows it: the next prompt
token, or the token just sampled; in a verify step the token sampled at each position, which is
the one kept wherever a draft was kept. It writes its K/V (one layer, a pool of its own with as
many pages as the target's, on the target's page table) at the target's slots, and keeps its
state before the final norm at each request's last position whose target K/V now stand (the
last prompt token or decode row; a verify step's last kept position, found on the device as the
scheduler finds it on the host) in `states`, by page-table row.

The invariant: wherever the target has K/V at positions < n, the head has its own, and
states[row] is its state at n - 1. One exception, as in vLLM: a prefix-cache hit's last cached
position keeps the K/V the head wrote with the token that followed it when it was computed (a
stale input costs kept drafts, never a token).

A verify step's drafts (`propose`, before the target's forward): the first from the LM head on
states[row]; each next one from a step of the head at position n + j over the draft before it
and the previous step's state, writing K/V at the verify's slot for that position (the verify's
shadow overwrites them with the target's). Each is sampled as the verify samples its position
(engine/draft.py `sample_drafts`). Every rank runs the same steps on the same inputs (the head
split as the target is, its logits gathered): every rank proposes the same drafts.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple, cast

import torch

from minisgl.core import Batch, Phase, Req
from minisgl.distributed import Communicator
from minisgl.engine.build import construct, drafter_kv, drafter_positions, fill_weights
from minisgl.engine.config import EngineConfig
from minisgl.engine.draft import Adjust, DraftSampling, sample_drafts
from minisgl.engine.eagle_graph import EagleGraphs, Proposing, greedy_draft, greedy_drafts
from minisgl.kernels.policy import KernelPolicy
from minisgl.kvcache import KVPool
from minisgl.models import CausalLM, ModelConfig
from minisgl.models.config import EAGLE3
from minisgl.models.eagle3 import LlamaForCausalLMEagle3, check_draft_vocab, eagle_shape
from minisgl.models.kv_scales import KVScaleCollector
from minisgl.models.path import resolve_model_path
from minisgl.models.weights import checkpoint_names
from minisgl.utils import to_device


def default_aux_layers(num_layers: int) -> Tuple[int, int, int]:
    """The target layers whose inputs an EAGLE-3 head reads where its config names none
    (vLLM's and EAGLE's: an early, the middle and a late one)."""
    return (2, num_layers // 2, num_layers - 3)


class LoadedEagle(NamedTuple):
    """`load_eagle`'s: the head with its weights, the target layers it reads, and what one
    KV page of it costs."""

    model: LlamaForCausalLMEagle3
    aux_layers: Tuple[int, ...]
    page_bytes: int


def _head_config(path: str, local: Path, cfg: EngineConfig, target: ModelConfig,
                 context: int) -> ModelConfig:
    """The head's config as it serves `target`: the layers it reads resolved, its embeddings
    shared where its checkpoint has none, its rope tables as long as the served `context`
    (vLLM's: a head's config says 2,048 where its target serves 128K). ValueError naming what
    does not fit."""
    model_cfg = ModelConfig.from_dir(local)
    name = f"EAGLE-3 head {path!r}"
    if model_cfg.eagle is None:
        raise ValueError(f"speculative method eagle3 needs an EAGLE-3 head (architectures "
                         f"{', '.join(EAGLE3)}); {path!r} is a {model_cfg.architecture}")
    if model_cfg.long_rope_from:
        raise ValueError(f"{name} scales its rope by the sequence's length (longrope): not "
                         f"supported")
    shape = model_cfg.eagle
    layers = shape.aux_layers or default_aux_layers(target.num_layers)
    if min(layers) < 0 or max(layers) >= target.num_layers:
        raise ValueError(f"{name} reads the target's layers {list(layers)}, but the target has "
                         f"{target.num_layers} (0 to {target.num_layers - 1})")
    if shape.target_hidden != target.hidden_size:
        raise ValueError(f"{name} reads hidden states of {shape.target_hidden} features; the "
                         f"target's have {target.hidden_size}")
    if model_cfg.vocab_size != target.vocab_size:
        raise ValueError(f"{name} knows {model_cfg.vocab_size} tokens, the target "
                         f"{target.vocab_size}: not a head of this target")
    shares = cfg.load_format == "dummy" or not any(
        n.endswith("embed_tokens.weight") for n in checkpoint_names(local))
    if shares and model_cfg.hidden_size != target.hidden_size:
        raise ValueError(f"{name} has no embeddings of its own and a hidden size of "
                         f"{model_cfg.hidden_size}, so it cannot take the target's "
                         f"({target.hidden_size})")
    return dataclasses.replace(
        model_cfg, max_position_embeddings=max(model_cfg.max_position_embeddings, context),
        eagle=dataclasses.replace(shape, aux_layers=tuple(layers), shares_embeddings=shares))


def load_eagle(path: str, cfg: EngineConfig, comm: Communicator, policy: KernelPolicy,
               target: CausalLM, context: int) -> LoadedEagle:
    """The EAGLE-3 head of checkpoint `path` (a directory or a hub id) for `target` on this
    rank, split over the ranks as the target is, unquantized in the target's dtype (random
    weights under load_format dummy). ValueError naming the head where it does not fit the
    target (`_head_config`, its d2t) or the tp."""
    local = resolve_model_path(path, download_dir=cfg.download_dir)
    model_cfg = _head_config(path, local, cfg, target.cfg, context)
    name = f"EAGLE-3 head {path!r}"
    model = construct(model_cfg, cfg, comm, policy, None, name)
    assert isinstance(model, LlamaForCausalLMEagle3)  # an EAGLE3 architecture's class
    if eagle_shape(model_cfg).shares_embeddings:
        model.share_embeddings(target.model.embed_tokens)
    fill_weights(model, model_cfg, None if cfg.load_format == "dummy" else str(local),
                 cfg.seed, KVScaleCollector(1), cfg.show_progress and cfg.tp_info.is_primary)
    wrong = check_draft_vocab(model, target.cfg.vocab_size, name, cfg.load_format == "dummy")
    if wrong is not None:
        raise ValueError(wrong)
    kv_heads = model.model.local_heads.kv_heads
    page = KVPool.bytes_per_page(1, cfg.page_size, kv_heads, model_cfg.head_dim,
                                 cfg.torch_dtype)
    return LoadedEagle(model.eval(), eagle_shape(model_cfg).aux_layers, page)


class ShadowPlan(NamedTuple):
    """A prefill batch's shadow inputs as the host knows them: each position's next token (0
    where it is sampled this step), where the sampled tokens go, and where each request's
    positions end (one past its last)."""

    ids: List[int]
    sampled_at: List[int]
    ends: List[int]


def shadow_plan(batch: Batch, sampled: Sequence[int]) -> ShadowPlan:
    """Per position of a prefill `batch` (and its decode rows), the token after it (module
    doc): the prompt's next token where the host has it, else the one sampled there
    (`sampled`: the batch indices sampled)."""
    ends = list(itertools.accumulate(batch.extend_lens))
    ids: List[int] = []
    for i, (req, prefix, ext) in enumerate(zip(batch.reqs, batch.prefix_lens,
                                               batch.extend_lens)):
        if i < batch.first_decode:
            ids.extend(req.token_ids[prefix + 1:prefix + ext])
            nxt = prefix + ext
            ids.append(req.token_ids[nxt] if nxt < len(req.token_ids) else 0)
        else:
            ids.append(0)
    return ShadowPlan(ids, [ends[i] - 1 for i in sampled], ends)


def kept_on_device(drafts: Sequence[List[int]], tokens: torch.Tensor, starts: Sequence[int]
                   ) -> torch.Tensor:
    """[requests] int64 on tokens' device: how many of request i's `drafts[i]` a verify step
    keeps, given its sampled `tokens` (one per position; request i's from `starts[i]`): those
    equal to the token sampled before them, as the scheduler finds on the host
    (scheduler/speculative.py `kept`), without waiting for the device."""
    most = max((len(d) for d in drafts), default=0)
    if most == 0:
        return torch.zeros(len(drafts), dtype=torch.int64, device=tokens.device)
    padded = to_device([list(d) + [-1] * (most - len(d)) for d in drafts], torch.int64,
                       tokens.device)
    at = to_device([[min(s + j, len(tokens) - 1) for j in range(most)] for s in starts],
                   torch.int64, tokens.device)
    return (tokens[at] == padded).long().cumprod(dim=1).sum(dim=1)


def _greedy(req: Req) -> bool:
    """Whether `req`'s tokens are its logits' first argmax (no edits, no sampling)."""
    return req.params.raw_sampling and req.params.is_greedy


class EagleDraft:
    """The head's forward passes beside the target's (module doc). Built once the target's
    pool is sized: `num_pages` as many as the target's, `page_table` the target's."""

    def __init__(self, loaded: LoadedEagle, cfg: EngineConfig, policy: KernelPolicy,
                 num_pages: int, page_table: torch.Tensor, target_vocab: int) -> None:
        self.model = loaded.model
        model_cfg: ModelConfig = self.model.cfg
        self.device = cfg.torch_device
        self.seed, self.policy = cfg.seed, policy  # the target sampler's: its noise
        self.pool, self.backend = drafter_kv(self.model, 1, cfg, policy, num_pages, page_table)
        self.page_table = page_table
        # Each page-table row's state before the final norm at its last position (see doc)
        self.states = torch.zeros(page_table.shape[0], model_cfg.hidden_size,
                                  dtype=cfg.torch_dtype, device=self.device)
        self.target_vocab = target_vocab
        self.target_ids = self.model.draft_vocab.target_ids()  # each draft token's target's
        self.graphs: Optional[EagleGraphs] = None

    def capture_graphs(self, max_rows: int, pad_row: int, scratch_slot: int,
                       verify_requests: int, drafts: int) -> None:
        """CUDA graphs of the head's step over up to `max_rows` rows (the target's graph
        buffers' rows, its padding row and scratch slot; engine/eagle_graph.py): its draft steps
        and its passes over decode and verify batches replay them from then on; and of whole
        greedy proposals of `drafts` drafts for up to `verify_requests` requests (the verify
        graphs' batch sizes; none where either is 0)."""
        self.graphs = EagleGraphs(self.model, self.backend,  # type: ignore[arg-type]
                                  max_rows, self.page_table, pad_row, scratch_slot)
        if verify_requests > 0 and drafts > 0:
            self.graphs.capture_proposals(verify_requests, Proposing(
                drafts, self.states, self.target_ids, self.policy))

    @torch.inference_mode()
    def shadow(self, batch: Batch, aux: torch.Tensor, sampled: Sequence[int],
               tokens: Optional[torch.Tensor]) -> None:
        """The head over the positions `batch` just ran through the target (`aux`: their
        kept hidden states), after its sampling (`tokens`: the sampled batch indices'
        tokens, or a verify's token at every position; None where nothing was sampled)."""
        rows = to_device([r.table_row for r in batch.reqs], torch.int64, self.device)
        if batch.phase in (Phase.DECODE, Phase.VERIFY) and tokens is not None:
            # every position sampled: the tokens after them are the sampled ones
            state = self._run(batch, tokens, self.model.fuse(aux))
            if batch.phase is Phase.DECODE:  # one position a request
                self.states[rows] = state
                return
            starts = list(itertools.accumulate(batch.extend_lens[:-1], initial=0))
            last = to_device(starts, torch.int64, self.device) + kept_on_device(
                batch.drafts or [[] for _ in batch.reqs], tokens, starts)
            self.states[rows] = state[last]
            return
        plan = shadow_plan(batch, sampled)
        ids = to_device(plan.ids, torch.int64, self.device)
        if tokens is not None and plan.sampled_at:
            ids[to_device(plan.sampled_at, torch.int64, self.device)] = tokens
        state = self._run(batch, ids, self.model.fuse(aux))
        self.states[rows] = state[to_device([end - 1 for end in plan.ends], torch.int64,
                                            self.device)]

    def _graphed(self, batch: Batch) -> bool:
        """Whether `_run` replays a graph for `batch`: every token a decode row (a decode or
        verify batch) and few enough of them."""
        return (self.graphs is not None and batch.phase in (Phase.DECODE, Phase.VERIFY)
                and sum(batch.extend_lens) <= self.graphs.max_rows)

    def _run(self, batch: Batch, ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The head's states over `batch`'s tokens: a graph's replay where `_graphed`, else
        eager."""
        if self.graphs is not None and self._graphed(batch):
            rows = [r.table_row for r, n in zip(batch.reqs, batch.extend_lens) for _ in range(n)]
            positions = [p for prefix, n in zip(batch.prefix_lens, batch.extend_lens)
                         for p in range(prefix, prefix + n)]
            return self.graphs.replay(rows, positions, ids, features)
        view = dataclasses.replace(batch, attn_meta=None, lora=None)
        self.backend.prepare(view)
        rope = drafter_positions(self.model, view, self.device)
        return self.model.step(ids, features, rope, view, self.backend).residual

    @torch.inference_mode()
    def propose(self, batch: Batch, adjust: Adjust) -> List[List[int]]:
        """Drafts for a verify batch whose request i extends by its newest token and
        `extend_lens[i] - 1` drafts (module doc), each step a decode batch of the requests
        still drafting at the verify's slots (`batch.out_slots`). Called before the scheduler
        advances the requests' lengths; waits for the device once, at the end (and once a
        step where a request's logits take the target's edits, `adjust`)."""
        rooms = [ext - 1 for ext in batch.extend_lens]
        if len(set(rooms)) == 1 and rooms[0] > 0 and all(_greedy(r) for r in batch.reqs):
            return self._greedy_proposal(batch, rooms[0]).tolist()
        table_rows = to_device([r.table_row for r in batch.reqs], torch.int64, self.device)
        states = self.states[table_rows]
        drafts = torch.zeros((batch.size, max(rooms)), dtype=torch.int64, device=self.device)
        for j in range(max(rooms)):
            active = [i for i, room in enumerate(rooms) if room > j]
            # every request drafting (the common case): whole tensors, no index copies
            at: Any = slice(None) if len(active) == batch.size else to_device(
                active, torch.int64, self.device)
            drafts[at, j] = self._draft(states[at], [batch.reqs[i] for i in active],
                                        DraftSampling([], table_rows[at], j, drafts[at, :j],
                                                      adjust, self.seed, self.policy,
                                                      self.target_vocab))
            going = [i for i in active if rooms[i] > j + 1]
            if going:
                at = slice(None) if len(going) == batch.size else to_device(
                    going, torch.int64, self.device)
                states[at] = self._step(batch, going, j, drafts[at, j], states[at])
        return [row[:room] for row, room in zip(drafts.tolist(), rooms)]

    def _greedy_proposal(self, batch: Batch, count: int) -> torch.Tensor:
        """int64 [requests, count] on the device: the drafts of a verify batch whose requests
        all sample greedily and draft `count` each: one replay of a proposal graph where one
        fits, else `greedy_drafts` eagerly (the same steps)."""
        table_rows = [r.table_row for r in batch.reqs]
        if self.graphs is not None and self.graphs.can_propose(batch.size, count):
            return self.graphs.propose(table_rows, batch.prefix_lens)
        everyone = list(range(batch.size))
        return greedy_drafts(
            self.model, self.policy, self.target_ids,
            self.states[to_device(table_rows, torch.int64, self.device)], count,
            lambda j, ids, states: self._step(batch, everyone, j, ids, states))

    def _draft(self, states: torch.Tensor, reqs: List[Req], how: DraftSampling
               ) -> torch.Tensor:
        """The next draft of `reqs` from their states: the draft vocabulary's first argmax
        mapped to the target's where every one samples greedily (as `greedy_drafts`), else
        sampled as the verify samples (`sample_drafts`) from the logits over the target's
        vocabulary."""
        if all(_greedy(r) for r in reqs):
            return greedy_draft(self.model, self.policy, self.target_ids, states)
        normed = cast(torch.Tensor, self.model.model.norm(states))
        logits = self.model.target_logits(normed, self.target_ids, self.target_vocab)
        return sample_drafts(logits, how._replace(reqs=reqs))

    def _step(self, batch: Batch, going: List[int], j: int, ids: torch.Tensor,
              states: torch.Tensor) -> torch.Tensor:
        """One step of the head at position prefix + j of the requests `going` (batch
        indices), over their draft j (`ids`) and `states`: their next states; K/V at the
        verify's slots for that position (`batch.out_slots`)."""
        step = Batch(Phase.DECODE, [batch.reqs[i] for i in going],
                     [batch.prefix_lens[i] + j for i in going], [1] * len(going),
                     [True] * len(going))
        if not self._graphed(step):  # eager: the slots as a tensor (a graph reads the table)
            starts = list(itertools.accumulate(batch.extend_lens, initial=0))
            slots = cast(torch.Tensor, batch.out_slots)  # the scheduler's, before any launch
            step.out_slots = slots[to_device([starts[i] + j for i in going], torch.int64,
                                             self.device)]
        return self._run(step, ids, states)
