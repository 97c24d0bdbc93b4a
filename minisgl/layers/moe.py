"""The tensor-parallel mixture-of-experts layer: a replicated router, the routed experts split
like the dense MLP, and an optional shared expert (Qwen2-MoE's sigmoid-gated, GLM-4.5's not).

The router scores the experts by a softmax (Qwen, Mixtral: `route`) or by sigmoids
(GLM-4.5, DeepSeek-V3's scheme: `route_grouped`).

Each rank holds a 1/tp slice of every expert's intermediate features (gate and up split by
output rows, down by input columns, as ColumnParallelLinear and RowParallelLinear split the
MLP), so every rank routes every token (the router is replicated and sees the same normed
hidden state on every rank), computes its slice of each chosen expert, and weights and sums
them: its output is a partial sum, and one all-reduce per layer (the ResidualStream's, fused
with the next residual add and RMSNorm where the communicator can) completes it. The shared
expert's partial sum joins the same all-reduce.

Experts (layers/experts.py: their weights, dense, FP8 or packed) run as the fused Triton kernels of
kernels/moe.py on CUDA tensors with `policy.fused`, else as the torch path here, which is the
reference (float32 on CPU: Hugging Face's loop over the experts that received tokens; FP8
and packed experts dequantized one at a time).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple, Optional, Tuple

import torch
from torch import nn

from minisgl.core import LoraRows
from minisgl.distributed import Communicator, DistributedInfo, Shard
from minisgl.kernels.policy import KernelPolicy
from minisgl.kernels.types import SILU, Normed
from minisgl.layers import blas
from minisgl.layers.activation import act_and_mul
from minisgl.layers.experts import Experts, ExpertsShape
from minisgl.layers.linear import (ColumnParallelLinear, ReplicatedLinear, ResidualStream,
                                   RowParallelLinear, all_reduce_norm, finish_norm_quantized)
from minisgl.layers.lora import LoraShape
from minisgl.layers.norm import RMSNorm
from minisgl.layers.weight_format import WeightFormat

if TYPE_CHECKING:  # kernels/fp8.py imports triton: only CUDA paths load it
    from minisgl.kernels.fp8 import Quantized


class RouterSpec(NamedTuple):
    """How the router chooses (ModelConfig.moe_scoring and the fields after it)."""

    scoring: str = "softmax"  # or "sigmoid" (route_grouped)
    groups: int = 1  # sigmoid: the experts in this many groups ...
    topk_groups: int = 1  # ... of which the best this many are eligible
    scale: float = 1.0  # sigmoid: the chosen weights' factor (routed_scaling_factor)


class MoEShape(NamedTuple):
    """What a MoE layer is built from (whole sizes: the layer takes its rank's slice)."""

    hidden: int
    num_experts: int
    top_k: int
    intermediate: int  # of one routed expert
    renormalize: bool  # the top-k weights divided by their sum
    shared_intermediate: int = 0  # of the shared expert; 0: none
    shared_gated: bool = True  # the shared expert's output times sigmoid(its gate's)
    router: RouterSpec = RouterSpec()


class TopK(NamedTuple):
    """Each token's chosen experts, in descending weight."""

    weights: torch.Tensor  # [T, k] float32
    ids: torch.Tensor  # [T, k] int64


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> TopK:
    """Softmax over all experts in float32, the top k, optionally renormalized to sum to 1."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return TopK(weights, ids)


def route_grouped(logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool,
                  spec: RouterSpec) -> TopK:
    """Sigmoid routing (GLM-4.5's, DeepSeek-V3's) of float32 router `logits` [T, E]: each
    expert's score is its sigmoid; the choice goes by score + `bias` (a learned per-expert
    correction) among the experts of the `spec.topk_groups` groups (of `spec.groups`, E / groups
    experts each) whose two best biased scores sum highest; the chosen experts' weights are
    their plain scores, renormalized to sum to one where `renormalize`, then times
    `spec.scale`. Tensor operations only (CUDA graphs capture it)."""
    scores = logits.sigmoid()
    choice = scores + bias
    t, e = choice.shape
    by_group = choice.view(t, spec.groups, e // spec.groups)
    group_scores = by_group.topk(2, dim=-1).values.sum(dim=-1)
    best = group_scores.topk(spec.topk_groups, dim=-1, sorted=False).indices
    eligible = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    choice = choice.masked_fill(~eligible.repeat_interleave(e // spec.groups, dim=1),
                                float("-inf"))
    ids = choice.topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return TopK(weights * spec.scale, ids)


def owned_topk(topk: TopK, owned: Shard) -> TopK:
    """The choices of the experts `owned` holds (expert parallelism), renumbered from 0; every
    other choice becomes expert `owned.size`, weight 0, which `experts_torch_by` skips and
    the fused kernels lay out no block for (kernels/moe.routing_of's `owned`)."""
    ids = topk.ids - owned.start
    mine = (ids >= 0) & (ids < owned.size)
    return TopK(torch.where(mine, topk.weights, 0.0), torch.where(mine, ids, owned.size))


# expert -> its (w13, w2) in the compute dtype
ExpertWeights = Callable[[int], Tuple[torch.Tensor, torch.Tensor]]


class MoEQuant(NamedTuple):
    """How a MoE layer's parts store their weights: the routed experts and the shared
    expert's gate/up and down projections. The routers stay dense."""

    experts: WeightFormat = WeightFormat()
    shared_gate_up: WeightFormat = WeightFormat()
    shared_down: WeightFormat = WeightFormat()


def _weights(weights_of: ExpertWeights, expert: int, x: torch.Tensor
             ) -> Tuple[torch.Tensor, torch.Tensor]:
    """An expert's weights in x's dtype (packed ones come dequantized in float32)."""
    w13, w2 = weights_of(expert)
    return w13.to(x.dtype), w2.to(x.dtype)


def _expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, invariant: bool
            ) -> torch.Tensor:
    hidden = act_and_mul(blas.plain_linear(x, w13, invariant=invariant))
    return blas.plain_linear(hidden, w2, invariant=invariant)


