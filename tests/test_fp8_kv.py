"""The FP8 KV cache end to end: the setting, the pool's size, the checkpoint's K/V scales, and
generation on CPU (torch backend) with prefix caching and chunked prefill.

The kernels' numerics over FP8 pools are tested in test_triton_attention.py."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable, List

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.engine import EngineConfig
from minisgl.engine.engine import check_kv_cache_dtype, pages_that_fit
from minisgl.kvcache.pool import FP8_KV_DTYPE, KVScales, quantize
from minisgl.models import ModelConfig
from minisgl.models.kv_scales import KVScaleCollector, kv_scale_target
from recording_source import ValuesSource

from script_loader import load_script


def test_kv_cache_dtype_setting() -> None:
    # auto: the model's dtype (float32 on the CPU)
    assert EngineConfig(device="cpu").kv_torch_dtype == torch.float32
    assert EngineConfig(dtype="bf16").kv_torch_dtype == torch.bfloat16
    for name in ("fp8", "fp8_e4m3"):
        assert EngineConfig(kv_cache_dtype=name).kv_torch_dtype == FP8_KV_DTYPE
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8_e4m3, fp8, "
                                         "got 'int4'"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM("unused", kv_cache_dtype="int4")
    # The bench scripts take the flag like every engine setting.
    latency = load_script("bench_latency")
    args = latency.parse_args(["--kv-cache-dtype", "fp8_e4m3"])
    assert latency.engine_settings(args).kv_torch_dtype == FP8_KV_DTYPE
    offline = load_script("bench_offline")
    assert offline.parse_args(["--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):
        latency.parse_args(["--kv-cache-dtype", "int4"])


def test_fp8_kv_needs_compute_capability_8_9(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = EngineConfig(kv_cache_dtype="fp8_e4m3")
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"kv_cache_dtype 'fp8_e4m3' needs compute capability "
                                         r"8.9 or newer \(FP8\); cuda:0 \(NVIDIA A100\) has 8.0"):
        check_kv_cache_dtype(cfg, gpu)
    check_kv_cache_dtype(EngineConfig(), gpu)  # a 16-bit cache runs anywhere
    check_kv_cache_dtype(cfg, torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    check_kv_cache_dtype(cfg, gpu)


def test_fp8_pool_holds_twice_the_pages(default_model_dir: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same memory budget holds twice the pages in FP8 as in bf16/fp16 (four times fp32),
    on a GPU (a share of the free memory) and on the CPU (the memory of the default token
    count in the model's dtype); a token count set by the user stays a token count."""
    model_cfg = ModelConfig.from_dir(str(default_model_dir))
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 << 30, 80 << 30))

    def pages(device: torch.device, **kw: object) -> int:
        # the config's device is the one asked about ("auto" would be CUDA on a GPU machine,
        # and the CPU case's dtype with it)
        cfg = EngineConfig(device=device.type, **kw)  # type: ignore[arg-type]
        return pages_that_fit(cfg, model_cfg, 3, device)

    for dtype in ("bf16", "fp16"):
        assert pages(gpu, dtype=dtype, kv_cache_dtype="fp8") == 2 * pages(gpu, dtype=dtype)
        assert pages(cpu, dtype=dtype, kv_cache_dtype="fp8") == 2 * pages(cpu, dtype=dtype)
    assert pages(cpu, kv_cache_dtype="fp8") == 4 * pages(cpu) == 4 * 16384 // 16
    assert pages(gpu, kv_cache_dtype="fp8", max_kv_tokens=1000) == pages(gpu, max_kv_tokens=1000)


