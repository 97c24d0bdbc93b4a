"""What the engine's model and its drafters (engine/draft.py, engine/eagle.py) are built with
alike: a drafter's model constructed on this rank, parameters filled from a checkpoint directory
or at random (dummy weights), and the attention backend over their KV pool."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Optional

import torch

from minisgl.attention import AttentionBackend, make_backend
from minisgl.core import Batch
from minisgl.distributed import Communicator
from minisgl.engine.config import EngineConfig
from minisgl.kernels.policy import KernelPolicy
from minisgl.kvcache import KVPool
from minisgl.models import CausalLM, ModelConfig, model_class
from minisgl.models.int_weights import dense_int_weights
from minisgl.models.kv_scales import KVScaleCollector
from minisgl.models.quantization import QuantPlan
from minisgl.models.weights import init_dummy, iter_checkpoint
from minisgl.utils import temporarily, to_device


def construct(model_cfg: ModelConfig, cfg: EngineConfig, comm: Communicator,
              policy: KernelPolicy, quant: Optional[QuantPlan], name: str) -> CausalLM:
    """A drafter's model of `model_cfg` on this rank, split over the ranks as the target is,
    its parameters uninitialized in cfg's dtype on cfg's device; a ValueError it raises (e.g.
    a tp its heads do not split by) names it (`name`)."""
    dtype = temporarily(torch.get_default_dtype, torch.set_default_dtype, cfg.torch_dtype)
    try:
        with torch.device(cfg.torch_device), dtype:
            return model_class(model_cfg.architecture)(model_cfg, cfg.tp_info, comm, policy,
                                                       quant)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def fill_weights(model: CausalLM, model_cfg: ModelConfig, path: Optional[str], seed: int,
                 scales: KVScaleCollector, show: bool = False) -> None:
    """`model`'s weights from checkpoint directory `path` (its KV cache scales into `scales`),
    or random ones (`path` None: dummy weights from `seed`).
    AWQ / GPTQ tensors become dense as they load (a plan that keeps some packed was given to
    the model's constructor); `show`: a progress bar."""
    if path is None:
        init_dummy(model, seed)
        return
    tensors = iter_checkpoint(Path(path), show)
    if model_cfg.int_quant is not None:
        tensors = dense_int_weights(tensors, model_cfg.int_quant)
    model.load_weights(scales.filter(tensors))


def attention_backend(cfg: EngineConfig, policy: KernelPolicy, model: CausalLM, pool: KVPool,
                      page_table: torch.Tensor) -> AttentionBackend:
    """cfg's attention backend for `model`'s layers over `pool`, slots from `page_table`."""
    kv_heads, heads = model.model.local_heads
    model_cfg = model.cfg
    return make_backend(
        cfg.backend_name, pool=pool, page_table=page_table, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=model_cfg.head_dim, scale=model_cfg.attention_scale,
        windows=model_cfg.layer_windows, softcap=model_cfg.attn_logit_softcapping or 0.0,
        **({"policy": policy} if cfg.backend_name == "triton"
           else {"batch_invariant": policy.batch_invariant}))


class DrafterKV(NamedTuple):
    """A drafter's own KV pool and the attention backend over it."""

    pool: KVPool
    backend: AttentionBackend


def drafter_kv(model: CausalLM, layers: int, cfg: EngineConfig, policy: KernelPolicy,
               num_pages: int, page_table: torch.Tensor) -> DrafterKV:
    """A drafter's pool of `layers` layers and `num_pages` pages (as many as the target's) in
    the model's dtype, and its backend on the target's `page_table` (the scheduler writes
    every slot both use)."""
    pool = KVPool(layers, num_pages, cfg.page_size, model.model.local_heads.kv_heads,
                  model.cfg.head_dim, cfg.torch_dtype, cfg.torch_device)
    return DrafterKV(pool, attention_backend(cfg, policy, model, pool, page_table))


def drafter_positions(model: CausalLM, batch: Batch, device: torch.device) -> torch.Tensor:
    """A drafter's rope indices for `batch`'s new tokens on `device` (positions: drafters
    refuse longrope, whose indices follow the target's requests)."""
    rope = model.rope_index
    return to_device([p for prefix, ext in zip(batch.prefix_lens, batch.extend_lens)
                      for p in rope.host(prefix, ext, False)], torch.int64, device)