def experts_torch(x: torch.Tensor, topk: TopK, w13: torch.Tensor, w2: torch.Tensor
                  ) -> torch.Tensor:
    """sum over j of weights[t, j] * expert_{ids[t, j]}(x[t]) for x [T, H], w13 [E, 2I, H]
    (gate rows, then up rows), w2 [E, H, I]: `experts_torch_by` over these tensors."""
    return experts_torch_by(x, topk, lambda e: (w13[e], w2[e]), w13.shape[0])


def experts_torch_by(x: torch.Tensor, topk: TopK, weights_of: ExpertWeights,
                     num_experts: int, invariant: bool = False) -> torch.Tensor:
    """The experts' weighted sum with each expert's weights from `weights_of` (FP8 experts
    dequantize one expert at a time). On the CPU only the experts that received tokens run, on
    those tokens, accumulated expert by expert (as Hugging Face does); on CUDA every expert runs
    on every token with the weight of the tokens that did not choose it zero, so that no step
    waits for the device (decode CUDA graphs capture it). Either way a token's experts add in
    increasing expert order; `invariant`: their products are blas.invariant_linear's, so a
    token's bits do not depend on the other tokens (deterministic inference)."""
    out = torch.zeros_like(x)
    if x.is_cuda:  # ids past num_experts (another rank's experts) match no e
        for e in range(num_experts):
            weight = (topk.weights * (topk.ids == e)).sum(dim=-1, keepdim=True)
            out += (_expert(x, *_weights(weights_of, e, x), invariant).float()
                    * weight).to(x.dtype)
        return out
    for e in torch.unique(topk.ids).tolist():
        if e >= num_experts:  # another rank's experts (expert parallelism: owned_topk)
            continue
        token, choice = torch.where(topk.ids == e)
        y = (_expert(x[token], *_weights(weights_of, e, x), invariant).float()
             * topk.weights[token, choice, None])
        out.index_add_(0, token, y.to(x.dtype))
    return out


class SharedExpert(nn.Module):
    """A gated MLP every token runs, split over ranks as the dense MLP; `forward` returns this
    rank's partial sum. `lora`: LoRA adapter slots in its projections, as the dense MLP's."""

    def __init__(self, hidden: int, intermediate: int, info: DistributedInfo,
                 comm: Communicator, policy: KernelPolicy, quant: MoEQuant = MoEQuant(),
                 lora: Optional[LoraShape] = None) -> None:
        super().__init__()
        self.policy = policy
        self.gate_up_proj = ColumnParallelLinear(hidden, [intermediate, intermediate], False,
                                                 info, policy, quant.shared_gate_up, lora=lora)
        self.down_proj = RowParallelLinear(intermediate, hidden, False, info, comm, policy,
                                           quant.shared_down, lora)

    def forward(self, x: torch.Tensor, lora: Optional[LoraRows] = None) -> torch.Tensor:
        """`lora`: the LoRA deltas of the tokens it names added to each projection."""
        if lora is None:
            return self.down_proj(act_and_mul(self.gate_up_proj(x), SILU, self.policy),
                                  reduce=False)
        gated = act_and_mul(self.gate_up_proj.forward_lora(x, lora), SILU, self.policy)
        return self.down_proj.partial_lora(gated, lora)


