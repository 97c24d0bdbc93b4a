"""The offline API on the default model: chat, sampling semantics, finish reasons, bad input."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

import pytest

from bos_tokenizer import with_bos

from minisgl import LLM, SamplingParams
from minisgl.core import prompt_error


@pytest.fixture(scope="module")
def llm(default_model_dir: Path) -> Iterator[LLM]:
    # vLLM's dict keywords go as their flags' JSON (compilation_config's torch.compile keys
    # change nothing; the language model alone, as a multimodal limit of 0 says)
    with LLM(str(default_model_dir), max_kv_tokens=4096, page_size=16, show_progress=False,
             compilation_config={"level": 3}, limit_mm_per_prompt={"image": 0}) as engine:
        yield engine


def _pages_balanced(llm: LLM) -> None:
    s = llm.check_accounting()
    assert s.live_requests == 0 and s.free_rows == s.total_rows
    assert s.reserved_pages == 0


def test_chat_answers_paris(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=40, temperature=0))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # the model ends its turn with an EOS id
    _pages_balanced(llm)


def test_generate_accepts_text_and_ids(llm: LLM) -> None:
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    by_text = llm.generate("The capital of France is", p)[0]
    ids = llm.tokenizer.encode("The capital of France is", add_special_tokens=False)
    by_ids = llm.generate([ids], p)[0]
    assert by_text.token_ids == by_ids.token_ids and len(by_ids.token_ids) == 8
    assert by_text.text == llm.tokenizer.decode(by_text.token_ids, skip_special_tokens=True)
    assert by_text.prompt_tokens == len(ids)


def test_text_prompts_get_the_tokenizers_bos(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A text prompt is encoded with the tokenizer's special tokens, as vLLM's LLM.generate and
    Hugging Face's tokenizer(text) do: Llama-3 and Mistral prompts start with their BOS (the
    default model's tokenizer adds none)."""
    ids = llm.tokenizer.encode("The capital of France is", add_special_tokens=False)
    monkeypatch.setattr(llm, "tokenizer", with_bos(llm.tokenizer))
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=1))[0]
    assert out.prompt_tokens == len(ids) + 1
    _pages_balanced(llm)


def test_seeded_sampling(llm: LLM) -> None:
    prompt = "Tell me a story about a dragon."
    p = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    a, b = llm.generate([prompt, prompt], p)
    assert a.token_ids == b.token_ids  # same seed, same text, even in one batch
    other = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=1.0, seed=99,
                                                ignore_eos=True))[0]
    assert other.token_ids != a.token_ids
    unseeded = llm.generate([prompt] * 2, SamplingParams(max_tokens=24, ignore_eos=True))
    assert unseeded[0].token_ids != unseeded[1].token_ids  # per-request noise without a seed


def test_greedy_equivalents(llm: LLM) -> None:
    prompt = "List three colors:"
    greedy = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    topk1 = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0.8, top_k=1,
                                                seed=5, ignore_eos=True))
    tiny_p = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0.7, top_p=1e-6,
                                                 seed=6, ignore_eos=True))
    min_p1 = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=1.0, min_p=1.0,
                                                 seed=7, ignore_eos=True))
    assert greedy[0].token_ids == topk1[0].token_ids == tiny_p[0].token_ids
    assert greedy[0].token_ids == min_p1[0].token_ids


def test_finish_reasons_and_stop_ids(llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ref = llm.generate("Count: 1, 2, 3,", greedy)[0].token_ids
    stop_at = ref[5]
    out = llm.generate("Count: 1, 2, 3,", SamplingParams(
        max_tokens=12, temperature=0, stop_token_ids=(stop_at,)))[0]
    assert out.finish_reason == "stop" and out.token_ids == ref[:ref.index(stop_at) + 1]
    one = llm.generate("Count: 1, 2, 3,", SamplingParams(max_tokens=1, temperature=0))[0]
    assert one.finish_reason in ("length", "stop") and len(one.token_ids) == 1
    _pages_balanced(llm)


def test_stats_count_steps_and_time_by_phase(llm: LLM) -> None:
    before = llm.stats
    llm.generate(["a", "b"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    after = llm.stats
    assert after is not None
    b_prefill = before.prefill_steps_total if before else 0
    b_decode = before.decode_steps_total if before else 0
    assert after.prefill_steps_total > b_prefill  # both prompts fit one prefill batch
    assert after.decode_steps_total - b_decode == 3  # tokens 2..4 of the pair, batched
    assert after.decode_seconds_total > 0 and after.prefill_seconds_total > 0
    assert after.generated_tokens_total - (before.generated_tokens_total if before else 0) == 8


def test_per_prompt_params(llm: LLM) -> None:
    outs = llm.generate(["a", "b"], [SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                                     SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)])
    assert [len(o.token_ids) for o in outs] == [3, 5]
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()])


