"""Tensor parallelism on CPU (gloo): same greedy tokens as tp=1 and Hugging Face, ranks in
lockstep, sharded loading, clear start-up errors, and a dead rank ending the others."""

from __future__ import annotations

import dataclasses

import multiprocessing as mp
import os
import signal
import time
from pathlib import Path
from typing import Callable, List, Tuple

import pytest
import torch

from hf_reference import hf_greedy, mixed_prompts
from minisgl import LLM, SamplingParams
from minisgl.distributed import Communicator, DistributedInfo
from minisgl.models import ModelConfig, model_class
from minisgl.models.weights import iter_checkpoint
from minisgl.scheduler.scheduler import Accounting
from recording_source import RecordingSource
from spawn_ranks import spawn_ranks

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _generate(path: Path, tp: int, prompts: List[List[int]], params: SamplingParams,
              overlap: bool = False) -> List[List[int]]:
    return _generate_and_account(path, tp, prompts, params, overlap)[0]


def _generate_and_account(path: Path, tp: int, prompts: List[List[int]], params: SamplingParams,
                          overlap: bool = False) -> Tuple[List[List[int]], Accounting]:
    """The tokens, and the scheduler's accounting after them (every rank checks its own)."""
    with LLM(str(path), device="cpu", tp=tp, page_size=4, max_kv_tokens=4096, show_progress=False,
             check_lockstep=tp > 1, overlap=overlap) as llm:
        tokens = [o.token_ids for o in llm.generate(prompts, params)]
        return tokens, llm.check_accounting()


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_greedy_matches_tp1_and_hf(tp: int, tiny_model: Callable[..., Path]) -> None:
    """(The default model at tp=3, an uneven head split: test_structured_output's
    test_tp3_equals_tp1_and_hf, on one start of three ranks with its constrained answers.)"""
    path = tiny_model("qwen3")
    prompts = mixed_prompts(8, seed=4, lengths=(2, 9, 40, 75))
    ref = hf_greedy(path, prompts, GREEDY.max_tokens)
    tokens, accounting = _generate_and_account(path, 1, prompts, GREEDY)
    assert tokens == ref
    # ranks schedule alike: rank 0's accounting is tp=1's (pages, rows, evictions), at rest
    assert _generate_and_account(path, tp, prompts, GREEDY) == (ref, accounting)
    assert accounting.live_requests == 0 and accounting.reserved_pages == 0
    assert accounting.free_rows == accounting.total_rows


def test_tp2_gemma3_matches_hf(tiny_model: Callable[..., Path]) -> None:
    """Gemma 3 at tp=2: its sandwich norms all-reduce each sublayer's output before norming
    it, and its sliding-window layers keep their window on every rank."""
    path = tiny_model("gemma3")
    prompts = mixed_prompts(4, seed=9, lengths=(3, 12, 30))
    assert _generate(path, 2, prompts, GREEDY) == hf_greedy(path, prompts, GREEDY.max_tokens)


