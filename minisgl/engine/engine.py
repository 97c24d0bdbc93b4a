"""One rank's forward pass: the model shard, the KV pool, the page table, attention and sampling.

The scheduler decides what runs and writes slot ids into `page_table`; the engine turns a `Batch`
into tensors, runs the model and returns the sampled tokens (with the log-probabilities asked for,
computed in logprobs.py). Every rank holds an identical page table and an equally sized KV pool
(the page count is the minimum over ranks). `Engine` is the scheduler's `StepEngine`.
"""

from __future__ import annotations

import copy
import itertools
import logging
import time
from pathlib import Path
from typing import (Callable, Dict, FrozenSet, Iterable, List, NamedTuple, Optional, Sequence,
                    Tuple)

import torch

from minisgl.attention import AttentionBackend
from minisgl.core import Batch, Phase, Req, StepResult, WeightsRefused
from minisgl.distributed import ProcessGroups, min_over_ranks
from minisgl.distributed.weight_group import GroupSpec, WeightGroup, parse_dtype
from minisgl.engine.build import attention_backend, fill_weights
from minisgl.engine.config import EngineConfig
from minisgl.engine.cuda_graph import DecodeGraphs, graph_sizes
from minisgl.engine.draft import DraftModel, load_draft
from minisgl.engine.eagle import EagleDraft, load_eagle
from minisgl.engine.lora import lora_rows
from minisgl.engine.logprobs import (PromptRows, prompt_entries, prompt_logprobs, prompt_rows,
                                     sampled_entries, sampled_logprobs, verified_entries)
from minisgl.engine.bad_words import BadWords
from minisgl.engine.penalties import Penalties
from minisgl.engine.pooling import PromptPools, pooled_chunks
from minisgl.engine.prefill_graph import PrefillGraphs, capture_prefill_graphs
from minisgl.engine.verify_graph import (VerifyGraphs, capture_verify_graphs,
                                         graph_buffer_rows, verify_graph_bs)
from minisgl.engine.sleep import Part, tensors_part, weights_part
from minisgl.engine.sleep_parts import TAGS, WEIGHTS, check_level, check_tags
from minisgl.engine.sampler import (LogprobTensors, add_logit_bias, apply_token_bitmask,
                                    greedy, mask_to_allowed_tokens, sample_requests,
                                    suppress_early_stops)
from minisgl.engine.warmup import warmup_batches, warmup_shapes
from minisgl.kernels.policy import KernelPolicy
from minisgl.kvcache import KVPool
from minisgl.kvcache.pool import FP8_KV_DTYPE, KVScales
from minisgl.layers import blas
from minisgl.layers.lora import LoraShape
from minisgl.layers.readback import Piece
from minisgl.layers.source import TensorOf
from minisgl.models import CausalLM, ModelConfig, model_class
from minisgl.models.int_plan import IntPlan, int_plan
from minisgl.models.lora import clear_slot, load_adapter, load_adapters
from minisgl.models.lora_config import read_adapter
from minisgl.models.quantization import quant_plan
from minisgl.models.kv_scales import KVScaleCollector
from minisgl.utils import temporarily, to_device

logger = logging.getLogger(__name__)
_CPU_DEFAULT_KV_TOKENS = 16384


class DeviceInputs(NamedTuple):
    """A batch's model inputs on the device (Engine._prepare_inputs)."""

    ids: torch.Tensor  # [tokens] int64
    positions: torch.Tensor  # [tokens] int64


class Forwarded(NamedTuple):
    """What one forward pass left on the device (Engine._forward)."""

    logits: torch.Tensor  # [sampled requests, vocab]
    rows: torch.Tensor  # page-table rows of the sampled requests
    prompt: Optional[PromptRows]
    prompt_logprobs: Optional[LogprobTensors]
    # [len(embed_rows), hidden] float32: the embeddings of the requests that asked
    # (params.embed) at these batch indices (primary rank only)
    embeddings: Optional[torch.Tensor] = None
    embed_rows: Tuple[int, ...] = ()
    # params.return_hidden_states: the final hidden states of every position these requests
    # ran (batch index, positions), in that order, float32 (primary rank only)
    hidden: Optional[torch.Tensor] = None
    hidden_spans: Tuple[Tuple[int, int], ...] = ()
    # With an EAGLE-3 head: where a prefill or verify graph's replay computed the batch's
    # tokens (None: rows 0 .. T - 1, as eager forwards and decode graphs do)
    token_rows: Optional[List[int]] = None


class Pending(NamedTuple):
    """A masked batch's forward, launched and not yet sampled: its output and the sampled
    requests as they were at launch (copies: the scheduler advances their lengths right after
    `launch`, and sampling's noise and min_tokens read the lengths of launch time)."""

    forwarded: Forwarded
    reqs: List[Req]


class Launched(NamedTuple):
    """A batch started on the device; `Engine.collect` waits for its tokens."""

    batch: Batch
    sampled: List[int]  # indices of the requests whose token is sampled
    tokens: Optional[torch.Tensor]  # host tensor (pinned on GPU), valid once `done` completes
    done: Optional[torch.cuda.Event]
    # Host tensors like `tokens`, row j for request sampled[j]: only on the primary rank and
    # only when a sampled request asked for log-probabilities.
    logprobs: Optional[LogprobTensors] = None
    # Prompt log-probabilities of the rows `prompt.rows` (host tensors; primary rank only).
    prompt: Optional[PromptRows] = None
    prompt_logprobs: Optional[LogprobTensors] = None
    # A masked batch between `launch` and `sample`.
    pending: Optional[Pending] = None
    # Forwarded's embeddings, on the host like `tokens` (primary rank only)
    embeddings: Optional[torch.Tensor] = None
    embed_rows: Tuple[int, ...] = ()
    hidden: Optional[torch.Tensor] = None  # Forwarded's, on the host like `tokens`
    hidden_spans: Tuple[Tuple[int, int], ...] = ()


def use_pdl(cfg: EngineConfig, device: torch.device) -> bool:
    """Whether this rank launches with programmatic dependent launch (cfg.pdl). The answer
    depends only on the config and the GPU model, so ranks of one machine agree. Raises, naming
    the device, when "on" asks for it on a GPU older than compute capability 9.0."""
    if cfg.pdl == "off" or device.type != "cuda" or not cfg.fused_ops:
        return False  # "on" off CUDA or without fused ops was refused by EngineConfig
    major, minor = torch.cuda.get_device_capability(device)
    if major >= 9:
        return True
    if cfg.pdl == "on":
        raise ValueError(f"pdl 'on' needs compute capability 9.0 or newer; {device} "
                         f"({torch.cuda.get_device_name(device)}) has {major}.{minor}")
    return False


