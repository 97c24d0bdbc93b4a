"""The decoder's batch-1 fused path (norm inside the QKV and gate/up GEMVs, rotary + K/V store and
SiLU in their epilogues) against the unfused model, on CPU: the Triton kernels run in the
interpreter, `takes_gemv` is widened to CPU rows, and the kernels launch without PDL (the
interpreter has no grid-dependency wait). This reaches the layers' dispatch (ResidualStream,
forward_normed*, the Normed unpacking in Attention and MLP), which otherwise runs only on a GPU."""

from __future__ import annotations

import os
from typing import Any, Callable, List, Tuple

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before triton is imported
pytest.importorskip("triton")
# The kernels get CPU tensors, which only the interpreter runs; a CUDA machine compiles them for
# the GPU instead (the interpreter is chosen once per process), and runs this path for real in
# test_gpu.py.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="a CPU-interpreter test (CPU tensors through Triton)")

from minisgl.core import Batch, Phase  # noqa: E402
from minisgl.distributed import Communicator, DistributedInfo  # noqa: E402
from minisgl.kernels import gemv, rotary  # noqa: E402
from minisgl.kernels.policy import KernelPolicy  # noqa: E402
from minisgl.kernels.types import KVTarget  # noqa: E402
from minisgl.layers import linear  # noqa: E402
from minisgl.layers.rotary import RotaryEmbedding  # noqa: E402
from minisgl.models.config import ModelConfig  # noqa: E402
from minisgl.models.decoder import CausalLM  # noqa: E402
from minisgl.models.gemma import Gemma3ForCausalLM  # noqa: E402
from minisgl.models.llama import LlamaForCausalLM  # noqa: E402
from minisgl.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM  # noqa: E402

HEADS, KV_HEADS, DIM, LAYERS, SLOTS = 4, 2, 16, 2, 12
NEW_SLOT, POSITION = 9, 7
CONTEXT = [0, 1, 2, 3, 4, 5, 6, NEW_SLOT]  # the earlier tokens' slots, then the new token's


class _CacheBackend:
    """Attention over one sequence whose K/V sit at CONTEXT in per-layer caches; offers the
    caches as a KV target (the fused QKV kernel writes there) when `target` is set."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, target: bool) -> None:
        self.k, self.v, self.target = k, v, target
        self.slots = torch.tensor([NEW_SLOT], dtype=torch.int32)

    def kv_target(self, layer: int, batch: Any) -> Any:
        return KVTarget(self.k[layer], self.v[layer], self.slots) if self.target else None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: Any,
                kv_stored: bool = False) -> torch.Tensor:
        if not kv_stored:
            self.k[layer][NEW_SLOT], self.v[layer][NEW_SLOT] = k[0], v[0]
        keys = self.k[layer][CONTEXT].repeat_interleave(HEADS // KV_HEADS, 1)  # [L, heads, d]
        values = self.v[layer][CONTEXT].repeat_interleave(HEADS // KV_HEADS, 1)
        scores = torch.einsum("hd,lhd->hl", q[0], keys) / DIM ** 0.5
        return torch.einsum("hl,lhd->hd", scores.softmax(-1), values).reshape(1, -1)


def _config(bias: bool, hidden_act: str = "silu") -> ModelConfig:
    return ModelConfig(architecture="test", vocab_size=50, hidden_size=64, intermediate_size=96,
                       num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM,
                       rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
                       max_position_embeddings=64, tie_word_embeddings=False,
                       attention_bias=bias, mlp_bias=False, eos_token_ids=(2,),
                       torch_dtype=None, hidden_act=hidden_act)


def _step(model: CausalLM, target: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode step of token 5 at POSITION: (logits, k caches, v caches)."""
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(LAYERS, SLOTS, KV_HEADS, DIM, generator=gen)
    v = torch.randn(LAYERS, SLOTS, KV_HEADS, DIM, generator=gen)
    with torch.no_grad():
        batch = Batch(Phase.DECODE, [], [POSITION], [1], [True])  # the fake backend's
        logits = model(torch.tensor([5]), torch.tensor([POSITION]), batch,
                       _CacheBackend(k, v, target), None)  # type: ignore[arg-type]
    return logits, k, v


def _random_reference(cls: type, cfg: ModelConfig, info: DistributedInfo) -> CausalLM:
    """An unfused model with random weights (norm weights near 1)."""
    torch.manual_seed(0)
    ref = cls(cfg, info, Communicator(info))
    for name, p in ref.named_parameters():
        p.data.uniform_(0.5, 1.5) if "norm" in name else p.data.normal_(0, 0.3)
    return ref


