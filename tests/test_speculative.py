"""Speculative decoding by n-gram lookup: the drafts, the settings, and tokens that are plain
decoding's whatever is kept (greedy against Hugging Face: test_engine_hf's
test_speculative_decoding_matches_hf)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable, List

import httpx
import pytest

from hf_reference import mixed_prompts
from minisgl import LLM, SamplingParams
from minisgl.core import Batch, Phase, Req, StructuredOutput
from minisgl.message.types import SchedulerStats
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.ngram import Drafter, propose
from minisgl.scheduler.speculative import SpecCounts, SpeculativeConfig, kept
from minisgl.server.metrics_vllm import vllm_lines
from minisgl.server.stats_log import Totals, stats_line
from server_helpers import CPU_ARGS, openai_client, serving

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}
CHATS = [[{"role": "user", "content": "Repeat this list three times: apple, banana, cherry, "
                                      "date, fig, grape."}],
         [{"role": "user", "content": "Count from 1 to 40, separated by commas."}],
         [{"role": "user", "content": "Tell me a story about a dragon."}]]


def test_lookup_takes_the_longest_then_the_latest_match() -> None:
    tokens = [1, 2, 3, 4, 1, 2, 3, 9, 9, 1, 2, 3]
    assert propose(tokens, 2, 4, 3) == [9, 9, 1]  # [1, 2, 3] twice: the latest
    assert propose(tokens, 1, 1, 2) == [9, 9]  # [3] alone: the latest too
    longer = [1, 2, 3, 70, 9, 2, 3, 80, 1, 2, 3]
    assert propose(longer, 2, 3, 2) == [70, 9]  # [1, 2, 3] beats the later [2, 3]
    assert propose(longer, 2, 2, 3) == [80, 1, 2]  # [2, 3] alone: the later
    assert propose([5, 1, 2, 3, 7, 8, 2, 3], 3, 3, 5) == []  # [8, 2, 3] never came before
    assert propose([1, 2, 3, 4], 1, 3, 4) == []  # no earlier occurrence
    assert propose([4, 4], 1, 2, 3) == [4]  # what follows, up to the end
    assert propose([1, 2, 1, 2], 2, 2, 0) == []  # no room
    assert propose([7], 1, 1, 3) == []


def _lookup_by_hand(tokens: List[int], lo: int, hi: int, k: int) -> List[int]:
    """propose's contract, written out: every earlier window equal to the last `lo` tokens,
    extended leftwards while it matches, up to `hi`; the longest, then the latest."""
    size, best = len(tokens), None
    if k < 1 or size <= lo:
        return []
    for s in range(size - lo):
        if tokens[s:s + lo] == tokens[size - lo:]:
            n = lo
            while n < hi and s - (n - lo) - 1 >= 0 and tokens[s - (n - lo) - 1] \
                    == tokens[size - n - 1]:
                n += 1
            if best is None or n >= best[0]:
                best = (n, s)
    return [] if best is None else tokens[best[1] + lo:best[1] + lo + k]


def test_lookup_agrees_with_its_contract_on_random_sequences() -> None:
    rng = random.Random(0)
    for _ in range(1500):
        tokens = [rng.randrange(rng.randint(1, 5)) for _ in range(rng.randint(1, 40))]
        lo = rng.randint(1, 4)
        hi, k = rng.randint(lo, 6), rng.randint(0, 5)
        assert propose(tokens, lo, hi, k) == _lookup_by_hand(tokens, lo, hi, k), (tokens, lo,
                                                                                   hi, k)


def test_kept_drafts_and_their_counts() -> None:
    assert kept([5, 6, 7], [5, 6, 8, 9]) == 2
    assert kept([5, 6], [4, 6, 1]) == 0
    assert kept([5, 6], [5, 6, 1]) == 2
    counts = SpecCounts()
    counts.add(3, 2)
    counts.add(0, 0)  # no drafts: not a draft
    counts.add(1, 1)
    assert (counts.drafts, counts.draft_tokens, counts.accepted_tokens,
            counts.accepted_per_pos) == (2, 4, 3, [2, 1, 0])


def test_settings_take_vllms_keys_and_name_what_is_wrong() -> None:
    cfg = SchedulerConfig(speculative_config=json.dumps(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}))
    assert cfg.speculative == SpeculativeConfig(3, 4, 4)  # vLLM: one bound sets both
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2}') \
        == SpeculativeConfig(2, 5, 5)
    assert SchedulerConfig().speculative is None
    bad = {
        '{"method": "eagle", "num_speculative_tokens": 3}': "method 'eagle' is not supported",
        '{"method": "ngram"}': "num_speculative_tokens must be an integer >= 1, got None",
        '{"method": "ngram", "num_speculative_tokens": 65}': "must be <= 64, got 65",
        '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, '
        '"prompt_lookup_max": 2}': "prompt_lookup_min 5 is more than prompt_lookup_max 2",
        '{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}': "method 'ngram' "
                                                                          "takes no draft model",
        '{"method": "ngram", "num_speculative_tokens": 2, "draft": 1}': "draft is not "
                                                                        "supported",
        '[1]': "must be a JSON object",
    }
    for text, message in bad.items():
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
            SchedulerConfig(speculative_config=text)
    with pytest.raises(ValueError, match="needs overlap off"):
        SchedulerConfig(speculative_config=json.dumps(SPEC), overlap=True)


def test_sglangs_ngram_flags_speculate_as_vllms_config() -> None:
    """SGLang's --speculative-algorithm NGRAM with its draft-token count (the newest token
    among them) and match windows; its other algorithms, a count without the algorithm, and
    both vLLM's and SGLang's settings at once are refused by name."""
    from minisgl.server.args import parse_args
    args = parse_args(["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "5",
                       "--speculative-ngram-max-match-window-size", "4"])
    assert args.scheduler.speculative == SpeculativeConfig(4, 1, 4)  # SGLang's min: 1
    assert SchedulerConfig(speculative_algorithm="ngram", speculative_num_draft_tokens=3
                           ).speculative == SpeculativeConfig(2, 1, 12)
    assert SchedulerConfig(speculative_algorithm="NGRAM",
                           speculative_num_draft_tokens=3).verify_tokens == 3
    capped = SchedulerConfig(speculative_config=json.dumps({**SPEC, "disable_by_batch_size": 6}))
    assert capped.verify_requests == 6 and SchedulerConfig().verify_requests is None
    bad = [({"speculative_algorithm": "EAGLE", "speculative_num_draft_tokens": 4},
            "speculative_algorithm 'EAGLE' is not supported"),
           ({"speculative_num_draft_tokens": 4}, "needs speculative_algorithm NGRAM"),
           ({"speculative_algorithm": "NGRAM"}, "speculative_num_draft_tokens must be an "
                                                "integer >= 2"),
           ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 1},
            "got 1"),
           ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 4,
             "speculative_ngram_min_match_window_size": 6,
             "speculative_ngram_max_match_window_size": 3}, "prompt_lookup_min 6 is more"),
           ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 4,
             "speculative_config": json.dumps(SPEC)}, "not both")]
    for kw, message in bad:
        with pytest.raises(ValueError, match=message):
            SchedulerConfig(**kw)  # type: ignore[arg-type]


LIST_CHAT = [[{"role": "user", "content": "Give these fruits as a JSON list: apple, banana, "
                                         "cherry, date, fig, grape."}]]
LIST_SCHEMA = {"type": "object", "properties": {"fruits": {"type": "array",
                                                           "items": {"type": "string"}}},
               "required": ["fruits"]}


def test_a_grammar_masks_each_draft_position_as_after_the_drafts_before_it(
        default_model_dir: Path) -> None:
    """`RequestGrammar.fill_drafted`: row j is the mask after accepting drafts[:j] one by one;
    past a draft the grammar refuses, rows stay all allowed; the matcher is left as it was."""
    from minisgl.grammar import GrammarCache, TokenizerSource
    from minisgl.grammar.matcher import RequestGrammar, full_bitmask
    from minisgl.tokenizer.text import load_tokenizer
    tok = load_tokenizer(default_model_dir)
    cache = GrammarCache(TokenizerSource(tokenizer=tok, stop_ids=[tok.eos_token_id]))
    compiled = cache.check(StructuredOutput("json", json.dumps(LIST_SCHEMA)))
    text = tok.encode('{"fruits": ["apple", "banana"', add_special_tokens=False)
    vocab = len(tok)
    grammar, step_by_step = RequestGrammar(compiled, [tok.eos_token_id]), RequestGrammar(
        compiled, [tok.eos_token_id])
    for t in text[:3]:
        assert grammar.accept(t) and step_by_step.accept(t)
    brace, bracket = (tok.encode(c, add_special_tokens=False)[0] for c in "}]")
    drafts = text[3:] + [brace, bracket]
    rows = full_bitmask(len(drafts) + 1, vocab)
    grammar.fill_drafted(rows, 0, drafts)
    refused = len(text) - 3  # "}" cannot close the object inside its list
    for j in range(len(drafts) + 1):
        want = full_bitmask(1, vocab)
        if j <= refused:
            step_by_step.fill_row(want, 0)
        assert bool((rows[j] == want[0]).all()), j
        if j < refused:
            assert step_by_step.accept(drafts[j])
    after = full_bitmask(1, vocab)
    grammar.fill_row(after, 0)
    again = RequestGrammar(compiled, [tok.eos_token_id])
    for t in text[:3]:
        again.accept(t)
    expected = full_bitmask(1, vocab)
    again.fill_row(expected, 0)
    assert bool((after == expected).all())  # rolled back
    cache.close()


def _in_sublist(word: List[int], tokens: List[int]) -> bool:
    return any(tokens[i:i + len(word)] == word for i in range(len(tokens)))


def test_every_sampling_option_gives_plain_decodings_tokens(default_model_dir: Path) -> None:
    """One batch of requests, each with another option, verified together gives plain
    decoding's tokens: seeded random sampling with log-probabilities (the noise keyed by the
    output position), penalties and bad words (each position sees the drafts before it as
    output), grammars (the mask at each position is the grammar's after the drafts before
    it), a stop token and max_tokens inside a verified run of drafts; a constrained request
    keeps drafts, and the KV accounting balances after."""
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    listed = SamplingParams(temperature=0.0, max_tokens=30, structured=StructuredOutput(
        "json", json.dumps(LIST_SCHEMA)))
    with LLM(str(default_model_dir), device="cpu", page_size=4, max_kv_tokens=4096,
             show_progress=False) as plain_llm:
        ref = plain_llm.chat(CHATS[1:2], greedy)[0].outputs[0].token_ids
        ban, stop = ref[12:14], ref[20]  # in a repetitive answer whose drafts are kept
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        workloads = {
            "seeded": (CHATS[0], SamplingParams(temperature=0.8, seed=11, max_tokens=30,
                                                logprobs=2, token_ids_logprob=[13, 7, 13])),
            "seeded_2": (CHATS[2], SamplingParams(temperature=0.8, seed=12, max_tokens=30)),
            "penalized": (CHATS[1], SamplingParams(temperature=0.0, max_tokens=30,
                                                   repetition_penalty=1.1,
                                                   frequency_penalty=0.2, presence_penalty=0.1)),
            "banned": (CHATS[1], SamplingParams(temperature=0.0, max_tokens=30,
                                                ignore_eos=True, bad_word_ids=[ban])),
            "json": (CHATS[2], SamplingParams(temperature=0.0, max_tokens=30,
                                              structured=StructuredOutput("json",
                                                                          json.dumps(schema)))),
            "listed": (LIST_CHAT[0], listed),
            "stopped": (CHATS[1], SamplingParams(temperature=0.0, max_tokens=30,
                                                 ignore_eos=True, stop_token_ids=[stop])),
            "short": (CHATS[1], SamplingParams(temperature=0.0, max_tokens=17,
                                               ignore_eos=True)),
        }
        chats, params = [c for c, _ in workloads.values()], [p for _, p in workloads.values()]
        plain = dict(zip(workloads, (o.outputs[0] for o in plain_llm.chat(chats, params))))
    with LLM(str(default_model_dir), device="cpu", page_size=4, max_kv_tokens=4096,
             speculative_config=SPEC, show_progress=False) as llm:
        alone = llm.chat(LIST_CHAT, listed)[0].outputs[0]
        kept_alone = llm.stats.spec_accepted_tokens_total
        spec = dict(zip(workloads, (o.outputs[0] for o in llm.chat(chats, params))))
        kept = llm.stats.spec_accepted_tokens_total - kept_alone
        accounting = llm.check_accounting()
    for k in workloads:
        assert spec[k].token_ids == plain[k].token_ids, k
    assert kept > 0 and kept_alone > 0  # drafts kept inside a grammar too
    assert alone.token_ids == plain["listed"].token_ids
    got, want = spec["seeded"].token_logprobs, plain["seeded"].token_logprobs
    assert got is not None and want is not None
    for a, b in zip(got, want):
        assert a.top_ids == b.top_ids and a.rank == b.rank
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert a.ids_logprobs == pytest.approx(b.ids_logprobs, abs=1e-4)  # verified alike
        assert len(a.ids_logprobs) == 3
    assert not _in_sublist(ban, spec["banned"].token_ids)
    assert json.loads(spec["json"].text)["n"] is not None
    assert json.loads(spec["listed"].text)["fruits"]
    assert spec["stopped"].token_ids == ref[:ref.index(stop) + 1]
    assert spec["stopped"].finish_reason == "stop"
    assert spec["short"].token_ids == ref[:17]
    assert accounting.live_requests == accounting.reserved_pages == 0


def test_tp2_speculates_in_lockstep(tiny_model: Callable[..., Path]) -> None:
    """Every rank drafts the same tokens from the same requests (lockstep checked each step):
    tp=2 with drafts gives tp=1's plain greedy tokens."""
    path = tiny_model("qwen3")
    prompts: List[List[int]] = [p + p[:8] for p in mixed_prompts(6, seed=5, lengths=(9, 40))]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with LLM(str(path), device="cpu", page_size=4, max_kv_tokens=2048,
             show_progress=False) as llm:
        ref = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM(str(path), device="cpu", tp=2, page_size=4, max_kv_tokens=2048,
             speculative_config=SPEC, check_lockstep=True, show_progress=False) as llm:
        tokens = [o.token_ids for o in llm.generate(prompts, params)]
        stats = llm.stats
    assert tokens == ref
    assert stats.verify_steps_total > 0 and stats.spec_draft_tokens_total > 0, stats