def test_kv_cache_memory_is_the_pools_bytes(default_model_dir: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's kv_cache_memory: the pool is the pages of the KV dtype in those bytes, on the
    CPU and on a GPU whatever mem_fraction and gpu_memory_utilization say; less than a page,
    more than the GPU's free memory, or with max_kv_tokens, is refused naming the numbers; an
    engine built with it holds that many pages."""
    model_cfg = ModelConfig.from_dir(str(default_model_dir))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 30, 80 << 30))
    page = 2 * model_cfg.num_layers * 16 * 3 * model_cfg.head_dim  # bytes of an FP8 page

    def pages(device: str, **kw: object) -> int:
        cfg = EngineConfig(device=device, **kw)  # type: ignore[arg-type]
        return pages_that_fit(cfg, model_cfg, 3, torch.device(device))

    budget = 100 * page + 7
    assert pages("cpu", kv_cache_memory=budget, kv_cache_dtype="fp8") == 100
    assert pages("cpu", kv_cache_memory=budget, dtype="bf16") == 50
    assert pages("cuda", kv_cache_memory=budget, dtype="bf16", mem_fraction=0.1,
                 gpu_memory_utilization=0.01) == 50
    with pytest.raises(ValueError, match=f"less than one KV page \\({page} bytes"):
        pages("cpu", kv_cache_memory=page - 1, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="2048 MiB is more than the 1024 MiB free"):
        pages("cuda", kv_cache_memory=2 << 30)
    with pytest.raises(ValueError, match="kv_cache_memory .* or max_kv_tokens .*, not both"):
        EngineConfig(kv_cache_memory=budget, max_kv_tokens=64)
    monkeypatch.undo()
    with LLM(str(default_model_dir), kv_cache_memory=budget, kv_cache_dtype="fp8",
             show_progress=False) as llm:
        assert llm._backend.engine.num_pages == 100  # type: ignore[attr-defined]


def test_gpu_memory_utilization_caps_the_instance() -> None:
    """vLLM's gpu_memory_utilization: the pool takes mem_fraction of what the share of the
    GPU's total leaves after what this process holds, never more than of the free memory;
    nothing left is an error naming the numbers."""
    from minisgl.engine.engine import gpu_kv_budget
    gib = 1 << 30
    assert gpu_kv_budget(60 * gib, 80 * gib, 16 * gib, 0.5, None) == 30 * gib
    # two instances of 0.45 on one 80 GiB GPU: the first sees 64 free, the cap allows 36 - 16
    assert gpu_kv_budget(64 * gib, 80 * gib, 16 * gib, 0.5, 0.45) == 10 * gib
    # the second: the first's 36 GiB gone, 44 - 16 free, capped the same
    assert gpu_kv_budget(28 * gib, 80 * gib, 16 * gib, 0.5, 0.45) == 10 * gib
    # another process holds most of the GPU: the free memory is the limit
    assert gpu_kv_budget(8 * gib, 80 * gib, 16 * gib, 0.5, 0.9) == 4 * gib
    with pytest.raises(ValueError, match="allows this instance 16384 MiB of the GPU's 81920 "
                                         "MiB; it already holds 17408 MiB"):
        gpu_kv_budget(60 * gib, 80 * gib, 17 * gib, 0.5, 0.2)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        EngineConfig(gpu_memory_utilization=1.5)


def test_kv_scale_names_and_values() -> None:
    """vLLM's spellings of the per-layer scales are taken out of the stream the model loads;
    layers without one keep 1.0; malformed scales are refused by name."""
    assert kv_scale_target("model.layers.3.self_attn.k_scale") == (3, ("k",))
    assert kv_scale_target("model.layers.3.self_attn.attn.v_scale") == (3, ("v",))
    assert kv_scale_target("model.layers.0.self_attn.kv_scale") == (0, ("k", "v"))
    assert kv_scale_target("model.layers.1.self_attn.k_proj.output_scale") == (1, ("k",))
    assert kv_scale_target("model.layers.1.self_attn.v_proj.v_scale") == (1, ("v",))
    for other in ("model.layers.1.self_attn.k_proj.weight_scale",
                  "model.layers.1.self_attn.q_proj.output_scale",
                  "model.layers.1.self_attn.k_proj.input_scale", "model.norm.weight"):
        assert kv_scale_target(other) is None, other
    collector = KVScaleCollector(3)
    stream = [("model.layers.0.self_attn.k_proj.weight", ValuesSource(1.0)),
              ("model.layers.0.self_attn.k_scale", ValuesSource(0.5)),
              ("model.layers.2.self_attn.kv_scale", ValuesSource(0.25)),
              ("model.layers.0.self_attn.v_proj.output_scale", ValuesSource(2.0))]
    assert [n for n, _ in collector.filter(stream)] == ["model.layers.0.self_attn.k_proj.weight"]
    assert collector.found == 4
    assert collector.scales() == KVScales((0.5, 1.0, 0.25), (2.0, 1.0, 0.25))
    for bad, match in (([("model.layers.0.self_attn.k_scale", ValuesSource(0.5, 0.5))],
                        "one value"),
                       ([("model.layers.0.self_attn.v_scale", ValuesSource(0.0))], "positive"),
                       ([("model.layers.7.self_attn.v_scale", ValuesSource(1.0))], "layer 7")):
        with pytest.raises(ValueError, match=match):
            list(KVScaleCollector(3).filter(bad))


def _agreement(a: List[int], b: List[int]) -> float:
    return sum(x == y for x, y in zip(a, b)) / max(len(a), len(b))


def test_checkpoint_kv_scales_load_and_are_used(tiny_model: Callable[..., Path],
                                                tmp_path: Path) -> None:
    """A checkpoint with K/V scales for some layers loads with either KV dtype (the scales are
    not model parameters); the FP8 pool stores K / k_scale and V / v_scale with them (1.0 for
    the rest): layer 0's entries are exactly the float32 run's K/V quantized, layer 1's (after
    an FP8 attention) close to them; the first greedy tokens agree."""
    from safetensors.torch import save_file
    model = tmp_path / "scaled"
    shutil.copytree(tiny_model("llama"), model)
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(0.05),
               "model.layers.0.self_attn.v_scale": torch.tensor([0.02]),
               "model.layers.1.self_attn.k_proj.output_scale": torch.tensor([0.04])},
              str(model / "kv_scales.safetensors"))
    prompts = [[5, 17, 300, 42, 7, 99, 1000, 3], [8, 8, 150, 2000]]
    # One token each: the pools then hold the prompts' K/V only, at the same slots in both runs.
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    pools, tokens = {}, {}
    for kv in ("auto", "fp8"):
        with LLM(str(model), dtype="float32", kv_cache_dtype=kv, max_kv_tokens=256,
                 show_progress=False) as llm:
            pools[kv] = llm._backend.engine.pool  # type: ignore[attr-defined]
            tokens[kv] = [o.token_ids for o in llm.generate(prompts, params)]
    ref, fp8 = pools["auto"], pools["fp8"]
    assert ref.dtype == torch.float32 and fp8.dtype == FP8_KV_DTYPE
    f32 = lambda x: float(torch.tensor(x, dtype=torch.float32))  # noqa: E731
    assert fp8.scales == KVScales((f32(0.05), f32(0.04)), (f32(0.02), 1.0))
    assert torch.equal(fp8.k[0].view(torch.uint8), quantize(ref.k[0], f32(0.05)).view(torch.uint8))
    assert torch.equal(fp8.v[0].view(torch.uint8), quantize(ref.v[0], f32(0.02)).view(torch.uint8))
    used = ref.k[1].abs().sum() > 0
    assert used and (fp8.k[1].float() * f32(0.04) - ref.k[1]).norm() < 0.1 * ref.k[1].norm()
    assert tokens["fp8"] == tokens["auto"]


def test_a_reload_with_other_kv_scales_keeps_the_pools_and_says_so(
        tiny_model: Callable[..., Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The FP8 pool's scales live in its pages and in the decode graphs: a weights reload
    from a checkpoint giving other scales keeps them, and the warning names the layers; one
    giving the same says nothing."""
    import logging
    from safetensors.torch import save_file
    same, other = tmp_path / "same", tmp_path / "other"
    for path, k0 in ((same, 0.05), (other, 0.5)):
        shutil.copytree(tiny_model("llama"), path)
        save_file({"model.layers.0.self_attn.k_scale": torch.tensor(k0)},
                  str(path / "kv_scales.safetensors"))
    with LLM(str(same), dtype="float32", kv_cache_dtype="fp8", max_kv_tokens=256,
             show_progress=False) as llm:
        pool = llm._backend.engine.pool  # type: ignore[attr-defined]
        served = pool.scales
        with caplog.at_level(logging.WARNING, logger="minisgl.engine.engine"):
            llm.update_weights_from_disk(str(same))
            assert "KV cache scales" not in caplog.text
            llm.update_weights_from_disk(str(other))
        assert pool.scales == served
    assert "gives other KV cache scales" in caplog.text
    assert f"layer 0 k: {float(torch.tensor(0.05)):g} -> 0.5" in caplog.text


