"""The radix prefix cache changes speed, never outputs: identical tokens with radix and naive,
cached tokens reported and really skipped, eviction under pressure with balanced accounting."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable, List, Optional

import pytest

from fake_engine import Harness
from hf_reference import hf_greedy
from minisgl import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _shared_prompts(n: int, prefix_len: int, seed: int) -> List[List[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(10, 40000) for _ in range(prefix_len)]
    return [system + [rng.randrange(10, 40000) for _ in range(rng.randrange(1, 20))]
            for _ in range(n)]


def _run(path: Path, cache: str, page_size: int, tp: int, batches: List[List[List[int]]],
         evictions: Optional[List[int]] = None, **kw: object) -> List[List[int]]:
    out: List[List[int]] = []
    with LLM(str(path), device="cpu", cache=cache, page_size=page_size, tp=tp, show_progress=False,
             **{"max_kv_tokens": 8192, **kw}) as llm:  # type: ignore[arg-type]
        for prompts in batches:
            out += [o.token_ids for o in llm.generate(prompts, GREEDY)]
        if evictions is not None:
            evictions.append(llm.check_accounting().evicted_pages)
    return out


@pytest.mark.parametrize("page_size,tp", [(1, 1), (16, 1), (16, 2)])
def test_radix_equals_naive(tiny_model: Callable[..., Path], page_size: int, tp: int) -> None:
    prompts = _shared_prompts(33, 150, seed=page_size)
    batches = [prompts[:1], prompts[1:]]  # the first request's prefix is cached for the 32
    path = tiny_model("qwen3")
    assert _run(path, "radix", page_size, tp, batches, max_prefill_tokens=64) == \
        _run(path, "naive", page_size, tp, batches, max_prefill_tokens=64)


def test_repeated_request_skips_cached_prefill(tiny_model: Callable[..., Path]) -> None:
    prompt = _shared_prompts(1, 100, seed=3)[0]
    with LLM(str(tiny_model("qwen3")), page_size=16, max_kv_tokens=4096,
             show_progress=False) as llm:
        first = llm.generate([prompt], GREEDY)[0]
        first_prefilled = llm.stats.prefilled_tokens_total  # type: ignore[union-attr]
        again = llm.generate([prompt], GREEDY)[0]
        prefilled = llm.stats.prefilled_tokens_total - first_prefilled  # type: ignore[union-attr]
    assert first.cached_tokens == 0
    assert again.cached_tokens >= len(prompt) - 16
    assert again.token_ids == first.token_ids
    # prefill computed only the uncached prompt tokens (counted by the scheduler)
    assert first_prefilled == len(prompt)
    assert prefilled == len(prompt) - again.cached_tokens


def test_cache_salt_keeps_tenants_apart(tiny_model: Callable[..., Path]) -> None:
    """vLLM's cache_salt: a prompt cached under one salt is a hit only for requests with that
    salt (so a tenant cannot time another's prompts); outputs never change; pages balance."""
    prompt = _shared_prompts(1, 100, seed=4)[0]

    def salted(salt: Optional[str]) -> SamplingParams:
        return SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, cache_salt=salt)

    with LLM(str(tiny_model("qwen3")), page_size=16, max_kv_tokens=4096,
             show_progress=False) as llm:
        first = llm.generate([prompt], salted("a"))[0]
        others = [llm.generate([prompt], salted(s))[0] for s in (None, "b", "a")]
        s = llm.check_accounting()
        with pytest.raises(ValueError, match="cache_salt must be a string of 1 to 256"):
            llm.generate([prompt], salted(""))
    assert first.cached_tokens == 0
    assert [o.cached_tokens for o in others[:2]] == [0, 0]
    assert others[2].cached_tokens >= len(prompt) - 16
    assert all(o.token_ids == first.token_ids for o in others)
    assert s.live_requests == 0 and s.free_rows == s.total_rows


@pytest.mark.parametrize("tp", [1, 2])
def test_reset_prefix_cache_drops_every_cached_prefix(tiny_model: Callable[..., Path],
                                                      tp: int) -> None:
    """vLLM's LLM.reset_prefix_cache: between calls, every rank drops its cached pages (not
    counted as evictions), so the next request computes its whole prompt again."""
    prompt = _shared_prompts(1, 100, seed=6)[0]
    with LLM(str(tiny_model("qwen3")), page_size=16, max_kv_tokens=4096, tp=tp,
             show_progress=False) as llm:
        llm.generate([prompt], GREEDY)
        assert llm.generate([prompt], GREEDY)[0].cached_tokens > 0
        assert llm.check_accounting().pages.cached > 0
        assert llm.reset_prefix_cache() is True
        after = llm.check_accounting()
        assert (after.pages.cached, after.evicted_pages) == (0, 0)
        assert after.pages.free == after.pages.total
        assert llm.generate([prompt], GREEDY)[0].cached_tokens == 0


