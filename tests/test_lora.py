"""LoRA adapters (PEFT's format) served beside the base model: greedy tokens equal to PEFT's on
Hugging Face transformers (float32, CPU) per request, with requests of several adapters and of
none in the same batches, chunked prefills and the prefix cache; at tp=2; vLLM's offline
`lora_request`; the HTTP API's `model` field; and clear refusals of what cannot be served."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional

import httpx
import pytest
import torch
from safetensors.torch import save_file

from hf_reference import hf_greedy, mixed_prompts
from minisgl import LLM, LoRARequest, SamplingParams
from minisgl.core import LoraBinding
from minisgl.distributed import Shard
from minisgl.engine.lora import graph_lora_rows, lora_rows
from minisgl.layers.lora import LoraShape, LoraSlots
from server_helpers import CPU_ARGS, error_line, run_serve, runtime_dirs, serving
from tiny_models import build_tiny_lora, write_lora

# Not imported here: peft imports triton, which must first see TRITON_INTERPRET (set when the
# interpreter-backed test modules are collected).
pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None,
                                reason="needs peft (the dev extra)")

NEW = 12
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def base(tiny_model: Callable[..., Path]) -> Path:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def adapters(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    """"all": every projection, rank 8; "few": q, v and down, rank 4 with rsLoRA's scaling."""
    root = tmp_path_factory.mktemp("lora")
    return {"all": build_tiny_lora(base, root / "all", 1),
            "few": build_tiny_lora(base, root / "few", 2, rank=4,
                                   targets=("q_proj", "v_proj", "down_proj"), use_rslora=True)}


def _modules(adapters: Dict[str, Path]) -> str:
    return ",".join(f"{name}={path}" for name, path in adapters.items())


def _expected(base: Path, adapters: Dict[str, Path], prompts: List[List[int]],
              names: List[Optional[str]]) -> List[List[int]]:
    """PEFT's tokens for each prompt under its adapter (None: the base model)."""
    return [hf_greedy(base, [p], NEW, adapter=None if n is None else adapters[n])[0]
            for p, n in zip(prompts, names)]


def test_adapters_and_base_in_one_batch_match_peft(base: Path,
                                                   adapters: Dict[str, Path]) -> None:
    """Nine prompts, three per adapter and three on the base model, in one call (one batch,
    5-token prefill chunks, pages of 4), then the same prompts with the adapters swapped: a
    prefix the cache holds for one adapter (or the base) is never reused by another, whose
    K/V differ."""
    prompts = mixed_prompts(9, seed=3, lengths=(3, 14, 30))
    names: List[Optional[str]] = [None, "all", "few"] * 3
    swapped: List[Optional[str]] = ["all", "few", None] * 3
    with LLM(str(base), device="cpu", page_size=4, max_prefill_tokens=5, max_kv_tokens=4096,
             show_progress=False, lora_modules=_modules(adapters)) as llm:
        first = llm.generate(prompts, [SamplingParams(max_tokens=NEW, temperature=0.0,
                                                      ignore_eos=True, lora_name=n)
                                       for n in names])
        second = llm.generate(prompts, [SamplingParams(max_tokens=NEW, temperature=0.0,
                                                       ignore_eos=True, lora_name=n)
                                        for n in swapped])
        assert llm.check_accounting().live_requests == 0
    assert [o.token_ids for o in first] == _expected(base, adapters, prompts, names)
    assert [o.token_ids for o in second] == _expected(base, adapters, prompts, swapped)
    # a prompt shared by two adapters within one run reuses nothing across them
    assert all(o.cached_tokens == 0 for o in second)


@pytest.mark.parametrize("kw", [dict(mixed_steps=True, max_prefill_tokens=16),
                                dict(overlap=True)], ids=["mixed", "overlap"])
def test_adapters_in_mixed_steps_and_overlap(base: Path, adapters: Dict[str, Path],
                                             kw: dict) -> None:
    """Three rows for six requests: newcomers' chunks join the others' decodes in mixed steps,
    or the scheduler decides a step ahead (overlap); each request keeps its adapter."""
    prompts = mixed_prompts(6, seed=11)
    names: List[Optional[str]] = [None, "all", "few"] * 2
    with LLM(str(base), device="cpu", page_size=4, max_kv_tokens=4096, show_progress=False,
             max_running_requests=3, lora_modules=_modules(adapters), **kw) as llm:
        outs = llm.generate(prompts, [SamplingParams(max_tokens=NEW, temperature=0.0,
                                                     ignore_eos=True, lora_name=n)
                                      for n in names])
    assert [o.token_ids for o in outs] == _expected(base, adapters, prompts, names)


