"""What vLLM's and SGLang's OpenAI clients send and expect, against a real `serve` process
(default model, tp=1, CPU): the streaming shape, defaults, /tokenize and the chat template,
refusals naming the field, usage on every chunk, tokenizer and version routes, matched stops,
vLLM's prompt_logprobs and allowed_token_ids.
Through the official `openai` client, and raw HTTP where the SDK has no field."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import httpx
import openai
import pytest

from server_helpers import Server, api_server, openai_client

PARIS = [{"role": "user", "content": "What is the capital of France?"}]
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Server]:
    yield from api_server(tmp_path_factory.mktemp("conformance"))


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai_client(server)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Any:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(default_model_dir))


def _post(server: Server, path: str, body: object) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


# --- defect 1: the finish reason rides on the last token's chunk -----------------------------------
def test_completion_stream_has_one_chunk_per_token(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=50, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    with_choices = [c for c in chunks if c.choices]
    assert len(with_choices) <= 50  # one per token at most (a split character waits)
    reasons = [c.choices[0].finish_reason for c in with_choices]
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    assert with_choices[-1].choices[0].text  # the last token's text, not an empty chunk
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 50


def test_chat_stream_finish_reason_on_the_last_content_chunk(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=PARIS, max_tokens=5, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = chunks[1:]
    assert len(content) == 5
    assert content[-1].choices[0].finish_reason == "length"
    assert content[-1].choices[0].delta.content
    assert all(c.choices[0].finish_reason is None for c in content[:-1])


# --- defect 1b: echo of a prompt with special tokens -----------------------------------------------
def test_echo_keeps_special_tokens_and_text_offsets_index_the_text(client: openai.OpenAI) -> None:
    prompt = "<|im_start|>user\nHi there , friend<|im_end|>\n<|im_start|>assistant\n"
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                     echo=True, logprobs=0)
    choice = resp.choices[0]
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    assert "<|im_start|>" in lp.tokens
    for token, offset in zip(lp.tokens, lp.text_offset):
        assert choice.text[offset:offset + len(token)] == token


# --- defect 2: defaults, and streamed equal to unstreamed ------------------------------------------
def test_completions_default_to_16_tokens_chat_to_as_many_as_fit(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0,
                                     extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 16 and resp.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model=MODEL, messages=PARIS, temperature=0,
                                          extra_body={"min_tokens": 20})
    assert chat.usage.completion_tokens >= 20  # not capped at 16


def _streamed(stream: Any, n: int, text_of: Any) -> Tuple[List[str], List[Any], int]:
    texts, reasons, usage = [""] * n, [None] * n, -1
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += text_of(c) or ""
            if c.finish_reason is not None:
                assert reasons[c.index] is None, "two finish reasons for one choice"
                reasons[c.index] = c.finish_reason
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    return texts, reasons, usage


@pytest.mark.parametrize("n", [1, 3])
def test_streamed_equals_unstreamed_chat(client: openai.OpenAI, n: int) -> None:
    kw: Dict[str, Any] = dict(model=MODEL, messages=PARIS, temperature=1.0, seed=11, n=n,
                              max_tokens=12)
    full = client.chat.completions.create(**kw)
    texts, reasons, used = _streamed(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}),
        n, lambda c: c.delta.content)
    assert texts == [c.message.content for c in full.choices]
    assert reasons == [c.finish_reason for c in full.choices]
    assert used == full.usage.completion_tokens


@pytest.mark.parametrize("n", [1, 3])
def test_streamed_equals_unstreamed_completions(client: openai.OpenAI, n: int) -> None:
    kw: Dict[str, Any] = dict(model=MODEL, prompt="The best thing about Paris is",
                              temperature=1.0, seed=5, n=n)
    full = client.completions.create(**kw)
    texts, reasons, used = _streamed(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True}),
        n, lambda c: c.text)
    assert texts == [c.text for c in full.choices]
    assert reasons == [c.finish_reason for c in full.choices]
    assert used == full.usage.completion_tokens


# --- defect 3: /tokenize follows the template options ----------------------------------------------
def test_tokenize_follows_the_chat_template_options(server: Server, client: openai.OpenAI,
                                                    tokenizer: Any) -> None:
    def template(**kw: Any) -> List[int]:
        out = tokenizer.apply_chat_template(PARIS, tokenize=True, **kw)
        return list(out["input_ids"] if hasattr(out, "keys") else out)
    with_prompt = _post(server, "/tokenize", {"messages": PARIS}).json()["tokens"]
    without = _post(server, "/tokenize", {"messages": PARIS, "add_generation_prompt": False})
    assert with_prompt == template(add_generation_prompt=True)
    assert without.json()["tokens"] == template(add_generation_prompt=False)
    assert len(without.json()["tokens"]) < len(with_prompt)
    chat = client.chat.completions.create(model=MODEL, messages=PARIS, max_tokens=1)
    assert chat.usage.prompt_tokens == len(with_prompt)
    chat = client.chat.completions.create(model=MODEL, messages=PARIS, max_tokens=1,
                                          extra_body={"add_generation_prompt": False})
    assert chat.usage.prompt_tokens == len(without.json()["tokens"])


def test_continue_final_message(server: Server, client: openai.OpenAI) -> None:
    messages = [*PARIS, {"role": "assistant", "content": "The capital of France is"}]
    body = {"messages": messages, "add_generation_prompt": False,
            "continue_final_message": True}
    ids = _post(server, "/tokenize", body).json()["tokens"]
    text = _post(server, "/detokenize", {"tokens": ids}).json()["prompt"]
    assert text.endswith("The capital of France is")
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3,
                                          temperature=0, extra_body={
                                              "add_generation_prompt": False,
                                              "continue_final_message": True})
    assert "Paris" in resp.choices[0].message.content
    assert resp.usage.prompt_tokens == len(ids)
    r = _post(server, "/v1/chat/completions", {"messages": messages,
                                               "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_chat_template_kwargs_reach_the_template(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=PARIS, max_tokens=2,
                                          extra_body={"chat_template_kwargs":
                                                      {"enable_thinking": False}})
    assert resp.choices[0].finish_reason in ("length", "stop")


# --- stop_regex (SGLang's): served on completions, chat and /generate ---------------------------
def test_stop_regex_cuts_the_output_where_the_text_first_matches(client: openai.OpenAI,
                                                                 server: Server) -> None:
    """The greedy output with a pattern is the output without it cut before the pattern's
    first match (the same text streamed; `matched_stop` the pattern; /generate's finish
    reason SGLang's); the KV pages of the request ended early are freed (the server goes on)."""
    prompt, greedy = "Once upon a time", dict(max_tokens=40, temperature=0)
    whole = client.completions.create(model=MODEL, prompt=prompt, **greedy,
                                      extra_body={"ignore_eos": True}).choices[0].text
    mid = len(whole) // 2
    pattern = re.escape(whole[mid]) + r"\S*\s"  # from the middle's character to a space
    expected = whole[:re.search(pattern, whole).start()]
    asked = dict(greedy, extra_body={"ignore_eos": True, "stop_regex": [pattern]})
    cut = client.completions.create(model=MODEL, prompt=prompt, **asked).choices[0]
    assert (cut.text, cut.finish_reason) == (expected, "stop") and len(expected) < len(whole)
    assert cut.model_extra["matched_stop"] == pattern
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, stream=True, **asked))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"
    r = _post(server, "/generate", {"text": prompt, "sampling_params": {
        "max_new_tokens": 40, "temperature": 0, "ignore_eos": True, "stop_regex": pattern}})
    assert r.json()["text"] == expected
    assert r.json()["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    chat = client.chat.completions.create(model=MODEL, messages=PARIS, max_tokens=20,
                                          temperature=0, extra_body={"stop_regex": r"[Pp]aris"})
    assert "aris" not in chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("value,words", [("x*", "matches the empty text"),
                                         (["("], "does not compile"), (5, "")])
