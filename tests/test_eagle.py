"""EAGLE-3 speculative decoding (engine/eagle.py, models/eagle3.py; vLLM's method "eagle3",
SGLang's EAGLE3): every draft is the one the reference proposal (tests/eagle_reference.py,
recomputed from scratch as vLLM computes it) gives for the request's tokens at that step, the
tokens are Hugging Face's greedy ones whatever the head proposes, and a head that knows the
target keeps every draft only if its state is taken at each verify's last kept position."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle_reference import Proposal, record_proposals, reference_drafts, write_eagle3
from hf_reference import hf_greedy, mixed_prompts
from minisgl import LLM, SamplingParams
from minisgl.engine.eagle import kept_on_device
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.speculative import SpeculativeConfig

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def _spec(head: Path, k: int = 3) -> dict:
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}


@pytest.fixture
def proposals(monkeypatch: pytest.MonkeyPatch) -> List[Proposal]:
    """Every proposal the in-process engine's head makes, with the tokens it drafted after."""
    return record_proposals(monkeypatch)


def _kept_share(llm: LLM) -> float:
    stats = llm.stats
    assert stats.verify_steps_total > 0 and stats.spec_draft_tokens_total > 0, stats
    return stats.spec_accepted_tokens_total / stats.spec_draft_tokens_total


@pytest.mark.parametrize("draft_vocab,aux,chunk", [(None, None, 16), (1000, (0, 3), None)])
def test_drafts_are_the_references_and_tokens_hf_greedy(
        tiny_model: Callable[..., Path], tmp_path: Path, proposals: List[Proposal],
        draft_vocab: Optional[int], aux: Optional[Tuple[int, ...]], chunk: Optional[int]
        ) -> None:
    """A random head over a 4-layer tiny Llama (its default layers 2, 2, 1; or two named),
    drafting over the whole vocabulary or 1,000 tokens of it (d2t), prompts whole or in
    16-token chunks: each proposal equals the reference's for the request's tokens then
    (the head's K/V and state follow the target's positions), and the tokens are HF's."""
    target = tiny_model("llama", num_hidden_layers=4)
    head = write_eagle3(target, tmp_path / "head", seed=3, draft_vocab=draft_vocab,
                        aux_layers=aux, scale=0.2)
    prompts = mixed_prompts(3, seed=1)
    with LLM(str(target), device="cpu", page_size=4, max_kv_tokens=2048, show_progress=False,
             max_prefill_tokens=chunk, speculative_config=_spec(head)) as llm:
        tokens = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        accounting = llm.check_accounting()
    assert tokens == hf_greedy(target, prompts, GREEDY.max_tokens)
    assert len(proposals) >= 3 * 5
    assert [d for _, d in proposals] == reference_drafts(target, head, proposals)
    assert accounting.live_requests == accounting.reserved_pages == 0


def test_mixed_steps_and_steps_past_disable_by_batch_size_keep_the_reference(
        tiny_model: Callable[..., Path], tmp_path: Path, proposals: List[Proposal]) -> None:
    """Requests admitted while others decode (mixed steps: prompt chunks and decode rows in
    one forward) and decode steps past disable_by_batch_size (no drafts, the head still runs
    over their tokens): every later proposal is still the reference's."""
    target = tiny_model("llama", num_hidden_layers=4)
    head = write_eagle3(target, tmp_path / "head", seed=5, scale=0.2)
    prompts = mixed_prompts(6, seed=4, lengths=(10, 30))
    params = [SamplingParams(max_tokens=8 + 4 * i, temperature=0.0, ignore_eos=True)
              for i in range(len(prompts))]
    spec = {**_spec(head), "disable_by_batch_size": 2}
    with LLM(str(target), device="cpu", page_size=4, max_kv_tokens=2048, show_progress=False,
             max_running_requests=3, speculative_config=spec) as llm:
        tokens = [o.token_ids for o in llm.generate(prompts, params)]
        stats = llm.stats
    assert stats.verify_steps_total > 0 and stats.decode_steps_total > 0, stats
    assert tokens == [hf_greedy(target, [p], n.max_tokens or 0)[0]
                      for p, n in zip(prompts, params)]
    assert len(proposals) > 5
    assert [d for _, d in proposals] == reference_drafts(target, head, proposals)