def _record_gemvs(monkeypatch: pytest.MonkeyPatch) -> List[str]:
    """The GEMV and rotary kernels the model launches from now on, by name (" fp8" appended
    where they read FP8 weights; " norms" and " store" where the rotary kernel applies q/k norms
    and stores K/V), run without PDL, every one-row projection taking the GEMV and the rotary
    kernel taking CPU tensors (as on CUDA)."""
    calls: List[str] = []

    def without_pdl(kernel: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            calls.append(kernel.__name__ + ("" if kwargs.get("weight_scale") is None
                                            else " fp8"))
            return kernel(*args, **{**kwargs, "pdl": False})
        return run
    for name in ("gemv", "norm_gemv", "norm_gate_up_act", "norm_qkv_rope"):
        monkeypatch.setattr(gemv, name, without_pdl(getattr(gemv, name)))
    rotate = rotary.rotary_qk_

    def rotary_without_pdl(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                           cos: torch.Tensor, sin: torch.Tensor, pdl: bool = False,
                           store: Any = None, scales: Any = None, norms: Any = None) -> Any:
        calls.append("rotary" + (" norms" if norms is not None else "")
                     + (" store" if store is not None else ""))
        return rotate(q, k, positions, cos, sin, False, store, scales, norms)
    monkeypatch.setattr(rotary, "rotary_qk_", rotary_without_pdl)
    monkeypatch.setattr(RotaryEmbedding, "_fusable",
                        lambda self, *xs: all(x.stride(2) == 1 for x in xs))
    monkeypatch.setattr(linear, "takes_gemv",
                        lambda x, policy: policy.gemv and x.numel() == x.shape[-1])
    return calls


@pytest.mark.parametrize("cls,bias", [(LlamaForCausalLM, False), (Qwen2ForCausalLM, True),
                                      (Qwen3ForCausalLM, False), (Gemma3ForCausalLM, False)])
@pytest.mark.parametrize("target", [True, False])
def test_batch1_fused_decoder_matches_unfused(cls: type, bias: bool, target: bool,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama (rotary + K/V store fused into QKV when the backend offers a KV target), Qwen2
    (the same with QKV bias), Qwen3 (per-head q/k norms: the norm is fused into QKV, the q/k
    norms into the rotary kernel that stores K/V), Gemma 3 (q/k norms as Qwen3's, sandwich
    norms, GELU in the gate/up GEMV's epilogue): the logits and every cache slot equal the
    unfused model's, and the fused kernels did run."""
    gemma = cls is Gemma3ForCausalLM
    cfg = _config(bias, "gelu_pytorch_tanh" if gemma else "silu")
    info = DistributedInfo(0, 1)
    ref = _random_reference(cls, cfg, info)
    fused = cls(cfg, info, Communicator(info), KernelPolicy(fused=True, pdl=True))
    fused.load_state_dict(ref.state_dict())
    want = _step(ref, target)
    calls = _record_gemvs(monkeypatch)
    got = _step(fused, target)

    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    qwen3 = cls in (Qwen3ForCausalLM, Gemma3ForCausalLM)  # q/k norms
    qkv_kernel = "norm_qkv_rope" if target and not qwen3 else "norm_gemv"
    assert calls.count(qkv_kernel) >= LAYERS and calls.count("norm_gate_up_act") == LAYERS
    rotation = {(True, True): "rotary norms store", (False, True): None,
                (True, False): "rotary", (False, False): "rotary"}[(qwen3, target)]
    assert [c for c in calls if c.startswith("rotary")] == ([rotation] * LAYERS if rotation
                                                            else [])


@pytest.mark.parametrize("cls,bias,target", [(LlamaForCausalLM, False, True),
                                             (Qwen2ForCausalLM, True, False)])
def test_batch1_fused_decoder_reads_fp8_weights(cls: type, bias: bool, target: bool,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """With FP8 projections (weights and row scales, kept FP8 as on a GPU), batch 1 takes the
    same fused GEMVs reading the FP8 weights, with the activations unquantized: the logits and
    caches equal the unfused model's on the dequantized weights."""
    from minisgl.layers import fp8
    from minisgl.models.quantization import QuantPlan
    cfg, info = _config(bias), DistributedInfo(0, 1)
    ref = _random_reference(cls, cfg, info)
    plan = QuantPlan(None, fp8.Fp8Spec(gemm="triton"))
    fused = cls(cfg, info, Communicator(info), KernelPolicy(fused=True, pdl=True), plan)
    fused.load_state_dict(ref.state_dict(), strict=False)
    layers = list(fp8.fp8_layers(fused))
    assert len(layers) == 4 * LAYERS
    for name, layer in layers:
        dense = ref.get_submodule(name)
        q, scale = fp8.quantize_rows(dense.weight.data)
        layer.weight.data.copy_(q)
        layer.weight_scale.copy_(scale)
        dense.weight.data.copy_(fp8.dequantize(q, scale, None, torch.float32))
    want = _step(ref, target)
    calls = _record_gemvs(monkeypatch)
    got = _step(fused, target)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    qkv_kernel = "norm_qkv_rope fp8" if target else "norm_gemv fp8"
    assert calls.count(qkv_kernel) == LAYERS and calls.count("norm_gate_up_act fp8") == LAYERS
    assert calls.count("gemv fp8") == 2 * LAYERS  # o_proj, down_proj
    assert calls.count("gemv") == 1  # the LM head, dense