@pytest.mark.parametrize("tp", [2, 4])
def test_fused_checkpoint_tensors_shard_like_separate_ones(
        tp: int, tiny_model: Callable[..., Path]) -> None:
    """Phi-3's checkpoints fuse q/k/v and gate/up: each rank reads only its rows of each part
    (K/V replicated at tp=4 over 2 KV heads), and the tokens are HF's at every tp."""
    path = tiny_model("phi3")
    prompts = mixed_prompts(6, seed=9, lengths=(3, 20, 50))
    ref = hf_greedy(path, prompts, GREEDY.max_tokens)
    assert _generate_and_account(path, tp, prompts, GREEDY)[0] == ref
    cfg = ModelConfig.from_dir(path)
    info = DistributedInfo(tp - 1, tp)
    model = model_class(cfg.architecture)(cfg, info, Communicator(info))
    reads: list = []
    model.load_weights((n, RecordingSource(s, reads)) for n, s in iter_checkpoint(path, False))
    kv_heads = max(1, cfg.num_kv_heads // tp)  # replicated where tp exceeds the KV heads
    want = {"qkv_proj": (cfg.num_heads // tp + 2 * kv_heads) * cfg.head_dim,
            "gate_up_proj": 2 * cfg.intermediate_size // tp}
    rows: dict = {}
    for name, _, got in reads:
        fused = next((f for f in want if f"{f}.weight" in name), None)
        if fused is not None:
            rows[name] = rows.get(name, 0) + got[0]
    assert len(rows) == 2 * cfg.num_layers
    assert all(n == want["qkv_proj" if "qkv" in name else "gate_up_proj"]
               for name, n in rows.items()), rows  # each rank: its rows of each part only


def test_tp_overlap_scheduling_matches_hf(tiny_model: Callable[..., Path]) -> None:
    """Overlap scheduling (one step behind) keeps every rank in lockstep and the tokens exact."""
    path = tiny_model("qwen3")
    prompts = mixed_prompts(8, seed=8, lengths=(2, 9, 40, 75))
    stops = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens, accounting = _generate_and_account(path, 2, prompts, stops, overlap=True)
    assert tokens == hf_greedy(path, prompts, 12)
    # answered at rest (the next time the ranks wait for input): nothing live or reserved
    assert accounting.live_requests == accounting.reserved_pages == accounting.pages.in_use == 0
    assert accounting.free_rows == accounting.total_rows


def test_tp_logprobs_come_from_rank0_and_match_tp1(tiny_model: Callable[..., Path]) -> None:
    """Rank 0 alone keeps log-probabilities (prompt ones too, whose LM head runs on every
    rank); they reach LLM.generate through the ZMQ reply path and equal tp=1's (to float32
    noise: the two ranks' partial sums round differently)."""
    path = tiny_model("qwen3")
    prompts = mixed_prompts(4, seed=9, lengths=(2, 9, 40, 75))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3,
                            prompt_logprobs=2)
    outs = []
    for tp in (1, 2):  # prompt chunks of 16: every rank runs the LM head over the prompt rows
        with LLM(str(path), device="cpu", tp=tp, page_size=4, max_kv_tokens=4096,
                 show_progress=False, max_prefill_tokens=16, overlap=True) as llm:
            outs.append(llm.generate(prompts, params))
    for one, two in zip(*outs):
        assert one.token_ids == two.token_ids
        assert [lp.top_ids for lp in one.logprobs] == [lp.top_ids for lp in two.logprobs]
        assert [lp.logprob for lp in two.logprobs] == pytest.approx(
            [lp.logprob for lp in one.logprobs], abs=1e-4)
        assert [lp.top_ids for lp in one.prompt_token_logprobs] == [
            lp.top_ids for lp in two.prompt_token_logprobs]
        assert [lp.logprob for lp in two.prompt_token_logprobs] == pytest.approx(
            [lp.logprob for lp in one.prompt_token_logprobs], abs=1e-4)


def test_tp_seeded_sampling_ranks_agree(tiny_model: Callable[..., Path]) -> None:
    """check_lockstep makes every rank compare its batch uids, KV slots and sampled tokens each
    step; a divergence would raise on the ranks and end generate() with an error."""
    prompts = mixed_prompts(6, seed=5)
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True)
    a = _generate(tiny_model("qwen3"), 2, prompts, params)
    b = _generate(tiny_model("qwen3"), 2, prompts, params)
    assert a == b and len({tuple(x) for x in a}) > 1


def test_tp_allowed_token_ids_match_tp1(tiny_model: Callable[..., Path]) -> None:
    """The allowed-token mask is computed alike on every rank (check_lockstep compares the
    sampled tokens each step): greedy and seeded tokens at tp=2 are tp=1's, all allowed."""
    path = tiny_model("qwen3")
    prompts = mixed_prompts(4, seed=6, lengths=(5, 20))
    allowed = (77, 300, 1234, 5000)
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                             allowed_token_ids=allowed[:3]),
              SamplingParams(max_tokens=6, temperature=1.0, seed=4, ignore_eos=True,
                             allowed_token_ids=allowed)] * 2
    outs = []
    for tp in (1, 2):
        with LLM(str(path), device="cpu", tp=tp, page_size=4, max_kv_tokens=2048,
                 show_progress=False, check_lockstep=tp > 1) as llm:
            outs.append([o.token_ids for o in llm.generate(prompts, params)])
    assert outs[0] == outs[1]
    assert all(set(t) <= set(p.allowed_token_ids or ()) for t, p in zip(outs[1], params))