def test_vllm_keywords(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's callers write `sampling_params=` and `use_tqdm=`: the same outputs, a bar on
    request (even for one prompt) and none when told."""
    greedy = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    capsys.readouterr()
    out = llm.generate("a", sampling_params=greedy, use_tqdm=True)
    assert out[0].token_ids == llm.generate("a", greedy)[0].token_ids
    assert "generating" in capsys.readouterr().err
    chat = [{"role": "user", "content": "Hi"}]
    assert len(llm.chat(chat, sampling_params=greedy, use_tqdm=False)[0].token_ids) == 3
    assert "generating" not in capsys.readouterr().err


@pytest.mark.parametrize("prompt,params,match", [
    ("", SamplingParams(max_tokens=4), "prompt 1: the prompt is empty"),
    ([], SamplingParams(max_tokens=4), "prompt 1: the prompt is empty"),
    ("hi", SamplingParams(max_tokens=-3), "max_tokens must be at least 1, got -3"),
    ("hi", SamplingParams(max_tokens=0), "got 0"),
    ("hi", SamplingParams(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
    ("hi", SamplingParams(top_p=0.0), "got 0.0"),
    ("hi", SamplingParams(temperature=-1.0), "temperature must be .* got -1.0"),
    ("hi", SamplingParams(min_p=2.0), "min_p must be in"),
    ("hi", SamplingParams(max_tokens=9000), r"prompt tokens plus max_tokens 9000 = \d+ exceeds "
                                            r"the context length 8192"),
    ([10, 99999999], SamplingParams(max_tokens=4), "prompt 1: token id 99999999 is outside"),
    ([10, -1, 99999999], SamplingParams(max_tokens=4), "prompt 1: token id -1 is outside"),
    ([10, True], SamplingParams(max_tokens=4), "a token-id prompt must be a list of integers"),
    ([10, 2.5], SamplingParams(max_tokens=4), "a token-id prompt must be a list of integers"),
])
def test_bad_input_raises_and_leaks_nothing(llm: LLM, prompt: object, params: SamplingParams,
                                            match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate(["fine prompt", prompt], params)  # type: ignore[list-item]
    _pages_balanced(llm)
    assert llm.generate("still works", SamplingParams(max_tokens=2, temperature=0))[0].token_ids


def test_request_bigger_than_pool_is_rejected(default_model_dir: Path) -> None:
    with LLM(str(default_model_dir), max_kv_tokens=64, page_size=16,
             show_progress=False) as small:
        with pytest.raises(ValueError, match="needs 5 KV pages, more than the pool holds \\(4\\)"):
            small.generate([[5] * 10, [6] * 10], [SamplingParams(max_tokens=4),
                                                  SamplingParams(max_tokens=60)])
        assert small.generate([[5] * 10], SamplingParams(max_tokens=4))
        _pages_balanced(small)


class _Props:
    def __init__(self, name: str, gib: int) -> None:
        self.name, self.total_memory = name, gib << 30


@pytest.mark.parametrize("name,gib,want", [("NVIDIA H200", 141, 16384),
                                           ("NVIDIA A100-SXM4-80GB", 80, 8192),
                                           ("NVIDIA L4", 24, 8192)])
def test_offline_prefill_chunk_follows_the_gpu(monkeypatch: pytest.MonkeyPatch, name: str,
                                               gib: int, want: int) -> None:
    import torch

    from minisgl.utils import offline_prefill_tokens
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: _Props(name, gib))
    assert offline_prefill_tokens(torch.device("cuda", 1)) == want
    assert offline_prefill_tokens(torch.device("cpu")) == 8192


def test_offline_prefill_chunk_default_reaches_the_scheduler(llm: LLM) -> None:
    """The fixture leaves max_prefill_tokens unset: on CPU the scheduler's chunk is 8,192."""
    assert llm.limits.max_prefill_tokens == 8192


def test_closed_llm_releases_its_engine(default_model_dir: Path) -> None:
    """Closing (the with block's end) drops the engine, weights and KV pool with it, so that a
    next LLM in the process sizes its pool from all the memory; a closed LLM refuses work."""
    import weakref
    with LLM(str(default_model_dir), max_kv_tokens=256, show_progress=False) as llm:
        engine = weakref.ref(llm._backend.engine)  # type: ignore[attr-defined]
        assert llm.generate("Hi", SamplingParams(max_tokens=2))[0].token_ids
    assert engine() is None
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate("Hi", SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="closed"):
        llm.check_accounting()


@pytest.mark.parametrize("ids,error", [
    ([5, 0, 49151], None), ([True, 3], None), ([], "the prompt is empty"),
    ([5, 49152, -1], "token id 49152 is outside the vocabulary [0, 49152)"),
    ([5, -1, 49152], "token id -1 is outside the vocabulary [0, 49152)"),
    ([5, 2.0, "x"], "token id 2.0 is outside the vocabulary [0, 49152)"),
])
def test_prompt_error_names_the_first_bad_id(ids: list, error: object) -> None:
    """The check every path makes (LLM, tokenizer, scheduler): the fast path for valid ids and
    the message naming the first bad one agree with checking id by id."""
    assert prompt_error(ids, 49152) == error


def test_stop_token_ids_as_a_list_and_their_text_left_out(llm: LLM) -> None:
    """vLLM writes stop_token_ids as a list; a stop token ends the output without its text (as
    the server renders it), while token_ids keep it. Before, a list broke the scheduler for
    every later call."""
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ref = llm.generate("Count: 1, 2, 3,", greedy)[0].token_ids
    stop_at = ref[3]
    first = ref.index(stop_at)
    out = llm.generate("Count: 1, 2, 3,", SamplingParams(max_tokens=12, temperature=0,
                                                         stop_token_ids=[stop_at]))[0]
    assert out.finish_reason == "stop" and out.token_ids == ref[:first + 1]
    assert out.text == llm.tokenizer.decode(ref[:first], skip_special_tokens=True)
    _pages_balanced(llm)
    assert llm.generate("hi", SamplingParams(max_tokens=2))[0].token_ids  # still serving


def test_an_interrupted_generate_leaves_nothing_behind(llm: LLM,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C in the middle of generate (KeyboardInterrupt out of a poll): the requests are
    aborted and their outs drained, so the pages balance and the next call works. Before,
    every later call raised KeyError on a stale uid."""
    backend = llm._backend  # type: ignore[attr-defined]
    polls = {"n": 0}
    real_poll = backend.poll

    def poll() -> object:
        polls["n"] += 1
        if polls["n"] == 3:
            raise KeyboardInterrupt
        return real_poll()
    monkeypatch.setattr(backend, "poll", poll)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["Once upon a time"] * 3, SamplingParams(max_tokens=32, ignore_eos=True))
    _pages_balanced(llm)
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert len(llm.generate("Hello", p)[0].token_ids) == 6


def test_vllm_dict_prompts(llm: LLM) -> None:
    """vLLM's TextPrompt / TokensPrompt dicts are prompts (before, a dict was iterated as a
    batch of its keys' text)."""
    p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    ids = llm.tokenizer.encode("The capital of France is", add_special_tokens=True)
    by_ids = llm.generate({"prompt_token_ids": ids}, p)[0]
    by_text = llm.generate([{"prompt": "The capital of France is"}], p)[0]
    assert by_ids.token_ids == by_text.token_ids == llm.generate([ids], p)[0].token_ids
    for bad, match in (({"text": "hi"}, "a dict prompt is"),
                       ({"prompt": "hi", "multi_modal_data": {}}, "a dict prompt is"),
                       (None, "prompts must be a prompt or a list"),
                       ([3.5], "a token-id prompt must be a list of integers")):
        with pytest.raises(ValueError, match=match):
            llm.generate(bad, p)  # type: ignore[arg-type]
    _pages_balanced(llm)


def test_chat_takes_text_parts_and_vllms_template_options(llm: LLM) -> None:
    p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "World"}]
    a = llm.chat([{"role": "user", "content": parts}], p)[0]
    b = llm.chat([{"role": "user", "content": "Hello\nWorld"}], p)[0]
    assert a.token_ids == b.token_ids and a.prompt_tokens == b.prompt_tokens
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello th"}]
    cont = llm.chat(conv, p, add_generation_prompt=False, continue_final_message=True)[0]
    new = llm.chat(conv, p)[0]
    assert cont.prompt_tokens < new.prompt_tokens  # no end of turn, no new assistant header
    with pytest.raises(ValueError, match="message 0 must be a dict with a role"):
        llm.chat([{"content": "hi"}], p)
    with pytest.raises(ValueError, match="only text content parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], p)
    with pytest.raises(ValueError, match="cannot both be true"):
        llm.chat(conv, p, continue_final_message=True)
    # vLLM's chat_template_content_format: a template that loops over content parts
    looped = ("{% for m in messages %}{% for c in m.content %}{{ c.text }}{% endfor %}"
              "{% endfor %}")
    assert llm.chat([{"role": "user", "content": "Hello"}], p, chat_template=looped)[
        0].prompt_tokens > 0
    with pytest.raises(ValueError, match="chat_template_content_format must be one of"):
        llm.chat(conv, p, chat_template_content_format="parts")
    _pages_balanced(llm)


_CALLS_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %} [call {{ c.id }} {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}]{% endfor %}"
    "{% if m.tool_call_id %} (answers {{ m.tool_call_id }}){% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")


