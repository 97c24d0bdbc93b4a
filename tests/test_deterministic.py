"""Deterministic inference (enable_deterministic_inference, SGLang's; vLLM's batch invariance):
a request's tokens and log-probabilities are the same bits alone and beside other requests,
with its prompt chunked otherwise, after its prefix was cached, through n-gram verification
and at tp=4; greedy and seeded sampling. Without the setting the same comparison differs
(the control: the CPU BLAS rounds a row by the row count). On CPU (the per-row products and
per-token attention); the Triton paths: tests/test_triton_ops.py (the GEMM) and
tests/test_gpu.py (the engine on CUDA)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import pytest

from hf_reference import mixed_prompts
from minisgl import LLM, SamplingParams
from minisgl.outputs import CompletionOutput

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(max_tokens=10, temperature=0.9, seed=7, ignore_eos=True, logprobs=3)
Result = Tuple[List[int], list]


def _bits(out: CompletionOutput) -> Result:
    """A choice's tokens and log-probabilities, as compared bit for bit."""
    return out.token_ids, [sorted((t, p.logprob) for t, p in d.items()) for d in out.logprobs]


def _run(path: Path, prompts: List[List[int]], params: SamplingParams, invariant: bool,
         **kw: object) -> List[Result]:
    with LLM(str(path), device="cpu", enable_deterministic_inference=invariant,
             max_kv_tokens=4096, show_progress=False, **kw) as llm:  # type: ignore[arg-type]
        return [_bits(o.outputs[0]) for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_request_alone_and_in_any_batch_gives_the_same_bits(
        tiny_model: Callable[..., Path], params: SamplingParams) -> None:
    path = tiny_model("llama3")
    target = mixed_prompts(1, seed=31, lengths=(37,))[0]
    others = mixed_prompts(5, seed=32, lengths=(5, 60))
    alone = _run(path, [target], params, True)[0]
    # beside five others, its prompt cut in chunks of 16 (mixed steps, decode batches of 6)
    batched = _run(path, [*others[:2], target, *others[2:]], params, True,
                   max_prefill_tokens=16)
    assert batched[2] == alone
    # after a request sharing its first 24 tokens cached them (a prefix-cache hit)
    shared = [target[:24] + [7, 8, 9]]
    with LLM(str(path), device="cpu", enable_deterministic_inference=True, max_kv_tokens=4096,
             page_size=4, show_progress=False) as llm:  # type: ignore[arg-type]
        llm.generate(shared, params)
        cached = llm.generate([target], params)[0].outputs[0]
        assert llm.stats is not None and llm.stats.cached_tokens_total >= 24
    assert _bits(cached) == alone
    if params is GREEDY:  # the control: the default kernels round a row by its company
        plain_alone = _run(path, [target], params, False)[0]
        plain_batched = _run(path, [*others[:2], target, *others[2:]], params, False,
                             max_prefill_tokens=16)[2]
        assert plain_batched[1] != plain_alone[1]


def test_speculation_gives_plain_decodings_bits(tiny_model: Callable[..., Path]) -> None:
    """n-gram drafts verified five tokens a step: the tokens and log-probabilities of plain
    decoding, bit for bit (without the setting a verify step's rows may round otherwise)."""
    path = tiny_model("llama3")
    loop = [11, 12, 13, 14, 15] * 6  # a repetitive prompt: drafts are found and kept
    prompts = [loop, *mixed_prompts(2, seed=33, lengths=(20, 30))]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
            "prompt_lookup_max": 3}
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    plain = _run(path, prompts, params, True)
    with LLM(str(path), device="cpu", enable_deterministic_inference=True, max_kv_tokens=4096,
             speculative_config=spec, show_progress=False) as llm:
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        accepted = llm.stats.spec_accepted_tokens_total if llm.stats else 0
    assert accepted > 0
    assert [_bits(o) for o in outs] == plain


def test_four_ranks_keep_the_bits(tiny_model: Callable[..., Path]) -> None:
    """At tp=4 the ranks' partials are gathered and added in rank order ("auto" takes the
    ordered all-reduce: EngineConfig.allreduce_mode; NCCL's or gloo's order follows the
    tensor's size): a request's bits alone and in a batch, its prompt chunked otherwise, are
    the same (gloo here; the two-GPU test: tests/test_gpu.py)."""
    path = tiny_model("llama3")  # 2 KV heads: replicated over 4 ranks
    target = mixed_prompts(1, seed=34, lengths=(29,))[0]
    others = mixed_prompts(3, seed=35, lengths=(7, 40))
    with LLM(str(path), device="cpu", enable_deterministic_inference=True, tp=4,
             max_kv_tokens=4096, max_prefill_tokens=16, show_progress=False) as llm:
        alone = _bits(llm.generate([target], GREEDY)[0].outputs[0])
        batched = llm.generate([others[0], target, *others[1:]], GREEDY)[1].outputs[0]
    assert _bits(batched) == alone