def test_metrics_and_the_stats_line_show_acceptance() -> None:
    """vLLM's spec_decode counters (per replica; per draft position up to
    num_speculative_tokens) only where the service speculates; the stats line's acceptance
    over the interval."""
    stats = SchedulerStats(spec_tokens=3, verify_steps_total=5, spec_drafts_total=4,
                           spec_draft_tokens_total=10, spec_accepted_tokens_total=6,
                           spec_accepted_per_pos=(4, 2), generated_tokens_total=16)
    lines = vllm_lines("m", [stats], {}, {})
    assert 'vllm:spec_decode_num_drafts_total{model_name="m",engine="0"} 4.0' in lines
    assert 'vllm:spec_decode_num_draft_tokens_total{model_name="m",engine="0"} 10.0' in lines
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="m",engine="0"} 6.0' in lines
    per_pos = [line for line in lines if line.startswith(
        "vllm:spec_decode_num_accepted_tokens_per_pos_total{")]
    assert [line.rsplit(" ", 1)[1] for line in per_pos] == ["4.0", "2.0", "0.0"]
    assert 'position="2"' in per_pos[2]
    assert not any("spec_decode" in line for line in vllm_lines("m", [SchedulerStats()], {}, {}))
    line = stats_line(Totals(), Totals.of([stats]), 1.0)
    assert line is not None and line.endswith(", drafts accepted 60.0% (2.5 tokens a verify)")
    assert "drafts" not in (stats_line(Totals(), Totals(running=1), 1.0) or "")