def test_one_pair_of_products_gives_each_token_its_own_adapters_delta() -> None:
    """A fused two-part projection with adapters in slots 0 and 2 (ranks 4 and 2, slot 1
    empty): the eager rows (over the slots the batch uses) and a decode graph's rows (over
    every slot) both add each token exactly its adapter's delta, none to a base token, and
    leave the projection's output as it was."""
    torch.manual_seed(0)
    layer = LoraSlots(LoraShape(slots=3, max_rank=4), 10, [Shard(0, 6), Shard(0, 5)])
    pairs = {}
    for slot, rank in ((0, 4), (2, 2)):
        for part, rows in ((0, 6), (1, 5)):
            pairs[slot, part] = (torch.randn(rank, 10), torch.randn(rows, rank))
            layer.load(slot, part, *pairs[slot, part], scaling=0.5)
    token_slots = [2, -1, 0, 2, -1]
    x, y = torch.randn(5, 10), torch.randn(5, 11)
    before = y.clone()
    expected = y.clone()
    for t, slot in enumerate(token_slots):
        for part, cols in ((0, slice(0, 6)), (1, slice(6, 11))):
            if slot >= 0:
                a, b = pairs[slot, part]
                expected[t, cols] += 0.5 * (b @ (a @ x[t]))
    reqs = [SimpleNamespace(lora=None if s < 0 else LoraBinding(s, 1)) for s in token_slots]
    eager = lora_rows(SimpleNamespace(reqs=reqs, extend_lens=[1] * 5),  # type: ignore[arg-type]
                      torch.device("cpu"), torch.float32)
    assert eager is not None and eager.picks is not None and eager.picks.tolist() == [0, 2]
    graph = graph_lora_rows(torch.tensor(token_slots, dtype=torch.int32), 3, torch.float32)
    for rows in (eager, graph):
        torch.testing.assert_close(layer.add_delta(y, x, rows), expected)
    assert torch.equal(y, before)
    layer.clear(2)
    torch.testing.assert_close(layer.add_delta(y, x, graph)[[0, 3]], y[[0, 3]])


def test_tp2_adapters_match_peft(base: Path, adapters: Dict[str, Path], tmp_path: Path) -> None:
    """tp=2: each rank holds A whole and its rows of B (q/k/v, gate/up), or its columns of A
    and B whole (o, down: the all-reduce sums the deltas). "few" loads at run time on both
    ranks; a load that fails (a truncated file) leaves both ranks as they were."""
    prompts = mixed_prompts(4, seed=4, lengths=(5, 21))
    names: List[Optional[str]] = ["all", "few", None, "all"]
    with LLM(str(base), device="cpu", tp=2, page_size=4, max_kv_tokens=4096,
             show_progress=False, lora_modules={"all": str(adapters["all"])},
             max_loras=3) as llm:
        few = LoRARequest("few", 2, str(adapters["few"]))
        outs = llm.generate(prompts, GREEDY, lora_request=[None if n is None else (
            few if n == "few" else LoRARequest(n)) for n in names])
        broken = tmp_path / "broken"
        broken.mkdir()
        for f in adapters["few"].iterdir():
            cut = 200 if f.suffix == ".safetensors" else None
            (broken / f.name).write_bytes(f.read_bytes()[:cut])
        with pytest.raises(ValueError, match="SafetensorError"):
            llm.add_lora(LoRARequest("late", 3, str(broken)))
        assert llm.list_loras() == ["all", "few"]
        assert llm.check_accounting().live_requests == 0
    assert [o.token_ids for o in outs] == _expected(base, adapters, prompts, names)


