"""Beam search over HTTP (vLLM's `use_beam_search`; server/beam_search_api.py): the same beams
as the offline `LLM.beam_search`, on completions, chat and streams; the search's sequencing on
a scripted server (EOS, include_stop_str_in_output, the context, errors); fields a beam search
does not take refused by name, the server serving on after each."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Callable, Dict, Iterator, List

import httpx
import pytest

from minisgl import LLM, BeamSearchParams
from minisgl.core import SamplingParams
from minisgl.message.types import ReplyChunk, TokenLogprobText
from minisgl.server.beam_search_api import BeamLimits, BeamServer, beam_search
from minisgl.server.protocol import ApiError, Job, Prompt
from server_helpers import CPU_ARGS, Server

PROMPTS = [[15, 300, 2000, 7], [42, 4242, 99, 1000, 5, 6, 7]]
WIDTH, TOKENS = 3, 5


@pytest.fixture(scope="module")
def tiny_llama(tiny_model: Callable[..., Path]) -> Path:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Iterator[Server]:
    srv = Server.start(["--model", str(tiny_llama), *CPU_ARGS, "--max-n", "6",
                        "--max-logprobs", "8"], tmp_path_factory.mktemp("beam-api"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline(tiny_llama: Path) -> List[List[List[int]]]:
    """LLM.beam_search's beams (generated tokens, best first) for each of PROMPTS."""
    with LLM(str(tiny_llama), device="cpu", max_kv_tokens=2048, show_progress=False) as llm:
        outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS],
                               BeamSearchParams(beam_width=WIDTH, max_tokens=TOKENS))
    return [[s.tokens[len(p):] for s in out.sequences] for p, out in zip(PROMPTS, outs)]


def _post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}/{path}", json=body, timeout=120)