def test_chat_hands_tool_calls_to_the_template_as_the_server_does(llm: LLM) -> None:
    """An assistant's call arguments reach the template as an object, whether given as JSON
    text (OpenAI's form) or as an object (vLLM's offline form also takes it); a Mistral
    template (it writes [TOOL_CALLS]) gets call ids of 9 letters and digits, a call and its
    answer alike; bad calls raise naming the field, and nothing is left allocated."""
    p = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def conv(arguments: object) -> list:
        return [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_abc123xyz000", "type": "function",
                     "function": {"name": "get_weather", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "call_abc123xyz000", "content": "sunny"}]

    def prompt(arguments: object, template: str = _CALLS_TEMPLATE) -> str:
        out = llm.chat(conv(arguments), p, chat_template=template)[0]
        return llm.tokenizer.decode(out.prompt_token_ids)

    as_text = prompt('{"city": "Paris"}')
    assert '[call call_abc123xyz000 get_weather {"city": "Paris"}]' in as_text
    assert as_text.endswith("tool: sunny (answers call_abc123xyz000)assistant:")
    assert prompt({"city": "Paris"}) == as_text
    mistral = prompt('{"city": "Paris"}', "{# [TOOL_CALLS] #}" + _CALLS_TEMPLATE)
    mapped = mistral.split("[call ")[1].split(" ")[0]
    assert len(mapped) == 9 and mapped.isalnum() and f"(answers {mapped})" in mistral
    with pytest.raises(ValueError, match=r"messages\[1\].tool_calls\[0\].function.arguments: "
                                         "not valid JSON"):
        prompt("{city")
    with pytest.raises(ValueError, match=r"messages\[1\].tool_calls\[0\]: must be"):
        llm.chat(conv("{}")[:1] + [{"role": "assistant", "tool_calls": [{"id": "x"}]}], p)
    with pytest.raises(ValueError, match="message 0: only assistant messages make tool calls"):
        llm.chat([{**conv("{}")[1], "role": "user"}], p)
    _pages_balanced(llm)


