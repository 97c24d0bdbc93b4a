"""The decoder shared by every supported family (Llama, Mistral, Mixtral, Qwen2, Qwen3 and their
MoE variants, Phi-3, Gemma 3).

Families differ only in small traits (QKV bias, per-head q/k RMSNorm; Gemma's scaled embeddings,
1 + weight norms and sandwich norms), given by their model classes, in the MLP's activation
(ModelConfig.hidden_act), and in the shape of the layer after attention: the dense MLP, or for
the layers `ModelConfig.is_sparse` names the mixture of experts (layers/moe.py). Tensor
parallelism lives in the layers: attention heads, MLP columns and every expert's columns are
split over ranks, and the row-parallel projections (and the MoE layer) all-reduce. Every such
all-reduce (o_proj, down_proj, the experts') is followed by a residual add and an RMSNorm
(post_attention_layernorm, the next layer's input_layernorm, the final norm), so sublayers pass
each other a `ResidualStream`: the partial product, un-reduced, with the residual. Its consumer
does the all-reduce, the add and the norm in the fewest kernels it can: inside its own one-token
GEMV (batch 1), in one fused all-reduce + norm kernel where the communicator offers one, else as
two steps. Gemma's sandwich norms (`Traits.sandwich_norms`) norm each sublayer's output before
it joins the residual: that output is reduced on its own, normed, and passed on as a stream with
nothing left to reduce.

A batch where some tokens run with a LoRA adapter (`Batch.lora`; the model built with
`Traits.lora`) takes the plain path through each projection, the adapters' deltas added
(layers/lora.py): norms, products and rotary as separate steps, none of the fused kernels.
"""

from __future__ import annotations

import itertools
import math
from types import MappingProxyType
from typing import (Any, ClassVar, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Set,
                    Tuple, Union, cast)

import torch
from torch import nn

from minisgl.attention import AttentionBackend
from minisgl.core import Batch, LoraRows
from minisgl.distributed import Communicator, DistributedInfo
from minisgl.kernels.policy import KernelPolicy
from minisgl.kernels.types import GELU_TANH, SILU, HeadNorms
from minisgl.layers.activation import act_and_mul, act_and_mul_quantized
from minisgl.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minisgl.layers.experts import expert_param
from minisgl.layers.fp8 import (SCALE_PARAMS, Fp8Spec, finish_loading, fp8_layers,
                                start_loading)
from minisgl.layers.linear import (ColumnParallelLinear, QKVParallelLinear, ReplicatedLinear,
                                   ResidualStream, RowParallelLinear)
from minisgl.layers.lora import LoraShape
from minisgl.layers.moe import MoEQuant, MoEShape, RouterSpec, SparseMoE
from minisgl.layers.norm import RMSNorm
from minisgl.layers.readback import Piece, Readable, first_rows, not_readable
from minisgl.layers.packed import PackedSpec
from minisgl.layers.rotary import RopeIndex, RotaryEmbedding
from minisgl.layers.source import RowsOf, TensorSource, copy_into
from minisgl.layers.weight_format import WeightFormat
from minisgl.models.config import SILU_ACTS, ModelConfig
from minisgl.models.int_plan import IntPlan
from minisgl.models.quantization import QuantPlan
from minisgl.utils import to_device

class Traits(NamedTuple):
    """What differs between families, plus the kernels every layer launches (`policy`) and
    which projections are FP8 (`quant`; None: none)."""

    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    policy: KernelPolicy = KernelPolicy()
    quant: Optional[QuantPlan] = None
    # parts -> the one checkpoint layer holding them (CausalLM.checkpoint_fused, reversed)
    fused_names: Mapping[Tuple[str, ...], str] = MappingProxyType({})
    # our module names -> the checkpoint's (CausalLM.checkpoint_renames, reversed)
    checkpoint_names: Mapping[str, str] = MappingProxyType({})
    norm_offset: float = 0.0  # added to every RMSNorm's weight as it loads (Gemma: 1)
    embed_scale: Optional[float] = None  # the embeddings' factor (Gemma: sqrt(hidden_size))
    embed_scale_rounded: bool = True  # the factor rounded to the dtype first (Gemma; Granite not)
    sandwich_norms: bool = False  # Gemma: norms after attention and the MLP too (see above)
    lora: Optional[LoraShape] = None  # LoRA slots of every projection but the routed experts
    ints: Optional[IntPlan] = None  # the projections holding packed integers (GPU AWQ / GPTQ)
    expert_parallel: bool = False  # routed experts whole, 1/tp of them a rank (layers/moe.py)

    def norm(self, dim: int, eps: float) -> RMSNorm:
        """An RMSNorm of this family (its weight offset) launching this policy's kernels."""
        return RMSNorm(dim, eps, self.policy, self.norm_offset)

    def weight_format(self, prefix: str, *parts: str) -> WeightFormat:
        """How the projection fusing checkpoint layers `prefix`.`part` stores its weights, asked
        under the checkpoint's own layer name where it fuses them (its quantization config's
        ignore and target lists name that one)."""
        fused = self.fused_names.get(parts)
        names = (fused,) if fused is not None else parts
        return WeightFormat(None if self.quant is None else self.quant.spec_for(prefix, names),
                            None if self.ints is None else self.ints.spec_for(prefix, names))

    def moe_quant(self, prefix: str, num_experts: int) -> MoEQuant:
        """How MoE layer `prefix`'s parts store their weights, asked under the checkpoint's
        names (Mixtral's block_sparse_moe.experts.N.w1): the routed experts have one FP8
        format, that of expert 0's projections (ValueError where its gate/up and down
        differ), and are packed where every expert's projections are."""
        ours = f"{prefix}.experts.0".split(".")
        theirs = ".".join(self.checkpoint_names.get(p, p) for p in ours)
        gate, up, down = (self.checkpoint_names.get(p, p)
                          for p in ("gate_proj", "up_proj", "down_proj"))
        fp8: Optional[Fp8Spec] = None
        if self.quant is not None:
            fp8 = self.quant.spec_for(theirs, (gate, up))
            if fp8 != self.quant.spec_for(theirs, (down,)):
                raise ValueError(f"{theirs}: the checkpoint quantizes the experts' {gate}/{up} "
                                 f"and {down} differently; FP8 experts take one format")
        packed: Optional[PackedSpec] = None
        if self.ints is not None:
            packed = self.ints.spec_for(theirs.rpartition(".")[0],
                                        [f"{e}.{p}" for e in range(num_experts)
                                         for p in (gate, up, down)])
        shared = f"{prefix}.shared_expert"
        return MoEQuant(WeightFormat(fp8, packed),
                        self.weight_format(shared, "gate_proj", "up_proj"),
                        self.weight_format(shared, "down_proj"))


