"""The OpenAI-compatible API of a real `serve` process (default model, tp=1, CPU), through real
HTTP with the official `openai` client. One server for the whole module."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, List

import httpx
import openai
import pytest
import torch

from server_helpers import Server, api_server, openai_client

from minisgl import LLM, SamplingParams

PARIS = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Server]:
    yield from api_server(tmp_path_factory.mktemp("api-server"))


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai_client(server)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def llm(default_model_dir: Path) -> Iterator[LLM]:
    with LLM(None, max_kv_tokens=8192, show_progress=False) as offline:
        yield offline


def _post(server: Server, path: str, body: object) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


# --- acceptance: Paris, equal to the offline LLM --------------------------------------------------
def test_chat_paris_matches_offline_llm(client: openai.OpenAI, model: str, llm: LLM,
                                        server: Server) -> None:
    ref = llm.chat(PARIS, SamplingParams(temperature=0, max_tokens=24))[0]
    assert "Paris" in ref.text
    resp = client.chat.completions.create(model=model, messages=PARIS, temperature=0,
                                          max_tokens=24)
    assert resp.choices[0].message.content == ref.text
    assert resp.choices[0].finish_reason == ref.finish_reason
    assert resp.usage.completion_tokens == len(ref.token_ids)
    assert resp.usage.prompt_tokens == ref.prompt_tokens
    assert resp.usage.total_tokens == ref.prompt_tokens + len(ref.token_ids)

    stream = client.chat.completions.create(model=model, messages=PARIS, temperature=0,
                                            max_tokens=24, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and
              c.choices[0].finish_reason]
    assert finals == [ref.finish_reason]
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # same prompt again

    # the exact token ids, through the native endpoint
    ids = llm._chat_ids(PARIS)
    gen = _post(server, "/generate", {"input_ids": ids,
                                      "sampling_params": {"temperature": 0, "max_tokens": 24}})
    assert gen.status_code == 200
    assert gen.json()["token_ids"] == ref.token_ids
    assert gen.json()["text"] == ref.text


def test_default_max_tokens_fills_the_context(client: openai.OpenAI, model: str) -> None:
    resp = client.chat.completions.create(model=model, messages=PARIS, temperature=0)
    assert "Paris" in resp.choices[0].message.content
    assert resp.choices[0].finish_reason == "stop"


def test_completions_match_offline_llm(client: openai.OpenAI, model: str, llm: LLM) -> None:
    prompts = ["The capital of France is", "Once upon a time"]
    refs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    resp = client.completions.create(model=model, prompt=prompts, temperature=0, max_tokens=8)
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.text for c in resp.choices] == [r.text for r in refs]
    assert resp.usage.completion_tokens == sum(len(r.token_ids) for r in refs)
    stream = client.completions.create(model=model, prompt=prompts[0], temperature=0,
                                       max_tokens=8, stream=True)
    assert "".join(c.choices[0].text for c in stream) == refs[0].text


def test_logprobs_match_offline_llm(client: openai.OpenAI, model: str, llm: LLM) -> None:
    """Chat (logprobs + top_logprobs) and completions (logprobs=k), plain and streamed, carry
    the offline API's log-probabilities token for token (to float32 noise: a prefix-cache hit
    changes the summation order)."""
    close = lambda values: pytest.approx(values, abs=1e-4)  # noqa: E731
    ref = llm.chat(PARIS, SamplingParams(temperature=0, max_tokens=8, logprobs=3))[0]
    assert ref.logprobs is not None and len(ref.logprobs) == len(ref.token_ids)
    resp = client.chat.completions.create(model=model, messages=PARIS, temperature=0,
                                          max_tokens=8, logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert [c.logprob for c in content] == close([r.logprob for r in ref.logprobs])
    tokens = [c.token for c in content]
    if resp.choices[0].finish_reason == "stop":  # the EOS token has an entry, not text
        assert tokens.pop() == "<|im_end|>"
    assert "".join(tokens) == resp.choices[0].message.content
    for c, r in zip(content, ref.logprobs):
        assert bytes(c.bytes) == c.token.encode()
        assert [t.logprob for t in c.top_logprobs] == close(list(r.top_logprobs))
        assert c.top_logprobs[0].token == c.token  # greedy: the sampled token is the top one

    stream = client.chat.completions.create(model=model, messages=PARIS, temperature=0,
                                            max_tokens=8, logprobs=True, stream=True)
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [e.logprob for e in streamed] == close([r.logprob for r in ref.logprobs])
    assert all(e.top_logprobs == [] for e in streamed)  # top_logprobs 0 by default

    prompt = "The capital of France is"
    ref = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, logprobs=2))[0]
    comp = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=6,
                                     logprobs=2)
    lp = comp.choices[0].logprobs
    assert "".join(lp.tokens) == comp.choices[0].text == ref.text
    assert lp.token_logprobs == close([r.logprob for r in ref.logprobs])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(top) == 2 and top[tok] == close(v)
               for top, tok, v in zip(lp.top_logprobs, lp.tokens, lp.token_logprobs))
    chunks = list(client.completions.create(model=model, prompt=prompt, temperature=0,
                                            max_tokens=6, logprobs=2, stream=True))
    offsets = [o for c in chunks if c.choices[0].logprobs
               for o in c.choices[0].logprobs.text_offset]
    assert offsets == lp.text_offset
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_echo_with_prompt_logprobs_matches_offline_llm(client: openai.OpenAI, model: str,
                                                      llm: LLM) -> None:
    """Completions' echo: the prompt comes first in text and logprobs (none for its first
    token); with logprobs, every later prompt token has its own, as the offline API's
    prompt_logprobs (the loglikelihood form evaluation harnesses use)."""
    prompt = "The capital of France is"
    ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
    ref = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, logprobs=1,
                                                prompt_logprobs=1))[0]
    assert ref.prompt_token_logprobs is not None and len(ref.prompt_token_logprobs) == len(ids) - 1
    resp = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=2,
                                     logprobs=1, echo=True)
    choice = resp.choices[0]
    assert choice.text == prompt + ref.text
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 2 and "".join(lp.tokens) == choice.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [e.logprob for e in ref.prompt_token_logprobs + (ref.logprobs or [])]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]

    chunks = list(client.completions.create(model=model, prompt=ids, temperature=0,
                                            max_tokens=2, logprobs=1, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text  # token-id prompt, decoded
    streamed = [v for c in chunks if c.choices[0].logprobs
                for v in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(want, abs=1e-4)
    plain = client.completions.create(model=model, prompt=ids, max_tokens=1, echo=True)
    assert plain.choices[0].text.startswith(prompt) and plain.choices[0].logprobs is None


def test_tokenize_and_detokenize(server: Server, llm: LLM) -> None:
    """/tokenize (a prompt, or messages through the chat template) and /detokenize answer as
    the offline tokenizer does, and stay out of the generation metrics."""
    def ttft_count() -> str:
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
        return [line for line in text.splitlines()
                if line.startswith("minisgl_time_to_first_token_seconds_count")][0]
    before = ttft_count()
    r = _post(server, "/tokenize", {"prompt": "Hello world, héllo 🙂"})
    ids = llm.tokenizer.encode("Hello world, héllo 🙂", add_special_tokens=False)
    assert r.status_code == 200
    assert r.json() == {"tokens": ids, "count": len(ids), "max_model_len": 8192}
    r = _post(server, "/tokenize", {"messages": PARIS})
    assert r.json()["tokens"] == llm._chat_ids(PARIS)
    r = _post(server, "/detokenize", {"tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": "Hello world, héllo 🙂"}
    assert _post(server, "/tokenize", {"prompt": ""}).json()["tokens"] == []
    assert ttft_count() == before


def test_generate_stream_returns_token_ids(server: Server, llm: LLM) -> None:
    """As SGLang streams by default, each chunk repeats the text and ids so far (a client
    prints `text[len(seen):]`); the last has them all."""
    ref = llm.generate("Hello, my name is", SamplingParams(temperature=0, max_tokens=6))[0]
    body = {"text": "Hello, my name is", "stream": True,
            "sampling_params": {"temperature": 0, "max_tokens": 6}}
    with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert len(events) > 1
    for before, after in zip(events, events[1:]):
        assert after["text"].startswith(before["text"])
        assert after["output_ids"][:len(before["output_ids"])] == before["output_ids"]
    assert events[-1]["output_ids"] == events[-1]["token_ids"] == ref.token_ids
    assert events[-1]["text"] == ref.text


def test_generate_stream_interval(server: Server) -> None:
    """SGLang's sampling_params.stream_interval: after the first chunk (at once), one chunk a
    5 tokens, the last with the finish; the same output as one chunk a token. A bad value is
    a 400 naming it."""
    def events(interval: int) -> list:
        body = {"text": "Hello, my name is", "stream": True, "sampling_params": {
            "temperature": 0, "max_new_tokens": 12, "ignore_eos": True,
            "stream_interval": interval}}
        with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=60) as r:
            return [json.loads(line[6:]) for line in r.iter_lines()
                    if line.startswith("data: ") and line != "data: [DONE]"]
    every, paced = events(1), events(5)
    assert [len(e["output_ids"]) for e in paced] == [1, 6, 11, 12]
    assert len(every) == 12 and paced[-1]["text"] == every[-1]["text"]
    r = _post(server, "/generate", {"text": "a", "sampling_params": {"stream_interval": 0}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_interval", r.text


def test_generate_speaks_sglangs_fields(server: Server, llm: LLM) -> None:
    """SGLang's /generate as RL frameworks call it: max_new_tokens and min_new_tokens in
    sampling_params, `rid`, and `return_logprob` with `top_logprobs_num`,
    `logprob_start_len` and `return_text_in_logprobs`, read back from `output_ids` and
    `meta_info` ((logprob, token id, text) triples); the same numbers as the offline API's."""
    prompt = "The capital of France is"
    ids = llm.tokenizer.encode(prompt, add_special_tokens=True)
    ref = llm.generate([ids], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                             logprobs=2, prompt_logprobs=2))[0]
    body = {"input_ids": ids, "rid": "rollout-7", "return_logprob": True,
            "top_logprobs_num": 2, "logprob_start_len": 1, "return_text_in_logprobs": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}}
    r = httpx.post(f"{server.url}/generate", json=body, timeout=120,
                   headers={"X-Request-Id": "proxy-42"})  # a proxy's: rid still wins
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    assert out["output_ids"] == out["token_ids"] == ref.token_ids
    assert meta["id"] == "rollout-7"
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(ids), 5)
    want = [[lp.logprob, t, llm.tokenizer.decode([t])] for t, lp in zip(ref.token_ids,
                                                                          ref.logprobs or [])]
    got = meta["output_token_logprobs"]
    assert [g[1:] for g in got] == [w[1:] for w in want]
    assert [g[0] for g in got] == pytest.approx([w[0] for w in want], abs=1e-4)
    assert [[t[1] for t in tops] for tops in meta["output_top_logprobs"]] == [
        list(lp.top_ids) for lp in ref.logprobs or []]
    prompt_lps = ref.prompt_token_logprobs or []
    # from prompt position 1: every entry has its logprob (position 0's would be null)
    assert [e[1] for e in meta["input_token_logprobs"]] == ids[1:]
    assert [e[0] for e in meta["input_token_logprobs"]] == pytest.approx(
        [lp.logprob for lp in prompt_lps], abs=1e-4)
    assert len(meta["input_top_logprobs"]) == len(ids) - 1
    plain = _post(server, "/generate", {"input_ids": ids, "sampling_params": {
        "max_new_tokens": 2, "min_new_tokens": 2, "temperature": 0}}).json()
    assert len(plain["output_ids"]) == 2 and "output_token_logprobs" not in plain["meta_info"]
    for bad, param in (({"sampling_params": {"max_new_tokens": 2, "max_tokens": 2}},
                        "max_new_tokens"),
                       ({"sampling_params": {"max_new_tokens": "2"}}, "max_new_tokens"),
                       ({"sampling_params": {"max_new_tokens": 2 ** 40}}, "max_new_tokens"),
                       ({"sampling_params": {"sampling_seed": 2 ** 70}}, "sampling_seed"),
                       ({"return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
                       ({"lora_path": "adapter"}, "lora_path")):
        r = _post(server, "/generate", {"input_ids": ids, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_generate_takes_sglangs_logit_bias(server: Server) -> None:
    """sampling_params.logit_bias (SGLang's: token ids as strings, as OpenAI's) biases the
    sampling as on the OpenAI routes (before: a 400 naming it); a bad one is a 400 naming it."""
    r = _post(server, "/generate", {"text": "Hello", "sampling_params": {
        "max_new_tokens": 4, "temperature": 0, "ignore_eos": True, "logit_bias": {"28": 100}}})
    assert r.status_code == 200 and r.json()["output_ids"] == [28] * 4, r.text
    for bias in ({"x": 5}, {"28": "high"}, {"28": 101}, [28]):
        r = _post(server, "/generate", {"text": "Hello", "sampling_params": {
            "max_new_tokens": 1, "logit_bias": bias}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text


def test_get_weights_by_name_as_sglang_serves_it(server: Server, default_model_dir: Path
                                                 ) -> None:
    """SGLang's /get_weights_by_name (GET with a JSON body, as its tests send it; POST; GET
    with a query): a tensor's first rows as the server holds them, the checkpoint's values;
    a name the model does not hold is a 400 naming it, and the server goes on."""
    from safetensors.torch import load_file
    want = load_file(str(default_model_dir / "model.safetensors"))
    name = "model.layers.2.self_attn.q_proj.weight"
    got = httpx.request("GET", f"{server.url}/get_weights_by_name", timeout=60,
                        json={"name": name, "truncate_size": 3}).json()
    assert torch.equal(torch.tensor(got), want[name].float()[:3])
    posted = _post(server, "/get_weights_by_name", {"name": "model.norm.weight"}).json()
    assert torch.equal(torch.tensor(posted), want["model.norm.weight"].float()[:100])  # default
    queried = httpx.get(f"{server.url}/get_weights_by_name", timeout=60, params={
        "name": "lm_head.weight", "truncate_size": 2}).json()  # tied: the embedding's rows
    assert torch.equal(torch.tensor(queried), want["model.embed_tokens.weight"].float()[:2])
    for body, param in (({"name": "model.layers.99.mlp.up_proj.weight"}, "name"),
                        ({"name": "model.norm.weight", "truncate_size": 0}, "truncate_size"),
                        ({"truncate_size": 3}, "name")):
        r = _post(server, "/get_weights_by_name", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


def test_generate_token_ids_logprob(server: Server, llm: LLM) -> None:
    """SGLang's token_ids_logprob: meta_info's output_token_ids_logprobs (and, from
    logprob_start_len, input_token_ids_logprobs) hold those ids' (logprob, id, text) at each
    position, in the order asked, the offline API's numbers; asked without return_logprob, a
    batch's differing lists or an id past the vocabulary: a 400 naming it."""
    ids = llm.tokenizer.encode("The capital of France is", add_special_tokens=True)
    asked = [12, 7042, 12]
    ref = llm.generate([ids], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                             logprobs=0, prompt_logprobs=0,
                                             token_ids_logprob=asked))[0]
    r = _post(server, "/generate", {
        "input_ids": ids, "return_logprob": True, "logprob_start_len": 1,
        "return_text_in_logprobs": True, "token_ids_logprob": asked,
        "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    texts = [llm.tokenizer.decode([t]) for t in asked]
    out = meta["output_token_ids_logprobs"]
    assert [[(t, s) for _, t, s in pos] for pos in out] == [list(zip(asked, texts))] * 4
    assert [[v for v, _, _ in pos] for pos in out] == [
        pytest.approx(list(lp.ids_logprobs), abs=1e-4) for lp in ref.logprobs or []]
    prompt = meta["input_token_ids_logprobs"]
    assert len(prompt) == len(ids) - 1 and [[v for v, _, _ in pos] for pos in prompt] == [
        pytest.approx(list(lp.ids_logprobs), abs=1e-4) for lp in ref.prompt_token_logprobs or []]
    for body in ({"token_ids_logprob": [1]},
                 {"return_logprob": True, "token_ids_logprob": [[1], [2]],
                  "input_ids": [ids, ids]},
                 {"return_logprob": True, "token_ids_logprob": [10 ** 6]}):
        r = _post(server, "/generate", {"input_ids": ids, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == "token_ids_logprob", r.text


def test_generate_return_hidden_states_as_hf_computes_them(server: Server,
                                                         default_model_dir: Path) -> None:
    """SGLang's return_hidden_states: meta_info.hidden_states is the prompt positions' final
    hidden states, then one for each later token's position, as HF's last hidden states over
    the prompt and the output but its last token; streamed, on the last event; a batch's
    prompts apart. A request that does not ask has none."""
    from transformers import AutoModelForCausalLM
    prompts = [[1, 504, 3458, 282], [1, 2683, 314, 260, 1233, 284, 1134]]
    body = {"input_ids": prompts, "return_hidden_states": True, "sampling_params": {
        "temperature": 0, "max_new_tokens": 5, "ignore_eos": True}}
    r = _post(server, "/generate", body)
    assert r.status_code == 200, r.text
    hf = AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32)
    for prompt, out in zip(prompts, r.json()):
        states = out["meta_info"]["hidden_states"]
        assert len(states) == 5 and len(states[0]) == len(prompt)
        got = torch.tensor(states[0] + states[1:])
        with torch.no_grad():
            want = hf(torch.tensor([prompt + out["output_ids"][:-1]]),
                      output_hidden_states=True).hidden_states[-1][0]
        assert got.shape == want.shape and torch.allclose(got, want, atol=2e-3, rtol=1e-3)
    with httpx.stream("POST", f"{server.url}/generate", timeout=60,
                      json={**body, "input_ids": prompts[0], "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert "hidden_states" not in events[0]["meta_info"]
    streamed, whole = (events[-1]["meta_info"]["hidden_states"],
                       r.json()[0]["meta_info"]["hidden_states"])  # alone, or in a batch
    assert torch.allclose(torch.tensor(streamed[0] + streamed[1:]),
                          torch.tensor(whole[0] + whole[1:]), atol=1e-4)
    plain = _post(server, "/generate", {"input_ids": prompts[0],
                                        "sampling_params": {"max_new_tokens": 2}}).json()
    assert "hidden_states" not in plain["meta_info"]
    # OpenAI's routes (SGLang's shape): the last token's position's state, on a whole reply's
    # choice and on a streamed choice's last chunk
    ask = {"prompt": prompts[0], "max_tokens": 5, "temperature": 0, "ignore_eos": True,
           "return_hidden_states": True}
    c = _post(server, "/v1/completions", ask)
    assert c.status_code == 200, c.text
    assert torch.allclose(torch.tensor(c.json()["choices"][0]["hidden_states"]),
                          torch.tensor(whole[-1]), atol=1e-4)
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**ask, "stream": True},
                      timeout=60) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert [("hidden_states" in ch["choices"][0]) for ch in chunks] \
        == [False] * (len(chunks) - 1) + [True]
    assert torch.allclose(torch.tensor(chunks[-1]["choices"][0]["hidden_states"]),
                          torch.tensor(whole[-1]), atol=1e-4)


def test_generate_takes_sglangs_batches_and_n(server: Server, llm: LLM) -> None:
    """A list of texts or of id lists, and sampling_params.n: a list of results, prompt-major
    (as SGLang), each with its index; the same tokens as the offline API, streamed or not."""
    texts = ["The capital of France is", "Hello, my name is"]
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    refs = llm.generate(texts, greedy)
    sp = {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}
    out = _post(server, "/generate", {"text": texts, "sampling_params": sp}).json()
    assert [o["index"] for o in out] == [0, 1]
    assert [o["output_ids"] for o in out] == [r.token_ids for r in refs]
    ids = [r.prompt_token_ids for r in refs]
    two = _post(server, "/generate", {"input_ids": ids, "sampling_params": {**sp, "n": 2}})
    assert [(o["index"], o["output_ids"]) for o in two.json()] == [
        (k, refs[k // 2].token_ids) for k in range(4)]
    events: List[dict] = []
    with httpx.stream("POST", f"{server.url}/generate", timeout=60,
                      json={"text": texts, "stream": True, "sampling_params": sp}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    for k, ref in enumerate(refs):
        assert [e for e in events if e["index"] == k][-1]["output_ids"] == ref.token_ids
    for bad, param in (({"text": texts, "rid": "one"}, "rid"),
                       ({"text": ["a"] * 65}, "text"),
                       ({"text": ["a", ""]}, "text"),
                       ({"input_ids": [[1], []]}, "input_ids"),
                       ({"text": "a", "sampling_params": {"n": 0}}, "n")):
        r = _post(server, "/generate", bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_generate_streams_sglangs_meta_info(server: Server) -> None:
    """Streamed, each chunk's meta_info holds the log-probabilities so far (the prompt's in
    every chunk, as SGLang's), the finish reason on the last."""
    body = {"text": "Hello, my name is", "stream": True, "return_logprob": True,
            "logprob_start_len": 0, "sampling_params": {"temperature": 0, "max_new_tokens": 4,
                                                        "ignore_eos": True}}
    events = []
    with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    metas = [e["meta_info"] for e in events]
    assert len(metas[-1]["output_token_logprobs"]) == 4
    assert [len(e["output_ids"]) for e in events] == [
        len(m["output_token_logprobs"]) for m in metas]
    assert all(m["input_token_logprobs"][0][0] is None for m in metas)  # the first prompt token's
    assert metas[-1]["finish_reason"] == {"type": "length", "length": 4}
    assert all(m["finish_reason"] is None for m in metas[:-1])


# --- stop strings, n, seeds, cached tokens --------------------------------------------------------
@pytest.mark.parametrize("stop", ["s Par", "apit", "France is"])
def test_stop_strings_across_tokens_are_trimmed(client: openai.OpenAI, model: str,
                                                server: Server, stop: str) -> None:
    full = "The capital of France is Paris."
    before = server.metrics()["minisgl_generation_tokens_total"]
    resp = client.chat.completions.create(model=model, messages=PARIS, temperature=0,
                                          max_tokens=300, stop=[stop, "never-seen"],
                                          extra_body={"ignore_eos": True})
    want = full[:full.index(stop)]
    assert resp.choices[0].message.content == want
    assert resp.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model=model, messages=PARIS, temperature=0,
                                            max_tokens=300, stop=stop, stream=True,
                                            extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream) == want
    # the scheduler was told to stop: nothing runs, far fewer than 2 x 300 tokens generated
    m = server.wait_metrics(lambda m: m["minisgl_num_requests_running"] == 0)
    assert m["minisgl_num_requests_running"] == 0
    assert m["minisgl_kv_pages_used"] == 0
    assert m["minisgl_generation_tokens_total"] - before < 100


def test_n_choices_seed_and_usage(client: openai.OpenAI, model: str) -> None:
    kw = dict(model=model, messages=PARIS, temperature=1.0, max_tokens=6, n=3, seed=7)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len({c.message.content for c in a.choices}) > 1  # choices get different seeds
    assert a.usage.prompt_tokens == b.usage.prompt_tokens < 60  # counted once, not 3 times
    assert a.usage.completion_tokens <= 18
    streamed = client.chat.completions.create(**kw, stream=True)
    texts = ["", "", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in a.choices]


def test_sampling_fields(client: openai.OpenAI, model: str, llm: LLM) -> None:
    ref = llm.chat(PARIS, SamplingParams(temperature=0, max_tokens=12))[0]
    kw = dict(model=model, messages=PARIS)
    r = client.chat.completions.create(**kw, temperature=0, max_tokens=50,
                                       extra_body={"max_completion_tokens": 3, "ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    france = ref.token_ids[3]  # " France": a stop token id ends the request, unrendered
    r = client.chat.completions.create(**kw, temperature=0, max_tokens=12,
                                       extra_body={"stop_token_ids": [france]})
    assert r.choices[0].message.content == "The capital of"
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 4
    r = client.chat.completions.create(**kw, temperature=1.5, max_tokens=12,
                                       extra_body={"top_k": 1, "min_p": 0.1, "top_p": 0.9})
    assert r.choices[0].message.content == ref.text  # top_k=1 is greedy
    # penalties: the OpenAI client's own fields and vLLM's repetition_penalty, as offline
    pen = dict(presence_penalty=0.5, frequency_penalty=1.0)
    ref = llm.chat(PARIS, SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3,
                                         **pen))[0]
    r = client.chat.completions.create(**kw, temperature=0, max_tokens=12, **pen,
                                       extra_body={"repetition_penalty": 1.3},
                                       response_format={"type": "text"}, tool_choice="none")
    assert r.choices[0].message.content == ref.text
    r = client.chat.completions.create(**kw, temperature=0, max_tokens=30,
                                       extra_body={"min_tokens": 20})
    assert r.usage.completion_tokens >= 20  # the plain answer stops after 8
    r = client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0,
                                  logit_bias={"28": 100})  # OpenAI's form: id strings
    r2 = client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0,
                                   logprobs=0, extra_body={"logit_bias": {"28": 100}})
    assert r.choices[0].text == r2.choices[0].text and len(set(r2.choices[0].logprobs.tokens)) == 1


def test_cached_tokens_reported(client: openai.OpenAI, model: str) -> None:
    prompt = "Tell me a story about a dragon. " * 8
    client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 32


# --- models, health, metrics ----------------------------------------------------------------------
def test_models_health_metrics(client: openai.OpenAI, server: Server, model: str) -> None:
    assert model == "SmolLM2-135M-Instruct"
    assert client.models.retrieve(model).id == model
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.head(f"{server.url}/health").status_code == 200  # a probe's HEAD too
    # rank 0 pushes its state on a timer: the pool's size is known before any request
    assert server.wait_metrics(lambda m: m["minisgl_kv_pages_total"] == 512
                               )["minisgl_kv_pages_total"] == 512
    client.completions.create(model=model, prompt="Hello", max_tokens=2, temperature=0)
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("minisgl_num_requests_running", "minisgl_num_requests_waiting",
                 "minisgl_kv_pages_used", "minisgl_kv_pages_total", "minisgl_kv_pages_cached",
                 "minisgl_prompt_tokens_total", "minisgl_generation_tokens_total",
                 "minisgl_cached_prompt_tokens_total", "minisgl_prefill_steps_total",
                 "minisgl_decode_steps_total", "minisgl_decode_seconds_total",
                 "minisgl_device_wait_seconds_total",
                 "minisgl_time_to_first_token_seconds_bucket",
                 "minisgl_inter_token_latency_seconds_count", "minisgl_num_preemptions_total",
                 "minisgl_kv_pages_evicted_total", "minisgl_e2e_request_latency_seconds_bucket",
                 "minisgl_request_prompt_tokens_bucket",
                 "minisgl_request_generation_tokens_bucket"):
        assert f"\n{name}" in text
    m = server.metrics()
    assert m["minisgl_kv_pages_total"] == 512
    assert m["minisgl_time_to_first_token_seconds_count"] >= 1
    assert m["minisgl_prefill_steps_total"] >= 1 and m["minisgl_decode_steps_total"] >= 1
    # the completion above: 2 tokens, ended by length (other tests' requests may add to these)
    assert m["minisgl_e2e_request_latency_seconds_count"] >= 1
    assert m['minisgl_request_generation_tokens_bucket{le="2.0"}'] >= 1
    completed = m["minisgl_e2e_request_latency_seconds_count"]
    assert m["minisgl_request_prompt_tokens_count"] == completed
    # vLLM's names for the same values, as dashboards, autoscalers and gateways read them
    tag, named = f'{{model_name="{model}",engine="0"}}', f'{{model_name="{model}"}}'
    for ours, theirs in (("minisgl_num_requests_running", "vllm:num_requests_running"),
                         ("minisgl_num_requests_waiting", "vllm:num_requests_waiting"),
                         ("minisgl_prompt_tokens_total", "vllm:prompt_tokens_total"),
                         ("minisgl_prompt_tokens_total", "vllm:prefix_cache_queries_total"),
                         ("minisgl_cached_prompt_tokens_total", "vllm:prefix_cache_hits_total"),
                         ("minisgl_generation_tokens_total", "vllm:generation_tokens_total"),
                         ("minisgl_num_preemptions_total", "vllm:num_preemptions_total")):
        assert m[theirs + tag] == m[ours], theirs
    assert m["vllm:kv_cache_usage_perc" + tag] == pytest.approx(
        m["minisgl_kv_pages_used"] / m["minisgl_kv_pages_total"])
    for measure in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                    "request_generation_tokens", "request_queue_time_seconds",
                    "request_prefill_time_seconds", "request_decode_time_seconds",
                    "request_inference_time_seconds"):
        assert m[f"vllm:{measure}_count{named}"] == m[f"minisgl_{measure}_count"], measure
    # a finished request's phases (the scheduler's queue and prefill times): one per request
    # that finished by stop or length, their sums within its end-to-end time
    assert m["minisgl_request_queue_time_seconds_count"] == completed
    assert 0 < m["minisgl_request_inference_time_seconds_sum"] == pytest.approx(
        m["minisgl_request_prefill_time_seconds_sum"]
        + m["minisgl_request_decode_time_seconds_sum"])
    assert m["minisgl_request_inference_time_seconds_sum"] < m[
        "minisgl_e2e_request_latency_seconds_sum"]
    assert m[f'vllm:request_success_total{{model_name="{model}",finished_reason="length"}}'] == (
        m['minisgl_requests_finished_total{reason="length"}'])


def test_sglang_server_info_names_the_model_and_each_replicas_state(server: Server) -> None:
    """SGLang's /get_server_info: the model, its sizes and the version, and one internal state
    per replica (no speculative fields where the server does not speculate)."""
    info = httpx.get(f"{server.url}/get_server_info").json()
    assert info["context_length"] > 0 and info["tp_size"] == 1 and info["dp_size"] == 1
    assert info["served_model_name"] and info["version"]
    [state] = info["internal_states"]
    assert set(state) == {"num_running_reqs", "num_waiting_reqs", "token_usage"}
    assert 0 <= state["token_usage"] <= 1


def test_vllm_metric_lines_label_each_replica_and_escape_the_name() -> None:
    """metrics_vllm: one line per data-parallel replica (engine label), vLLM's finish reasons
    (a timeout counts as an abort), a model name with quotes escaped as the format requires."""
    from minisgl.message.types import SchedulerStats
    from minisgl.server.metrics import Metrics
    metrics = Metrics(2, 'a"b')
    metrics.update(SchedulerStats(running=3, kv_pages_used=5, kv_pages_total=20, replica=1,
                                  seq=1))
    metrics.count_finished("timeout")
    metrics.count_finished("abort")
    metrics.ttft.observe(0.03)
    lines = metrics.render().splitlines()
    assert 'vllm:num_requests_running{model_name="a\\"b",engine="1"} 3.0' in lines
    assert 'vllm:num_requests_running{model_name="a\\"b",engine="0"} 0.0' in lines
    assert 'vllm:kv_cache_usage_perc{model_name="a\\"b",engine="1"} 0.25' in lines
    assert 'vllm:request_success_total{model_name="a\\"b",finished_reason="abort"} 2.0' in lines
    assert 'vllm:time_to_first_token_seconds_bucket{model_name="a\\"b",le="0.05"} 1' in lines
    assert 'vllm:time_to_first_token_seconds_count{model_name="a\\"b"} 1' in lines


# --- disconnects free the KV pages ----------------------------------------------------------------
def _long_body(model: str, stream: bool) -> dict:
    return {"model": model, "messages": PARIS, "max_tokens": 4000, "ignore_eos": True,
            "temperature": 0, "stream": stream}


def test_client_disconnect_mid_stream_aborts(server: Server, model: str) -> None:
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=60,
                      json=_long_body(model, True)) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(8):
            next(lines)
        busy = server.metrics()
        assert busy["minisgl_kv_pages_used"] > 0 and busy["minisgl_num_requests_running"] == 1
    m = server.wait_metrics(lambda m: m["minisgl_kv_pages_used"] == 0)
    assert m["minisgl_kv_pages_used"] == 0 and m["minisgl_num_requests_running"] == 0
    assert m['minisgl_requests_finished_total{reason="abort"}'] >= 1


def test_client_disconnect_while_waiting_aborts(server: Server, model: str) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=_long_body(model, False),
                   timeout=2.0)
    m = server.wait_metrics(lambda m: m["minisgl_kv_pages_used"] == 0)
    assert m["minisgl_kv_pages_used"] == 0 and m["minisgl_num_requests_running"] == 0


# --- bad input ------------------------------------------------------------------------------------
def _chat(**fields: object) -> dict:
    return {"model": "SmolLM2-135M-Instruct", "messages": PARIS, "max_tokens": 4, **fields}


BAD_REQUESTS = [
    ("malformed json", "/v1/chat/completions", b'{"model": "x", "messages": [', 400),
    ("body not an object", "/v1/chat/completions", b"[1, 2, 3]", 400),
    ("invalid utf-8", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400),
    ("missing messages", "/v1/chat/completions", {"model": "SmolLM2-135M-Instruct"}, 400),
    ("empty messages", "/v1/chat/completions", _chat(messages=[]), 400),
    ("messages not a list", "/v1/chat/completions", _chat(messages="hi"), 400),
    ("content wrong type", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": 42}]), 400),
    ("unknown role", "/v1/chat/completions",
     _chat(messages=[{"role": "wizard", "content": "hi"}]), 400),
    ("negative max_tokens", "/v1/chat/completions", _chat(max_tokens=-5), 400),
    ("zero max_completion_tokens", "/v1/chat/completions", _chat(max_completion_tokens=0), 400),
    ("max_tokens a string", "/v1/chat/completions", _chat(max_tokens="ten"), 400),
    ("negative temperature", "/v1/chat/completions", _chat(temperature=-0.5), 400),
    ("top_p above 1", "/v1/chat/completions", _chat(top_p=1.5), 400),
    ("min_p above 1", "/v1/chat/completions", _chat(min_p=2.0), 400),
    ("top_k not an int", "/v1/chat/completions", _chat(top_k=2.5), 400),
    ("stream not a bool", "/v1/chat/completions", _chat(stream="yes"), 400),
    ("empty stop string", "/v1/chat/completions", _chat(stop=[""]), 400),
    ("negative stop token id", "/v1/chat/completions", _chat(stop_token_ids=[-1]), 400),
    ("n over the limit", "/v1/chat/completions", _chat(n=5), 400),
    ("n zero", "/v1/chat/completions", _chat(n=0), 400),
    ("chat logprobs a number", "/v1/chat/completions", _chat(logprobs=3), 400),
    ("top_logprobs without logprobs", "/v1/chat/completions", _chat(top_logprobs=2), 400),
    ("top_logprobs over the cap", "/v1/chat/completions",
     _chat(logprobs=True, top_logprobs=21), 400),
    ("presence_penalty above 2", "/v1/chat/completions", _chat(presence_penalty=2.5), 400),
    ("min_tokens above max_tokens", "/v1/chat/completions", _chat(max_tokens=3, min_tokens=4),
     400),
    ("min_tokens beyond the auto max_tokens", "/v1/chat/completions",
     _chat(max_tokens=None, min_tokens=9000), 400),
    ("repetition_penalty zero", "/v1/chat/completions", _chat(repetition_penalty=0), 400),
    ("logit_bias key not an id", "/v1/chat/completions", _chat(logit_bias={"x": 5}), 400),
    ("logit_bias beyond the vocabulary", "/v1/chat/completions",
     _chat(logit_bias={"49152": 5}), 400),
    ("logit_bias above 100", "/v1/chat/completions", _chat(logit_bias={"15": 101}), 400),
    ("json_schema response_format without its schema object", "/v1/chat/completions",
     _chat(response_format={"type": "json_schema"}), 400),
    ("tools whose parameters are not an object schema", "/v1/chat/completions",
     _chat(tools=[{"type": "function", "function": {"name": "f",
                                                    "parameters": {"type": "string"}}}]), 400),
    ("completion suffix", "/v1/completions",
     {"model": "SmolLM2-135M-Instruct", "prompt": "a", "suffix": "b"}, 400),
    ("completion logprobs negative", "/v1/completions",
     {"model": "SmolLM2-135M-Instruct", "prompt": "a", "logprobs": -1}, 400),
    ("completion logprobs a bool", "/v1/completions",
     {"model": "SmolLM2-135M-Instruct", "prompt": "a", "logprobs": True}, 400),
    ("unknown model", "/v1/chat/completions", _chat(model="gpt-17"), 404),
    ("prompt beyond the context", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": "hello " * 9000}]), 400),
    ("prompt plus max_tokens beyond the context", "/v1/chat/completions",
     _chat(max_tokens=8190), 400),
    ("empty completion prompt", "/v1/completions",
     {"model": "SmolLM2-135M-Instruct", "prompt": ""}, 400),
    ("token id outside the vocabulary", "/v1/completions",
     {"model": "SmolLM2-135M-Instruct", "prompt": [1, 2, 10 ** 9]}, 400),
    ("mixed prompt list", "/v1/completions",
     {"model": "SmolLM2-135M-Instruct", "prompt": ["a", 1]}, 400),
    ("seed beyond int64", "/v1/chat/completions", _chat(seed=10 ** 30), 400),
    ("max_tokens beyond int32", "/v1/chat/completions", _chat(max_tokens=10 ** 20), 400),
    ("token id beyond int32", "/generate", {"input_ids": [1, 2 ** 40]}, 400),
    ("generate with text and ids", "/generate", {"text": "a", "input_ids": [1]}, 400),
    ("generate without a prompt", "/generate", {"sampling_params": {}}, 400),
    ("tokenize with neither prompt nor messages", "/tokenize", {}, 400),
    ("tokenize with both", "/tokenize", {"prompt": "a", "messages": PARIS}, 400),
    ("detokenize an id outside the vocabulary", "/detokenize", {"tokens": [1, 10 ** 6]}, 400),
    ("detokenize tokens not ids", "/detokenize", {"tokens": "abc"}, 400),
    ("tokenize for another model", "/tokenize", {"model": "gpt-17", "prompt": "a"}, 404),
    ("unknown route", "/v1/audio/speech", {"input": "x"}, 404),
]


@pytest.mark.parametrize("name,path,body,status", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_gets_an_openai_error(server: Server, name: str, path: str, body: object,
                                        status: int) -> None:
    url = f"{server.url}{path}"
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"Content-Type": "application/json"},
                       timeout=60)
    else:
        r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and set(error) == {"message", "type", "param", "code"}
    if "beyond the context" in name:
        assert "8192" in error["message"]  # names the lengths


def test_errors_through_the_openai_client_then_service_still_works(
        client: openai.OpenAI, model: str, server: Server) -> None:
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.chat.completions.create(model=model, max_tokens=10,
                                       messages=[{"role": "user", "content": "hi " * 9000}])
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.chat.completions.create(model=model, messages=PARIS, max_tokens=10,
                                       stream=True, extra_body={"max_tokens": 9000})
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=PARIS)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=PARIS, temperature=-1)
    ok = client.chat.completions.create(model=model, messages=PARIS, temperature=0, max_tokens=8)
    assert "Paris" in ok.choices[0].message.content
    r = httpx.get(f"{server.url}/v1/chat/completions", timeout=10)
    assert r.status_code == 405 and r.json()["error"]["message"]


# --- the interactive shell, driven through its functions ------------------------------------------
def test_shell_chats_with_history_and_reset(server: Server, model: str) -> None:
    from minisgl.server.shell import run_shell
    lines = iter(["What is the capital of France?", "/reset", "/temperature x", "/exit"])
    out: List[str] = []
    run_shell(server.url, model, read=lambda prompt: next(lines), write=out.append)
    text = "".join(out)
    assert "Paris" in text and "(conversation cleared)" in text and "usage:" in text


# --- embeddings -------------------------------------------------------------------------------
def test_embeddings_match_offline_llm(client: openai.OpenAI, model: str, llm: LLM,
                                      server: Server) -> None:
    """POST /v1/embeddings through the official client (which asks for base64 and decodes it)
    and as floats: each input's embedding is the offline `LLM.embed`'s, in order, with the
    prompt tokens counted; what cannot be served is a 400 naming its field."""
    texts = ["The capital of France is", "Hello there"]
    want = llm.embed(texts)
    got = client.embeddings.create(model=model, input=texts)
    assert [d.index for d in got.data] == [0, 1] and got.model == model
    for d, w in zip(got.data, want):
        assert d.embedding == pytest.approx(w.outputs.embedding, abs=1e-6)
    assert got.usage.prompt_tokens == sum(w.prompt_tokens for w in want)
    ids = want[1].prompt_token_ids
    floats = _post(server, "/v1/embeddings", {"input": ids, "encoding_format": "float"}).json()
    assert floats["object"] == "list" and floats["data"][0]["object"] == "embedding"
    assert floats["data"][0]["embedding"] == pytest.approx(want[1].outputs.embedding, abs=1e-6)
    for bad, param in (({"input": ""}, "input"), ({"input": []}, "input"),
                       ({"input": "x", "dimensions": 8}, "dimensions"),
                       ({"input": "x", "pooling": "mean"}, "pooling"),
                       ({"input": "x", "encoding_format": "int8"}, "encoding_format")):
        r = _post(server, "/v1/embeddings", bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = _post(server, "/v1/embeddings", {"input": "x", "model": "nope"})
    assert r.status_code == 404


def test_score_and_rerank_are_cosines_of_the_embeddings(llm: LLM, server: Server) -> None:
    """vLLM's /score and the Jina/Cohere /rerank: the cosine similarity of two texts'
    embeddings (the offline `LLM.embed`'s), pairs as vLLM forms them, reranked best first;
    vLLM's /pooling: the embedding itself."""
    query, docs = "Where is Paris?", ["Paris is in France.", "Bananas are yellow.", "Hi"]
    vectors = [torch.tensor(o.outputs.embedding) for o in llm.embed([query, *docs])]
    want = [float(vectors[0] @ v) for v in vectors[1:]]
    score = _post(server, "/score", {"text_1": query, "text_2": docs}).json()
    assert [d["index"] for d in score["data"]] == [0, 1, 2]
    assert [d["score"] for d in score["data"]] == pytest.approx(want, abs=1e-5)
    pairwise = _post(server, "/v1/score", {"text_1": [query, docs[0]],
                                           "text_2": [docs[0], docs[0]]}).json()
    assert [d["score"] for d in pairwise["data"]] == pytest.approx([want[0], 1.0], abs=1e-5)
    ranked = _post(server, "/v1/rerank", {"query": query, "documents": docs, "top_n": 2}).json()
    order = sorted(range(3), key=lambda i: -want[i])[:2]
    assert [r["index"] for r in ranked["results"]] == order
    assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx(
        [want[i] for i in order], abs=1e-5)
    assert ranked["results"][0]["document"] == {"text": docs[order[0]]}
    pooled = _post(server, "/pooling", {"input": [query]}).json()  # vLLM's raw pooled output
    assert pooled["data"][0]["data"] == pytest.approx(vectors[0].tolist(), abs=1e-5)
    for path, bad, param in (("/score", {"text_1": ["a", "b"], "text_2": ["c"]}, "text_2"),
                             ("/rerank", {"query": "q", "documents": []}, "documents"),
                             ("/rerank", {"query": "q", "documents": ["d"], "top_n": 0},
                              "top_n")):
        r = _post(server, path, bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_embeddings_take_a_client_sized_batch(server: Server) -> None:
    """Clients batch documents (LangChain: up to 1,000 inputs a request): 200 inputs get 200
    embeddings in order; more than OpenAI's 2,048 is a 400 naming `input`."""
    inputs = [[5 + i % 50, 6 + i % 7] for i in range(200)]
    out = _post(server, "/v1/embeddings", {"input": inputs, "encoding_format": "base64"}).json()
    assert [d["index"] for d in out["data"]] == list(range(200))
    assert out["usage"]["prompt_tokens"] == 400
    r = _post(server, "/v1/embeddings", {"input": [[5]] * 2049})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"


def test_generate_streams_only_what_is_new_when_asked() -> None:
    """--incremental-streaming-output (SGLang's): each chunk carries its own text and ids;
    by default each repeats all so far. The formatter alone, over two chunks."""
    from minisgl.core import SamplingParams as Params
    from minisgl.message.types import ReplyChunk
    from minisgl.server.protocol import Job, Prompt
    from minisgl.server.responses import Choice, GenerateFormatter
    job = Job([Prompt(input_ids=[1, 2])], Params(max_tokens=2), 1, (), True, True, False)
    chunks = [ReplyChunk(0, "Hel", [7], prompt_tokens=2), ReplyChunk(0, "lo", [8], "length")]

    def events(incremental: bool) -> List[dict]:
        fmt, choice, out = GenerateFormatter("m", job, incremental), Choice(), []
        for c in chunks:
            choice.add(c)
            out += [json.loads(line[6:]) for line in fmt.delta(0, c, choice)]
        return out

    assert [(e["text"], e["output_ids"]) for e in events(True)] == [("Hel", [7]), ("lo", [8])]
    assert [(e["text"], e["output_ids"]) for e in events(False)] == [("Hel", [7]),
                                                                    ("Hello", [7, 8])]
    assert [e["finish_reason"] for e in events(False)] == [None, "length"]