def test_min_tokens_holds_stop_strings_back(llm: LLM) -> None:
    """As vLLM: a stop string ending within the first min_tokens tokens does not end the
    output; the next one does."""
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    full = llm.generate("Count: 1, 2, 3,", greedy)[0]
    first = full.text.index(",")
    upto = next(n for n in range(1, len(full.token_ids) + 1)
                if "," in llm.tokenizer.decode(full.token_ids[:n]))  # tokens through it
    plain = llm.generate("Count: 1, 2, 3,", SamplingParams(
        max_tokens=16, temperature=0, stop=[","]))[0]
    held = llm.generate("Count: 1, 2, 3,", SamplingParams(
        max_tokens=16, temperature=0, stop=[","], min_tokens=upto))[0]
    assert plain.text == full.text[:first]
    assert held.text == full.text[:full.text.index(",", first + 1)]
    assert held.finish_reason == "stop"
    _pages_balanced(llm)


def test_vllm_request_output_names(llm: LLM) -> None:
    """A script ported from vLLM reads `out.outputs[0].text`, `.prompt_token_ids`,
    `.request_id`, `.cumulative_logprob` and logprobs as {token id: Logprob} (before, every
    one was an AttributeError); with n > 1, one output per prompt holds its choices, as in
    vLLM."""
    ids = llm.tokenizer.encode("Count: 1, 2, 3,", add_special_tokens=True)
    p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2)
    text, by_ids = llm.generate(["Count: 1, 2, 3,", {"prompt_token_ids": ids}], p)
    assert text.prompt == "Count: 1, 2, 3," and by_ids.prompt is None
    assert text.prompt_token_ids == by_ids.prompt_token_ids == ids
    assert text.request_id != by_ids.request_id and text.finished
    assert llm.get_tokenizer() is llm.tokenizer
    assert text.num_cached_tokens == text.cached_tokens
    [choice] = text.outputs
    assert (choice.index, choice.text, choice.token_ids, choice.finish_reason) == (
        0, text.text, text.token_ids, "length")
    assert text.logprobs is not None and choice.logprobs is not None
    assert choice.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in text.logprobs))
    for token, step, lp in zip(choice.token_ids, choice.logprobs, text.logprobs):
        assert step[token].logprob == lp.logprob and step[token].rank == lp.rank
        assert set(lp.top_ids) <= set(step) and len(step) <= 3
    m = text.metrics  # vLLM's RequestStateStats: submitted <= admitted <= first <= last token
    assert m is not None and m.num_generation_tokens == 4
    assert abs(m.arrival_time - time.time()) < 60
    assert m.queued_ts <= m.scheduled_ts <= m.first_token_ts <= m.last_token_ts <= time.monotonic()
    assert m.first_token_latency == m.first_token_ts - m.queued_ts > 0
    for step in choice.logprobs:
        assert all(v.decoded_token == llm.tokenizer.decode([t]) for t, v in step.items())
    assert llm.generate("a", SamplingParams(max_tokens=2))[0].outputs[0].cumulative_logprob \
        is None  # as vLLM: only where logprobs are asked for
    scored = llm.generate({"prompt_token_ids": ids}, SamplingParams(
        max_tokens=1, temperature=0, prompt_logprobs=1, detokenize=False))[0]
    assert scored.prompt_logprobs is not None and scored.prompt_logprobs[0] is None
    assert len(scored.prompt_logprobs) == len(ids)
    entry = scored.prompt_logprobs[1]  # as lm-eval-harness reads a continuation's scores
    assert entry is not None and entry[ids[1]].decoded_token is None  # detokenize=False
    n2 = llm.generate(["a", "b"], SamplingParams(max_tokens=2, seed=1, n=2))
    assert len(n2) == 2 and n2[0].request_id != n2[1].request_id
    assert [[c.index for c in o.outputs] for o in n2] == [[0, 1], [0, 1]]
    assert n2[1].prompt == "b" and n2[1].text == n2[1].outputs[0].text
    _pages_balanced(llm)