def test_served_with_drafts_streams_plain_decodings_text(tmp_path: Path) -> None:
    """`serve --speculative-config`: several tokens a step reach the client streamed as plain
    decoding's text (the offline engine's, without drafts), a stop string inside a verified
    run cuts there, and /metrics counts drafts under vLLM's names."""
    chat = CHATS[1]
    with LLM(max_kv_tokens=4096, show_progress=False) as llm:
        ref = llm.chat([chat], SamplingParams(temperature=0, max_tokens=50))[0].text
    with serving([*CPU_ARGS, "--speculative-config", json.dumps(SPEC)], tmp_path) as srv:
        client = openai_client(srv)
        model = client.models.list().data[0].id
        chunks = client.chat.completions.create(model=model, messages=chat, temperature=0,
                                                max_tokens=50, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        stop = ref[len(ref) // 2:len(ref) // 2 + 3]
        cut = client.chat.completions.create(model=model, messages=chat, temperature=0,
                                             max_tokens=50, stop=[stop])
        metrics = srv.wait_metrics(lambda m: any("spec_decode_num_accepted" in k for k in m))
        info = httpx.get(f"{srv.url}/get_server_info").json()
    # SGLang's bench_serving reads the accept length here
    state = info["internal_states"][0]
    assert state["speculative_num_draft_tokens"] == 5 and 1 < state["avg_spec_accept_length"] <= 5
    assert streamed == ref
    assert cut.choices[0].message.content == ref[:ref.index(stop)]
    accepted = [v for k, v in metrics.items()
                if k.startswith("vllm:spec_decode_num_accepted_tokens_total")]
    assert accepted and accepted[0] > 0, metrics
    assert metrics["minisgl_spec_accepted_tokens_total"] == accepted[0]


def _req(uid: int, tokens: List[int], max_tokens: int = 50, pages: int = 8, **kw: object
         ) -> Req:
    """A running request with `tokens` on the host (its prompt: all but the last)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]
    return Req(uid, list(tokens), len(tokens) - 1, params, (0,), device_len=len(tokens),
               pages=list(range(pages)))


def DecodeBatch(reqs: List[Req]) -> Batch:  # noqa: N802 (what decode.py builds)
    return Batch(Phase.DECODE, reqs, [r.device_len - 1 for r in reqs], [1] * len(reqs),
                 [True] * len(reqs))


def test_drafter_caps_and_who_drafts() -> None:
    """Drafts stop short of max_tokens, of the request's own pages and reservation, and of a
    longrope model's pretraining length; a batch past disable_by_batch_size decodes
    plainly."""
    loop = [1, 2, 3, 4, 5, 6] * 4  # every lookup finds what follows
    cfg = SpeculativeConfig(4, 1, 3)
    drafter = Drafter(cfg, page_size=4)
    verify = drafter.with_drafts(DecodeBatch([_req(1, loop), _req(2, loop, max_tokens=3),
                                              _req(3, loop[:22], pages=6),
                                              _req(4, loop, bad_word_ids=[[9, 9]])]))
    assert verify.phase is Phase.VERIFY
    assert verify.drafts == [[1, 2, 3, 4], [1], [5, 6], [1, 2, 3, 4]]  # K, max_tokens, pages
    assert verify.extend_lens == [5, 2, 3, 5] and verify.prefix_lens == [23, 23, 21, 23]
    assert drafter.room(_req(5, loop, pages=6)) == 0  # 24 tokens fill its 6 pages of 4
    assert drafter.room(_req(6, loop, max_tokens=1)) < 1  # its last token is the next one
    assert Drafter(cfg, 4, long_rope_from=26).room(_req(7, loop)) == 2
    plain = DecodeBatch([_req(8, loop), _req(9, loop)])
    assert Drafter(SpeculativeConfig(4, 1, 3, disable_by_batch_size=1), 4).with_drafts(
        plain) is plain
    nothing = DecodeBatch([_req(12, [7, 8, 9])])  # no earlier occurrence
    assert drafter.with_drafts(nothing) is nothing


def test_lora_requests_verify_with_their_adapter(tiny_model: Callable[..., Path],
                                                 tmp_path: Path) -> None:
    """A verify step runs each position with its request's adapter (eager LoRA rows per
    token): requests with and without an adapter, drafted side by side, give plain decoding's
    tokens."""
    from minisgl import LoRARequest
    from tiny_models import write_lora
    path = tiny_model("qwen3")
    adapter = write_lora(path, tmp_path / "adapter", seed=3)
    prompts = [p + p[:6] for p in mixed_prompts(4, seed=5, lengths=(9, 30))]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    loras = [LoRARequest("a"), None, LoRARequest("a"), None]
    runs = []
    for spec in (None, SPEC):
        with LLM(str(path), device="cpu", page_size=4, max_kv_tokens=2048,
                 lora_modules=f"a={adapter}", speculative_config=spec,
                 show_progress=False) as llm:
            runs.append([o.token_ids for o in llm.generate(prompts, params,
                                                           lora_request=loras)])
            stats = llm.stats
    assert runs[0] == runs[1]
    assert stats.spec_accepted_tokens_total > 0, stats


def test_drafts_under_kv_pressure_and_retraction(tiny_model: Callable[..., Path]) -> None:
    """A pool too small for every request's whole output (decode_reserve_tokens 8): requests
    are retracted and come back while others verify drafts (drafts never take a page beyond a
    request's own and its reservation); mixed options; plain decoding's tokens, the pool
    balanced after."""
    path = tiny_model("qwen3")
    rng = random.Random(1)
    prompts = [p + p[:rng.randint(1, 8)] for p in mixed_prompts(16, seed=9, lengths=(5, 20, 60))]
    params = [SamplingParams(max_tokens=rng.randint(5, 50), temperature=rng.choice([0.0, 0.7]),
                             seed=i, ignore_eos=True, logprobs=rng.choice([None, 1]),
                             repetition_penalty=rng.choice([1.0, 1.2])) for i in range(16)]
    runs, stats = [], []
    for spec in (None, {**SPEC, "num_speculative_tokens": 6}):
        with LLM(str(path), device="cpu", page_size=4, max_kv_tokens=480,
                 max_running_requests=12, decode_reserve_tokens=8, speculative_config=spec,
                 show_progress=False) as llm:
            runs.append([o.token_ids for o in llm.generate(prompts, params)])
            stats.append(llm.stats)
            accounting = llm.check_accounting()
            assert accounting.live_requests == accounting.reserved_pages == 0
    assert runs[0] == runs[1]
    assert stats[1].retracted_requests_total > 0 and stats[1].verify_steps_total > 0, stats[1]