class Router(ReplicatedLinear):
    """The router's linear layer, replicated. A sigmoid router (`sigmoid`) also holds its
    per-expert score correction (the checkpoint's `e_score_correction_bias`) and computes its
    logits in float32, as Hugging Face's GLM-4.5 does: the choice turns on small differences
    of the scores, which bf16 logits would blur."""

    def __init__(self, hidden: int, num_experts: int, sigmoid: bool,
                 policy: KernelPolicy = KernelPolicy()) -> None:
        super().__init__(hidden, num_experts, False, policy)
        self.e_score_correction_bias: Optional[nn.Parameter] = None
        if sigmoid:  # float32 whatever the model's dtype (the checkpoint keeps it so)
            self.e_score_correction_bias = nn.Parameter(
                torch.empty(num_experts, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.e_score_correction_bias is None:
            return super().forward(x)
        return blas.plain_linear(x.float(), self.weight.float(), invariant=self.invariant)


class SparseMoE(nn.Module):
    """The MoE block of a decoder layer: `forward` takes the stream before its norm and
    returns the stream after the experts (this rank's partial sum, not yet all-reduced: the
    layer is its own reducer). LoRA adapters (`lora`) adapt the shared expert's projections;
    the routed experts and the routers take none (models/lora.py refuses such adapters).
    `expert_parallel`: each rank holds 1/tp of the routed experts whole (layers/experts.py)
    and runs the tokens routed to them; the all-reduce sums every rank's experts as it sums
    the slices of tensor parallelism. Routing is replicated: every rank sees every token and
    computes the same choices."""

    def __init__(self, shape: MoEShape, info: DistributedInfo, comm: Communicator,
                 policy: KernelPolicy = KernelPolicy(), quant: MoEQuant = MoEQuant(),
                 lora: Optional[LoraShape] = None, expert_parallel: bool = False) -> None:
        super().__init__()
        self.shape = shape
        self.policy = policy
        self.comm = comm
        self.gate = Router(shape.hidden, shape.num_experts, shape.router.scoring == "sigmoid",
                           policy)
        self.experts = Experts(ExpertsShape(shape.num_experts, shape.hidden, shape.intermediate),
                               info, quant.experts, expert_parallel)
        self.shared_expert: Optional[SharedExpert] = None
        self.shared_expert_gate: Optional[ReplicatedLinear] = None
        if shape.shared_intermediate:
            self.shared_expert = SharedExpert(shape.hidden, shape.shared_intermediate, info,
                                              comm, policy, quant, lora)
        if shape.shared_intermediate and shape.shared_gated:
            self.shared_expert_gate = ReplicatedLinear(shape.hidden, 1, False, policy)

    def forward(self, stream: ResidualStream, norm: RMSNorm,
                lora: Optional[LoraRows] = None) -> ResidualStream:
        x, residual = stream.normed(norm)
        return ResidualStream(self.partial(x, lora), residual, self)

    def partial(self, x: torch.Tensor, lora: Optional[LoraRows] = None) -> torch.Tensor:
        """This rank's partial sum of the block's output on x [T, H] (`lora`: the adapters'
        deltas of the tokens it names, in the shared expert)."""
        logits = self.gate(x)
        experts, top_k, renorm = self.experts, self.shape.top_k, self.shape.renormalize
        owned = experts.owned
        grouped = self.gate.e_score_correction_bias is not None
        if self.policy.fused and x.is_cuda and not self.policy.batch_invariant:
            from minisgl.kernels import moe
            if grouped:
                chosen = self._grouped(logits)
                routing = moe.routing_of(chosen.weights, chosen.ids, self.shape.num_experts)
            else:
                routing = moe.route(logits, top_k, renorm)
            if owned.size != self.shape.num_experts:
                mine = owned_topk(TopK(routing.weights, routing.ids), owned)
                routing = moe.routing_of(mine.weights, mine.ids, owned.size + 1, owned.size)
            tiles = moe.moe_tiles(x.shape[0], top_k, self.shape.num_experts)
            gemms = experts.packed_gemms()
            out = (moe.fused_packed_experts(x, routing, *gemms, tiles) if gemms is not None
                   else moe.fused_experts(x, routing, experts.w13, experts.w2, tiles,
                                          experts.scales()))
        else:
            chosen = self._grouped(logits) if grouped else route(logits, top_k, renorm)
            out = experts_torch_by(x, owned_topk(chosen, owned), experts.dense, owned.size,
                                   self.policy.batch_invariant)
        if self.shared_expert is None:
            return out
        shared = self.shared_expert(x, lora)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out + shared

    def _grouped(self, logits: torch.Tensor) -> TopK:
        assert self.gate.e_score_correction_bias is not None  # a sigmoid router's (see Router)
        return route_grouped(logits, self.gate.e_score_correction_bias, self.shape.top_k,
                             self.shape.renormalize, self.shape.router)

    def finish(self, partial: torch.Tensor) -> torch.Tensor:
        """The block's output from a partial sum: the all-reduce (a collective)."""
        return self.comm.all_reduce(partial)

    def reduce_norm(self, partial: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
                    ) -> Normed:
        """norm(finish(partial), residual), fused where the communicator can (a collective)."""
        return all_reduce_norm(self.comm, partial, None, residual, norm)

    def reduce_norm_quantized(self, partial: torch.Tensor, residual: torch.Tensor,
                              norm: RMSNorm) -> Tuple[Quantized, torch.Tensor]:
        return finish_norm_quantized(self, partial, residual, norm)