def test_long_prompt_chunks_are_shared_while_running() -> None:
    """(The scheduler on the fake engine: the test steps it batch by batch.)"""
    prompt = _shared_prompts(1, 300, seed=4)[0]
    h = Harness(page_size=16, max_prefill_tokens=64, num_pages=4096 // 16)
    sched = h.sched
    h.submit(10_000, prompt, GREEDY.max_tokens)
    for _ in range(3):  # three 64-token chunks
        h.step()
    assert sched.cache.manager.stats().cached_pages == 192 // 16
    while sched.has_work:
        h.step()
    sched.check_idle()


def test_eviction_under_pressure(tiny_model: Callable[..., Path]) -> None:
    """200 requests through a pool far too small for every prefix: outputs match a big naive
    pool, pages balance at idle, and locked prefixes of running requests are never evicted."""
    rng = random.Random(7)
    groups = [_shared_prompts(1, 96, seed=100 + g)[0][:96] for g in range(12)]
    prompts = []
    for i in range(200):
        tail = [rng.randrange(10, 40000) for _ in range(rng.randrange(1, 30))]
        prompts.append((groups[i % 12] if i % 5 else []) + tail)
    batches = [prompts[i:i + 40] for i in range(0, 200, 40)]
    path = tiny_model("qwen3")
    evictions: List[int] = []
    small = _run(path, "radix", 16, 1, batches, evictions, max_kv_tokens=1024,
                 max_running_requests=8)
    big = _run(path, "naive", 16, 1, batches, max_kv_tokens=16384)
    assert small == big
    assert evictions[0] > 64  # the 64-page pool was recycled more than once


def test_locked_prefix_survives_eviction() -> None:
    """(The scheduler on the fake engine: the test reaches the cache between steps.)"""
    h = Harness(page_size=4, num_pages=256 // 4, max_running_requests=4)
    sched = h.sched
    prefix = _shared_prompts(1, 40, seed=9)[0][:40]
    h.submit(0, prefix + [11], GREEDY.max_tokens)
    h.run()  # prefix cached, unlocked
    h.submit(900, prefix + [12], max_tokens=40)
    h.step()
    req = sched.reqs[900]
    assert req.num_prefix_pages == 10  # matched and locked
    held = list(req.pages[:10])
    evicted = sched.cache.manager.evict(10_000)  # provoke: evict everything possible
    assert evicted, "nothing was evicted: the locked prefix was never put to the test"
    assert not set(held) & set(evicted)
    sched.cache.release(evicted)
    while sched.has_work:
        h.step()
    sched.check_idle()


def test_overlap_with_radix_eviction_and_stops(tiny_model: Callable[..., Path]) -> None:
    """Overlap scheduling under pool pressure, with early stops: same tokens as the plain loop,
    and the pages balance once idle."""
    prompts = _shared_prompts(40, 60, seed=11)
    path = tiny_model("qwen3")
    results = []
    evicted: List[int] = []  # pages each run's cache evicted
    for overlap in (False, True):
        with LLM(str(path), device="cpu", page_size=4, max_kv_tokens=512, max_running_requests=6,
                 overlap=overlap, show_progress=False) as llm:
            ref = [o.token_ids for o in llm.generate(prompts, GREEDY)]
            stops = SamplingParams(max_tokens=8, temperature=0.0,
                                   stop_token_ids=tuple(t[2] for t in ref[:20]))
            got = [o.token_ids for o in llm.generate(prompts, stops)]
            evicted.append(llm.check_accounting().evicted_pages)
            results.append((ref, got))
    assert results[0] == results[1]
    assert evicted[0] > 0 and evicted[1] > 0, f"a run never evicted: {evicted}"


@pytest.mark.parametrize("cache,overlap", [("radix", False), ("radix", True), ("naive", True)])
def test_retraction_under_optimistic_admission(tiny_model: Callable[..., Path], cache: str,
                                               overlap: bool) -> None:
    """Admission reserving only 4 output tokens overcommits a small pool: decode retracts the
    newest requests and re-queues them; tokens stay exactly the reference's."""
    path = tiny_model("qwen3")
    prompts = _shared_prompts(16, 20, seed=12)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    with LLM(str(path), device="cpu", page_size=4, max_kv_tokens=400, max_running_requests=12,
             cache=cache, overlap=overlap, decode_reserve_tokens=4, show_progress=False) as llm:
        got = [o.token_ids for o in llm.generate(prompts, params)]
        acct = llm.check_accounting()
        assert acct.retracted_requests > 0 and acct.reserved_pages == 0
    assert got == hf_greedy(path, prompts, 40)