def test_vllm_stop_reason(llm: LLM) -> None:
    """stop_reason (vLLM's): the stop string or stop token id that ended the output, None when
    max_tokens did."""
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ref = llm.generate("Count: 1, 2, 3,", greedy)[0]
    assert ref.stop_reason is None and ref.finish_reason == "length"
    by_str = llm.generate("Count: 1, 2, 3,", SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True, stop=[",", "never"]))[0]
    assert (by_str.finish_reason, by_str.outputs[0].stop_reason) == ("stop", ",")
    by_id = llm.generate("Count: 1, 2, 3,", SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True, stop_token_ids=[ref.token_ids[2]]))[0]
    assert (by_id.finish_reason, by_id.stop_reason) == ("stop", ref.token_ids[2])


def test_include_stop_str_in_output(llm: LLM) -> None:
    """vLLM's include_stop_str_in_output keeps the matched stop string at the end of the text
    (before, SamplingParams refused the keyword: TypeError); a non-bool is a ValueError naming
    it."""
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    full = llm.generate("Count: 1, 2, 3,", greedy)[0].text
    kept = llm.generate("Count: 1, 2, 3,", SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True, stop=[","],
        include_stop_str_in_output=True))[0]
    assert kept.text == full[:full.index(",") + 1] and kept.finish_reason == "stop"
    with pytest.raises(ValueError, match="include_stop_str_in_output must be true or false, "
                                         "got 'yes'"):
        llm.generate("hi", SamplingParams(include_stop_str_in_output="yes"))  # type: ignore
    _pages_balanced(llm)