def _diverge(rank: int, port: int, out: "mp.Queue[str]") -> None:
    import torch.distributed as dist
    from minisgl.distributed import check_same_across_ranks
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    check_same_across_ranks([1, 2, 3], dist.group.WORLD, "same")
    try:
        check_same_across_ranks([1, 2, 3 + rank], dist.group.WORLD, "tokens")
        out.put("no error")
    except RuntimeError as e:
        out.put(str(e))


def test_lockstep_check_detects_divergence() -> None:
    from minisgl.distributed.bind import free_port
    with spawn_ranks(_diverge, 2, free_port()) as ranks:
        msgs = [ranks.out.get(timeout=60) for _ in ranks.procs]
    assert all(m.startswith("ranks diverged on tokens") for m in msgs), msgs


@pytest.mark.parametrize("tp", [3])
def test_sharded_loading_reads_only_slices(default_model_dir: Path, tp: int) -> None:
    cfg = ModelConfig.from_dir(default_model_dir)
    total = sum(torch.Size(s.shape).numel() for _, s in iter_checkpoint(default_model_dir, False))
    for rank in range(tp):
        info = DistributedInfo(rank, tp)
        model = model_class(cfg.architecture)(cfg, info, Communicator(info))
        reads: list = []
        model.load_weights((n, RecordingSource(s, reads))
                           for n, s in iter_checkpoint(default_model_dir, False))
        for name, full, got in reads:
            if len(full) == 2:  # every matrix is split: no rank reads a whole one
                assert torch.Size(got).numel() * tp <= torch.Size(full).numel() * 1.01, name
        params = sum(p.numel() for p in model.parameters())
        replicated = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
        assert abs((params - replicated) * tp - (total - replicated)) <= 0.01 * total


def test_heads_not_divisible_fail_at_start(default_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="cannot split 9 attention heads over tp=2"):
        LLM(str(default_model_dir), tp=2)
    from minisgl.distributed.info import check_head_split
    check_head_split(36, 3, 9)  # more ranks than KV heads: each KV head is replicated
    with pytest.raises(ValueError, match="cannot split 3 KV heads over tp=2"):
        check_head_split(36, 3, 2)


def test_an_mlp_width_tp_does_not_divide_fails_at_start(default_model_dir: Path) -> None:
    """The default model's heads split over 9 ranks but its MLP width (1,536) does not: refused
    before any rank starts, naming the numbers (before, rank 2 failed loading its weights)."""
    from minisgl.models.config import ModelConfig
    with pytest.raises(ValueError, match="cannot split the MLP's intermediate_size 1536 over "
                                         "tp=9"):
        LLM(str(default_model_dir), tp=9)
    shape = ModelConfig.from_dir(default_model_dir)
    shape.check_tp(3)
    moe = dataclasses.replace(shape, num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=100, decoder_sparse_step=1)
    with pytest.raises(ValueError, match="moe_intermediate_size 100 over tp=3"):
        moe.check_tp(3)  # every layer sparse: the dense width is not used, the experts' is


def test_killed_rank_ends_the_others(tiny_model: Callable[..., Path]) -> None:
    llm = LLM(str(tiny_model("qwen3")), device="cpu", tp=2, max_kv_tokens=1024, show_progress=False)
    procs = llm.rank_processes
    assert llm.generate([[5, 6, 7]], GREEDY)[0].token_ids
    os.kill(procs[1].pid, signal.SIGKILL)
    start = time.monotonic()
    procs[0].join(timeout=30)  # rank 0's watchdog sees its peer gone
    assert not procs[0].is_alive() and procs[0].exitcode != 0
    assert time.monotonic() - start < 30
    with pytest.raises(RuntimeError, match="died"):
        llm.generate([[5, 6, 7]], GREEDY)
    with pytest.raises(RuntimeError, match="closed"):
        llm.check_accounting()
    llm.close()
