"""SGLang's get_weights_by_name: checkpoint tensors read back as the ranks serve them, by their
Hugging Face names (layers/readback.py, scheduler/weight_read.py), against the checkpoint's own
tensors: every tensor of tiny random checkpoints (fused, tied, offset norms, experts), at tp=1
and 2 (KV heads replicated too), the rows asked for; a pushed update read back; refusals that
leave the engine serving. The HTTP route: test_server_api.py."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, List

import pytest
import torch
from safetensors.torch import load_file

from minisgl import LLM, SamplingParams


def _tensors(path: Path) -> Dict[str, torch.Tensor]:
    out: Dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _check_all(llm: LLM, tensors: Dict[str, torch.Tensor], rows: List[int]) -> None:
    """Equal, shapes too (a norm stored minus one: within float32's rounding of w + 1 - 1)."""
    for name, t in tensors.items():
        for r in rows:
            got, want = torch.tensor(llm.get_weights_by_name(name, r)), t.float()[:r]
            assert got.shape == want.shape and torch.allclose(got, want, rtol=0, atol=1e-7), (
                name, r)


@pytest.mark.parametrize("family,tp,extra", [
    ("llama3", 1, {}),  # untied, a Llama-3 rope
    ("phi3", 2, {}),  # qkv_proj and gate_up_proj fused in the checkpoint
    ("gemma2", 1, {}),  # norms stored minus one, a tied LM head
    ("qwen3_moe", 2, {}),  # experts split over the ranks' intermediate features
    ("qwen3_moe", 2, {"enable_expert_parallel": True}),  # whole experts a rank
])
def test_every_tensor_reads_back_as_the_checkpoint_holds_it(
        tiny_model: Callable[..., Path], family: str, tp: int, extra: dict) -> None:
    path = tiny_model(family)
    tensors = _tensors(path)
    with LLM(str(path), tp=tp, dtype="float32", max_kv_tokens=256, show_progress=False,
             **extra) as llm:
        _check_all(llm, tensors, [3, 10_000])
        if "lm_head.weight" not in tensors:  # tied: the embedding's rows, as HF's model has
            assert torch.equal(torch.tensor(llm.get_weights_by_name("lm_head.weight", 4)),
                               tensors["model.embed_tokens.weight"].float()[:4])


def test_replicated_kv_heads_read_back_once(tiny_model: Callable[..., Path]) -> None:
    """tp=2 over one KV head: both ranks hold k_proj and v_proj whole."""
    path = tiny_model("llama3", num_key_value_heads=1)
    tensors = _tensors(path)
    with LLM(str(path), tp=2, dtype="float32", max_kv_tokens=256, show_progress=False) as llm:
        _check_all(llm, {n: t for n, t in tensors.items() if "layers.0." in n}, [5])


def test_a_pushed_update_reads_back(two_llamas: List[Path]) -> None:
    """What an RL loop checks after an update: the new tensors are served."""
    served, pushed = two_llamas
    new = _tensors(pushed)
    name = "model.layers.1.self_attn.o_proj.weight"
    with LLM(str(served), dtype="float32", max_kv_tokens=256, show_progress=False) as llm:
        assert not torch.equal(torch.tensor(llm.get_weights_by_name(name, 8)),
                               new[name].float()[:8])
        llm.update_weights_from_tensor([(name, new[name])])
        assert torch.equal(torch.tensor(llm.get_weights_by_name(name, 8)), new[name].float()[:8])


def test_refusals_name_the_tensor_and_the_engine_goes_on(tiny_model: Callable[..., Path]
                                                         ) -> None:
    with LLM(str(tiny_model("llama3")), dtype="float32", max_kv_tokens=256,
             enable_sleep_mode=True, show_progress=False) as llm:
        with pytest.raises(ValueError, match="model.layers.9.mlp.up_proj.weight has no place"):
            llm.get_weights_by_name("model.layers.9.mlp.up_proj.weight")
        with pytest.raises(ValueError, match="has no 'bias'"):
            llm.get_weights_by_name("model.layers.0.mlp.up_proj.bias")
        with pytest.raises(ValueError, match="truncate_size must be 1 to"):
            llm.get_weights_by_name("model.norm.weight", 0)
        with pytest.raises(ValueError, match="does not keep it"):
            llm.get_weights_by_name("model.layers.0.self_attn.rotary_emb.inv_freq")
        llm.sleep(level=1)
        with pytest.raises(ValueError, match="the weights are asleep"):
            llm.get_weights_by_name("model.norm.weight")
        llm.wake_up()
        assert len(llm.get_weights_by_name("model.norm.weight", 5)) == 5
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(out[0].token_ids) == 3