# checkpoint module name -> (our fused module, shard index)
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
# A multimodal checkpoint's language model, under the prefixes published checkpoints use
# (transformers 4's, which transformers saves still) and transformers 5's own; its vision tower
# and projector are not served (CausalLM.checkpoint_prefixes)
MULTIMODAL_TEXT_PREFIXES: Mapping[str, Optional[str]] = MappingProxyType({
    "language_model.model.": "model.", "model.language_model.": "model.",
    "language_model.lm_head.": "lm_head.", "vision_tower.": None,
    "model.vision_tower.": None, "multi_modal_projector.": None,
    "model.multi_modal_projector.": None})
# the decoder's tensors as a checkpoint of the bare decoder (no `model.` prefix) names them
_DECODER_TENSORS = ("layers.", "embed_tokens.", "norm.")
# checkpoint parameter name -> ours: Hugging Face's block scales multiply the weight, as
# compressed-tensors' weight_scale does (the inverse of the quantization's divisor)
_PARAM_RENAMES = {"weight_scale_inv": "weight_scale"}


class AttentionInput(NamedTuple):
    """q [T, heads, d], k and v [T, kv_heads, d] (q and k rotated), the new residual, and
    whether K/V are already in the cache (`kv_stored` of the backend's forward)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    residual: torch.Tensor
    stored: bool


class Attention(nn.Module):
    """Self-attention; `forward` takes the stream before the layer's input norm and returns the
    stream after o_proj (its partial product, not yet all-reduced)."""

    def __init__(self, cfg: ModelConfig, layer: int, traits: "Traits",
                 rotary: Optional[RotaryEmbedding], info: DistributedInfo,
                 comm: Communicator, in_features: int = 0) -> None:
        """`rotary`: None for a layer that rotates nothing (SmolLM3's NoPE layers);
        `in_features`: what q, k and v project from (0: the hidden size; an EAGLE-3 layer's
        is twice that)."""
        super().__init__()
        self.layer = layer
        prefix = f"model.layers.{layer}.self_attn"
        self.qkv_proj = QKVParallelLinear(in_features or cfg.hidden_size, cfg.head_dim,
                                          cfg.num_heads,
                                          cfg.num_kv_heads, traits.qkv_bias, info,
                                          traits.policy,
                                          traits.weight_format(prefix, "q_proj", "k_proj",
                                                               "v_proj"),
                                          traits.lora)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size,
                                        traits.o_bias, info, comm, traits.policy,
                                        traits.weight_format(prefix, "o_proj"), traits.lora)
        self.q_norm = traits.norm(cfg.head_dim, cfg.rms_norm_eps) if traits.qk_norm else None
        self.k_norm = traits.norm(cfg.head_dim, cfg.rms_norm_eps) if traits.qk_norm else None
        self.rotary = rotary
        self.head_dim = cfg.head_dim

    def forward(self, stream: ResidualStream, norm: RMSNorm, positions: torch.Tensor,
                batch: Batch, backend: AttentionBackend) -> ResidualStream:
        qkv = (self._qkv(stream, norm, positions, batch, backend) if batch.lora is None
               else self._qkv_lora(stream, norm, positions, batch.lora))
        out = backend.forward(qkv.q, qkv.k, qkv.v, self.layer, batch, kv_stored=qkv.stored)
        return self.o_proj.forward_stream(out, qkv.residual, batch.lora)

    def forward_input(self, x: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor,
                      batch: Batch, backend: AttentionBackend) -> ResidualStream:
        """Attention on an input `x` its caller normed (an EAGLE-3 layer's two normed halves),
        in torch ops and the backend's attention (which stores K/V); the stream after o_proj
        over `residual`."""
        qkv = self._rotated(self.qkv_proj(x), residual, positions)
        out = backend.forward(qkv.q, qkv.k, qkv.v, self.layer, batch, kv_stored=False)
        return self.o_proj.forward_stream(out, residual)

    def _qkv_lora(self, stream: ResidualStream, norm: RMSNorm, positions: torch.Tensor,
                  rows: LoraRows) -> AttentionInput:
        """`_qkv` step by step, the LoRA deltas of `rows` added to the projection; attention
        stores K/V."""
        x, residual = stream.normed(norm)
        return self._rotated(self.qkv_proj.forward_lora(x, rows), residual, positions)

    def _qkv(self, stream: ResidualStream, norm: RMSNorm, positions: torch.Tensor, batch: Batch,
             backend: AttentionBackend) -> AttentionInput:
        """norm, QKV projection, q/k norms, rotary, and the K/V store where a kernel before
        attention can do it: all in the QKV GEMV at batch 1 without q/k norms, else the rotary
        kernel stores K/V (backends with a KV target; it also applies the scales of an FP8
        product taken unscaled, and the q/k norms), else attention does. Where K/V are stored,
        the returned k and v are not read again (and may be unscaled)."""
        rotary = self.rotary  # None: nothing rotates, attention stores K/V
        target = backend.kv_target(self.layer, batch) if rotary is not None else None
        if target is not None and rotary is not None and self.q_norm is None:  # no q/k norms
            fused = self.qkv_proj.forward_normed_rotary(stream, norm, rotary, positions, target)
            if fused is not None:
                return AttentionInput(*self._heads(fused.out), fused.residual, stored=True)
        proj = self.qkv_proj.forward_normed_unscaled(stream, norm)
        if target is not None and rotary is not None:
            q, k, v = self._heads(proj.out)
            if rotary.rotate_into_cache(positions, q, k, v, target, proj.scales,
                                        self._head_norms()):
                return AttentionInput(q, k, v, proj.residual, stored=True)
        return self._rotated(proj.scaled(), proj.residual, positions)

    def _rotated(self, qkv: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor
                 ) -> AttentionInput:
        """The projection's heads with their q/k norms and rotary applied in torch ops (or
        the rotary kernel); attention stores K/V."""
        q, k, v = self._heads(qkv)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        return AttentionInput(q, k, v, residual, stored=False)

    def _head_norms(self) -> Optional[HeadNorms]:
        if self.q_norm is None or self.k_norm is None:
            return None
        return HeadNorms(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)

    def _heads(self, qkv: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = (t.view(t.shape[0], -1, self.head_dim)
                   for t in qkv.split(self.qkv_proj.split_sizes, dim=-1))
        return q, k, v


class MLP(nn.Module):
    """Gated MLP (SiLU, or GELU with the tanh approximation: ModelConfig.hidden_act);
    `forward` takes the stream before its norm and returns the stream after down_proj (its
    partial product, not yet all-reduced)."""

    def __init__(self, cfg: ModelConfig, info: DistributedInfo, comm: Communicator,
                 traits: "Traits", prefix: str) -> None:
        """`prefix`: the checkpoint's name of this MLP (model.layers.N.mlp)."""
        super().__init__()
        self.policy = traits.policy
        self.act = SILU if cfg.hidden_act in SILU_ACTS else GELU_TANH  # config.HIDDEN_ACTS
        inter = cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [inter, inter], cfg.mlp_bias,
                                                 info, traits.policy,
                                                 traits.weight_format(prefix, "gate_proj",
                                                                      "up_proj"),
                                                 lora=traits.lora)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, cfg.mlp_bias, info, comm,
                                           traits.policy,
                                           traits.weight_format(prefix, "down_proj"),
                                           traits.lora)

    def forward(self, stream: ResidualStream, norm: RMSNorm,
                lora: Optional[LoraRows] = None) -> ResidualStream:
        """W8A8 (FP8 gate/up and down scaled per row, dynamic activations) with no launch of
        its own besides the GEMMs: the norm quantizes gate/up's input, the activation kernel
        applies gate/up's scales where its product is taken unscaled and quantizes down's
        input, and down's scales go to the next norm (RowParallelLinear's streams). `lora`:
        the plain path with the LoRA deltas of these tokens."""
        if lora is not None:
            x, residual = stream.normed(norm)
            gated = act_and_mul(self.gate_up_proj.forward_lora(x, lora), self.act, self.policy)
            return self.down_proj.forward_stream(gated, residual, lora)
        fused = self.gate_up_proj.forward_normed_act(stream, norm, self.act)  # batch 1
        if fused is not None:
            return self.down_proj.forward_stream(fused.out, fused.residual)
        proj = self.gate_up_proj.forward_normed_unscaled(stream, norm)
        if self.down_proj.takes_quantized(proj.out):
            act = act_and_mul_quantized(proj.out, self.act, self.policy, proj.scales)
            return self.down_proj.forward_quantized_stream(act, proj.residual.dtype,
                                                           proj.residual)
        return self.down_proj.forward_stream(act_and_mul(proj.scaled(), self.act, self.policy),
                                             proj.residual)