def test_bad_stop_regex_is_a_400_naming_it(server: Server, value: object, words: str) -> None:
    for path, body in [("/v1/completions", {"prompt": "a", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": PARIS, "max_tokens": 2})]:
        r = _post(server, path, {**body, "stop_regex": value})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop_regex", r.text
        assert words in r.json()["error"]["message"]


# --- defect 4: refusals name the field -------------------------------------------------------------
REFUSED = [
    ("length_penalty", 2.0),  # without use_beam_search
    ("guided_whitespace_pattern", " *"), ("guided_decoding_backend", "outlines"),
    ("spaces_between_special_tokens", False), ("chat_template", "{{ 1 }}"),
]


@pytest.mark.parametrize("field,value", REFUSED, ids=[r[0] for r in REFUSED])
def test_unimplemented_fields_are_refused_by_name(server: Server, field: str,
                                                  value: object) -> None:
    r = _post(server, "/v1/chat/completions", {"messages": PARIS, "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    r = _post(server, "/v1/completions", {"prompt": "a", "max_tokens": 2, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field


def test_request_chat_templates_are_refused_unless_trusted(server: Server) -> None:
    """Without --trust-request-chat-template a template in a request (a template is code the
    tokenizer runs) is a 400 naming the field it came in, on chat and /tokenize."""
    for fields, param in [({"chat_template": "{{ 1 }}"}, "chat_template"),
                          ({"chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
                           "chat_template_kwargs")]:
        for path, body in [("/v1/chat/completions", {"messages": PARIS, "max_tokens": 2}),
                           ("/tokenize", {"messages": PARIS})]:
            r = _post(server, path, {**body, **fields})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            assert "--trust-request-chat-template" in r.json()["error"]["message"]


def test_values_that_ask_for_nothing_are_accepted(server: Server) -> None:
    r = _post(server, "/v1/chat/completions", {
        "messages": PARIS, "max_tokens": 2, "use_beam_search": False, "regex": None,
        "spaces_between_special_tokens": True, "cache_salt": None, "guided_json": None})
    assert r.status_code == 200, r.text


PARAMS = [
    ("stop token id outside the vocabulary", {"stop_token_ids": [10 ** 6]}, "stop_token_ids"),
    ("stream_options without stream", {"stream_options": {"include_usage": True}},
     "stream_options"),
    ("logit_bias beyond the vocabulary", {"logit_bias": {"49152": 1, "60000": 2}}, "logit_bias"),
    ("prompt plus max_tokens beyond the context", {"max_tokens": 8190}, "max_tokens"),
    ("prompt beyond the context",
     {"messages": [{"role": "user", "content": "hi " * 9000}]}, "messages"),
]


@pytest.mark.parametrize("name,fields,param", PARAMS, ids=[p[0] for p in PARAMS])
def test_errors_name_the_field(server: Server, name: str, fields: Dict[str, Any],
                               param: str) -> None:
    r = _post(server, "/v1/chat/completions", {"messages": PARIS, "max_tokens": 2, **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    if name == "logit_bias beyond the vocabulary":
        assert "49152" in r.json()["error"]["message"] and "60000" in r.json()["error"]["message"]


def test_completion_prompt_errors_name_the_prompt(server: Server) -> None:
    r = _post(server, "/v1/completions", {"prompt": [1, 10 ** 9], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = _post(server, "/v1/completions", {"prompt": "hi " * 9000, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_every_bad_logit_bias_key_is_named(server: Server) -> None:
    r = _post(server, "/v1/chat/completions", {"messages": PARIS, "max_tokens": 2,
                                               "logit_bias": {"x": 1, "12": 2, "-3": 4}})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "logit_bias" and "'x'" in error["message"] and "'-3'" in \
        error["message"]
    r = _post(server, "/v1/chat/completions", {"messages": PARIS, "max_tokens": 2,
                                               "logit_bias": {"5": 101, "6": -200}})
    assert "5" in r.json()["error"]["message"] and "6" in r.json()["error"]["message"]


def test_a_body_that_is_not_json_gets_415(server: Server) -> None:
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/generate"):
        r = httpx.post(f"{server.url}{path}", content=b"prompt=hi", timeout=30,
                       headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert r.status_code == 415, (path, r.text)
        assert r.json()["error"]["message"]


def test_stream_refusal_through_the_client(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="stop_token_ids"):
        client.chat.completions.create(model=MODEL, messages=PARIS, max_tokens=2, stream=True,
                                       extra_body={"stop_token_ids": [10 ** 6]})


# --- item 5: usage on every chunk ------------------------------------------------------------------
def test_continuous_usage_stats(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=PARIS, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True}))
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 6
    assert all(c.usage.prompt_tokens > 0 for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == \
        chunks[-1].usage.prompt_tokens + 6
    plain = list(client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=3, stream=True,
        stream_options={"include_usage": False, "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in plain)


# --- item 7: tokenizer and model information -------------------------------------------------------
def test_tokenize_token_strs_tokenizer_info_version_model_card(server: Server,
                                                               client: openai.OpenAI,
                                                               tokenizer: Any) -> None:
    r = _post(server, "/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    assert r.json()["tokens"] == ids
    assert r.json()["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
    info = httpx.get(f"{server.url}/tokenizer_info", timeout=30).json()
    assert info["eos_token"] == tokenizer.eos_token and info["chat_template"]
    assert info["tokenizer_class"] and info["model_max_length"] == 8192
    version = httpx.get(f"{server.url}/version", timeout=30).json()
    assert isinstance(version["version"], str) and version["version"]
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.model_extra["max_model_len"] == 8192
    assert Path(card.model_extra["root"]).name == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")


def test_null_fields_are_their_defaults(server: Server) -> None:
    """OpenAI's schema lets n, stream, echo and include_usage be null (the Python SDK sends
    None through extra_body, other clients write null): served as the defaults."""
    r = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": PARIS, "max_tokens": 2,
                                               "n": None, "stream": None})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2,
                                          "echo": None, "stream": True,
                                          "stream_options": {"include_usage": None}})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
    assert '"usage"' not in r.text


# --- item 8: matched_stop, no_stop_trim ------------------------------------------------------------
def test_matched_stop_and_no_stop_trim(client: openai.OpenAI, tokenizer: Any) -> None:
    kw: Dict[str, Any] = dict(model=MODEL, messages=PARIS, temperature=0, max_tokens=30)
    r = client.chat.completions.create(**kw, stop=["Paris", "never"])
    assert r.choices[0].message.content == "The capital of France is "
    assert r.choices[0].model_extra["matched_stop"] == "Paris"
    r = client.chat.completions.create(**kw, stop=["Paris"], extra_body={"no_stop_trim": True})
    assert r.choices[0].message.content == "The capital of France is Paris"
    r = client.chat.completions.create(**kw, stop=["Paris"],  # vLLM's name for it
                                       extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].message.content == "The capital of France is Paris"
    streamed = list(client.chat.completions.create(**kw, stop=["Paris"], stream=True,
                                                   extra_body={"no_stop_trim": True}))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == \
        "The capital of France is Paris"
    assert streamed[-1].choices[0].model_extra["matched_stop"] == "Paris"
    r = client.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["matched_stop"] == tokenizer.convert_tokens_to_ids(
        "<|im_end|>")
    r = client.chat.completions.create(**{**kw, "max_tokens": 2})
    assert r.choices[0].model_extra["matched_stop"] is None


def test_stop_matcher_names_the_match_and_keeps_it_when_asked() -> None:
    from minisgl.tokenizer.incremental import StopMatcher
    m = StopMatcher(["lo w", "o"], keep=True)
    assert m.feed("hel") == ("he", False) and m.matched is None  # "l" may start "lo w"
    assert m.feed("lo world") == ("llo w", True) and m.matched == "lo w"
    m = StopMatcher(["ab", "abc"])
    assert m.feed("xabc") == ("x", True) and m.matched == "abc"  # the longest at the spot


# --- item 10: the Responses API --------------------------------------------------------------------
def test_responses_api_plain_streamed_and_continued(client: openai.OpenAI, server: Server) -> None:
    chat = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=12,
        messages=[{"role": "system", "content": "Be brief."}, *PARIS])
    r = client.responses.create(model=MODEL, input=PARIS[0]["content"], temperature=0,
                                instructions="Be brief.", max_output_tokens=12)
    assert r.output_text == chat.choices[0].message.content and r.status == "completed"
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens

    events = list(client.responses.create(model=MODEL, input=PARIS, temperature=0,
                                          instructions="Be brief.", max_output_tokens=12,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        r.output_text
    assert events[-1].response.output_text == r.output_text

    lp = client.responses.create(model=MODEL, input=PARIS[0]["content"], temperature=0,
                                 instructions="Be brief.", max_output_tokens=12, top_logprobs=2,
                                 include=["message.output_text.logprobs"])
    part = lp.output[0].content[0]
    assert part.text == r.output_text and "".join(e.token for e in part.logprobs) == part.text
    assert len(part.logprobs) in (lp.usage.output_tokens, lp.usage.output_tokens - 1)  # EOS
    assert all(len(e.top_logprobs) == 2 for e in part.logprobs)

    more = client.responses.create(model=MODEL, input="And of Germany?", temperature=0,
                                   max_output_tokens=4, previous_response_id=r.id)
    assert more.status == "incomplete" and more.incomplete_details.reason == "max_output_tokens"
    assert more.usage.input_tokens > r.usage.input_tokens + 4  # the conversation came along
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="x", previous_response_id="resp-nope")
    assert client.responses.retrieve(more.id).model_dump() == more.model_dump()
    # the SDK's input_items.list: the input as items with ids, newest first by default
    listed = client.responses.input_items.list(r.id)
    assert [(i.type, i.role, i.content[0].text) for i in listed.data] == [
        ("message", "user", PARIS[0]["content"])]
    assert listed.data[0].id.startswith("msg_") and not listed.has_more
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
             *PARIS]
    multi = client.responses.create(model=MODEL, input=turns, max_output_tokens=2)
    pages = client.responses.input_items.list(multi.id, order="asc", limit=2)
    assert [i.role for i in pages.data] == ["user", "assistant"] and pages.has_more
    rest = client.responses.input_items.list(multi.id, order="asc", after=pages.data[-1].id)
    assert [i.role for i in rest.data] == ["user"] and not rest.has_more
    assert [i.id for i in client.responses.input_items.list(multi.id)] == [
        i.id for i in [*pages.data, *rest.data][::-1]]  # all pages, newest first
    bad = httpx.get(f"{server.url}/v1/responses/{multi.id}/input_items?limit=0", timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp-nope")
    client.responses.delete(more.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(more.id)
    with pytest.raises(openai.NotFoundError):  # its conversation went with it
        client.responses.create(model=MODEL, input="x", previous_response_id=more.id)
    bad = _post(server, "/v1/responses", {"input": "x", "tools": [{"type": "web_search"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools.0.type"
    bad = _post(server, "/v1/responses", {"input": "x", "max_output_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_output_tokens"


def test_responses_api_background_polled_and_cancelled(client: openai.OpenAI,
                                                      server: Server) -> None:
    """background: answered at once in progress; polled with GET until it ends, with the
    output a foreground request gives; a long one cancelled while it runs ends cancelled (its
    job aborted: the server answers the next request); cancelling one that is not running
    is a 400."""
    ask = dict(model=MODEL, input=PARIS[0]["content"], temperature=0, max_output_tokens=12)
    fg = client.responses.create(**ask)  # type: ignore[call-overload]
    bg = client.responses.create(**ask, background=True)  # type: ignore[call-overload]
    assert bg.status in ("in_progress", "completed") and bg.background
    for _ in range(600):
        got = client.responses.retrieve(bg.id)
        if got.status != "in_progress":
            break
        time.sleep(0.05)
    assert got.status == "completed" and got.output_text == fg.output_text
    long = client.responses.create(model=MODEL, input="Tell me a very long story.",
                                   max_output_tokens=2000, background=True)
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(
        long.id).status == "cancelled"
    for _ in range(200):  # its job aborted: nothing runs, no KV page is held
        metrics = dict(line.rsplit(" ", 1) for line in httpx.get(
            f"{server.url}/metrics", timeout=10).text.splitlines() if line[:1] not in "#")
        if float(metrics["minisgl_num_requests_running"]) == float(
                metrics["minisgl_kv_pages_used"]) == 0:
            break
        time.sleep(0.05)
    assert float(metrics["minisgl_kv_pages_used"]) == 0
    running = client.responses.create(model=MODEL, input="Tell me a very long story.",
                                      max_output_tokens=2000, background=True)
    client.responses.delete(running.id)  # stopped first: its end does not store it again
    time.sleep(0.2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(running.id)
    assert client.responses.create(**ask).output_text == fg.output_text  # type: ignore
    bad = _post(server, f"/v1/responses/{fg.id}/cancel", {})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_id"


def test_conversations_api_carries_a_responses_conversation(client: openai.OpenAI,
                                                           server: Server) -> None:
    """The SDK's client.conversations: created with an item and metadata, retrieved; a
    Responses request naming it sees its items (more input tokens than alone) and appends
    its turn; items added, retrieved, listed and deleted; metadata updated; conversation with
    previous_response_id a 400; once deleted, 404s for it and for a request naming it."""
    question = PARIS[0]["content"]
    conv = client.conversations.create(
        items=[{"type": "message", "role": "user", "content": "Hi, I am Ann."}],
        metadata={"topic": "names"})
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "names"}
    assert client.conversations.retrieve(conv.id).model_dump() == conv.model_dump()
    r = client.responses.create(model=MODEL, conversation=conv.id, input=question,
                                temperature=0, max_output_tokens=8)
    alone = client.responses.create(model=MODEL, input=question, temperature=0,
                                    max_output_tokens=8)
    assert r.conversation is not None and r.conversation.id == conv.id
    assert r.usage.input_tokens > alone.usage.input_tokens
    listed = client.conversations.items.list(conv.id, order="asc")
    assert [(i.type, i.role) for i in listed.data] == [  # type: ignore[union-attr]
        ("message", "user"), ("message", "user"), ("message", "assistant")]
    assert listed.data[-1].content[0].text == r.output_text  # type: ignore[union-attr]
    added = client.conversations.items.create(conv.id, items=[
        {"type": "message", "role": "user", "content": "Thanks."}])
    (item,) = added.data
    got = client.conversations.items.retrieve(item.id, conversation_id=conv.id)
    assert got.content[0].text == "Thanks."  # type: ignore[union-attr]
    assert client.conversations.items.delete(item.id, conversation_id=conv.id).id == conv.id
    assert len(client.conversations.items.list(conv.id).data) == 3
    assert client.conversations.update(conv.id, metadata={"topic": "capitals"}).metadata == {
        "topic": "capitals"}
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, conversation=conv.id, input="x",
                                previous_response_id=r.id)
    assert client.conversations.delete(conv.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conv.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, conversation=conv.id, input="x")
    bad = _post(server, "/v1/conversations", {"items": [{"type": "web_search_call"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "items.0.type"


def test_responses_api_function_call_turn(client: openai.OpenAI) -> None:
    """A required function call comes back as a function_call item (arguments valid for the
    tool's schema), streamed as plain; its function_call_output, continuing the stored
    response, reaches the model as the tool's message and the reply is a message."""
    weather = {"type": "function", "name": "get_weather", "description": "Weather in a city",
               "parameters": {"type": "object", "properties": {"city": {
                   "type": "string", "maxLength": 20}}, "required": ["city"],
                   "additionalProperties": False}}
    ask = dict(model=MODEL, input="What is the weather in Paris?", tools=[weather],
               tool_choice="required", temperature=0, max_output_tokens=60)
    r = client.responses.create(**ask)  # type: ignore[call-overload]
    calls = [i for i in r.output if i.type == "function_call"]
    assert r.status == "completed" and len(calls) >= 1 and calls[0].name == "get_weather"
    assert set(json.loads(calls[0].arguments)) == {"city"}
    events = list(client.responses.create(**ask, stream=True))  # type: ignore[call-overload]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.type, getattr(i, "arguments", None)) for i in done] == [
        (i.type, getattr(i, "arguments", None)) for i in r.output]
    more = client.responses.create(
        model=MODEL, previous_response_id=r.id, temperature=0, max_output_tokens=8,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "sunny, 25 C"}])
    assert more.output[0].type == "message" and more.usage.input_tokens > r.usage.input_tokens


# --- item 6: vLLM's prompt_logprobs and allowed_token_ids ------------------------------------------
PROMPT = "The capital of France is"


def _check_prompt_logprobs(entries: List[Any], ids: List[int], k: int, tokenizer: Any) -> None:
    """vLLM's shape: null first, then per prompt token a map id -> {logprob, rank,
    decoded_token} holding the prompt token and the k most likely tokens."""
    assert len(entries) == len(ids) and entries[0] is None
    for entry, tok in zip(entries[1:], ids[1:]):
        assert str(tok) in entry and k <= len(entry) <= k + 1
        mine = entry[str(tok)]
        ranks = sorted(v["rank"] for v in entry.values())
        assert ranks[:k] == list(range(1, k + 1)) and mine["logprob"] <= 0
        assert (mine["rank"] > k) == (len(entry) == k + 1)  # in the top k or beside it
        by_rank = sorted(entry.values(), key=lambda v: v["rank"])
        assert [v["logprob"] for v in by_rank] == sorted((v["logprob"] for v in by_rank),
                                                         reverse=True)
        assert all(v["decoded_token"] == tokenizer.decode([int(t)]) for t, v in entry.items())


def _prompt_token_logprobs(entries: List[Any], ids: List[int]) -> List[float]:
    return [e[str(t)]["logprob"] for e, t in zip(entries[1:], ids[1:])]


def test_prompt_logprobs_in_completions(client: openai.OpenAI, tokenizer: Any) -> None:
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    kw: Dict[str, Any] = dict(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    client.completions.create(**kw)  # the prefix cache now holds the prompt
    full = client.completions.create(**kw, extra_body={"prompt_logprobs": 2})
    entries = full.choices[0].model_extra["prompt_logprobs"]
    _check_prompt_logprobs(entries, ids, 2, tokenizer)
    assert full.usage.prompt_tokens_details.cached_tokens == 0  # it skipped the cache
    # the same numbers as echo's log-probabilities of the prompt tokens
    echo = client.completions.create(**kw, echo=True, logprobs=1)
    echoed = echo.choices[0].logprobs.token_logprobs[:len(ids)]
    assert echoed[0] is None
    assert echoed[1:] == pytest.approx(_prompt_token_logprobs(entries, ids), rel=1e-5, abs=1e-4)
    # streamed: on each choice's first chunk, the same
    chunks = list(client.completions.create(**kw, stream=True,
                                            extra_body={"prompt_logprobs": 2}))
    carried = [c.choices[0].model_extra.get("prompt_logprobs") for c in chunks if c.choices]
    assert carried[0] == entries and not any(carried[1:])
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert "prompt_logprobs" not in echo.choices[0].model_extra  # only when asked


def test_prompt_logprobs_in_chat(client: openai.OpenAI, server: Server, tokenizer: Any) -> None:
    ids = _post(server, "/tokenize", {"messages": PARIS}).json()["tokens"]
    kw: Dict[str, Any] = dict(model=MODEL, messages=PARIS, max_tokens=3, temperature=0, n=2,
                              extra_body={"prompt_logprobs": 0})
    full = client.chat.completions.create(**kw)
    entries = full.model_extra["prompt_logprobs"]  # vLLM's: once, at the top
    _check_prompt_logprobs(entries, ids, 0, tokenizer)
    assert all(len(e) == 1 for e in entries[1:])
    chunks = list(client.chat.completions.create(**kw, stream=True))
    carried = [c.model_extra.get("prompt_logprobs") for c in chunks]
    assert carried[0] is not None and not any(carried[1:])  # the stream's first chunk
    assert [list(e) for e in carried[0][1:]] == [list(e) for e in entries[1:]]
    # float32, but the two runs may share their steps with other requests (another batch
    # shape, another summation order): equal to about 1e-6 relative, not bit for bit
    assert _prompt_token_logprobs(carried[0], ids) == pytest.approx(
        _prompt_token_logprobs(entries, ids), rel=1e-5, abs=1e-4)


def _single_tokens(tokenizer: Any, words: List[str]) -> List[int]:
    ids = [tokenizer.encode(w, add_special_tokens=False) for w in words]
    assert all(len(i) == 1 for i in ids), ids
    return [i[0] for i in ids]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_allowed_token_ids(client: openai.OpenAI, server: Server, tokenizer: Any,
                           temperature: float) -> None:
    """Sampling (greedy and random) picks only among the allowed tokens, in chat and
    completions, streamed and not (the same seeded tokens either way)."""
    words = [" London", " Rome", " Berlin"]
    allowed = _single_tokens(tokenizer, words)
    only = re.compile("(" + "|".join(words) + ")+")
    extra = {"allowed_token_ids": allowed, "ignore_eos": True}
    kw: Dict[str, Any] = dict(model=MODEL, max_tokens=6, temperature=temperature, seed=3,
                              extra_body=extra)
    text = client.completions.create(prompt=PROMPT, **kw).choices[0].text
    chat = client.chat.completions.create(messages=PARIS, **kw).choices[0].message.content
    assert only.fullmatch(text) and only.fullmatch(" " + chat.lstrip()), (text, chat)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        prompt=PROMPT, stream=True, **kw) if c.choices)
    chat_streamed = "".join(c.choices[0].delta.content or "" for c in
                            client.chat.completions.create(messages=PARIS, stream=True, **kw)
                            if c.choices)
    assert (streamed, chat_streamed) == (text, chat)
    free = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    assert not only.fullmatch(free.choices[0].text)  # the mask made the difference
    r = httpx.post(f"{server.url}/generate", timeout=120, json={
        "text": PROMPT, "sampling_params": {"max_tokens": 4, "temperature": temperature,
                                            "seed": 3, **extra}})
    assert r.status_code == 200 and set(r.json()["token_ids"]) <= set(allowed), r.text


BAD_ITEM6 = [
    ({"allowed_token_ids": []}, "allowed_token_ids", "must not be empty"),
    ({"allowed_token_ids": [5, 60000, 70000]}, "allowed_token_ids", "60000, 70000"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids", "-1"),
    ({"allowed_token_ids": "5"}, "allowed_token_ids", ""),
    ({"prompt_logprobs": 21}, "prompt_logprobs",
     "prompt_logprobs asks for the 21 most likely tokens, more than this engine returns "
     "(max_logprobs 20)"),
    ({"prompt_logprobs": -1}, "prompt_logprobs", "got -1"),
    ({"prompt_logprobs": True}, "prompt_logprobs", ""),
]


@pytest.mark.parametrize("fields,param,words", BAD_ITEM6,
                         ids=[f"{p}={f[p]}" for f, p, _ in BAD_ITEM6])
def test_bad_allowed_token_ids_and_prompt_logprobs(server: Server, client: openai.OpenAI,
                                                   fields: Dict[str, Any], param: str,
                                                   words: str) -> None:
    for path, body in (("/v1/chat/completions", {"messages": PARIS}),
                       ("/v1/completions", {"prompt": PROMPT})):
        r = _post(server, path, {**body, "max_tokens": 2, **fields})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and words in error["message"], error
    with pytest.raises(openai.BadRequestError, match=param):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, stream=True,
                                  extra_body=fields)


# --- vLLM's truncate_prompt_tokens and return_tokens_as_token_ids ---------------------------------
def test_truncate_prompt_tokens_keeps_the_prompts_end(client: openai.OpenAI, server: Server,
                                                      tokenizer: Any) -> None:
    """As vLLM: the prompt's last k tokens are served (usage counts them), the same output as
    a prompt of those tokens alone; k larger than the prompt changes nothing; chat too."""
    ids = tokenizer.encode("One two three four five six seven eight", add_special_tokens=False)
    kw: Dict[str, Any] = dict(model=MODEL, max_tokens=4, temperature=0)
    cut = client.completions.create(prompt=ids, **kw, extra_body={"truncate_prompt_tokens": 3})
    alone = client.completions.create(prompt=ids[-3:], **kw)
    assert cut.usage.prompt_tokens == 3 and cut.choices[0].text == alone.choices[0].text
    whole = client.completions.create(prompt=ids, **kw, extra_body={"truncate_prompt_tokens": 99})
    assert whole.usage.prompt_tokens == len(ids)
    chat = client.chat.completions.create(messages=PARIS, **kw,
                                          extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5
    for bad, words in ((0, "-1 (the context length) or an integer from 1 to 2**31 - 1, got 0"),
                       (10 ** 6, "(1000000) is more than the model's maximum context length"),
                       (True, "")):
        r = _post(server, "/v1/completions", {"prompt": "a", "max_tokens": 2,
                                              "truncate_prompt_tokens": bad})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "truncate_prompt_tokens" and words in error["message"], error


def test_return_tokens_as_token_ids(client: openai.OpenAI, tokenizer: Any) -> None:
    """As vLLM: every log-probability token (top ones too, an echoed prompt's too) is
    "token_id:N", its bytes that string's; text and offsets follow the strings."""
    kw: Dict[str, Any] = dict(model=MODEL, max_tokens=4, temperature=0, logprobs=True,
                              top_logprobs=2)
    plain = client.chat.completions.create(messages=PARIS, **kw)
    as_ids = client.chat.completions.create(messages=PARIS, **kw,
                                            extra_body={"return_tokens_as_token_ids": True})
    assert as_ids.choices[0].message.content == plain.choices[0].message.content
    for mine, theirs in zip(as_ids.choices[0].logprobs.content, plain.choices[0].logprobs.content):
        tid = int(re.fullmatch(r"token_id:(\d+)", mine.token).group(1))  # type: ignore[union-attr]
        assert tokenizer.decode([tid]) == theirs.token
        # another run (its prompt now cached): the same up to float32 summation order
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert mine.bytes == list(mine.token.encode())
        assert all(re.fullmatch(r"token_id:\d+", t.token) for t in mine.top_logprobs)
    echo = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0,
                                     echo=True, logprobs=1,
                                     extra_body={"return_tokens_as_token_ids": True})
    lp = echo.choices[0].logprobs
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    assert lp.tokens[:len(ids)] == [f"token_id:{t}" for t in ids]
    assert lp.text_offset[1] == len(lp.tokens[0])


def test_cache_salt_scopes_the_prefix_cache(client: openai.OpenAI, server: Server) -> None:
    """vLLM's cache_salt: a cached prompt is a hit only under the salt it was cached with
    (usage's cached_tokens says so); a bad salt is a 400 naming it."""
    messages = [{"role": "user", "content": "Name three colours of the rainbow, please. " * 8}]

    def cached(salt: Optional[str]) -> int:
        extra = {} if salt is None else {"cache_salt": salt}
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                           extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    # unsalted: at most the chat template's system prompt that other tests' chats cached
    unsalted = cached(None)
    assert cached("tenant-b") == 0
    assert cached("tenant-a") == cached(None) > unsalted  # each now holds the whole prompt
    for bad in ("", "x" * 257, 5):
        r = _post(server, "/v1/completions", {"prompt": "a", "max_tokens": 2, "cache_salt": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text


def test_priority_under_first_come_first_served(server: Server) -> None:
    """vLLM's priority: 0 is served; another value under the default policy is a 400 naming
    the field and the policy that would take it."""
    for path, body in (("/v1/chat/completions", {"messages": PARIS}),
                       ("/v1/completions", {"prompt": PROMPT})):
        assert _post(server, path, {**body, "max_tokens": 2, "priority": 0}).status_code == 200
        r = _post(server, path, {**body, "max_tokens": 2, "priority": 3})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "priority" and "--scheduling-policy priority" in error["message"]


def test_return_token_ids(client: openai.OpenAI, server: Server, tokenizer: Any) -> None:
    """vLLM's return_token_ids: the prompt's ids (chat: at the top; completions: per choice)
    and each choice's output ids, whose text is the choice's; streamed, the prompt's on the
    first chunk only and the output's as they come, joining into the unstreamed ones."""
    prompt_ids = _post(server, "/tokenize", {"messages": PARIS}).json()["tokens"]
    kw: Dict[str, Any] = dict(model=MODEL, messages=PARIS, max_tokens=6, temperature=0,
                              extra_body={"return_token_ids": True, "ignore_eos": True})
    full = client.chat.completions.create(**kw)
    assert full.model_extra["prompt_token_ids"] == prompt_ids
    ids = full.choices[0].model_extra["token_ids"]
    assert len(ids) == full.usage.completion_tokens == 6
    assert tokenizer.decode(ids) == full.choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True))
    carried = [c.model_extra.get("prompt_token_ids") for c in chunks]
    assert carried[0] == prompt_ids and not any(carried[1:])
    assert [t for c in chunks if c.choices for t in c.choices[0].model_extra.get("token_ids")
            or []] == ids
    plain = client.chat.completions.create(model=MODEL, messages=PARIS, max_tokens=2)
    assert "prompt_token_ids" not in plain.model_extra
    assert "token_ids" not in plain.choices[0].model_extra

    text_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                     n=2, extra_body={"return_token_ids": True})
    for choice in done.choices:
        assert choice.model_extra["prompt_token_ids"] == text_ids
        assert tokenizer.decode(choice.model_extra["token_ids"]) == choice.text
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3,
                                              temperature=0, stream=True,
                                              extra_body={"return_token_ids": True}))
    firsts = [c.choices[0].model_extra.get("prompt_token_ids") for c in streamed]
    assert firsts[0] == text_ids and not any(firsts[1:])
    assert [t for c in streamed for t in c.choices[0].model_extra["token_ids"]] == \
        done.choices[0].model_extra["token_ids"]


# --- SageMaker's /invocations (vLLM's): the body's fields pick the endpoint -----------------------
def test_invocations_route_by_the_bodys_fields(server: Server) -> None:
    chat = {"messages": PARIS, "max_tokens": 4, "temperature": 0}
    completion = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
        direct, routed = _post(server, path, body).json(), _post(server, "/invocations", body)
        assert routed.status_code == 200, routed.text
        assert routed.json()["object"] == direct["object"]
        assert routed.json()["choices"][0] == direct["choices"][0]
    bad = _post(server, "/invocations", {"messages": []})  # the endpoint's own refusal
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    r = _post(server, "/invocations", {"model": "x"})
    assert r.status_code == 400 and "messages (chat)" in r.json()["error"]["message"]
    r = _post(server, "/invocations", [1, 2])
    assert r.status_code == 400 and "a JSON object" in r.json()["error"]["message"]


def test_invocation_routes() -> None:
    from minisgl.server.invocations import invocation_route
    from minisgl.server.protocol import ApiError
    cases = [({"messages": []}, False, "chat"), ({"prompt": "a"}, False, "completions"),
             ({"input": "a"}, False, "embeddings"), ({"input": "a"}, True, "classify"),
             ({"query": "q", "documents": []}, False, "rerank"),
             ({"text_1": "a", "text_2": "b"}, False, "score")]
    for body, classifier, route in cases:
        assert invocation_route(json.dumps(body).encode(), classifier) == route
    for raw in (b"", b"[1]", b"{not json", b'{"model": "m"}'):
        with pytest.raises(ApiError):
            invocation_route(raw, False)


def test_chat_echo_starts_with_a_continued_message(server: Server) -> None:
    """vLLM's chat echo: where the last message has the reply's role (a continued assistant
    message), every choice's content starts with it, streamed in the role chunk; otherwise
    echo changes nothing."""
    prefix = "The capital of France is"
    body = {"messages": [*PARIS, {"role": "assistant", "content": prefix}], "max_tokens": 4,
            "temperature": 0, "add_generation_prompt": False, "continue_final_message": True}
    plain = _post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]
    echoed = _post(server, "/v1/chat/completions", {**body, "echo": True}).json()
    assert echoed["choices"][0]["message"]["content"] == prefix + plain["content"]
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=60,
                      json={**body, "echo": True, "stream": True}) as r:
        events = [json.loads(ln[6:]) for ln in r.iter_lines()
                  if ln.startswith("data: ") and ln != "data: [DONE]"]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert deltas[0]["content"] == prefix
    assert "".join(d.get("content") or "" for d in deltas) == prefix + plain["content"]
    asked = {"messages": PARIS, "max_tokens": 4, "temperature": 0}
    assert (_post(server, "/v1/chat/completions", {**asked, "echo": True}).json()["choices"][0]
            == _post(server, "/v1/chat/completions", asked).json()["choices"][0])


def test_load_counts_the_requests_in_flight(server: Server) -> None:
    """vLLM's GET /load: 0 at rest, 1 while a stream runs, 0 once it ended; its flags
    (--enable-server-load-tracking, --disable-uvicorn-access-log) are what is done by default."""
    from minisgl.server.args import parse_args
    assert httpx.get(f"{server.url}/load", timeout=10).json() == {"server_load": 0}
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60, json={
            "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True,
            "stream": True}) as r:
        lines = r.iter_lines()  # held: a dropped line iterator closes the response
        next(line for line in lines if line.startswith("data: "))
        assert httpx.get(f"{server.url}/load", timeout=10).json() == {"server_load": 1}
    deadline = time.monotonic() + 10
    while httpx.get(f"{server.url}/load", timeout=10).json()["server_load"] and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(f"{server.url}/load", timeout=10).json() == {"server_load": 0}
    cfg = parse_args(["--enable-server-load-tracking", "--disable-uvicorn-access-log"])
    assert cfg.server_load_tracking and not cfg.uvicorn_access_log
    assert not parse_args(["--no-server-load-tracking"]).server_load_tracking