@pytest.mark.parametrize("family", ["phi3", "gemma3_multimodal", "granite"])
def test_fused_and_multimodal_checkpoints_adapters_match_peft(
        family: str, tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    """Phi-3's adapters adapt its fused qkv_proj and gate_up_proj (B's rows split per part,
    A shared); a Gemma 3 multimodal checkpoint's adapter also adapts the vision tower, whose
    pairs are skipped (text prompts never reach it); Granite's o_proj and down_proj deltas
    take its residual multiplier, as their outputs do."""
    from tiny_models import build_tiny_gemma3_multimodal
    if family == "phi3":
        model = tiny_model("phi3")
        targets = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    elif family == "granite":
        model = tiny_model("granite")
        targets = ("q_proj", "o_proj", "down_proj")
    else:
        model = build_tiny_gemma3_multimodal(tmp_path / "gemma3")
        targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                   "down_proj")
    _check_one_adapter(model, build_tiny_lora(model, tmp_path / "adapter", 7, targets=targets),
                       mixed_prompts(2, seed=7, lengths=(4, 19)))


def _check_one_adapter(model: Path, adapter: Path, prompts: List[List[int]],
                       reference: Optional[Path] = None) -> None:
    """`model` serving `adapter` alone gives PEFT's greedy tokens for `prompts` (on
    `reference`, by default `model`)."""
    with LLM(str(model), device="cpu", page_size=4, max_kv_tokens=2048, show_progress=False,
             lora_modules=f"x={adapter}") as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0.0,
                                                    ignore_eos=True, lora_name="x"))
    assert [o.token_ids for o in outs] == hf_greedy(reference or model, prompts, NEW,
                                                    adapter=adapter)


def test_hand_written_adapter_reads_as_peft_reads_it(base: Path, tmp_path: Path) -> None:
    """The adapter the GPU tests write without PEFT (tiny_models.write_lora) is one PEFT
    applies as minisgl does."""
    _check_one_adapter(base, write_lora(base, tmp_path / "hand", 9),
                       mixed_prompts(2, seed=8, lengths=(7, 15)))


def test_vllm_lora_request(base: Path, adapters: Dict[str, Path]) -> None:
    """vLLM's `generate(..., lora_request=LoRARequest(name, id, path))`, for all prompts or one
    each, in `chat` too; an adapter not loaded and given no path (or a path that holds none),
    or loaded from another directory, is a ValueError naming it."""
    prompts = mixed_prompts(2, seed=5, lengths=(6, 11))
    with LLM(str(base), device="cpu", page_size=4, max_kv_tokens=2048, show_progress=False,
             lora_modules={k: str(v) for k, v in adapters.items()}) as llm:
        one = llm.generate(prompts, GREEDY, lora_request=LoRARequest("few", 1,
                                                                     str(adapters["few"])))
        each = llm.generate(prompts, GREEDY, lora_request=[LoRARequest("all", 2), None])
        chat = llm.chat([{"role": "user", "content": "Hi"}], GREEDY,
                        lora_request=LoRARequest("all", 2))
        with pytest.raises(ValueError, match="'other' is not loaded .*gives no lora_path"):
            llm.generate(prompts, GREEDY, lora_request=LoRARequest("other", 3))
        with pytest.raises(ValueError, match="at run time needs --enable-lora"):
            llm.generate(prompts, GREEDY, lora_request=LoRARequest("other", 3, "/x"))
        with pytest.raises(ValueError, match="'few' was loaded from .*, not /elsewhere"):
            llm.generate(prompts, GREEDY, lora_request=LoRARequest("few", 1, "/elsewhere"))
        with pytest.raises(ValueError, match="'nope' is not loaded"):
            llm.generate(prompts, SamplingParams(lora_name="nope"))
        assert llm.generate(prompts[:1], GREEDY)[0].token_ids  # still serving
    assert [o.token_ids for o in one] == _expected(base, adapters, prompts, ["few", "few"])
    assert [o.token_ids for o in each] == _expected(base, adapters, prompts, ["all", None])
    assert len(chat[0].outputs[0].token_ids) == NEW