def moe_shape(cfg: ModelConfig) -> MoEShape:
    """The shape of the config's MoE layers."""
    return MoEShape(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                    cfg.moe_intermediate_size, cfg.norm_topk_prob,
                    cfg.shared_expert_intermediate_size, cfg.shared_expert_gated,
                    RouterSpec(cfg.moe_scoring, cfg.moe_groups, cfg.moe_topk_groups,
                               cfg.routed_scaling_factor))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, traits: "Traits",
                 rotary: Optional[RotaryEmbedding], info: DistributedInfo,
                 comm: Communicator) -> None:
        super().__init__()
        norm = lambda: traits.norm(cfg.hidden_size, cfg.rms_norm_eps)  # noqa: E731
        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, layer, traits, rotary, info, comm)
        # Gemma's norm of the attention's output (its sandwich); the MLP's input norm otherwise
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm() if traits.sandwich_norms else None
        self.post_feedforward_layernorm = norm() if traits.sandwich_norms else None
        self.mlp: Union[MLP, SparseMoE] = (
            SparseMoE(moe_shape(cfg), info, comm, traits.policy,
                      traits.moe_quant(f"model.layers.{layer}.mlp", cfg.num_experts),
                      traits.lora, traits.expert_parallel)
            if cfg.is_sparse(layer)
            else MLP(cfg, info, comm, traits, f"model.layers.{layer}.mlp"))

    def forward(self, stream: ResidualStream, positions: torch.Tensor, batch: Batch,
                backend: AttentionBackend, keep: Tuple[torch.Tensor, ...] = ()
                ) -> ResidualStream:
        """The stream after the previous layer (or the embeddings) -> the stream after this
        one; each sublayer applies its own norm to the stream it takes. `keep` ([T, hidden]
        each): the layer's input hidden state is copied there (an EAGLE-3 head reads it:
        DecoderModel.keep_aux)."""
        stream = self.self_attn(stream, self.input_layernorm, positions, batch, backend)
        for out in keep:  # the input norm's residual out: the layer's input, reduced
            out.copy_(cast(torch.Tensor, stream.residual))
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            return self._mlp(stream, self.post_attention_layernorm, batch)
        stream = _normed_output(stream, self.post_attention_layernorm)
        stream = self._mlp(stream, self.pre_feedforward_layernorm, batch)
        return _normed_output(stream, self.post_feedforward_layernorm)

    def _mlp(self, stream: ResidualStream, norm: RMSNorm, batch: Batch) -> ResidualStream:
        """The layer's MLP or experts on the stream, with the batch's LoRA adapters (the
        experts': in their shared expert)."""
        return self.mlp(stream, norm, batch.lora)


