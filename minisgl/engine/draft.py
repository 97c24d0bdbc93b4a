"""A draft model for speculative decoding (vLLM's speculative_config `{"model": ...}`, SGLang's
STANDALONE): a smaller model of the same tokenizer proposes each request's next tokens, and the
target verifies them as it verifies n-gram drafts (scheduler/speculative.py), so the tokens are
the target's whatever the draft proposes; a better draft only keeps more of them.

The draft keeps its own KV pool with as many pages as the target's, indexed by the target's
page table: slot s holds the draft's K/V of the token whose target K/V is in slot s. The
invariant: wherever the target has K/V, the draft has its own. A prefill (with a mixed step's
decode rows) and a decode step run the draft over the same tokens first (`shadow`); a verify
step's draft steps (`propose`) write the newest token's K/V and every draft's, at the positions
the verify then computes. So the prefix cache, retraction and the slots freed behind rejected
drafts need no bookkeeping of the draft's: its slots live and die with the target's.

A draft token is sampled as the target will sample its position: greedy requests take the
argmax, the others the request's temperature and filters with the very noise the verify step
will use there (engine/sampler.py: a function of the seed, the output position and the token),
so a draft that agrees with the target's distribution proposes the token the target then
samples, random sampling included. The target's penalties, logit bias, allowed tokens,
min_tokens and bad words apply to the draft's logits as well (its grammars do not: a draft a
grammar refuses ends the run there); only tokens both vocabularies hold are proposed. On CUDA
its decode steps replay CUDA graphs of their own (engine/cuda_graph.py's, reading each row's
input from the draft's `inputs` buffer); prefills run eager. Every rank runs them alike (the
draft is split over the ranks as the target is, its logits gathered, the noise a function of
the request), so every rank proposes the same drafts: the lockstep invariant holds.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from minisgl.core import Batch, Phase, Req
from minisgl.distributed import Communicator
from minisgl.engine.build import construct, drafter_kv, drafter_positions, fill_weights
from minisgl.engine.config import EngineConfig
from minisgl.engine.cuda_graph import DecodeGraphs
from minisgl.engine.sampler import sample_requests
from minisgl.kernels.policy import KernelPolicy
from minisgl.kvcache import KVPool
from minisgl.models import CausalLM, ModelConfig
from minisgl.models.kv_scales import KVScaleCollector
from minisgl.models.path import resolve_model_path
from minisgl.models.quantization import quant_plan
from minisgl.utils import to_device

logger = logging.getLogger(__name__)

# The target's logit edits (Engine._adjusted): (logits over its vocabulary, page-table rows,
# requests as sampling sees them, the drafts each row follows) -> the logits sampling reads.
Adjust = Callable[[torch.Tensor, torch.Tensor, List[Req], Sequence[Tuple[int, ...]]],
                  torch.Tensor]


class DraftSampling(NamedTuple):
    """Draft j of each of `reqs` (page-table `rows`; `before`: their drafts so far) as the
    verify samples that position, through the target's sampler (its `seed` and `policy`) and
    logit edits (`adjust`) over its `target_vocab` tokens."""

    reqs: List[Req]
    rows: torch.Tensor
    j: int
    before: torch.Tensor
    adjust: Adjust
    seed: int
    policy: KernelPolicy
    target_vocab: int


def sample_drafts(logits: torch.Tensor, how: DraftSampling) -> torch.Tensor:
    """The drafts `how` asks for from their `logits` over the first tokens of the target's
    vocabulary (all of them, or a smaller draft's first ones: the rest cannot be drafted):
    each sampled at the output number its request's length + j (engine.verify_views), after
    the target's logit edits where a request has any (the drafts so far read to the host only
    then)."""
    views = []
    for req in how.reqs:
        view = copy.copy(req)
        view.device_len = req.device_len + how.j
        views.append(view)
    if all(r.params.raw_sampling for r in how.reqs):
        return sample_requests(logits, views, how.seed, how.policy)
    if logits.shape[1] < how.target_vocab:  # the edits index the target's vocabulary
        logits = torch.nn.functional.pad(logits.float(), (0, how.target_vocab - logits.shape[1]),
                                         value=float("-inf"))
    drafted = [tuple(d) for d in how.before.tolist()]
    return sample_requests(how.adjust(logits, how.rows, views, drafted), views, how.seed,
                           how.policy)


class LoadedDraft(NamedTuple):
    """`load_draft`'s: the draft model with its weights, and what one KV page of it costs."""

    model: CausalLM
    page_bytes: int