def test_adapters_load_at_run_time_least_recently_used_out(
        base: Path, adapters: Dict[str, Path], tmp_path: Path) -> None:
    """vLLM's offline LoRA: `LLM(enable_lora=True)` starts with no adapter, and a
    LoRARequest's lora_path loads it on first use; with every slot taken the least recently
    used adapter the call does not need is unloaded. A failed load changes nothing; the
    prefix cache never serves one adapter's K/V to another loaded into the same slot."""
    prompts = mixed_prompts(2, seed=8, lengths=(9, 17))
    a, f = (LoRARequest(n, i, str(adapters[n])) for i, n in ((1, "all"), (2, "few")))
    with LLM(str(base), device="cpu", page_size=4, max_kv_tokens=2048, show_progress=False,
             enable_lora=True) as llm:
        first = llm.generate(prompts, GREEDY, lora_request=a)
        second = llm.generate(prompts, GREEDY, lora_request=f)  # "all" out, "few" in slot 0
        assert llm.list_loras() == ["few"]
        with pytest.raises(ValueError, match="2 LoRA adapters do not fit the 1 slots"):
            llm.generate(prompts, GREEDY, lora_request=[a, f])
        with pytest.raises(ValueError, match="no adapter_config.json"):
            llm.add_lora(LoRARequest("gone", 3, str(tmp_path / "missing")))
        assert not llm.add_lora(f) and llm.list_loras() == ["few"]
        assert llm.remove_lora("few") and not llm.remove_lora("few")
        third = llm.generate(prompts, GREEDY, lora_request=a)  # back in the same slot
        assert all(o.cached_tokens == 0 for o in second + third)
        assert llm.check_accounting().live_requests == 0
    assert [o.token_ids for o in first] == _expected(base, adapters, prompts, ["all"] * 2)
    assert [o.token_ids for o in second] == _expected(base, adapters, prompts, ["few"] * 2)
    assert [o.token_ids for o in third] == [o.token_ids for o in first]


def _refusal(base: Path, adapter: Path, match: str, **kw: object) -> None:
    with pytest.raises(Exception, match=match):
        with LLM(str(base), device="cpu", max_kv_tokens=1024, show_progress=False,
                 lora_modules=f"bad={adapter}", **kw):
            pass


@pytest.mark.parametrize("change,match", [
    ({"use_dora": True}, "use_dora=True is not supported"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save .* is not supported"),
    ({"r": 32}, r"rank 32 is not in \[1, 16\] \(--max-lora-rank\)"),
    ({"bias": "all"}, "bias='all' is not supported"),
])
def test_adapters_minisgl_cannot_apply_are_refused_at_start(
        base: Path, adapters: Dict[str, Path], tmp_path: Path, change: dict, match: str) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((adapters["few"] / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, **change}))
    (bad / "adapter_model.safetensors").write_bytes(
        (adapters["few"] / "adapter_model.safetensors").read_bytes())
    _refusal(base, bad, f"LoRA adapter 'bad': {match}")


def test_adapted_modules_and_models_minisgl_cannot_serve_are_refused(
        base: Path, adapters: Dict[str, Path], tiny_model: Callable[..., Path],
        tmp_path: Path) -> None:
    """An adapter of the embeddings or of a mixture of experts' routed experts, a missing
    directory, a malformed list: each a start-up error naming it."""
    embed = build_tiny_lora(base, tmp_path / "embed", 4, targets=("embed_tokens", "q_proj"))
    _refusal(base, embed, "tensor .*embed_tokens.* is not a LoRA A or B weight")
    _refusal(base, tmp_path / "missing", "LoRA adapter 'bad': no adapter_config.json")
    with pytest.raises(ValueError, match="lora_modules entry '=/p' is not NAME=PATH"):
        LLM(str(base), device="cpu", lora_modules="=/p")
    with pytest.raises(ValueError, match="lora_modules names a more than once"):
        LLM(str(base), device="cpu", lora_modules="a=/p,a=/q")
    with pytest.raises(ValueError, match="max_loras 1 is fewer than the 2 adapters"):
        LLM(str(base), device="cpu", lora_modules="a=/p,b=/q", max_loras=1)
    moe = tiny_model("qwen3_moe")
    experts = build_tiny_lora(moe, tmp_path / "experts", 5, rank=4, targets=("q_proj",))
    tensors = {f"base_model.model.model.layers.0.mlp.experts.3.up_proj.lora_{h}.weight": t
               for h, t in (("A", torch.ones(4, 64)), ("B", torch.ones(32, 4)))}
    save_file(tensors, str(experts / "adapter_model.safetensors"))
    _refusal(moe, experts, "adapts model.layers.0.mlp.experts.3.up_proj, which is not one of "
             "this model's projections that take adapters .*not a router or routed experts")