def check_kv_cache_dtype(cfg: EngineConfig, device: torch.device) -> None:
    """Raise, naming the setting and the device, where the KV cache dtype cannot run: an FP8
    cache on a GPU older than compute capability 8.9 (no FP8 conversions)."""
    if cfg.kv_torch_dtype != FP8_KV_DTYPE or device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(f"kv_cache_dtype {cfg.kv_cache_dtype!r} needs compute capability 8.9 "
                         f"or newer (FP8); {device} ({torch.cuda.get_device_name(device)}) "
                         f"has {major}.{minor}")


def kernel_policy(cfg: EngineConfig, device: torch.device) -> KernelPolicy:
    """The kernels this rank's model, attention backend and sampler launch, decided once at
    start-up: the fused Triton kernels where cfg.fused_ops asks for them on CUDA, PDL where
    `use_pdl` allows it (and raises as it does). Depends only on the config and the GPU model,
    so ranks of one machine agree."""
    invariant = cfg.enable_deterministic_inference
    return KernelPolicy(fused=cfg.fused_ops and device.type == "cuda",
                        pdl=use_pdl(cfg, device) and not invariant, batch_invariant=invariant)


def check_batch_invariant(cfg: EngineConfig, model_cfg: ModelConfig, quantized: bool) -> None:
    """Raise, naming the model's, where enable_deterministic_inference cannot hold with it:
    quantized weights (FP8, packed integers: their GEMMs are not made invariant). Experts
    hold (layers/moe.py: the invariant products, in the torch path, not the fused kernels)."""
    if cfg.enable_deterministic_inference and quantized:
        raise ValueError(f"enable_deterministic_inference cannot hold with "
                         f"{model_cfg.architecture}: quantized weights (FP8 or packed "
                         f"integers)")