def _identity_target(tiny_model: Callable[..., Path], out: Path) -> Path:
    """A 4-layer tiny Llama whose layers add nothing (o_proj and down_proj zero): its next
    token is a function of the current one, f(t) = argmax lm_head(norm(embed(t)))."""
    base = tiny_model("llama", num_hidden_layers=4, num_key_value_heads=4,
                      tie_word_embeddings=False)
    out.mkdir()
    for f in base.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(out / "model.safetensors"))
    for name, w in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w.zero_()
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _oracle_head(target: Path, out: Path) -> Path:
    """A head whose first draft is the identity target's token: its attention (q = k = 4 x,
    v = x on the embedding half, per head) takes each position's own input token's
    embedding, o_proj passes it on, fc and the MLP add nothing, and the target's LM head
    scores it, so at position i (the token after i is t) it proposes f(t), the token after
    that. Its state carries the embedding of the token it read: taken at a wrong position, it
    drafts from the wrong token. (Its later drafts add the state before to the residual, so
    they miss: it drafts one token a step.)"""
    write_eagle3(target, out, seed=0)
    w = load_file(str(out / "model.safetensors"))
    hidden = json.loads((target / "config.json").read_text())["hidden_size"]
    half = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    w.update({"midlayer.self_attn.q_proj.weight": 4 * half,
              "midlayer.self_attn.k_proj.weight": 4 * half,
              "midlayer.self_attn.v_proj.weight": half.clone(),
              "midlayer.self_attn.o_proj.weight": torch.eye(hidden),
              "midlayer.mlp.down_proj.weight": torch.zeros_like(w["midlayer.mlp.down_proj.weight"]),
              "fc.weight": torch.zeros_like(w["fc.weight"]),
              "lm_head.weight": load_file(str(target / "model.safetensors"))["lm_head.weight"]})
    for name in w:
        if name.endswith("norm.weight"):
            w[name] = torch.ones(hidden)
    save_file(w, str(out / "model.safetensors"))
    return out


def test_a_head_that_knows_the_target_keeps_every_draft(
        tiny_model: Callable[..., Path], tmp_path: Path, proposals: List[Proposal]) -> None:
    """The oracle head keeps every draft of every verify step, so each verify's last kept
    position, found on the device, is where the next proposal starts from (the position
    before it would propose the newest token again), and matches the reference."""
    target = _identity_target(tiny_model, tmp_path / "target")
    head = _oracle_head(target, tmp_path / "head")
    prompts = mixed_prompts(3, seed=5)
    params = SamplingParams(max_tokens=22, temperature=0.0, ignore_eos=True)
    with LLM(str(target), device="cpu", page_size=4, max_kv_tokens=2048, show_progress=False,
             speculative_config=_spec(head, 1)) as llm:
        tokens = [o.token_ids for o in llm.generate(prompts, params)]
        kept = _kept_share(llm)
    expected = hf_greedy(target, prompts, params.max_tokens)
    assert tokens == expected and all(len(set(t)) > 3 for t in expected)  # not one token
    assert kept == 1.0
    assert [d for _, d in proposals] == reference_drafts(target, head, proposals)


def test_kept_drafts_on_the_device() -> None:
    """kept_on_device counts what scheduler/speculative.kept counts: the drafts equal to the
    token sampled before each, up to the first that differs; requests without drafts keep
    none."""
    drafts = [[5, 6, 7], [8], [], [1, 2]]
    sampled = [[5, 6, 9, 4], [3, 0], [7], [1, 2, 3]]  # one token per position of each
    starts = [0, 4, 6, 7]
    flat = torch.tensor([t for s in sampled for t in s])
    assert kept_on_device(drafts, flat, starts).tolist() == [2, 0, 0, 2]
    assert kept_on_device([[], []], torch.tensor([1, 2]), [0, 1]).tolist() == [0, 0]


def test_seeded_sampling_and_a_prefix_cache_give_plain_decodings_tokens(
        tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    """Seeded sampling with top-p and a repetition penalty, prompts that share prefixes (hits
    on the prefix cache, whose last cached position keeps the head's older K/V), and a pool
    small enough to retract: the tokens of plain decoding, the pool balanced."""
    target = tiny_model("llama", num_hidden_layers=4)
    head = write_eagle3(target, tmp_path / "head", seed=4, scale=0.2)
    base = mixed_prompts(6, seed=9, lengths=(20, 40))
    prompts = base + [p[:12] + p[:6] for p in base]
    params = [SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=i,
                             repetition_penalty=1.2, ignore_eos=True)
              for i in range(len(prompts))]
    runs = []
    for spec in (None, _spec(head, 3)):
        with LLM(str(target), device="cpu", page_size=4, max_kv_tokens=256,
                 max_running_requests=8, decode_reserve_tokens=4, show_progress=False,
                 speculative_config=spec) as llm:
            runs.append([o.token_ids for o in llm.generate(prompts, params)])
            stats, accounting = llm.stats, llm.check_accounting()
        assert accounting.live_requests == accounting.reserved_pages == 0
    assert runs[0] == runs[1]
    assert stats.cached_tokens_total > 0 and stats.verify_steps_total > 0, stats