def test_adapters_of_fp8_weights_match_peft_on_the_dequantized_twin(
        base: Path, tmp_path: Path) -> None:
    """An FP8 checkpoint (per-channel weight scales, tp=1 and tp=2: each rank's scales its
    own rows' or columns') serving an adapter of every projection and the base model in one
    batch: PEFT's tokens on the checkpoint's dequantized twin."""
    from fp8_checkpoints import Fp8Format, Group, write_fp8
    ckpt = write_fp8(base, tmp_path / "fp8", Fp8Format(
        "compressed-tensors", (Group("Linear", "channel", False),), (), ("lm_head",)))
    adapter = build_tiny_lora(ckpt.dequantized, tmp_path / "adapter", 6)
    prompts = mixed_prompts(4, seed=9, lengths=(4, 23))
    names: List[Optional[str]] = ["x", None, "x", "x"]
    want = [hf_greedy(ckpt.dequantized, [p], NEW, adapter=adapter if n else None)[0]
            for p, n in zip(prompts, names)]
    assert want[0] != hf_greedy(ckpt.dequantized, prompts[:1], NEW)[0]  # the adapter counts
    for tp in (1, 2):
        with LLM(str(ckpt.fp8), device="cpu", tp=tp, page_size=4, max_kv_tokens=2048,
                 show_progress=False, lora_modules=f"x={adapter}") as llm:
            outs = llm.generate(prompts, [SamplingParams(max_tokens=NEW, temperature=0.0,
                                                         ignore_eos=True, lora_name=n)
                                          for n in names])
        assert [o.token_ids for o in outs] == want, tp


def test_adapters_of_packed_integer_weights_match_peft_on_the_dequantized_twin(
        base: Path, tmp_path: Path) -> None:
    """An AWQ checkpoint (on the CPU dequantized at load; on the GPU kept packed:
    tests/test_int_packed.py) serving an adapter: PEFT's tokens on its dequantized twin."""
    from test_int_weights import _write
    quantized, dense = tmp_path / "awq", tmp_path / "dense"
    _write(base, quantized, dense, "awq")
    adapter = build_tiny_lora(dense, tmp_path / "adapter", 3, targets=("k_proj", "up_proj"))
    _check_one_adapter(quantized, adapter, mixed_prompts(2, seed=13, lengths=(6, 18)),
                       reference=dense)


def test_adapters_of_a_mixture_of_experts_match_peft(tiny_model: Callable[..., Path],
                                                     tmp_path: Path) -> None:
    """Qwen2-MoE: an adapter of attention, the dense layer's MLP and the sparse layers'
    shared expert (its delta inside the expert, under the expert's sigmoid gate), beside the
    base model in one batch: PEFT's tokens."""
    moe = tiny_model("qwen2_moe")
    adapter = build_tiny_lora(moe, tmp_path / "adapter", 8, targets=(
        "q_proj", "v_proj", "o_proj", "shared_expert.gate_proj", "shared_expert.up_proj",
        "shared_expert.down_proj"))
    prompts = mixed_prompts(3, seed=10, lengths=(5, 20))
    names: List[Optional[str]] = ["x", None, "x"]
    with LLM(str(moe), device="cpu", page_size=4, max_kv_tokens=2048, show_progress=False,
             lora_modules=f"x={adapter}") as llm:
        outs = llm.generate(prompts, [SamplingParams(max_tokens=NEW, temperature=0.0,
                                                     ignore_eos=True, lora_name=n)
                                      for n in names])
    want = [hf_greedy(moe, [p], NEW, adapter=adapter if n else None)[0]
            for p, n in zip(prompts, names)]
    assert [o.token_ids for o in outs] == want
    assert want[0] != hf_greedy(moe, prompts[:1], NEW)[0]  # the adapter counts