@pytest.mark.parametrize("kw,named", [
    ({"tp": 4, "allreduce": "nccl"}, "allreduce 'nccl' at tp 4"),
    ({"quantization": "fp8"}, "quantization 'fp8'")])
def test_what_it_cannot_hold_with_is_refused_by_name(tiny_model: Callable[..., Path],
                                                     kw: dict, named: str) -> None:
    with pytest.raises(ValueError,
                       match=f"enable_deterministic_inference cannot hold with.*{named}"):
        LLM(str(tiny_model("llama3")), device="cpu", enable_deterministic_inference=True,
            show_progress=False, **kw)


@pytest.mark.parametrize("family,kw", [
    ("qwen3_moe", {}), ("qwen2_moe", {}), ("glm4_moe", {}),
    ("qwen3_moe", {"tp": 2, "enable_expert_parallel": True})],
    ids=["qwen3_moe", "qwen2_moe", "glm4_moe", "qwen3_moe-ep2"])
def test_a_mixture_of_experts_keeps_the_bits(tiny_model: Callable[..., Path], family: str,
                                             kw: dict) -> None:
    """Experts (softmax top-k; a gated shared expert; sigmoid routing in groups; each of two
    ranks holding half the experts, their partials added by the ordered all-reduce): a
    request's bits alone and in a chunked batch are the same, the routers' and experts'
    products invariant and each token's experts added in expert order (layers/moe.py)."""
    target = mixed_prompts(1, seed=36, lengths=(33,))[0]
    others = mixed_prompts(3, seed=37, lengths=(6, 50))
    with LLM(str(tiny_model(family)), device="cpu", enable_deterministic_inference=True,
             max_kv_tokens=4096, max_prefill_tokens=16, show_progress=False,
             **kw) as llm:  # type: ignore[arg-type]
        alone = _bits(llm.generate([target], GREEDY)[0].outputs[0])
        batched = llm.generate([*others[:2], target, others[2]], GREEDY)[2].outputs[0]
    assert _bits(batched) == alone


def test_lora_adapters_keep_the_bits(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    """LoRA: a request's bits under its adapter alone and in a chunked batch beside a base
    request and another adapter's are the same, and the base request's as alone (each delta's
    products invariant, summed over every slot's columns: layers/lora.py)."""
    from tiny_models import build_tiny_lora
    base = tiny_model("llama")
    modules = (f"a={build_tiny_lora(base, tmp_path / 'a', 1)},"
               f"b={build_tiny_lora(base, tmp_path / 'b', 2, rank=4)}")
    target, plain, other = mixed_prompts(3, seed=38, lengths=(9, 40))

    def params(name: Optional[str]) -> SamplingParams:
        return dataclasses.replace(GREEDY, lora_name=name)

    with LLM(str(base), device="cpu", enable_deterministic_inference=True, max_kv_tokens=4096,
             max_prefill_tokens=16, lora_modules=modules, show_progress=False) as llm:
        alone = _bits(llm.generate([target], params("a"))[0].outputs[0])
        plain_alone = _bits(llm.generate([plain], params(None))[0].outputs[0])
        outs = llm.generate([plain, target, other], [params(None), params("a"), params("b")])
    assert _bits(outs[1].outputs[0]) == alone
    assert _bits(outs[0].outputs[0]) == plain_alone


def test_vllms_environment_variable_turns_it_on_under_the_settings(
        tiny_model: Callable[..., Path], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    """VLLM_BATCH_INVARIANT=1 (vLLM's switch) is enable_deterministic_inference for `serve`
    and LLM() where no setting says otherwise (resolved at the launcher: the nodes'
    fingerprints compare it); 0 is off; a setting wins; a non-integer is named."""
    from minisgl.server.args import parse_args
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert parse_args(["--model", "m"]).engine.enable_deterministic_inference
    config = tmp_path / "off.toml"
    config.write_text("enable_deterministic_inference = false\n")
    assert not parse_args(["--model", "m", "--config", str(config)]).engine \
        .enable_deterministic_inference
    with pytest.raises(ValueError, match="enable_deterministic_inference cannot hold with"
                                         ".*quantization 'fp8'"):
        LLM(str(tiny_model("llama3")), device="cpu", quantization="fp8", show_progress=False)
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    assert not parse_args(["--model", "m"]).engine.enable_deterministic_inference
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "yes")
    with pytest.raises(ValueError, match="VLLM_BATCH_INVARIANT must be an integer.*'yes'"):
        parse_args(["--model", "m"])