def test_json_schema_requests_give_plain_decodings_tokens(tiny_model: Callable[..., Path],
                                                          tmp_path: Path) -> None:
    """Requests held to a JSON schema (their batches sampled after the grammar's mask, the
    head's pass after that sampling), greedy and seeded: plain decoding's tokens."""
    from minisgl.core import StructuredOutputsParams
    target = tiny_model("llama", num_hidden_layers=4)
    head = write_eagle3(target, tmp_path / "head", seed=6, scale=0.2)
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"},
                                                          "b": {"type": "string"}},
                         "required": ["a", "b"]})
    params = [SamplingParams(max_tokens=24, temperature=t, seed=1, structured_outputs=(
        StructuredOutputsParams(json=schema))) for t in (0.0, 0.9)]
    prompts = mixed_prompts(2, seed=8, lengths=(5, 12))
    runs = []
    for spec in (None, _spec(head)):
        with LLM(str(target), device="cpu", page_size=4, max_kv_tokens=1024,
                 show_progress=False, speculative_config=spec) as llm:
            runs.append([o.token_ids for o in llm.generate(prompts, params)])
            verified = llm.stats.verify_steps_total
    assert runs[0] == runs[1] and verified > 0


def test_tp2_proposes_in_lockstep(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    """At tp=2 (the head's heads, MLP and LM head split as the target's): HF's tokens."""
    target = tiny_model("llama", num_hidden_layers=4)
    head = write_eagle3(target, tmp_path / "head", seed=3, draft_vocab=1000, scale=0.2)
    prompts = mixed_prompts(2, seed=2)
    with LLM(str(target), device="cpu", tp=2, page_size=4, max_kv_tokens=1024,
             show_progress=False, speculative_config=_spec(head)) as llm:
        tokens = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        assert llm.stats.verify_steps_total > 0
    assert tokens == hf_greedy(target, prompts, GREEDY.max_tokens)


def test_settings_and_start_up_name_what_is_wrong(tiny_model: Callable[..., Path],
                                                   tmp_path: Path) -> None:
    """vLLM's method eagle3 and SGLang's EAGLE3 (num_draft_tokens or num_steps, topk 1);
    EAGLE-1 and trees are refused by name, as are a head given as a model or as a draft
    model, a model given as a head, and a head that does not fit its target."""
    assert SpeculativeConfig.parse(json.dumps(_spec(Path("h")))) == SpeculativeConfig(
        3, model="h", eagle=True)
    sglang = SchedulerConfig(speculative_algorithm="EAGLE3", speculative_draft_model_path="h",
                             speculative_num_steps=3, speculative_eagle_topk=1,
                             speculative_num_draft_tokens=4)
    assert sglang.speculative == SpeculativeConfig(3, model="h", eagle=True)
    assert sglang.draft_method == "eagle3" and sglang.draft_model_path == "h"
    assert SchedulerConfig(speculative_algorithm="STANDALONE", speculative_draft_model_path="d",
                           speculative_num_steps=2).speculative == SpeculativeConfig(2, model="d")
    bad = [({"speculative_config": '{"method": "eagle", "model": "h", '
                                   '"num_speculative_tokens": 2}'}, "EAGLE-1 heads"),
           ({"speculative_config": '{"method": "eagle3", "num_speculative_tokens": 2}'},
            "eagle3 needs \"model\""),
           ({"speculative_algorithm": "EAGLE3", "speculative_num_draft_tokens": 3},
            "EAGLE3 needs speculative_draft_model_path"),
           ({"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": "h",
             "speculative_num_steps": 3, "speculative_eagle_topk": 4}, "not a tree"),
           ({"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": "h",
             "speculative_num_steps": 3, "speculative_num_draft_tokens": 8}, "takes 4"),
           ({"speculative_algorithm": "NGRAM", "speculative_num_steps": 3}, "not NGRAM's"),
           ({"speculative_eagle_topk": 1}, "needs speculative_algorithm")]
    for kw, message in bad:
        with pytest.raises(ValueError, match=message):
            SchedulerConfig(**kw)  # type: ignore[arg-type]
    target = tiny_model("llama", num_hidden_layers=4)
    head = write_eagle3(target, tmp_path / "head", seed=1)
    small = tiny_model("llama")  # 2 layers: the default layers 2 and -1 do not exist
    cases = [(dict(model=str(head)), "is an EAGLE-3 draft head, not a model to serve"),
             (dict(model=str(target), speculative_config={"model": str(head),
                                                          "num_speculative_tokens": 2}),
              "is an EAGLE-3 head, not a model"),
             (dict(model=str(target), speculative_config=_spec(small)),
              "needs an EAGLE-3 head"),
             (dict(model=str(small), speculative_config=_spec(
                 write_eagle3(small, tmp_path / "small-head", seed=1))),
              r"reads the target's layers \[2, 1, -1\], but the target has 2")]
    for kw, message in cases:
        with pytest.raises(ValueError, match=message):
            LLM(device="cpu", show_progress=False, max_kv_tokens=256, **kw)  # type: ignore