def test_http_model_field_picks_the_adapter(base: Path, adapters: Dict[str, Path],
                                            tmp_path: Path) -> None:
    """Over HTTP an adapter is a model: /v1/models lists it (its parent the base model), a
    completion naming it runs with it (and says so in its `model`), SGLang's /generate takes
    its `lora_path`, and a name neither served nor loaded is a 404. Adapters load and unload
    at run time through vLLM's and SGLang's endpoints, each refusal a 4xx naming why."""
    prompt = mixed_prompts(1, seed=6, lengths=(9,))[0]
    want = _expected(base, adapters, [prompt, prompt, prompt], ["all", None, "few"])
    args = ["--model", str(base), *CPU_ARGS, "--lora-modules", _modules(adapters),
            "--max-loras", "3"]
    with serving(args, tmp_path) as srv:
        models = httpx.get(f"{srv.url}/v1/models").json()["data"]
        assert [(m["id"], m["parent"]) for m in models[1:]] == [("all", models[0]["id"]),
                                                                 ("few", models[0]["id"])]
        body = {"prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        out = httpx.post(f"{srv.url}/v1/completions", json={**body, "model": "all"},
                         timeout=60).json()
        assert out["model"] == "all" and out["choices"][0]["token_ids"] == want[0]
        plain = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).json()
        assert plain["choices"][0]["token_ids"] == want[1]
        sglang = httpx.post(f"{srv.url}/v1/completions", json={**body, "lora_path": "all"},
                            timeout=60).json()  # SGLang's field in an OpenAI body
        assert sglang["choices"][0]["token_ids"] == want[0]
        gen = httpx.post(f"{srv.url}/generate", json={
            "input_ids": prompt, "lora_path": "all", "sampling_params": {
                "max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}}, timeout=60).json()
        assert gen["output_ids"] == want[0]
        missing = httpx.post(f"{srv.url}/v1/completions", json={**body, "model": "nope"},
                             timeout=60)
        assert missing.status_code == 404
        assert "LoRA adapters all, few" in missing.json()["error"]["message"]
        bad = httpx.post(f"{srv.url}/generate", json={"input_ids": prompt, "lora_path": "nope"},
                         timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
        assert "(loaded: all, few)" in bad.json()["error"]["message"]
        _load_and_unload_at_run_time(srv.url, adapters, {**body, "model": "late"}, want[2])


def _load_and_unload_at_run_time(url: str, adapters: Dict[str, Path], body: dict,
                                 want: List[int]) -> None:
    """With "all" and "few" loaded into 3 slots: "late" (few's files) loads, serves, refuses
    to load twice; a missing directory and a fourth adapter are refused; "late" unloads and
    is gone."""
    load = {"lora_name": "late", "lora_path": str(adapters["few"])}
    r = httpx.post(f"{url}/v1/load_lora_adapter", json=load, timeout=60)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'late' added successfully."
    again = httpx.post(f"{url}/v1/load_lora_adapter", json=load, timeout=60)
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    assert "late" in [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
    assert "minisgl_lora_adapters_loaded 3" in httpx.get(f"{url}/metrics").text
    out = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    assert out["model"] == "late" and out["choices"][0]["token_ids"] == want
    missing = httpx.post(f"{url}/load_lora_adapter", timeout=60,
                         json={"lora_name": "x", "lora_path": "/nonexistent"})
    assert missing.status_code == 400 and not missing.json()["success"]
    assert "no adapter_config.json in /nonexistent" in missing.json()["error_message"]
    full = httpx.post(f"{url}/load_lora_adapter", timeout=60,
                      json={"lora_name": "fourth", "lora_path": str(adapters["all"])})
    assert "every one of the 3 LoRA adapter slots is taken" in full.json()["error_message"]
    gone = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "late"}, timeout=60)
    assert gone.json() == {"success": True, "error_message": "", "loaded_adapters": {
        "all": str(adapters["all"]), "few": str(adapters["few"])}}
    twice = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=60)
    assert twice.status_code == 404
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 404


def test_an_adapter_named_like_the_served_model_is_refused() -> None:
    from minisgl.server.args import ServerConfig
    from minisgl.settings import build
    with pytest.raises(ValueError, match="x names both the served model and a LoRA adapter"):
        build(ServerConfig(), {"served_model_name": "m,x", "lora_paths": "x=/p"}, "serve")


def test_lora_modules_take_vllms_json_form() -> None:
    """vLLM's `--lora-modules '{"name": ..., "path": ..., "base_model_name": ...}'` (or a
    list of such objects) names the adapters as NAME=PATH pairs do."""
    from minisgl.engine.config import EngineConfig
    one = '{"name": "a", "path": "/p", "base_model_name": "m"}'
    assert EngineConfig(lora_modules=one).lora_adapters == (("a", "/p"),)
    both = '[{"name": "a", "path": "/p"}, {"name": "b", "path": "/q"}]'
    assert EngineConfig(lora_modules=both).lora_adapters == EngineConfig(
        lora_modules="a=/p, b=/q").lora_adapters
    with pytest.raises(ValueError, match='has no "name" and "path" strings'):
        EngineConfig(lora_modules='{"name": 1}')
    with pytest.raises(ValueError, match="lora_modules is not JSON"):
        EngineConfig(lora_modules="{name")
    # SGLang's bare path: the adapter named by it
    assert EngineConfig(lora_modules="/a/sql, b=/q").lora_adapters == (("/a/sql", "/a/sql"),
                                                                       ("b", "/q"))


def test_lora_lists_take_several_words_as_vllm_and_sglang_do() -> None:
    """`--lora-modules a=/p b=/q` (vLLM; SGLang's --lora-paths too), JSON objects likewise;
    the words after the list stay flags and the model."""
    from minisgl.server.args import parse_args
    cfg = parse_args(["--lora-modules", "a=/p", "b=/q", "--max-loras", "3", "m"])
    assert cfg.engine.lora_adapters == (("a", "/p"), ("b", "/q"))
    assert cfg.engine.max_loras == 3 and cfg.model == "m"
    objs = ['{"name": "a", "path": "/p"}', '{"name": "b", "path": "/q"}']
    assert parse_args(["--lora-paths", *objs, "m"]).engine.lora_adapters == (
        ("a", "/p"), ("b", "/q"))


def test_an_adapter_given_as_a_hub_id_is_fetched_and_served(
        base: Path, adapters: Dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """`--lora-modules all=ORG/NAME` (vLLM's and SGLang's hub ids): the adapter's config and
    weights come through huggingface_hub's snapshot (here a stand-in returning the local
    copy) and it serves PEFT's tokens; an id the hub cannot give is a ValueError naming the
    adapter and the id."""
    import huggingface_hub
    from minisgl.models.lora_config import read_adapter
    asked: List[tuple] = []

    def snapshot(repo_id: str, **kw: object) -> str:
        asked.append((repo_id, tuple(kw["allow_patterns"])))  # type: ignore[arg-type]
        if repo_id != "org/all-lora":
            raise OSError(f"404 Client Error: {repo_id} not found")
        return str(adapters["all"])
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)
    assert read_adapter("all", "org/all-lora", 16).path == adapters["all"]
    assert asked == [("org/all-lora", ("adapter_config.json", "adapter_model.safetensors"))]
    with pytest.raises(ValueError, match="LoRA adapter 'x': model 'org/none' .*404"):
        read_adapter("x", "org/none", 16)
    prompts = mixed_prompts(2, seed=5)
    with LLM(str(base), device="cpu", page_size=4, max_kv_tokens=2048, show_progress=False,
             lora_modules={"all": "org/all-lora"}) as llm:
        outs = llm.generate(prompts, GREEDY, lora_request=LoRARequest("all"))
    assert [o.token_ids for o in outs] == _expected(base, adapters, prompts, ["all", "all"])


def test_the_launcher_names_a_bad_adapter_before_any_rank_starts(base: Path,
                                                                 tmp_path: Path) -> None:
    """`serve` reads every adapter's config before it starts anything: one error line, exit
    1, nothing left behind (the launcher imports no torch for it)."""
    r = run_serve(["--model", str(base), *CPU_ARGS, "--port", "0", "--lora-modules",
                   f"x={tmp_path / 'missing'}"], tmp_path)
    assert r.returncode == 1
    assert "LoRA adapter 'x': no adapter_config.json" in error_line(r.stderr)
    assert "Traceback" not in r.stderr and runtime_dirs(tmp_path) == []