def test_stop_regex_offline(llm: LLM) -> None:
    """SGLang's stop_regex in LLM.generate: the output cut before the pattern's first match
    (kept with include_stop_str_in_output), `stop_reason` the pattern, the request's pages
    freed; a bad pattern is a ValueError naming it, before anything runs."""
    greedy = dict(max_tokens=12, temperature=0, ignore_eos=True)
    full = llm.generate("Count: 1, 2, 3,", SamplingParams(**greedy))[0].text
    cut = llm.generate("Count: 1, 2, 3,", SamplingParams(**greedy, stop_regex=r"\d,"))[0]
    at = next(i for i in range(len(full) - 1) if full[i].isdigit() and full[i + 1] == ",")
    assert (cut.text, cut.finish_reason, cut.stop_reason) == (full[:at], "stop", r"\d,")
    kept = llm.generate("Count: 1, 2, 3,", SamplingParams(
        **greedy, stop_regex=[r"\d,"], include_stop_str_in_output=True))[0]
    assert kept.text == full[:at + 2]
    with pytest.raises(ValueError, match="does not compile"):
        llm.generate("hi", SamplingParams(stop_regex="("))
    _pages_balanced(llm)


def test_skip_special_tokens_false_renders_them(llm: LLM) -> None:
    """vLLM's skip_special_tokens=False keeps special tokens in the text (before, SamplingParams
    refused the keyword: TypeError), with or without stop strings; True (the default) drops
    them."""
    start = llm.tokenizer.convert_ids_to_tokens(1)  # <|im_start|>: special, not an EOS
    forced = dict(max_tokens=3, temperature=0, ignore_eos=True, allowed_token_ids=[1])
    assert llm.generate("Hi", SamplingParams(**forced))[0].text == ""
    shown = llm.generate("Hi", SamplingParams(**forced, skip_special_tokens=False))[0]
    assert shown.token_ids == [1, 1, 1] and shown.text == start * 3
    watched = llm.generate("Hi", SamplingParams(**forced, skip_special_tokens=False,
                                                stop=["never"]))[0]
    assert watched.text == start * 3
    with pytest.raises(ValueError, match="skip_special_tokens must be true or false, got 0"):
        llm.generate("hi", SamplingParams(skip_special_tokens=0))  # type: ignore[arg-type]
    _pages_balanced(llm)


def test_detokenize_false_leaves_the_text_empty(llm: LLM) -> None:
    """vLLM's detokenize=False: token ids only, the text empty (before, SamplingParams refused
    the keyword: TypeError); stop strings need the text, so they are a ValueError with it."""
    p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    ref = llm.generate("Hi", p)[0]
    out = llm.generate("Hi", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                            detokenize=False))[0]
    assert out.token_ids == ref.token_ids and ref.text and out.text == ""
    with pytest.raises(ValueError, match=r"stop strings need detokenize=True, got "
                                         r"stop=\['\\n'\] with detokenize=False"):
        llm.generate("Hi", SamplingParams(stop="\n", detokenize=False))
    _pages_balanced(llm)