def pages_that_fit(cfg: EngineConfig, model_cfg: ModelConfig, kv_heads: int,
                   device: torch.device, extra_page_bytes: int = 0) -> int:
    """This rank's KV page budget (ranks then agree on the minimum): `max_kv_tokens` where set,
    else a memory budget in bytes divided by the bytes of a page in the KV dtype, so that an
    FP8 cache holds twice the pages of a 16-bit one. The budget is `kv_cache_memory` where set;
    else, on a GPU, `mem_fraction` of the memory free now (after the weights), within
    `gpu_memory_utilization` where set (gpu_kv_budget); elsewhere the memory of the default
    token count in the model's dtype. `extra_page_bytes`: what each page also costs elsewhere
    (a draft model's pool of as many pages: engine/draft.py), shared out of the same budget."""
    if cfg.max_kv_tokens is not None:
        return -(-cfg.max_kv_tokens // cfg.page_size)
    shape = (model_cfg.num_layers, cfg.page_size, kv_heads, model_cfg.head_dim)
    if cfg.kv_cache_memory is not None:
        return _pages_of_bytes(cfg.kv_cache_memory, shape, cfg.kv_torch_dtype, device,
                               extra_page_bytes)
    if device.type != "cuda":
        budget = KVPool.bytes_per_page(*shape, cfg.torch_dtype) * (
            _CPU_DEFAULT_KV_TOKENS // cfg.page_size)
    else:
        free, total = torch.cuda.mem_get_info(device)
        held = torch.cuda.memory_reserved(device) if cfg.gpu_memory_utilization else 0
        budget = gpu_kv_budget(free, total, held, cfg.mem_fraction, cfg.gpu_memory_utilization)
    return budget // (KVPool.bytes_per_page(*shape, cfg.kv_torch_dtype) + extra_page_bytes)


def _pages_of_bytes(budget: int, shape: Tuple[int, int, int, int], dtype: torch.dtype,
                    device: torch.device, extra_page_bytes: int = 0) -> int:
    """The pages of `shape` (layers, page size, KV heads, head dim), each costing
    `extra_page_bytes` more, in `budget` bytes (vLLM's kv_cache_memory); ValueError naming the
    numbers where that is not one page, or more than the GPU's free memory."""
    page = KVPool.bytes_per_page(*shape, dtype) + extra_page_bytes
    if budget < page:
        raise ValueError(f"kv_cache_memory {budget} bytes is less than one KV page "
                         f"({page} bytes: {shape[1]} tokens of {shape[0]} layers)")
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if budget > free:
            raise ValueError(f"kv_cache_memory {budget >> 20} MiB is more than the "
                             f"{free >> 20} MiB free on {device} after the weights")
    return budget // page


def gpu_kv_budget(free: int, total: int, held: int, mem_fraction: float,
                  utilization: Optional[float]) -> int:
    """The KV pool's bytes on a GPU with `free` of `total` bytes free, `held` of them held by
    this process (its weights; torch's allocator): `mem_fraction` of the memory left to it,
    the free memory, or with `utilization` (vLLM's gpu_memory_utilization) at most that share
    of `total` less what it holds. ValueError naming the numbers where nothing is left."""
    if utilization is None:
        return int(free * mem_fraction)
    allowed = int(utilization * total)
    left = min(free, allowed - held)
    if left <= 0:
        raise ValueError(f"gpu_memory_utilization {utilization} allows this instance "
                         f"{allowed >> 20} MiB of the GPU's {total >> 20} MiB; it already "
                         f"holds {held >> 20} MiB (its weights), leaving no KV cache")
    return int(left * mem_fraction)


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of device tensor `t`, started without waiting (valid once an event
    recorded after it completes)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def _embeddings(launched: Launched) -> Optional[Dict[int, bytes]]:
    """Batch index -> float32 little-endian bytes of each embedding the batch computed (after
    `done`, as the tokens)."""
    if launched.embeddings is None:
        return None
    if launched.done is not None:
        launched.done.synchronize()
    vectors = launched.embeddings.cpu().numpy().astype("<f4")
    return {i: vectors[j].tobytes() for j, i in enumerate(launched.embed_rows)}


def _hidden_states(launched: Launched) -> Optional[Dict[int, torch.Tensor]]:
    """Batch index -> [positions, hidden] float32 CPU: the final hidden states of the
    positions each request that asked ran in the batch (after `done`, as the tokens)."""
    if launched.hidden is None:
        return None
    if launched.done is not None:
        launched.done.synchronize()
    states = launched.hidden.cpu()
    starts = itertools.accumulate([0, *(n for _, n in launched.hidden_spans)])
    return {i: states[s:s + n] for (i, n), s in zip(launched.hidden_spans, starts)}


def _tokens(launched: Launched) -> List[int]:
    """Wait for a launched batch; one token per request (-1 where `sample` is False)."""
    out = [-1] * launched.batch.size
    if launched.tokens is None:
        return out
    if launched.done is not None:
        launched.done.synchronize()
    for i, tok in zip(launched.sampled, launched.tokens.tolist()):
        out[i] = tok
    return out


def _verified_tokens(launched: Launched) -> List[List[int]]:
    """Wait for a launched verify batch; per request, the tokens sampled at its positions."""
    if launched.done is not None:
        launched.done.synchronize()
    flat = launched.tokens.tolist() if launched.tokens is not None else []
    ends = list(itertools.accumulate(launched.batch.extend_lens))
    return [flat[end - n:end] for end, n in zip(ends, launched.batch.extend_lens)]


def draft_prefixes(batch: Batch) -> List[Tuple[int, ...]]:
    """Per logits row of a verify batch, the draft tokens its position follows: at request
    i's position j, drafts[:j], output already as a decode step after keeping them would
    see it (its penalties count them, its bad words match them)."""
    return [tuple(draft[:j]) for draft in batch.drafts or [] for j in range(1 + len(draft))]


def verify_views(batch: Batch) -> List[Req]:
    """A verify batch's requests as sampling sees them, one per sampled position: request i's
    position j samples its output token number `device_len - prompt_len + j` (its noise's
    step), the token a decode step at that length would sample. Copies: the scheduler
    advances the lengths right after `launch`."""
    views: List[Req] = []
    for req, n in zip(batch.reqs, batch.extend_lens):
        for j in range(n):
            view = copy.copy(req)
            view.device_len = req.device_len + j
            views.append(view)
    return views


class LoadedModel(NamedTuple):
    """Engine._load_model's: the model, its checkpoint's KV cache scales, and whether
    `reload_weights` can write other weights into it (not where FP8 weights were dequantized
    as they loaded: a reload would need them FP8 again)."""

    model: CausalLM
    kv_scales: KVScales
    reloadable: bool


class Engine:
    def __init__(self, cfg: EngineConfig, groups: ProcessGroups,
                 on_progress: Callable[[str], None] = lambda text: None,
                 mixed_rows: int = 0, verify_tokens: int = 0,
                 verify_requests: Optional[int] = None, draft_path: Optional[str] = None,
                 draft_method: str = "draft_model") -> None:
        """`on_progress` hears each start-up step as it ends (weights loaded, KV pages sized,
        decode graphs captured), for a launcher to show. `mixed_rows`: the most decode rows a
        mixed step's prefill graph carries (the scheduler's, where it mixes; 0: none).
        `verify_tokens`: the most new tokens a verify step gives a request (the scheduler's,
        where it speculates; 0: none), for the verify graphs, which hold at most
        `verify_requests` requests (the scheduler's disable_by_batch_size; None: no limit).
        `draft_path`: the draft model that proposes a verify step's drafts (engine/draft.py), or
        with `draft_method` "eagle3" the EAGLE-3 head (engine/eagle.py); None: the scheduler's
        n-gram lookup proposes them, if anything does."""
        self.cfg = cfg
        start = time.perf_counter()
        self.device = cfg.torch_device
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.policy = kernel_policy(cfg, self.device)
        check_kv_cache_dtype(cfg, self.device)
        self.model_cfg = ModelConfig.from_dir(Path(cfg.model_path), cfg.hf_override_dict)
        if self.model_cfg.eagle is not None:
            raise ValueError(f"{cfg.model_path} is an EAGLE-3 draft head, not a model to serve: "
                             f"serve its target with speculative_config {{\"method\": "
                             f"\"eagle3\", \"model\": \"{cfg.model_path}\"}}")
        self.lora_slots = cfg.lora_slots  # 0: no LoRA (and no adapter scan per forward)
        self.model, kv_scales, self._reloadable = self._load_model(groups)
        self.max_context = cfg.context_length(self.model_cfg.max_context)
        # batch-invariant steps attend decode rows as extends, not as a prefill graph's
        # decode part (TritonBackend._invariant)
        self._mixed_rows = 0 if self.policy.batch_invariant else min(
            mixed_rows, cfg.max_running_requests)
        self._verify_tokens, self._verify_requests = verify_tokens, verify_requests
        draft = eagle = None
        if draft_path is not None:
            if cfg.enable_sleep_mode:
                raise ValueError("enable_sleep_mode with a draft model: the draft's weights "
                                 "and KV pool would stay awake (not supported)")
            if draft_method == "eagle3":
                eagle = load_eagle(draft_path, cfg, groups.comm, self.policy, self.model,
                                   self.max_context)
                self.model.model.keep_aux(eagle.aux_layers, self._graph_tokens)
            else:
                draft = load_draft(draft_path, cfg, groups.comm, self.policy, self.model_cfg,
                                   self.max_context)
        on_progress(f"weights loaded in {time.perf_counter() - start:.1f} s")
        local_kv_heads = self.model.model.local_heads.kv_heads
        drafter = draft or eagle
        self.num_pages = min_over_ranks(
            pages_that_fit(cfg, self.model_cfg, local_kv_heads, self.device,
                           drafter.page_bytes if drafter is not None else 0), groups.cpu_group)
        kv_dtype = cfg.kv_torch_dtype
        self.pool = KVPool(self.model_cfg.num_layers, self.num_pages, cfg.page_size,
                           local_kv_heads, self.model_cfg.head_dim, kv_dtype, self.device,
                           kv_scales if kv_dtype == FP8_KV_DTYPE else None)
        on_progress(f"KV pool sized: {self.num_pages} pages of {cfg.page_size} tokens "
                    f"({str(kv_dtype).removeprefix('torch.')})")
        # One spare row, so a row index never needs bounds checks in kernels.
        self.page_table = torch.zeros((cfg.max_running_requests + 1, self.max_context),
                                      dtype=torch.int32, device=self.device)
        # The newest sampled token of each row: decode inputs, readable before the host has it.
        self.last_tokens = torch.zeros(cfg.max_running_requests + 1, dtype=torch.int64,
                                       device=self.device)
        self.penalties = Penalties(cfg.max_running_requests + 1, self.model_cfg.vocab_size,
                                   self.device)
        self.bad_words = BadWords(cfg.max_running_requests + 1, self.device)
        self.pools = PromptPools(cfg.max_running_requests + 1, self.model_cfg.hidden_size,
                                 self.device)
        self.backend: AttentionBackend = attention_backend(cfg, self.policy, self.model,
                                                           self.pool, self.page_table)
        self.draft = (None if draft is None else DraftModel(
            draft, cfg, self.policy, self.num_pages, self.page_table, self.vocab_size))
        self.eagle = (None if eagle is None else EagleDraft(
            eagle, cfg, self.policy, self.num_pages, self.page_table, self.vocab_size))
        self.graphs: Optional[DecodeGraphs] = None
        self.prefill_graphs: Optional[PrefillGraphs] = None
        self.verify_graphs: Optional[VerifyGraphs] = None
        if cfg.tune_gemms:  # before the capture, which records the kernels chosen
            self._tune_gemms(graph_sizes(self._graph_bs))
        self._capture_graphs(on_progress)
        self._asleep: Dict[str, Part] = {}  # sleep mode: the parts asleep (sleep.TAGS)
        self._host_copy: Optional[torch.Tensor] = None  # the weights' (Part.sleep's buffer)
        self._weight_groups: Dict[str, WeightGroup] = {}  # trainers' groups joined, by name
        if self.device.type == "cuda":
            self._warm_up_eager()
            self._warm_up_sampler()
        logger.info("rank %d: engine ready: %d KV pages of %d tokens (%s), backend %s, pdl %s%s",
                    cfg.tp_info.rank, self.num_pages, cfg.page_size, kv_dtype, cfg.backend_name,
                    "on" if self.policy.pdl else "off",
                    ", batch-invariant kernels (deterministic inference)"
                    if self.policy.batch_invariant else "")

    @property
    def _graph_bs(self) -> int:
        return min(self.cfg.decode_graph_max_bs, self.cfg.max_running_requests)

    @property
    def _graph_tokens(self) -> int:
        """The most tokens a CUDA graph of this engine's runs (0: no graphs)."""
        cfg = self.cfg
        if self.device.type != "cuda":
            return 0
        decode = (graph_buffer_rows(self._graph_bs, self._verify_tokens, self._verify_requests)
                  if cfg.decode_graph_max_bs > 0 else 0)
        prefill = (cfg.prefill_graph_max_tokens + self._mixed_rows
                   if cfg.prefill_graph_max_tokens > 0 else 0)
        return max(decode, prefill)

    def _capture_graphs(self, on_progress: Callable[[str], None]) -> None:
        """Capture the decode and prefill CUDA graphs the config asks for (on CUDA), over the
        tensors as they are now (at start-up, and after a wake-up: new addresses)."""
        cfg = self.cfg
        if (self.device.type == "cuda" and cfg.decode_graph_max_bs > 0
                and hasattr(self.backend, "init_graph_buffers")):
            self.graphs = DecodeGraphs(
                self.model, self.backend,  # type: ignore[arg-type]
                self._graph_bs, self.page_table,
                pad_row=cfg.max_running_requests, scratch_slot=self.pool.scratch_slot,
                last_tokens=self.last_tokens, lora_slots=self.lora_slots, dtype=cfg.torch_dtype,
                buffer_rows=graph_buffer_rows(self._graph_bs, self._verify_tokens,
                                              self._verify_requests))
            if self.draft is not None:
                self.draft.capture_graphs(self._graph_bs, cfg.max_running_requests,
                                          self.pool.scratch_slot, cfg.torch_dtype)
            if self.eagle is not None:
                self.eagle.capture_graphs(
                    graph_buffer_rows(self._graph_bs, self._verify_tokens,
                                      self._verify_requests),
                    cfg.max_running_requests, self.pool.scratch_slot,
                    verify_graph_bs(self._graph_bs, self._verify_tokens, self._verify_requests),
                    self._verify_tokens - 1)
            on_progress(f"decode CUDA graphs captured for batch sizes up to {self._graph_bs}")
        if self.device.type == "cuda" and cfg.prefill_graph_max_tokens > 0:
            self.prefill_graphs = capture_prefill_graphs(
                self.model, self.backend, cfg.prefill_graph_max_tokens, self.page_table,
                self.pool.scratch_slot, self.last_tokens, self._mixed_rows)
        if self.device.type == "cuda" and cfg.decode_graph_max_bs > 0 and self._verify_tokens:
            self.verify_graphs = capture_verify_graphs(
                self.model, self.backend,
                verify_graph_bs(self._graph_bs, self._verify_tokens, self._verify_requests),
                self._verify_tokens, self.page_table, cfg.max_running_requests,
                self.pool.scratch_slot)

    @property
    def asleep(self) -> FrozenSet[str]:
        """The parts asleep (sleep.TAGS: "weights", "kv_cache"); empty while serving."""
        return frozenset(self._asleep)

    def sleep_level(self, tag: str) -> int:
        """The level part `tag` sleeps at (1: kept in host memory, 2: forgotten); 0: awake."""
        part = self._asleep.get(tag)
        return 0 if part is None else 1 if part.kept else 2

    @torch.inference_mode()
    def sleep(self, level: int, tags: Tuple[str, ...] = ()) -> int:
        """Hand back the device memory of the parts `tags` names (sleep.TAGS; empty: all) that
        are awake (sleep.py): level 1 keeps a host copy of the weights, level 2 forgets the
        checkpoint's (a reload fills them again); the KV cache is forgotten at either. The
        scheduler calls it with no request live and the prefix cache dropped (every rank at
        the same step). The CUDA graphs go too (captured again by the wake-up that leaves
        nothing asleep). The bytes freed. ValueError naming the level where it is not 1 or 2,
        or where level 2 would forget weights no reload can restore (FP8 dequantized as they
        loaded)."""
        level = check_level(level)
        awake = [t for t in check_tags(tags) if t not in self._asleep]
        if level == 2 and WEIGHTS in awake and not self._reloadable:
            raise ValueError("sleep level 2 would forget weights no reload can restore: this "
                             "model's FP8 weights were dequantized as they loaded (weight-only "
                             "FP8, the CPU's); use level 1")
        self.graphs = self.prefill_graphs = self.verify_graphs = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        freed = 0
        for tag in sorted(awake, key=TAGS.index, reverse=True):
            # the KV cache first: pinning the weights' host copies takes some device memory
            # (the driver maps them), which a full device does not have
            part = (weights_part(self.model, self.device) if tag == WEIGHTS
                    else tensors_part([self.pool.k, self.pool.v]))
            freed += part.sleep(keep_checkpoint=level == 1, pin=self.device.type == "cuda",
                                buffer=self._host_copy if tag == WEIGHTS else None)
            if tag == WEIGHTS:  # kept for the next level-1 sleep (pinning is the slow part)
                self._host_copy = part.buffer if level == 1 else None
            self._asleep[tag] = part
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        if self.device.type == "cuda":
            logger.debug("rank %d: asleep: %.2f GiB still allocated on %s (host copy %.2f GiB)",
                        self.cfg.tp_info.rank, torch.cuda.memory_allocated(self.device) / 2**30,
                        self.device, 0 if self._host_copy is None
                        else self._host_copy.numel() / 2**30)
        return freed

    @torch.inference_mode()
    def wake_up(self, tags: Tuple[str, ...] = ()) -> None:
        """Take the memory of the parts `tags` names (sleep.TAGS; empty: all) again, the
        weights restored (zeroed where level 2 forgot them), the KV cache zeroed; once nothing
        is asleep, the CUDA graphs are captured again. ValueError naming an unknown tag; an
        error on the way (the device out of memory: another process took it meanwhile) leaves
        the engine asleep as this call found it."""
        woken: List[Tuple[str, Part]] = []
        try:
            for tag in check_tags(tags):
                part = self._asleep.get(tag)
                if part is not None:
                    part.wake()  # raises with the part still asleep
                    woken.append((tag, self._asleep.pop(tag)))
            if not self._asleep:
                self._capture_graphs(lambda text: None)
        except Exception:
            self.graphs = self.prefill_graphs = self.verify_graphs = None
            for tag, part in woken:
                part.sleep(part.kept, pin=self.device.type == "cuda", buffer=part.buffer)
                self._asleep[tag] = part
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            raise

    def _warm_up_eager(self) -> None:
        """Run each eager step shape of warmup.py once (junk tokens, the spare row, the scratch
        slot), so that Triton compiles its kernel variants now and not inside a first request;
        every rank runs the same batches in the same order."""
        start = time.perf_counter()
        graph_tokens = self.prefill_graphs.max_tokens if self.prefill_graphs else 0
        shapes = warmup_shapes(graph_tokens, self.max_context)
        for batch in warmup_batches(shapes, self.cfg.max_running_requests,
                                    self.pool.scratch_slot, self.device):
            self.forward(batch)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        logger.info("rank %d: eager steps warmed up (%d shapes) in %.2f s",
                    self.cfg.tp_info.rank, len(shapes), time.perf_counter() - start)

    @torch.inference_mode()
    def _warm_up_sampler(self) -> None:
        """Run the greedy sampler's Triton argmax once for each logits dtype it sees (the
        model's; float32 after a logit bias or an early-stop mask), so that its kernels
        compile at start: the CUDA graphs hold only the forward pass, and on a machine with an
        empty Triton cache the first greedy request would compile them on its way to its first
        token."""
        for dtype in dict.fromkeys((self.cfg.torch_dtype, torch.float32)):
            greedy(torch.zeros((1, self.model_cfg.vocab_size), dtype=dtype, device=self.device),
                   self.policy)
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def _tune_gemms(self, rows: List[int]) -> None:
        """Choose cuBLAS or cuBLASLt for each projection at each decode batch size (blas.tune)."""
        start = time.perf_counter()
        tuned = blas.tune(blas.tunable_layers(self.model), rows, blas.cuda_timer())
        logger.info("rank %d: GEMM tuning: %d weight shapes x %d batch sizes in %.1f s; "
                    "cuBLASLt chosen for: %s", self.cfg.tp_info.rank, tuned.shapes, len(rows),
                    time.perf_counter() - start, blas.describe(self.model))

    def _load_model(self, groups: ProcessGroups) -> LoadedModel:
        """The model with its weights, the KV cache scales its checkpoint gives (1.0 for the
        layers it gives none; for dummy weights, all) and whether a reload can write other
        weights into it."""
        cls = model_class(self.model_cfg.architecture)
        self.model_cfg.check_quantization(self.cfg.quantization)
        quant = quant_plan(self.model_cfg.quantization, self.cfg.quantization, self.device,
                           self.cfg.torch_dtype)
        check_batch_invariant(self.cfg, self.model_cfg,
                              quant is not None or self.model_cfg.int_quant is not None)
        dtype = temporarily(torch.get_default_dtype, torch.set_default_dtype, self.cfg.torch_dtype)
        adapters = [read_adapter(name, path, self.cfg.max_lora_rank)
                    for name, path in self.cfg.lora_adapters]
        lora = LoraShape(self.lora_slots, self.cfg.max_lora_rank) if self.lora_slots else None
        with torch.device(self.device), dtype:
            model = cls(self.model_cfg, self.cfg.tp_info, groups.comm, self.policy, quant, lora,
                        self._int_plan(), self.cfg.enable_expert_parallel)
        scales = KVScaleCollector(self.model_cfg.num_layers)
        self._fill_weights(model, scales, None if self.cfg.load_format == "dummy"
                           else self.cfg.model_path, self.cfg.show_progress)
        load_adapters(model, adapters)
        if self.cfg.kv_torch_dtype == FP8_KV_DTYPE and scales.found == 0:
            logger.warning("rank %d: the checkpoint gives no KV cache scales: the FP8 KV cache "
                           "uses 1.0 for every layer (K/V beyond +-448 saturate)",
                           self.cfg.tp_info.rank)
        return LoadedModel(model.eval(), scales.scales(),
                           quant is None or not quant.runtime.weight_only)

    def _fill_weights(self, model: CausalLM, scales: KVScaleCollector, path: Optional[str],
                      show: bool = False) -> None:
        """`model`'s weights from checkpoint directory `path` (its KV cache scales into
        `scales`), or random ones (`path` None: dummy weights, this engine's seed)."""
        fill_weights(model, self.model_cfg, path, self.cfg.seed, scales,
                     show and self.cfg.tp_info.is_primary)

    @torch.no_grad()
    def reload_weights(self, path: Optional[str]) -> None:
        """The weights of checkpoint directory `path` in place of the served ones (None: the
        start-up dummy weights again), written into the same tensors, so CUDA graphs and LoRA
        adapters stay as they are; its KV cache scales are read but not taken (the pool keeps
        its own: a warning names those that differ).
        WeightsRefused, before any weight changes, where `path` is not a checkpoint of the
        served model (its config.json unreadable, or other: ModelConfig.reload_error) or the
        served weights were changed at load in a way a reload cannot repeat (FP8 dequantized on
        the CPU); any error after that leaves the weights mixed, for the caller to restore."""
        if not self._reloadable:
            raise WeightsRefused("weights cannot be reloaded here: this model's FP8 weights "
                                 "were dequantized as they loaded (weight-only FP8, the CPU's)")
        if path is not None:
            try:
                error = self.model_cfg.reload_error(
                    ModelConfig.from_dir(Path(path), self.cfg.hf_override_dict))
            except (OSError, ValueError) as e:
                raise WeightsRefused(f"{path}: {e}") from None
            if error is not None:
                raise WeightsRefused(f"{path}: {error}")
        scales = KVScaleCollector(self.model_cfg.num_layers)
        self._fill_weights(self.model, scales, path)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # a load's error surfaces here, not later
        changed = (self.pool.scales.differences(scales.scales())
                   if path is not None and self.pool.dtype == FP8_KV_DTYPE else [])
        if changed:
            logger.warning("rank %d: %s gives other KV cache scales than the FP8 KV cache "
                           "uses (%s%s): the cache keeps its own (its pages and CUDA graphs "
                           "hold them); restart the service to take the checkpoint's",
                           self.cfg.tp_info.rank, path, ", ".join(changed[:4]),
                           f", {len(changed) - 4} more" if len(changed) > 4 else "")

    def join_weight_group(self, spec: GroupSpec, rank: int) -> None:
        """Join a trainer's group as `rank` (distributed/weight_group.py; blocks until every
        member has joined). ValueError naming a group of that name already joined; the
        store's or backend's error where joining fails."""
        if spec.group_name in self._weight_groups:
            raise ValueError(f"weight update group {spec.group_name!r} is already joined")
        self._weight_groups[spec.group_name] = WeightGroup.join(spec, rank, self.device)
        logger.info("rank %d: joined weight update group %r as rank %d of %d (%s)",
                    self.cfg.tp_info.rank, spec.group_name, rank, spec.world_size, spec.backend)

    def leave_weight_group(self, name: str) -> None:
        """Forget group `name`; ValueError where none of that name was joined."""
        if self._weight_groups.pop(name, None) is None:
            raise ValueError(f"no weight update group {name!r}")

    @torch.no_grad()
    def weights_from_group(self, name: str, tensors: Sequence[Tuple[str, str, Tuple[int, ...]]]
                           ) -> None:
        """Receive (checkpoint name, dtype name, shape) `tensors`, in order, from the trainer
        of group `name`, and load each into the served weights (this rank's shard; the others
        stay), with no request live. Every tensor is received even where loading one fails
        (the trainer sends them all), then the error is raised: ValueError naming a tensor
        that is not a weight of this model or does not fit (the weights then mixed, for the
        caller to restore); WeightsRefused, before any weight changed, naming a group not
        joined or a model whose weights cannot change in part (CausalLM.partial_refusal)."""
        group = self._weight_groups.get(name)
        if group is None:
            raise WeightsRefused(f"no weight update group {name!r} (init_weights_update_group "
                                 f"first)")
        received = group.receive_all([(n, parse_dtype(d), tuple(shape))
                                      for n, d, shape in tensors])
        try:
            self.load_some_weights(received)
        finally:
            # The trainer sends every tensor whatever happens here: those a failed load left
            # unread are taken now, or the trainer would wait on them and the next update
            # would read them as its own.
            for _ in received:
                pass

    @torch.no_grad()
    def load_some_weights(self, named: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Load whole checkpoint tensors (name, tensor: on any device) into the served weights,
        this rank's shard of each; the others stay. ValueError naming a tensor that is not a
        weight of this model or does not fit (the weights then mixed, for the caller to
        restore); WeightsRefused, before any weight changed, for a model whose weights cannot
        change in part (CausalLM.partial_refusal)."""
        refusal = self.model.partial_refusal()
        if refusal is not None:
            raise WeightsRefused(f"weights cannot change in part: {refusal} (reload a whole "
                                 f"checkpoint with update_weights_from_disk)")
        self.model.load_weights(((n, TensorOf(t)) for n, t in named), complete=False)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def read_back(self, name: str, rows: int, max_values: int) -> List[Piece]:
        """This rank's pieces of the first `rows` rows of checkpoint tensor `name` as served
        (CausalLM.read_back); ValueError why not."""
        return self.model.read_back(name, rows, max_values)

    def _int_plan(self) -> Optional[IntPlan]:
        """The projections that keep an AWQ / GPTQ checkpoint's integers packed: on CUDA with
        the fused kernels (models/int_plan.py); None elsewhere (dequantized as they load)."""
        quant = self.model_cfg.int_quant
        if quant is None or not self.policy.fused:
            return None
        dummy = self.cfg.load_format == "dummy"
        plan = int_plan(quant, None if dummy else Path(self.cfg.model_path))
        logger.info("rank %d: %s weights: %s projections kept packed (the rest dequantized)",
                    self.cfg.tp_info.rank, quant.describe(),
                    "all" if plan.packed is None else len(plan.packed))
        return plan

    def load_adapter(self, slot: int, name: str, path: str) -> None:
        """LoRA adapter `name` from PEFT directory `path` into `slot` (the scheduler's
        choice, alike on every rank; no launched batch uses the slot). ValueError or the
        files' own error why not; the slot is then left empty."""
        adapter = read_adapter(name, path, self.cfg.max_lora_rank)
        with torch.no_grad():
            load_adapter(self.model, slot, adapter)

    def clear_adapter(self, slot: int) -> None:
        """Empty LoRA `slot` (a load that failed on another rank)."""
        with torch.no_grad():
            clear_slot(self.model, slot)

    @property
    def vocab_size(self) -> int:
        return self.model_cfg.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.model_cfg.hidden_size

    @property
    def long_rope_from(self) -> int:
        return self.model_cfg.long_rope_from

    @property
    def eos_token_ids(self) -> Tuple[int, ...]:
        return self.model_cfg.eos_token_ids

    def mixes(self, prefill: Batch, num_decode: int) -> bool:
        """Whether a step of `prefill` with `num_decode` running requests' decode rows riding
        along should run (StepEngine.mixes): where prefill graphs run, only a step that one of
        them replays (an eager mixed step loses the graph and costs more than the decode step
        it saves: RESULTS.md, sixteenth session); elsewhere always. Reads only the batch and
        the config, so ranks agree."""
        if self.prefill_graphs is None:
            return True
        return (self.prefill_graphs.can_run(prefill, joining=num_decode)
                and prompt_rows(prefill) is None)

    @torch.inference_mode()
    def launch(self, batch: Batch) -> Launched:
        """Start the batch on the device and return without waiting for it (on a GPU).

        The scheduler has written the batch's slots into `page_table`, set `batch.out_slots`, and
        not yet advanced the requests' lengths. Decode inputs come from `last_tokens` on the
        device, so a batch can be launched before the previous one's tokens reach the host.
        A `batch.masked` batch runs the forward only: `sample` finishes it with the bitmask.
        """
        sampled = [i for i, s in enumerate(batch.sample) if s]
        if self.draft is not None:
            self._draft(batch)
        elif self.eagle is not None and batch.phase is Phase.VERIFY:
            batch.drafts = self.eagle.propose(batch, self._adjusted)
        fwd = self._forward(batch, sampled)
        reqs = (verify_views(batch) if batch.phase is Phase.VERIFY
                else [batch.reqs[i] for i in sampled])
        if batch.masked and sampled:
            return Launched(batch, sampled, None, None,
                            pending=Pending(fwd, [copy.copy(r) for r in reqs]))
        return self._sample_launched(batch, sampled, fwd, reqs, None)

    def _draft(self, batch: Batch) -> None:
        """The draft model's part of a step, before the target's (engine/draft.py): a verify
        batch's drafts proposed into `batch.drafts`; any other batch's tokens shadowed (their
        decode inputs read from `last_tokens` before this step's sampling overwrites them)."""
        assert self.draft is not None
        if batch.phase is Phase.VERIFY:
            batch.drafts = self.draft.propose(batch, [r.token_ids[p] for r, p in
                                                      zip(batch.reqs, batch.prefix_lens)],
                                              self._adjusted)
            return
        rows = to_device([r.table_row for r in batch.reqs], torch.int64, self.device)
        self.draft.shadow(batch, self._prepare_inputs(batch, rows).ids, rows)

    @torch.inference_mode()
    def sample(self, launched: Launched, bitmask: torch.Tensor) -> Launched:
        """Sample a masked batch launched by `launch`, each sampled row i restricted to the
        tokens its bitmask row i allows (int32 [sampled rows, ceil(vocab / 32)] on the host,
        pinned on a GPU; xgrammar's layout). The mask goes to the device and is applied to the
        logits outside any CUDA graph."""
        if launched.pending is None:
            raise ValueError("sample() takes a masked batch launch() has not sampled")
        pending = launched.pending
        return self._sample_launched(launched.batch, launched.sampled, pending.forwarded,
                                     pending.reqs, bitmask)

    def _sample_launched(self, batch: Batch, sampled: List[int], fwd: Forwarded,
                         reqs: List[Req], bitmask: Optional[torch.Tensor]) -> Launched:
        """Sample `reqs` (batch.reqs[i] for i in sampled; a verify batch's `verify_views`,
        with its `draft_prefixes`) from the forward's logits and start the copies of the
        tokens (and log-probabilities) to the host."""
        tokens = logprobs = None
        if sampled:
            drafted = draft_prefixes(batch) if batch.phase is Phase.VERIFY else None
            tokens, logprobs = self._sample(fwd.logits, fwd.rows, reqs, bitmask, drafted)
        if self.eagle is not None:  # the head's step after the target's (engine/eagle.py)
            self.eagle.shadow(batch, self.model.model.aux_states(
                sum(batch.extend_lens), fwd.token_rows), sampled, tokens)
        if self.device.type != "cuda" or (tokens is None and fwd.prompt_logprobs is None
                                          and fwd.hidden is None):
            return Launched(batch, sampled, tokens, None, logprobs, fwd.prompt,
                            fwd.prompt_logprobs, embeddings=fwd.embeddings,
                            embed_rows=fwd.embed_rows, hidden=fwd.hidden,
                            hidden_spans=fwd.hidden_spans)
        pinned = lambda t: None if t is None else LogprobTensors(  # noqa: E731
            *(_to_pinned(x) for x in t))
        host = None if tokens is None else _to_pinned(tokens)
        embeddings = None if fwd.embeddings is None else _to_pinned(fwd.embeddings)
        hidden = None if fwd.hidden is None else _to_pinned(fwd.hidden)
        done = torch.cuda.Event()
        launched = Launched(batch, sampled, host, done, pinned(logprobs), fwd.prompt,
                            pinned(fwd.prompt_logprobs), embeddings=embeddings,
                            embed_rows=fwd.embed_rows, hidden=hidden,
                            hidden_spans=fwd.hidden_spans)
        done.record()  # after every copy above
        return launched

    def _forward(self, batch: Batch, sampled: List[int]) -> Forwarded:
        """The model on `batch`: a decode graph's replay where one fits (the LoRA family's
        where some request runs with an adapter), else eager (with the prompt log-probabilities
        of the requests collecting them). The prefill and verify graphs take no adapters."""
        lora = self.lora_slots > 0 and any(r.lora is not None for r in batch.reqs)
        batch.lora = None
        embed = () if batch.phase is not Phase.PREFILL else tuple(  # they end at prefill
            i for i in sampled if batch.reqs[i].params.embed)
        chunks = pooled_chunks(batch)
        states = tuple(i for i, r in enumerate(batch.reqs) if r.params.return_hidden_states)
        if not (embed or chunks or states) and self.graphs is not None and self.graphs.can_run(
                batch, lora):
            logits, rows = self.graphs.replay(batch, lora)  # decode: every request is sampled
            return Forwarded(logits, rows, None, None)
        if lora:
            batch.lora = lora_rows(batch, self.device, self.cfg.torch_dtype,
                                   self.lora_slots if self.policy.batch_invariant else 0)
        if lora or embed or chunks or states:
            return self._forward_eager(batch, sampled, embed, chunks, states)
        if (self.prefill_graphs is not None and self.prefill_graphs.can_run(batch)
                and prompt_rows(batch) is None):
            logits, rows = self.prefill_graphs.replay(batch)
            return Forwarded(logits, rows, None, None, token_rows=None if self.eagle is None
                             else self.prefill_graphs.token_rows(batch))
        if self.verify_graphs is not None and self.verify_graphs.can_run(batch):
            logits, rows = self.verify_graphs.replay(batch)
            return Forwarded(logits, rows, None, None, token_rows=None if self.eagle is None
                             else self.verify_graphs.token_rows(batch))
        return self._forward_eager(batch, sampled)

    def _forward_eager(self, batch: Batch, sampled: List[int], embed: Tuple[int, ...] = (),
                       chunks: Sequence[int] = (), states: Tuple[int, ...] = ()) -> Forwarded:
        """The model on `batch`, eager; with `embed` (batch indices of sampled requests that
        asked for embeddings), those requests' embeddings too (their last hidden states, or
        their `pools` for a whole-prompt pooling, through CausalLM.pooled: normalized, or a
        classifier's logits); `chunks` (pooled_chunks) pooled into `pools` first; `states`
        (batch indices of requests that asked for hidden states): the final hidden state of
        every position they run here."""
        ends = list(itertools.accumulate(batch.extend_lens))  # one past each request's last
        if batch.phase is Phase.VERIFY:  # every position of every request is sampled
            table_rows = [r.table_row for r, n in zip(batch.reqs, batch.extend_lens)
                          for _ in range(n)]
            positions_sampled = list(range(ends[-1]))
        else:
            table_rows = [batch.reqs[i].table_row for i in sampled]
            positions_sampled = [ends[i] - 1 for i in sampled]
        rows = to_device(table_rows, torch.int64, self.device)
        ids, positions = self._prepare_inputs(batch, rows)
        self.backend.prepare(batch)
        logit_rows = to_device(positions_sampled, torch.int64, self.device)
        prompt = prompt_rows(batch)
        if prompt is None and not embed and not chunks and not states:
            logits = self.model(ids, positions, batch, self.backend, logit_rows)
            return Forwarded(logits, rows, None, None)
        hidden = self.model.hidden(ids, positions, batch, self.backend)
        last = hidden[logit_rows]
        kept: Optional[torch.Tensor] = None
        spans: Tuple[Tuple[int, int], ...] = ()
        if states and self.cfg.tp_info.is_primary:  # the hidden state is whole on every rank
            spans = tuple((i, batch.extend_lens[i]) for i in states)
            kept = torch.cat([hidden[ends[i] - n:ends[i]] for i, n in spans]).float()
        embeddings = None
        if self.cfg.tp_info.is_primary:  # the hidden state is whole on every rank
            self.pools.add(batch, hidden, chunks)
        if embed and self.cfg.tp_info.is_primary:
            picked = to_device([sampled.index(i) for i in embed], torch.int64, self.device)
            normalize = to_device([batch.reqs[i].params.normalize for i in embed], torch.bool,
                                  self.device)
            embeddings = self.model.pooled(self._embedding_states(batch, last[picked], embed),
                                           normalize)
        plp = None if prompt is None else prompt_logprobs(self.model.lm_head, hidden, prompt,
                                                          self.cfg.tp_info.is_primary)
        return Forwarded(self.model.lm_head(last), rows, prompt, plp, embeddings, embed, kept,
                         spans)

    def _embedding_states(self, batch: Batch, last: torch.Tensor, embed: Tuple[int, ...]
                          ) -> torch.Tensor:
        """What CausalLM.pooled takes for the requests at batch indices `embed`: `last`, their
        last tokens' hidden states, with those pooling their whole prompt replaced by their
        pools (mean or first state, float32)."""
        whole = [k for k, i in enumerate(embed) if batch.reqs[i].pools_whole_prompt]
        if not whole:
            return last
        states = last.float()
        states[to_device(whole, torch.int64, self.device)] = self.pools.pooled(
            [batch.reqs[embed[k]] for k in whole])
        return states

    def _sample(self, logits: torch.Tensor, rows: torch.Tensor, reqs: List[Req],
                bitmask: Optional[torch.Tensor] = None,
                drafted: Optional[List[Tuple[int, ...]]] = None
                ) -> Tuple[torch.Tensor, Optional[LogprobTensors]]:
        """Tokens for `reqs` (row i of `logits`, page-table row rows[i]) after their penalties,
        logit bias, allowed tokens, min_tokens, bad words and grammar bitmask, recorded as the
        rows' newest tokens; and their log-probabilities (of the raw logits) where asked.
        `drafted` (a verify batch's, `draft_prefixes`): the draft tokens each row follows,
        output already to its penalties and bad words; its tokens are recorded by `keep`
        once the scheduler knows which it keeps."""
        mask = None if bitmask is None else bitmask.to(self.device, non_blocking=True)
        if all(r.params.raw_sampling for r in reqs):  # the common case: one pass to find out
            masked = logits if mask is None else apply_token_bitmask(logits, mask)
            tokens = sample_requests(masked, reqs, self.cfg.seed, self.policy)
            self.last_tokens[rows] = tokens
            return tokens, None
        adjusted = self._adjusted(logits, rows, reqs, drafted)
        if mask is not None:
            adjusted = apply_token_bitmask(adjusted, mask)
        tokens = sample_requests(adjusted, reqs, self.cfg.seed, self.policy)
        self.last_tokens[rows] = tokens
        if drafted is None:
            self.penalties.record(rows, tokens, reqs)
            self.bad_words.record(rows, tokens, reqs)
        return tokens, sampled_logprobs(logits, tokens, reqs, self.cfg.tp_info.is_primary)

    def _adjusted(self, logits: torch.Tensor, rows: torch.Tensor, reqs: List[Req],
                  drafted: Optional[Sequence[Tuple[int, ...]]] = None) -> torch.Tensor:
        """Row i of `logits` (request reqs[i], page-table row rows[i]) as sampling reads it:
        after its penalties, logit bias, allowed tokens, min_tokens and bad words (a grammar's
        mask comes after); `drafted` as for `_sample`. The draft model's drafts take it too."""
        adjusted = add_logit_bias(self.penalties.apply(logits, rows, reqs, drafted), reqs)
        adjusted = suppress_early_stops(mask_to_allowed_tokens(adjusted, reqs), reqs)
        return self.bad_words.apply(adjusted, rows, reqs, drafted)

    def start_request(self, req: Req) -> None:
        """The scheduler admitted `req` into page-table row `req.table_row` (before any batch
        of it launches): set up its per-row sampling state (the penalties' token counts)."""
        if req.params.has_penalties:
            self.penalties.start(req.table_row, req.token_ids[:req.prompt_len],
                                 req.token_ids[req.prompt_len:])
        if req.params.bad_word_ids:
            self.bad_words.start(req.table_row, req.token_ids[req.prompt_len:])

    @staticmethod
    def collect(launched: Launched) -> StepResult:
        """Wait for a launched batch: one token per request (-1 where `sample` is False), or a
        verify batch's token at every position, and the log-probabilities it computed (see
        StepResult; logprobs.py)."""
        batch = launched.batch
        if batch.phase is Phase.VERIFY:
            verified = _verified_tokens(launched)
            return StepResult([v[0] for v in verified], [None] * batch.size, {},
                              verified=verified, verified_logprobs=verified_entries(
                                  batch, launched.logprobs, launched.done),
                              hidden_states=_hidden_states(launched))
        return StepResult(
            _tokens(launched),
            sampled_entries(batch, launched.sampled, launched.logprobs, launched.done),
            prompt_entries(batch, launched.prompt, launched.prompt_logprobs, launched.done),
            _embeddings(launched), hidden_states=_hidden_states(launched))

    @torch.inference_mode()
    def keep(self, reqs: List[Req], kept: List[List[int]]) -> None:
        """After a verify batch: `kept[i]` are the tokens running request `reqs[i]` kept, in
        order. Its penalties and bad words count them, and the last is its row's newest token,
        the input of its next decode step (the sampling wrote a token per position, not
        knowing which would be kept)."""
        if not reqs:
            return
        dev = self.device
        self.last_tokens[to_device([r.table_row for r in reqs], torch.int64, dev)] = to_device(
            [k[-1] for k in kept], torch.int64, dev)
        each = [(r, t) for r, k in zip(reqs, kept) for t in k
                if r.params.has_penalties or r.params.bad_word_ids]
        if each:
            rows = to_device([r.table_row for r, _ in each], torch.int64, dev)
            tokens = to_device([t for _, t in each], torch.int64, dev)
            self.penalties.record(rows, tokens, [r for r, _ in each])
            self.bad_words.record(rows, tokens, [r for r, _ in each])

    def forward(self, batch: Batch) -> List[int]:
        """Launch and collect the tokens: the synchronous path."""
        return self.collect(self.launch(batch)).tokens

    def _prepare_inputs(self, batch: Batch, rows: torch.Tensor) -> DeviceInputs:
        """Input ids and rope indices (positions, but for longrope: layers/rotary.RopeIndex) on
        the device; `rows` are the page-table rows of the sampled requests, which for a decode
        batch are all of them, in order."""
        dev = self.device
        rope = self.model.rope_index  # the model takes rope indices (longrope's differ)
        host_positions: List[int] = []
        for req, prefix, ext in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            host_positions.extend(rope.host(prefix, ext, req.long_rope))
        positions = to_device(host_positions, torch.int64, dev)
        if batch.phase is Phase.DECODE:  # the newest token may still be on the device only
            return DeviceInputs(self.last_tokens[rows], positions)
        ids: List[int] = []
        first_decode = batch.first_decode
        for req, prefix, ext in zip(batch.reqs[:first_decode], batch.prefix_lens,
                                    batch.extend_lens):
            ids.extend(req.token_ids[prefix:prefix + ext])  # prompt tokens: known on the host
        if batch.drafts is not None:  # VERIFY: the newest token (on the host) and its drafts
            ids = [t for req, prefix, draft in zip(batch.reqs, batch.prefix_lens, batch.drafts)
                   for t in (req.token_ids[prefix], *draft)]
        input_ids = to_device(ids, torch.int64, dev)
        if batch.num_decode:  # a mixed step's decode rows, sampled last: as a decode batch's
            input_ids = torch.cat([input_ids, self.last_tokens[rows[-batch.num_decode:]]])
        return DeviceInputs(input_ids, positions)