def test_completions_give_the_offline_beams(server: Server,
                                            offline: List[List[List[int]]]) -> None:
    r = _post(server, "completions", {"prompt": PROMPTS, "max_tokens": TOKENS, "n": WIDTH,
                                      "use_beam_search": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == list(range(2 * WIDTH))
    assert [c["token_ids"] for c in choices] == [t for beams in offline for t in beams]
    assert all(c["finish_reason"] == "length" for c in choices)
    texts = [c["text"] for c in choices]
    for c, text in zip(choices, texts):  # each text is its tokens decoded
        d = _post(server, "../detokenize", {"tokens": c["token_ids"]}).json()["prompt"]
        assert d == text
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == 2 * WIDTH * TOKENS


def _finished(server: Server) -> Dict[str, float]:
    """/metrics' finished requests by reason, and the first-token histogram's count."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith(("minisgl_requests_finished_total", "minisgl_time_to_first_token")):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_a_search_counts_once_in_the_metrics(server: Server) -> None:
    """A beam search of n beams counts as n finished requests (as n sampled choices do), not
    as its steps' jobs; its steps add no first-token latencies."""
    before = _finished(server)
    r = _post(server, "completions", {"prompt": PROMPTS[0], "max_tokens": TOKENS, "n": WIDTH,
                                      "use_beam_search": True})
    assert r.status_code == 200, r.text
    after = _finished(server)
    key = 'minisgl_requests_finished_total{reason="length"}'
    assert after[key] - before.get(key, 0) == WIDTH
    ttft = "minisgl_time_to_first_token_seconds_count"
    assert after.get(ttft) == before.get(ttft)


def test_a_stream_carries_each_beam_whole(server: Server) -> None:
    body = {"prompt": PROMPTS[0], "max_tokens": TOKENS, "n": WIDTH, "use_beam_search": True,
            "length_penalty": 0.5}
    whole = _post(server, "completions", body).json()["choices"]
    with httpx.stream("POST", f"{server.base_url}/completions", timeout=120,
                      json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    events = [json.loads(ln) for ln in lines[:-1]]
    texts = {i: "" for i in range(WIDTH)}
    reasons = {}
    for e in events:
        for c in e["choices"]:
            texts[c["index"]] += c["text"]
            reasons[c["index"]] = c["finish_reason"] or reasons.get(c["index"])
    assert [texts[i] for i in range(WIDTH)] == [c["text"] for c in whole]
    assert all(reasons[i] == "length" for i in range(WIDTH))


def test_chat_beams_are_the_templated_prompts(server: Server, tiny_llama: Path) -> None:
    messages = [{"role": "user", "content": "Name a color."}]
    ids = _post(server, "../tokenize", {"messages": messages}).json()["tokens"]
    r = _post(server, "chat/completions", {"messages": messages, "max_tokens": 4, "n": 2,
                                           "use_beam_search": True})
    assert r.status_code == 200, r.text
    got = [c["message"]["content"] for c in r.json()["choices"]]
    with LLM(str(tiny_llama), device="cpu", max_kv_tokens=2048, show_progress=False) as llm:
        out = llm.beam_search([{"prompt_token_ids": ids}],
                              BeamSearchParams(beam_width=2, max_tokens=4))[0]
        want = [llm.tokenizer.decode(s.tokens[len(ids):], skip_special_tokens=True)
                for s in out.sequences]
    assert got == want


@pytest.mark.parametrize("extra, param", [
    ({"logprobs": 2}, "logprobs"), ({"stop": ["x"]}, "stop"), ({"echo": True}, "echo"),
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"use_beam_search": "yes"}, "use_beam_search"), ({"length_penalty": "long"}, "length_penalty"),
    ({"n": 5}, "n"), ({"max_tokens": 100000}, "max_tokens")])
def test_what_a_beam_search_cannot_take_is_refused(server: Server, extra: dict,
                                                   param: str) -> None:
    body = {"prompt": PROMPTS[0], "max_tokens": 2, "n": 2, "use_beam_search": True, **extra}
    r = _post(server, "completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    ok = _post(server, "completions", {"prompt": PROMPTS[0], "max_tokens": 2})
    assert ok.status_code == 200


def test_length_penalty_needs_beam_search(server: Server) -> None:
    r = _post(server, "completions", {"prompt": "hi", "max_tokens": 2, "length_penalty": 2.0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "length_penalty"
    numbers = _post(server, "completions", {"prompt": PROMPTS[0], "max_tokens": 2, "n": 5,
                                            "use_beam_search": True}).json()["error"]
    assert "2 x n = 10" in numbers["message"] and "max_logprobs 8" in numbers["message"]


# --- the search's sequencing on a scripted server ------------------------------------------------
EOS, CONTEXT = 9, 12


def _scripted(steps: List[int]) -> BeamServer:
    """A server whose model offers, after a beam ending in token t: t + 1 (log-probability
    -0.1), EOS (-0.5), t + 2 (-3); it records each step's live beam count in `steps`."""
    async def encode(prompt: Prompt) -> List[int]:
        return list(prompt.input_ids or [1])

    async def run(job: Job) -> List[ReplyChunk]:
        steps.append(len(job.prompts))
        assert job.params.logprobs == 2 * 2 and job.params.max_tokens == 1
        out = []
        for p in job.prompts:
            t = (p.input_ids or [0])[-1]
            out.append(ReplyChunk(0, logprobs=[TokenLogprobText(
                "", -0.1, top_ids=(t + 1, EOS, t + 2), top_logprobs=(-0.1, -0.5, -3.0))]))
        return out

    async def decode(ids: List[int], skip: bool) -> str:
        return " ".join(map(str, ids))

    return BeamServer(encode, run, decode)


def _job(max_tokens: object, no_stop_trim: bool = False) -> Job:
    params = SamplingParams(max_tokens=max_tokens)  # type: ignore[arg-type]
    return Job([Prompt(input_ids=[1, 2])], params, 2, (), True, False, False,
               no_stop_trim=no_stop_trim, beam_search=True)


def test_an_eos_ends_a_beam_and_its_text_leaves_it_out() -> None:
    steps: List[int] = []
    chunks = asyncio.run(beam_search(_job(3), _scripted(steps), BeamLimits((EOS,), CONTEXT, 20)))
    assert steps == [1, 2, 2]  # one beam, then the two best live ones each step
    # scores (cumulative log-probability over the length, prompt in, a final EOS out): the
    # live 1 2 3 4 5 -0.3 / 5, then the complete 1 2 3 4 EOS -0.7 / 4 (1 2 3 EOS: -0.6 / 3)
    assert [(c.token_ids, c.finish_reason, c.text) for c in chunks] == [
        ([3, 4, 5], "length", "3 4 5"), ([3, 4, EOS], "stop", "3 4")]
    assert [c.completion_tokens for c in chunks] == [3, 3]
    keep = asyncio.run(beam_search(_job(3, no_stop_trim=True), _scripted([]),
                                   BeamLimits((EOS,), CONTEXT, 20)))
    assert keep[1].text == f"3 4 {EOS}"


def test_max_tokens_unset_is_what_the_context_leaves_and_overflow_is_refused() -> None:
    steps: List[int] = []
    asyncio.run(beam_search(_job(None), _scripted(steps), BeamLimits((), CONTEXT, 20)))
    assert len(steps) == CONTEXT - 2
    with pytest.raises(ApiError, match="2 prompt tokens \\+ max_tokens 11 exceed the context "
                                       "of 12 tokens"):
        asyncio.run(beam_search(_job(11), _scripted([]), BeamLimits((), CONTEXT, 20)))
    with pytest.raises(ApiError, match="max_logprobs 3"):
        asyncio.run(beam_search(_job(2), _scripted([]), BeamLimits((), CONTEXT, 3)))