def load_draft(path: str, cfg: EngineConfig, comm: Communicator, policy: KernelPolicy,
               target: ModelConfig, context: int) -> LoadedDraft:
    """The draft model of checkpoint `path` (a directory or a hub id) on this rank, split over
    the ranks as the target is, in the target's dtype (FP8 checkpoints as they are; random
    weights under load_format dummy, from the engine's seed). ValueError naming the draft where
    it cannot serve: a classifier, a context length below the served `context` (its rope
    tables end there), longrope (its rope indices follow the target's requests' lengths), or,
    under deterministic inference, quantized weights."""
    local = resolve_model_path(path, download_dir=cfg.download_dir)
    model_cfg = ModelConfig.from_dir(local)
    name = f"draft model {path!r} ({model_cfg.architecture})"
    if model_cfg.classifier is not None:
        raise ValueError(f"{name} is a classifier, not a causal language model")
    if model_cfg.eagle is not None:
        raise ValueError(f"{name} is an EAGLE-3 head, not a model: give speculative_config "
                         f"method \"eagle3\" (SGLang: --speculative-algorithm EAGLE3)")
    if model_cfg.max_context < context:
        raise ValueError(f"{name} has a context length of {model_cfg.max_context} tokens, "
                         f"below the served {context}: give max_model_len {model_cfg.max_context}"
                         f" or less, or a draft of a longer context")
    if model_cfg.long_rope_from:
        raise ValueError(f"{name} scales its rope by the sequence's length (longrope): "
                         f"not supported as a draft")
    if model_cfg.vocab_size > target.vocab_size:
        logger.info("rank %d: the %s knows %d tokens, the target %d: it drafts among the "
                    "target's", cfg.tp_info.rank, name, model_cfg.vocab_size, target.vocab_size)
    quant = quant_plan(model_cfg.quantization, None, cfg.torch_device, cfg.torch_dtype)
    if cfg.enable_deterministic_inference and (quant is not None or model_cfg.int_quant):
        raise ValueError(f"enable_deterministic_inference cannot hold with the {name}: "
                         f"quantized weights")
    model = construct(model_cfg, cfg, comm, policy, quant, name)
    fill_weights(model, model_cfg, None if cfg.load_format == "dummy" else str(local),
                 cfg.seed, KVScaleCollector(model_cfg.num_layers),
                 cfg.show_progress and cfg.tp_info.is_primary)
    kv_heads = model.model.local_heads.kv_heads
    page = KVPool.bytes_per_page(model_cfg.num_layers, cfg.page_size, kv_heads,
                                 model_cfg.head_dim, cfg.torch_dtype)
    return LoadedDraft(model.eval(), page)