def _normed_output(stream: ResidualStream, norm: RMSNorm) -> ResidualStream:
    """A sandwich norm: the sublayer's output (reduced here) normed before it joins the
    residual, which the next norm adds."""
    return ResidualStream(cast(torch.Tensor, norm(stream.reduced())), stream.residual, None)


def _check_has_tensor(name: str, module_name: str, module: nn.Module, param: str) -> None:
    """ValueError unless `param` is one of `module`'s own parameters or buffers: a layer's
    `load` takes the name as given (an RMSNorm would load a `bias` tensor into its weight)."""
    own = ({n for n, _ in module.named_parameters(recurse=False)}
           | {n for n, _ in module.named_buffers(recurse=False)})
    if getattr(module, "packed", None) is not None:  # checkpoint weights fill packed buffers
        own.update(getattr(module, "checkpoint_params", ()))
    if param not in own:
        hint = (" (the config gives it none: attention_bias / mlp_bias)"
                if param == "bias" and hasattr(module, "bias") else "")
        raise ValueError(f"checkpoint tensor {name} has no place in this model: "
                         f"{module_name} ({type(module).__name__}) has no {param!r}{hint}; "
                         f"it has {sorted(own)}")


class LocalHeads(NamedTuple):
    """The attention heads one rank holds (KV heads replicated where tp exceeds them)."""

    kv_heads: int
    heads: int


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, traits: "Traits", info: DistributedInfo,
                 comm: Communicator) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, info, comm)
        self.embed_scale = traits.embed_scale
        self.embed_scale_rounded = traits.embed_scale_rounded
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_context, cfg.rope_theta, cfg.rope_scaling,
                                 traits.policy, cfg.max_position_embeddings, cfg.rotary_dims,
                                 cfg.rotary_interleaved)
        local = rotary  # the sliding-window layers' (Gemma 3: their own theta, unscaled)
        if cfg.local_rope_theta is not None:
            local = RotaryEmbedding(cfg.head_dim, cfg.max_context, cfg.local_rope_theta, None,
                                    traits.policy, cfg.max_position_embeddings, cfg.rotary_dims)
        self.rope_index = rotary.index
        windows = cfg.layer_windows or (0,) * cfg.num_layers
        turns = cfg.rope_layers or (True,) * cfg.num_layers  # SmolLM3's NoPE layers: False
        layers = [DecoderLayer(cfg, i, traits, (local if windows[i] else rotary)
                               if turns[i] else None, info, comm)
                  for i in range(cfg.num_layers)]
        qkv = layers[0].self_attn.qkv_proj
        self.local_heads = LocalHeads(qkv.num_local_kv_heads, qkv.num_local_heads)
        self.layers = nn.ModuleList(layers)
        self.norm = traits.norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.aux_layers: Tuple[int, ...] = ()  # keep_aux's
        self._no_aux: Tuple[Tuple[torch.Tensor, ...], ...] = ((),) * len(layers)
        self._aux = torch.empty(0, 0)
        self._aux_beyond = torch.empty(0, 0)

    def keep_aux(self, layers: Tuple[int, ...], rows: int) -> None:
        """From now on every forward keeps the input hidden states of `layers` (an EAGLE-3
        head's features: engine/eagle.py), read by `aux_states`. Forwards of up to `rows`
        tokens write them into one buffer allocated here, so CUDA graphs captured after this
        call write them too; longer (eager) forwards into a tensor of their own. A layer may
        be named twice (a small target's default layers): its state is then kept twice."""
        hidden = self.norm.weight.shape[0]
        self.aux_layers = layers
        self._aux = torch.empty(rows, len(layers) * hidden, dtype=self.norm.weight.dtype,
                                device=self.norm.weight.device)

    def aux_states(self, tokens: int, rows: Optional[List[int]] = None) -> torch.Tensor:
        """[tokens, len(aux_layers) * hidden]: the kept hidden states of the last forward's
        `tokens` tokens, layer after layer: its rows 0 .. tokens - 1, or `rows` (a CUDA graph's
        replay that lays them out otherwise, in the buffer)."""
        if rows is not None:
            return self._aux[to_device(rows, torch.int64, self._aux.device)]
        return self._aux[:tokens] if tokens <= self._aux.shape[0] else self._aux_beyond

    def _aux_out(self, tokens: int) -> Sequence[Tuple[torch.Tensor, ...]]:
        """Per layer, where its input hidden state goes this forward (nowhere: ())."""
        if not self.aux_layers:
            return self._no_aux
        if tokens > self._aux.shape[0]:
            self._aux_beyond = self._aux.new_empty(tokens, self._aux.shape[1])
        chunks = self.aux_states(tokens).chunk(len(self.aux_layers), dim=1)
        return [tuple(c for c, at in zip(chunks, self.aux_layers) if at == i)
                for i in range(len(self.layers))]

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, batch: Batch,
                backend: AttentionBackend) -> torch.Tensor:
        h = self.embed_tokens(ids)
        if self.embed_scale is not None:  # Gemma's rounded to the model's dtype, as in HF
            scale = self.embed_scale
            h = h * (torch.tensor(scale, dtype=h.dtype).item() if self.embed_scale_rounded
                     else scale)
        stream = ResidualStream(h, None, None)
        for layer, keep in zip(self.layers, self._aux_out(ids.shape[0])):
            stream = layer(stream, positions, batch, backend, keep)
        return stream.normed(self.norm)[0]