def test_truncate_prompt_tokens_keeps_the_prompts_end(llm: LLM) -> None:
    """vLLM's SamplingParams.truncate_prompt_tokens: the last k prompt tokens are served
    (-1: the context's worth); more than the context holds is refused naming both numbers."""
    ids = llm.tokenizer.encode("One two three four five six", add_special_tokens=False)
    greedy = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    cut = llm.generate([ids], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True,
                                             truncate_prompt_tokens=2))[0]
    assert cut.prompt_token_ids == ids[-2:] and cut.prompt_tokens == 2
    assert cut.token_ids == llm.generate([ids[-2:]], greedy)[0].token_ids
    whole = llm.generate([ids], SamplingParams(max_tokens=1, truncate_prompt_tokens=-1))[0]
    assert whole.prompt_token_ids == ids
    context = llm.limits.max_context
    with pytest.raises(ValueError, match=rf"prompt 0: truncate_prompt_tokens \({context + 1}\) "
                                         rf"is more than the model's maximum context length "
                                         rf"\({context}\)"):
        llm.generate([ids], SamplingParams(truncate_prompt_tokens=context + 1))
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be -1"):
        llm.generate([ids], SamplingParams(truncate_prompt_tokens=0))
    _pages_balanced(llm)


def test_priority_needs_the_priority_policy(llm: LLM, tiny_qwen3: Path) -> None:
    """vLLM's `priority=` keyword: refused naming the policy under first come, first served;
    served under scheduling_policy="priority" (the same tokens: it orders, never changes)."""
    greedy = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    with pytest.raises(ValueError, match=r"prompt 1: priority 2 needs the priority scheduling "
                                         r"policy \(--scheduling-policy priority\)"):
        llm.generate(["a", "b"], greedy, priority=[0, 2])
    with pytest.raises(ValueError, match="one value per prompt"):
        llm.generate(["a", "b"], greedy, priority=[0])
    _pages_balanced(llm)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    with LLM(str(tiny_qwen3), device="cpu", scheduling_policy="priority", max_running_requests=1,
             show_progress=False) as ranked:
        urgent_last = ranked.generate(prompts, greedy, priority=[3, 2, -1])
        plain = ranked.generate(prompts, greedy)
    assert [o.token_ids for o in urgent_last] == [o.token_ids for o in plain]


def test_vllms_structured_outputs_params(llm: LLM) -> None:
    """vLLM's `SamplingParams(structured_outputs=StructuredOutputsParams(...))` (or a dict of
    its fields) constrains as `structured` does; what it cannot serve raises naming it."""
    import json

    from minisgl import StructuredOutput, StructuredOutputsParams
    cities = ["Paris", "London", "Berlin"]
    kw = dict(max_tokens=8, temperature=0)
    paris = [{"role": "user", "content": "What is the capital of France?"}]
    vllm_style = llm.chat(paris, SamplingParams(
        **kw, structured_outputs=StructuredOutputsParams(choice=cities)))[0]
    ours = llm.chat(paris, SamplingParams(
        **kw, structured=StructuredOutput("choice", json.dumps(cities))))[0]
    assert vllm_style.text in cities and vllm_style.token_ids == ours.token_ids
    digits = llm.generate("Count:", SamplingParams(**kw, structured_outputs={
        "regex": "[0-9]{3}", "disable_any_whitespace": True}))[0]
    assert len(digits.text) == 3 and digits.text.isdigit()
    for bad, match in (
            (dict(structured_outputs=StructuredOutputsParams(regex="a", whitespace_pattern=" ")),
             "whitespace_pattern is not supported"),
            (dict(structured_outputs=StructuredOutputsParams()), "asks for no constraint"),
            (dict(structured_outputs={"regex": "a", "choice": ["b"]}), "sets two constraints"),
            (dict(structured_outputs={"json": 5}), "a JSON schema must be an object"),
            (dict(structured_outputs=StructuredOutputsParams(regex="a"),
                  structured=StructuredOutput("regex", "b")), "both constrain the output")):
        with pytest.raises(ValueError, match=match):
            llm.generate("a", SamplingParams(max_tokens=2, **bad))  # type: ignore[arg-type]
    _pages_balanced(llm)