class DraftModel:
    """The draft model's forward passes over the target's batches (module doc). Built once
    the target's pool is sized: `num_pages` as many as the target's, `page_table` the
    target's (the scheduler writes every slot both use). Its K/V are in the model's dtype
    (an FP8 target pool's scales are the target's layers')."""

    def __init__(self, loaded: LoadedDraft, cfg: EngineConfig, policy: KernelPolicy,
                 num_pages: int, page_table: torch.Tensor, target_vocab: int) -> None:
        self.model = loaded.model
        model_cfg: ModelConfig = self.model.cfg
        self.device = cfg.torch_device
        self.seed, self.policy = cfg.seed, policy  # the target sampler's: its noise
        self.pool, self.backend = drafter_kv(self.model, model_cfg.num_layers, cfg, policy,
                                             num_pages, page_table)
        self.page_table = page_table
        # Each page-table row's input token for the decode graphs (`capture_graphs`).
        self.inputs = torch.zeros(page_table.shape[0], dtype=torch.int64, device=self.device)
        self.graphs: Optional[DecodeGraphs] = None
        self.vocab = min(model_cfg.vocab_size, target_vocab)  # drafts the target can take
        self.target_vocab = target_vocab
        # Target tokens past the draft's vocabulary are read as its last token (a wrong input
        # costs kept drafts, never a token); None where the draft knows every target token.
        self.last_id = model_cfg.vocab_size - 1 if model_cfg.vocab_size < target_vocab else None

    def _inputs(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.last_id is None else ids.clamp_max(self.last_id)

    def capture_graphs(self, max_bs: int, pad_row: int, scratch_slot: int,
                       dtype: torch.dtype) -> None:
        """Decode graphs of up to `max_bs` requests over this draft (the target's sizes, its
        padding row and scratch slot): its decode steps replay them from then on."""
        self.graphs = DecodeGraphs(self.model, self.backend,  # type: ignore[arg-type]
                                   max_bs, self.page_table, pad_row, scratch_slot,
                                   self.inputs, dtype=dtype)

    def _decode(self, step: Batch, ids: torch.Tensor, rows: torch.Tensor,
                logit_rows: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """A decode batch of the draft on input `ids` (the requests' page-table `rows`): the
        logits of `logit_rows` (None: none wanted), by a graph's replay where one fits."""
        if self.graphs is not None and self.graphs.can_run(step):
            self.inputs[rows] = ids
            logits = self.graphs.replay(step).logits
            return None if logit_rows is None else logits[logit_rows]
        self.backend.prepare(step)
        positions = drafter_positions(self.model, step, self.device)
        if logit_rows is None:
            self.model.hidden(ids, positions, step, self.backend)
            return None
        return self.model(ids, positions, step, self.backend, logit_rows)

    @torch.inference_mode()
    def shadow(self, batch: Batch, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """The draft over a prefill or decode batch's new tokens (`ids`, the target's inputs,
        before it samples; `rows`: the requests' page-table rows on the device), writing their
        K/V at the batch's slots."""
        view = dataclasses.replace(batch, attn_meta=None, lora=None)
        if batch.phase is Phase.DECODE:
            self._decode(view, self._inputs(ids), rows, None)
            return
        self.backend.prepare(view)
        self.model.hidden(self._inputs(ids), drafter_positions(self.model, view, self.device),
                          view, self.backend)

    def _sample(self, logits: torch.Tensor, reqs: List[Req], rows: torch.Tensor, j: int,
                before: torch.Tensor, adjust: Adjust) -> torch.Tensor:
        return sample_drafts(logits[:, :self.vocab], DraftSampling(
            reqs, rows, j, before, adjust, self.seed, self.policy, self.target_vocab))

    @torch.inference_mode()
    def propose(self, batch: Batch, newest: List[int], adjust: Adjust) -> List[List[int]]:
        """Drafts for a verify batch whose request i extends by its newest token `newest[i]`
        and `extend_lens[i] - 1` drafts: that many steps of the draft from the newest token
        (each draft sampled as the verify will sample its position: the module doc), then one
        more that only writes the last draft's K/V, each step a decode batch of the requests
        still drafting at the verify's slots (`batch.out_slots`) for those positions. Called
        before the scheduler advances the requests' lengths. Waits for the device once, at the
        end (and once a step where a request's logits take the target's edits, `adjust`)."""
        rooms = [ext - 1 for ext in batch.extend_lens]
        starts = list(itertools.accumulate(batch.extend_lens, initial=0))
        slots = batch.out_slots
        assert slots is not None  # the scheduler's, written before any launch
        latest = self._inputs(to_device(newest, torch.int64, self.device))  # the next inputs
        table_rows = to_device([r.table_row for r in batch.reqs], torch.int64, self.device)
        drafts = torch.zeros((batch.size, max(rooms)), dtype=torch.int64, device=self.device)
        for j in range(max(rooms) + 1):
            active = [i for i, room in enumerate(rooms) if room >= j]
            step = Batch(Phase.DECODE, [batch.reqs[i] for i in active],
                         [batch.prefix_lens[i] + j for i in active], [1] * len(active),
                         [True] * len(active))
            index = to_device(active, torch.int64, self.device)
            if self.graphs is None or not self.graphs.can_run(step):  # (graphs find their own)
                step.out_slots = slots[to_device([starts[i] + j for i in active],
                                                 torch.int64, self.device)]
            drafting = [k for k, i in enumerate(active) if rooms[i] > j]
            picked = to_device(drafting, torch.int64, self.device) if drafting else None
            logits = self._decode(step, latest[index], table_rows[index], picked)
            if logits is None:  # the last drafts' K/V only
                break
            into = index[picked]
            tokens = self._sample(logits, [step.reqs[k] for k in drafting], table_rows[into], j,
                                  drafts[into, :j], adjust)
            latest[into] = tokens
            drafts[into, j] = tokens
        return [row[:room] for row, room in zip(drafts.tolist(), rooms)]