class CausalLM(nn.Module):
    """Base of every model class: the decoder plus the LM head, and checkpoint loading.

    Subclasses override `traits` with their family's differences, `checkpoint_renames`
    where their checkpoints name modules differently (each component of a tensor's name found
    there is replaced before the name is matched to a parameter), `checkpoint_prefixes` where
    the decoder's tensors sit under another prefix (a multimodal checkpoint's language model:
    the first prefix a name starts with is replaced; None skips the tensor, e.g. a vision
    tower not served), and `checkpoint_fused` where a checkpoint tensor fuses projections
    along its rows (each part then loads as the checkpoint tensor of that name would:
    `_unfused`).
    """

    checkpoint_renames: ClassVar[Mapping[str, str]] = MappingProxyType({})
    checkpoint_prefixes: ClassVar[Mapping[str, Optional[str]]] = MappingProxyType({})
    checkpoint_fused: ClassVar[Mapping[str, Tuple[str, ...]]] = MappingProxyType({})

    @classmethod
    def traits(cls, cfg: ModelConfig) -> "Traits":
        return Traits(qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm=False)

    def __init__(self, cfg: ModelConfig, info: DistributedInfo, comm: Communicator,
                 policy: KernelPolicy = KernelPolicy(), quant: Optional[QuantPlan] = None,
                 lora: Optional[LoraShape] = None, ints: Optional[IntPlan] = None,
                 expert_parallel: bool = False) -> None:
        """`policy`: the kernels every layer launches; `quant`: the FP8 projections; `lora`:
        LoRA adapter slots in every dense projection, whatever its weights hold (16-bit, FP8
        or packed integers: the delta is added to the product), and in a MoE layer's shared
        expert (see Traits); `ints`: the projections holding packed integers;
        `expert_parallel`: the routed experts split over ranks whole (layers/moe.py)."""
        super().__init__()
        self.cfg = cfg
        fused_names = {parts: name for name, parts in self.checkpoint_fused.items()}
        traits = self.traits(cfg)._replace(
            policy=policy, quant=quant, fused_names=fused_names, lora=lora, ints=ints,
            expert_parallel=expert_parallel,
            checkpoint_names={ours: theirs for theirs, ours in self.checkpoint_renames.items()})
        self.model = self._decoder(cfg, traits, info, comm)
        tied = self.model.embed_tokens if self._lm_head_tied else None
        self.lm_head = ParallelLMHead(cfg.lm_head_rows, cfg.hidden_size, info, comm, tied_to=tied,
                                      policy=policy, softcap=cfg.final_logit_softcapping,
                                      divisor=cfg.logits_scaling)
        # a sequence classifier's head (models/classifier.py), on every rank
        self.score = (None if cfg.classifier is None else
                      ReplicatedLinear(cfg.hidden_size, cfg.classifier.num_labels, False,
                                       policy))

    @classmethod
    def _decoder(cls, cfg: ModelConfig, traits: "Traits", info: DistributedInfo,
                 comm: Communicator) -> Any:
        """The decoder under the LM head: a DecoderModel (an EAGLE-3 head's: its one layer)."""
        return DecoderModel(cfg, traits, info, comm)

    @property
    def _lm_head_tied(self) -> bool:
        """The LM head is the embeddings' matrix: tied by the config, or a classifier's whose
        checkpoint has no LM head (its logits only pick a token no one reads)."""
        c = self.cfg.classifier
        return self.cfg.tie_word_embeddings or (c is not None and not c.from_tokens)

    def pooled(self, states: torch.Tensor, normalize: Optional[torch.Tensor] = None
               ) -> torch.Tensor:
        """What embedding requests return from their pooled final hidden states [n, hidden]
        (the last token's, or a mean: engine/pooling.py), float32: a classifier's logits
        [labels], else the states L2-normalized (an embedding), each where `normalize` [n]
        (bool; None: all) says."""
        if self.score is not None:
            return self.score(states.to(self.score.weight.dtype)).float()
        states = states.float()
        normed = torch.nn.functional.normalize(states, dim=-1)
        return normed if normalize is None else torch.where(normalize[:, None], normed, states)

    def _score_from_rows(self, name: str, src: TensorSource) -> bool:
        """Build the classifier's head from the LM head's rows of its tokens where checkpoint
        tensor `name` is the LM head's matrix (classifier_from_token); whether it was."""
        c = self.cfg.classifier
        head = "model.embed_tokens.weight" if self.cfg.tie_word_embeddings else "lm_head.weight"
        if c is None or not c.from_tokens or name != head or self.score is None:
            return False
        rows = torch.cat([src.read(0, i, i + 1) for i in c.token_ids]).float()
        if c.two_way:
            rows = rows[1:2] - rows[0:1]
        copy_into(self.score.weight.data, rows, f"{name} rows {list(c.token_ids)}")
        return True

    @property
    def rope_index(self) -> RopeIndex:
        """How positions become the rope indices `forward` and `hidden` take."""
        return self.model.rope_index

    def hidden(self, ids: torch.Tensor, positions: torch.Tensor, batch: Batch,
               backend: AttentionBackend) -> torch.Tensor:
        """The final (normed) hidden state of every token row, before the LM head.
        `positions`: the tokens' rope indices (`rope_index`; their positions but for
        longrope)."""
        return self.model(ids, positions, batch, backend)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, batch: Batch,
                backend: AttentionBackend, logit_rows: Optional[torch.Tensor],
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits [len(logit_rows), vocab] in the model's dtype for the chosen token rows only
        (every row when `logit_rows` is None, as in decode); the sampler upcasts where needed.
        `out`: where given, [those rows, lm_head.padded_vocab] that the logits land in (the
        result is its view): CUDA graphs of every size share one such buffer."""
        hidden = self.hidden(ids, positions, batch, backend)
        if logit_rows is not None:
            hidden = hidden[logit_rows]
        return self.lm_head(hidden, out)

    def load_weights(self, tensors: Iterable[Tuple[str, TensorSource]],
                     complete: bool = True) -> None:
        """Load every parameter from (checkpoint name, source) pairs; raise naming any missing,
        and any FP8 scale of a layer that is not FP8. Then the weight-only FP8 layers are
        dequantized (layers/fp8.finish_loading). A reload into the same tensors goes the same
        way (static activation scales restarted: layers/fp8.start_loading). With `complete`
        False (a trainer's bucket of weights) only the tensors given change, and none need be
        missing: the caller refuses models whose loading spans tensors (`partial_refusal`)."""
        if complete:
            start_loading(self)
        loaded: Set[str] = set()
        own = ((self._own_name(name), src) for name, src in tensors)
        for name, src in (part for name, src in own if name is not None
                          for part in self._unfused(name, src)):
            if self._score_from_rows(name, src):
                loaded.add("score.weight")
            target = self._target(name)
            if target is None:
                continue
            module_name, param, shard = target
            module = self._module_for(name, module_name)
            if param.endswith(SCALE_PARAMS) and getattr(module, "fp8", None) is None:
                raise ValueError(f"checkpoint tensor {name} is an FP8 scale, but minisgl keeps "
                                 f"{module_name} unquantized (FP8 applies to the decoder's "
                                 f"projections and experts; quantization config: "
                                 f"{self.cfg.quantization})")
            _check_has_tensor(name, module_name, module, param)
            try:
                module.load(param, src, shard)  # type: ignore[operator]
            except ValueError as e:
                raise ValueError(f"loading checkpoint tensor {name}: {e}") from None
            loaded.add(f"{module_name}.{param}")
        if not complete:
            self._fold_residual_multiplier(loaded)
            return
        expected = {n for n, _ in self.named_parameters()} | {
            f"{n}.{p}" for n, m in self.named_modules() if getattr(m, "packed", None)
            for p in getattr(m, "checkpoint_params", ())}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:4]}")
        self._fold_residual_multiplier()
        finish_loading(self)

    def partial_refusal(self) -> Optional[str]:
        """Why some of this model's weights cannot change alone (load_weights' `complete`
        False), or None: static FP8 activation scales (the largest over a layer's fused parts,
        restarted only by a whole checkpoint), FP8 dequantized as it loaded, packed integer
        weights (packed from a layer's tensors together)."""
        for name, module in self.named_modules():
            if getattr(module, "packed", None) is not None:
                return f"{name} keeps packed integer weights, packed from all its tensors"
            if getattr(module, "fp8", None) is not None and any(
                    n.endswith("input_scale") for n, _ in module.named_parameters(recurse=False)):
                return f"{name} has static FP8 activation scales, set by a whole checkpoint"
        if any(True for _ in fp8_layers(self)) and not next(self.parameters()).is_cuda:
            return "its FP8 weights were dequantized as they loaded (weight-only FP8, the CPU's)"
        return None

    def output_multiplier(self, name: str) -> float:
        """What the output of our projection `name` is multiplied by before it joins the
        residual stream (Granite's residual_multiplier on o_proj and down_proj; else 1),
        which LoRA adapters' deltas there take too."""
        last = name.rsplit(".", 1)[-1]
        return self.cfg.residual_multiplier if last in ("o_proj", "down_proj") else 1.0

    @torch.no_grad()
    def _fold_residual_multiplier(self, loaded: Optional[Set[str]] = None) -> None:
        """Granite's residual_multiplier m folded into the layers whose output it scales:
        m (x W^T + b) = x (m W)^T + m b; an FP8 layer's weight scale takes it (dequantized,
        its weight is weight * scale), a packed layer's scales likewise ((q - z) * scales).
        `loaded`: the parameters ("module.param") just loaded, alone (the others hold it
        folded already; an FP8 weight's load sets its scale too)."""
        m = self.cfg.residual_multiplier
        if m == 1.0:
            return
        fresh = (lambda n, *params: True) if loaded is None else (  # noqa: E731
            lambda n, *params: any(f"{n}.{p}" in loaded for p in params))
        for name, module in self.named_modules():
            if self.output_multiplier(name) == 1.0:
                continue
            if getattr(module, "packed", None) is not None:
                factor, fold = module.scales, fresh(name, "qweight", "scales")
            elif getattr(module, "fp8", None) is not None:
                factor, fold = module.weight_scale, fresh(name, "weight", "weight_scale")
            elif hasattr(module, "weight"):
                factor, fold = module.weight, fresh(name, "weight")
            else:
                continue
            if fold:
                factor.mul_(m)
            if getattr(module, "bias", None) is not None and fresh(name, "bias"):
                module.bias.mul_(m)

    def projection_parts(self, module: str) -> List[Tuple[str, int, slice]]:
        """Where checkpoint module `module` (e.g. model.layers.0.self_attn.q_proj) lives in
        this model: (our module's name, its output part, the checkpoint rows of that part)
        for each part (several where the checkpoint fuses projections); [] for a module this
        model does not hold (a vision tower) or that is no projection."""
        own = self._own_name(f"{module}.weight")
        if own is None:
            return []
        *path, _ = own.split(".")
        parts = self.checkpoint_fused.get(path[-1]) if path else None
        names = [".".join([*path[:-1], p]) for p in parts] if parts else [".".join(path)]
        sizes = [self._rows_of(n.rsplit(".", 1)[-1]) for n in names] if parts else [0]
        found: List[Tuple[str, int, slice]] = []
        start = 0
        for name, size in zip(names, sizes):
            target = self._target(f"{name}.weight")
            if target is None or not isinstance(self._submodule(target[0]),
                                                (ColumnParallelLinear, RowParallelLinear)):
                return []
            rows = slice(start, start + size) if parts else slice(None)
            found.append((target[0], target[2], rows))
            start += size
        return found

    def read_back(self, name: str, rows: int, max_values: int) -> List[Piece]:
        """This rank's pieces (layers/readback.first_rows) of the first `rows` rows of
        checkpoint tensor `name` as served: one, or one per projection where the checkpoint
        fuses several (Phi-3's qkv_proj), each cut to the rows it covers of the fused tensor.
        ValueError naming a tensor this model does not hold or cannot give back, or one of
        more than `max_values` values."""
        own = self._own_name(name)
        if own is None:
            raise not_readable(name, "minisgl does not load it")
        *path, param = own.split(".")
        fused = self.checkpoint_fused.get(path[-1]) if path else None
        parts = [(own, 0)] if fused is None else [
            (".".join([*path[:-1], part, param]), offset) for part, offset in
            zip(fused, itertools.accumulate([0, *map(self._rows_of, fused)]))]
        pieces = []
        for part, offset in parts:
            target = (("lm_head", "weight", 0) if part == "lm_head.weight"
                      and self._lm_head_tied else self._target(part))
            if target is None:
                raise not_readable(name, "minisgl does not keep it")
            module_name, param_name, shard = target
            module = self._module_for(part, module_name)
            if not isinstance(module, Readable):
                raise not_readable(name, f"{type(module).__name__} weights are not kept "
                                         f"as the checkpoint's tensors")
            _check_has_tensor(part, module_name, module, param_name)
            pieces.append(first_rows(module.piece(param_name, shard), max(0, rows - offset),
                                     name, max_values))
        return pieces

    def serves(self, name: str) -> bool:
        """Whether checkpoint tensor `name` is one this model loads (not one of a part it
        skips, e.g. a multimodal checkpoint's vision tower: `checkpoint_prefixes`)."""
        return self._own_name(name) is not None

    def _submodule(self, name: str) -> Optional[nn.Module]:
        """The module of that name, or None where this model has none."""
        try:
            return self.get_submodule(name)
        except AttributeError:
            return None

    def _own_name(self, name: str) -> Optional[str]:
        """Checkpoint tensor `name` with its prefix replaced (`checkpoint_prefixes`; a
        checkpoint saved from the bare decoder, as embedding models are, names its tensors
        without `model.`); None: the tensor is not loaded."""
        for prefix, replacement in self.checkpoint_prefixes.items():
            if name.startswith(prefix):
                return None if replacement is None else replacement + name[len(prefix):]
        if name.startswith(_DECODER_TENSORS):
            return f"model.{name}"
        return name

    def _unfused(self, name: str, src: TensorSource) -> List[Tuple[str, TensorSource]]:
        """Checkpoint tensor `name` as (name, source) pairs: itself, or where it fuses
        projections (`checkpoint_fused`) each projection's rows under that projection's name
        (a scale of one value, shared by the parts, goes to each as it is)."""
        *path, param = name.split(".")
        parts = self.checkpoint_fused.get(path[-1]) if path else None
        if parts is None:
            return [(name, src)]
        sizes = [self._rows_of(part) for part in parts]
        rows, total = (src.shape[0] if src.shape else 1), sum(sizes)
        if rows != total and math.prod(src.shape) != 1:
            # a block scale: a row per block of rows, where every part is whole blocks
            block = total // rows if rows and total % rows == 0 else 0
            if not block or any(size % block for size in sizes):
                raise ValueError(f"checkpoint tensor {name} has {rows} rows, but "
                                 f"{' + '.join(parts)} take {' + '.join(map(str, sizes))} "
                                 f"(a block scale splits only where each part is whole blocks)")
            sizes = [size // block for size in sizes]
        starts = itertools.accumulate([0, *sizes[:-1]])
        return [(".".join([*path[:-1], part, param]),
                 src if math.prod(src.shape) == 1 else RowsOf(src, start, size))
                for part, start, size in zip(parts, starts, sizes)]

    def _rows_of(self, projection: str) -> int:
        """The output rows of one unsharded projection a checkpoint may fuse."""
        c = self.cfg
        rows = {"q_proj": c.num_heads * c.head_dim, "k_proj": c.num_kv_heads * c.head_dim,
                "v_proj": c.num_kv_heads * c.head_dim, "gate_proj": c.intermediate_size,
                "up_proj": c.intermediate_size}
        return rows[projection]

    def _module_for(self, name: str, module_name: str) -> nn.Module:
        """The module checkpoint tensor `name` loads into; ValueError where this model has
        none (a checkpoint of more layers or other modules than config.json describes)."""
        try:
            return self.get_submodule(module_name)
        except AttributeError:
            raise ValueError(f"checkpoint tensor {name} has no place in this model: no module "
                             f"{module_name} in {self.cfg.architecture} of {self.cfg.num_layers} "
                             f"layers (does config.json describe this checkpoint?)") from None

    def _target(self, name: str) -> Optional[Tuple[str, str, int]]:
        if "rotary_emb" in name or (name == "lm_head.weight" and self._lm_head_tied):
            return None
        *path, param = name.split(".")
        path = [self.checkpoint_renames.get(p, p) for p in path]
        param = _PARAM_RENAMES.get(param, param)
        expert = expert_param(path, param)
        if expert is not None:
            return expert
        shard = 0
        if path and path[-1] in _FUSED:
            path[-1], shard = _FUSED[path[-1]]
        return ".".join(path), param, shard