def test_default_model_with_fp8_kv(default_model_dir: Path) -> None:
    """The default model with an FP8 KV cache (scales 1.0): answers "Paris" over chunked
    prefill, answers the same again from the prefix cache, agrees with a float32 KV cache on
    most greedy tokens, and the page accounting balances."""
    question = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    with LLM(str(default_model_dir), kv_cache_dtype="fp8_e4m3", max_kv_tokens=1024,
             max_prefill_tokens=16, show_progress=False) as llm:
        first = llm.chat(question, params)[0]
        again = llm.chat(question, params)[0]
        accounting = llm.check_accounting()
    assert "Paris" in first.text, first.text
    assert first.cached_tokens == 0 and again.cached_tokens >= 16
    assert again.token_ids == first.token_ids
    assert accounting.live_requests == 0 and accounting.reserved_pages == 0
    with LLM(str(default_model_dir), max_kv_tokens=1024, show_progress=False) as llm:
        ref = llm.chat(question, params)[0]
    agree = _agreement(first.token_ids, ref.token_ids)
    print(f"fp8 KV vs float32 KV greedy agreement: {agree:.0%} of {len(ref.token_ids)} tokens")
    assert agree >= 0.75, (first.text, ref.text)


@pytest.mark.gpu
def test_gpu_fp8_kv_graphs_match_eager(tiny_model: Callable[..., Path]) -> None:
    """An FP8 KV cache on the Triton backend: float32 decode CUDA graphs (padded batches) give
    the eager path's tokens (the scales are launch constants, recorded at capture)."""
    path = tiny_model("qwen3")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[1, 5, 3, 4, 6] * n for n in (1, 7, 30)]
    outputs = {}
    for graphs in (8, 0):
        with LLM(str(path), device="cuda", dtype="float32", kv_cache_dtype="fp8",
                 cuda_graph_max_bs=graphs, max_kv_tokens=4096, show_progress=False) as llm:
            outputs[graphs] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outputs[8] == outputs[0]


@pytest.mark.gpu
def test_gpu_fp8_kv_answers_paris_with_twice_the_pages(default_model_dir: Path) -> None:
    """In bf16 with an FP8 KV cache the default model answers "Paris", and the pool holds about
    twice the pages of a bf16 one in the same memory."""
    if not any(default_model_dir.glob("*.safetensors")):
        pytest.skip(f"the default model's weights are not in {default_model_dir}")
    question = [{"role": "user", "content": "What is the capital of France?"}]
    pages = {}
    for kv in ("fp8_e4m3", "auto"):
        with LLM(str(default_model_dir), device="cuda", dtype="bfloat16", kv_cache_dtype=kv,
                 mem_fraction=0.2, show_progress=False) as llm:
            answer = llm.chat(question, SamplingParams(max_tokens=24, temperature=0.0))[0]
            pages[kv] = llm.limits.num_pages
        assert "Paris" in answer.text, (kv, answer.text)
    assert 1.8 < pages["fp8_e4m3"] / pages["auto"] < 2.2
