"""Data parallelism: `--dp N` replicas behind one API server, routed by prefix, then by load.

The router's logic is checked alone (tokenizer/router.py); the service is checked through HTTP
on the CPU with a random tiny Qwen3: greedy tokens equal to the offline engine's, both replicas
serving (their metrics carry a `replica` label), a repeated prompt served from one replica's
prefix cache, a LoRA adapter loaded at run time on both replicas, and `--dp 2 --tp 2`.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import List, Optional

import httpx
from safetensors.torch import load_file

from server_helpers import CPU_ARGS, check_same_as_tp1, serving

from tiny_models import write_lora

from minisgl import LLM, LoRARequest, SamplingParams
from minisgl.message.types import SchedulerStats
from minisgl.tokenizer.router import SLACK_PAGES, Router, prefix_keys

PAGE = 4


# --- the router alone -----------------------------------------------------------------------------
def test_prefix_keys_cover_doubling_page_counts_and_all_full_pages() -> None:
    ids = list(range(11 * PAGE + 1))
    assert len(prefix_keys(ids, PAGE)) == 5  # 1, 2, 4, 8 and all 11 full pages
    assert prefix_keys(ids[:PAGE - 1], PAGE) == []
    assert prefix_keys(ids, PAGE)[:4] == prefix_keys(ids[:8 * PAGE], PAGE)
    assert prefix_keys([9, *ids[1:]], PAGE)[0] != prefix_keys(ids, PAGE)[0]
    salted = prefix_keys(ids, PAGE, "tenant-a")  # cached apart, so remembered apart
    assert not set(salted) & set(prefix_keys(ids, PAGE) + prefix_keys(ids, PAGE, "tenant-b"))
    assert salted == prefix_keys(ids, PAGE, "tenant-a")


def test_router_follows_the_prefix_unless_its_holder_is_overloaded() -> None:
    r = Router(2, PAGE)
    a, b = list(range(40)), list(range(100, 140))
    assert r.route(a, 40) == 0 and r.route(b, 40) == 1  # no holder: the least loaded
    r.update(SchedulerStats(replica=0))
    r.update(SchedulerStats(replica=1))
    assert r.route(a + [7, 8], 42) == 0 and r.route(b, 40) == 1  # the holders of the prefixes
    r.update(SchedulerStats(replica=0, kv_pages_used=4 * SLACK_PAGES))  # far above replica 1
    assert r.route(a, 40) == 1  # overloaded: the least loaded takes it, and holds it now
    r.update(SchedulerStats(replica=0))
    r.update(SchedulerStats(replica=1))
    assert r.route(a, 40) == 1
    assert Router(1, PAGE).route(a, 40) == 0


def test_router_forgets_the_oldest_prefixes_beyond_its_capacity() -> None:
    r = Router(2, PAGE, capacity=8)
    for k in range(20):
        r.route([k] * (3 * PAGE), 3 * PAGE)
    assert len(r.holders) == 8


# --- the service ----------------------------------------------------------------------------------
def _prompts(n: int, seed: int = 0) -> List[List[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 4000) for _ in range(rng.randrange(4, 40))] for _ in range(n)]


def _generate(url: str, ids: List[int], max_tokens: int, lora: Optional[str] = None) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_tokens": max_tokens, "temperature": 0},
            "lora_path": lora}
    r = httpx.post(f"{url}/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_dp2_matches_the_offline_engine_and_uses_both_replicas(tmp_path: Path,
                                                               tiny_qwen3: Path) -> None:
    prompts = _prompts(32)
    adapter = write_lora(tiny_qwen3, tmp_path / "adapter", seed=3)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    with LLM(str(tiny_qwen3), max_kv_tokens=8192, show_progress=False, enable_lora=True) as llm:
        refs = llm.generate(prompts, greedy)
        lora_refs = llm.generate(prompts, greedy, lora_request=LoRARequest("a", 1, str(adapter)))
    assert sum(a.token_ids != b.token_ids for a, b in zip(refs, lora_refs)) > 16
    with serving(["--model", str(tiny_qwen3), "--dp", "2", "--enable-lora", *CPU_ARGS],
                 tmp_path) as srv:
        assert httpx.get(f"{srv.url}/health").status_code == 200
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: _generate(srv.url, p, 8), prompts))
        assert [g["token_ids"] for g in got] == [r.token_ids for r in refs]
        r = httpx.post(f"{srv.url}/v1/load_lora_adapter", timeout=60,
                       json={"lora_name": "a", "lora_path": str(adapter)})
        assert r.status_code == 200, r.text
        with ThreadPoolExecutor(len(prompts)) as pool:  # both replicas serve "a"
            got = list(pool.map(lambda p: _generate(srv.url, p, 8, "a"), prompts))
        assert [g["token_ids"] for g in got] == [r.token_ids for r in lora_refs]
        name = "minisgl_generation_tokens_total"
        m = srv.wait_metrics(lambda m: sum(m.get(f'{name}{{replica="{d}"}}', 0)
                                           for d in (0, 1)) >= 16 * len(prompts))
        per_replica = [m.get(f'{name}{{replica="{d}"}}', 0) for d in (0, 1)]
        assert all(n > 0 for n in per_replica) and sum(per_replica) == 16 * len(prompts), m
        assert name not in m  # every scheduler line carries its replica
        long_prompt = _prompts(1, seed=7)[0] * 6  # well over a few KV pages
        cached = [_generate(srv.url, long_prompt, 2)["usage"]["prompt_tokens_details"]
                  ["cached_tokens"] for _ in range(5)]
        assert sum(c > 0 for c in cached) >= 4, cached


def test_dp2_tp2(tmp_path: Path, tiny_qwen3: Path) -> None:
    with serving(["--model", str(tiny_qwen3), "--dp", "2", "--tp", "2", *CPU_ARGS],
                 tmp_path) as srv:
        check_same_as_tp1(srv, tiny_qwen3)
        m = srv.metrics()
        assert all(m[f'minisgl_generation_tokens_total{{replica="{d}"}}'] > 0 for d in (0, 1))
        # get_weights_by_name answers each replica's (SGLang's list a replica), each put
        # together from its two ranks' shards
        name = "model.layers.1.self_attn.q_proj.weight"
        want = load_file(str(tiny_qwen3 / "model.safetensors"))[name].float()[:5].tolist()
        got = httpx.post(f"{srv.url}/get_weights_by_name", timeout=60,
                         json={"name": name, "truncate_size": 5}).json()
        assert got == [want, want]
