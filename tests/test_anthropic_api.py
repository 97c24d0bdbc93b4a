"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) of a real `serve`
process (default model, CPU, an API key set), through raw HTTP and the official `anthropic`
client: the message's shape and stop reasons, streams whose events fold into the same message,
tool_use blocks enforced by tool_choice, tool_use / tool_result turns, Anthropic-shaped errors,
`x-api-key`, and count_tokens equal to the prompt a request has. One server for the module."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import anthropic
import httpx
import jsonschema
import pytest

from formatter_helpers import chunks_of, plain_and_streamed
from server_helpers import CPU_ARGS, Server

KEY = "test-key"
PARIS = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
           "input_schema": {"type": "object",
                            "properties": {"city": {"type": "string", "maxLength": 20},
                                           "unit": {"type": "string",
                                                    "enum": ["celsius", "fahrenheit"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}
ADD = {"name": "add", "description": "Add two integers",
       "input_schema": {"type": "object",
                        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 1000},
                                       "b": {"type": "integer", "minimum": 0, "maximum": 1000}},
                        "required": ["a", "b"], "additionalProperties": False}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris? Also add 2 and 3."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Server]:
    srv = Server.start([*CPU_ARGS, "--api-key", KEY], tmp_path_factory.mktemp("anthropic"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(server: Server) -> str:
    models = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    return str(models.json()["data"][0]["id"])


def _post(server: Server, path: str, body: Dict[str, Any],
          headers: Any = None) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120,
                      headers={"x-api-key": KEY} if headers is None else headers)


def _message(server: Server, **body: Any) -> Dict[str, Any]:
    r = _post(server, "/v1/messages", body)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _events(server: Server, **body: Any) -> List[Dict[str, Any]]:
    """A stream's events, each `event:` line checked against its data's type."""
    r = _post(server, "/v1/messages", {**body, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = []
    for frame in r.text.strip().split("\n\n"):
        name, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        events.append(event)
    return events


def _fold(events: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The message a client assembles from the events (block by block, each opened, grown by
    its deltas and stopped before the next begins)."""
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    message = dict(events[0]["message"])
    assert message["content"] == [] and message["stop_reason"] is None
    blocks: List[Dict[str, Any]] = []
    partial = ""
    for e in events[1:-2]:
        if e["type"] == "content_block_start":
            assert e["index"] == len(blocks)
            blocks.append(dict(e["content_block"]))
            partial = ""
        elif e["type"] == "content_block_delta":
            assert e["index"] == len(blocks) - 1
            delta = e["delta"]
            if delta["type"] == "text_delta":
                blocks[-1]["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                blocks[-1]["thinking"] += delta["thinking"]
            else:
                assert delta["type"] == "input_json_delta"
                partial += delta["partial_json"]
        else:
            assert e == {"type": "content_block_stop", "index": len(blocks) - 1}
            if blocks[-1]["type"] == "tool_use":
                blocks[-1]["input"] = json.loads(partial)
    final = events[-2]
    return {**message, **final["delta"], "content": blocks,
            "usage": {**message["usage"], **final["usage"]}}


def _without_ids(message: Dict[str, Any]) -> Dict[str, Any]:
    """A message with its ids blanked (every reply makes its own)."""
    return {**message, "id": "",
            "content": [{**b, "id": ""} if b["type"] == "tool_use" else b
                        for b in message["content"]]}


def _tool_uses(message: Dict[str, Any], names: List[str]) -> List[Tuple[str, Dict[str, Any]]]:
    """The message's tool_use blocks, each checked: its id, a given name, valid input."""
    uses = [b for b in message["content"] if b["type"] == "tool_use"]
    assert uses
    for b in uses:
        assert b["id"].startswith("toolu_") and b["name"] in names
        jsonschema.validate(b["input"], SCHEMAS[b["name"]])
    return [(b["name"], b["input"]) for b in uses]


# --- plain messages ----------------------------------------------------------------------------
def test_plain_message_and_system_prompt_as_chat(server: Server, model: str,
                                                 client: anthropic.Anthropic) -> None:
    """A plain message has Anthropic's shape, and a request is its chat request: the same text
    and token counts as /v1/chat/completions with the system prompt as a system message."""
    system = [{"type": "text", "text": "You are a geography teacher."},
              {"type": "text", "text": "Answer in one sentence."}]
    chat_messages = [{"role": "system",
                      "content": "You are a geography teacher.\nAnswer in one sentence."}, *PARIS]
    with ThreadPoolExecutor(3) as pool:
        plain = pool.submit(_message, server, model=model, max_tokens=24, temperature=0,
                            messages=PARIS)
        sys_msg = pool.submit(_message, server, model=model, max_tokens=24, temperature=0,
                              messages=PARIS, system=system)
        chat = pool.submit(_post, server, "/v1/chat/completions",
                           {"model": model, "max_tokens": 24, "temperature": 0,
                            "messages": chat_messages},
                           {"Authorization": f"Bearer {KEY}"})
        out, with_system, reference = plain.result(), sys_msg.result(), chat.result().json()
    assert out["id"].startswith("msg_") and out["type"] == "message"
    assert (out["role"], out["model"], out["stop_sequence"]) == ("assistant", model, None)
    assert out["stop_reason"] == "end_turn" and len(out["content"]) == 1
    assert out["content"][0]["type"] == "text" and "Paris" in out["content"][0]["text"]
    assert set(out["usage"]) == {"input_tokens", "output_tokens"}
    assert with_system["content"][0]["text"] == reference["choices"][0]["message"]["content"]
    assert with_system["usage"] == {"input_tokens": reference["usage"]["prompt_tokens"],
                                    "output_tokens": reference["usage"]["completion_tokens"]}
    # the official client reads it
    # (the client of today's API has no sampling arguments: vLLM's fields go in extra_body)
    sdk = client.messages.create(model=model, max_tokens=24, messages=PARIS,
                                 extra_body={"temperature": 0})
    assert sdk.content[0].text == out["content"][0]["text"]
    assert sdk.stop_reason == "end_turn" and sdk.usage.output_tokens == out["usage"][
        "output_tokens"]


def test_stop_sequences_and_max_tokens(server: Server, model: str) -> None:
    kw: Dict[str, Any] = dict(model=model, temperature=0, messages=PARIS)
    with ThreadPoolExecutor(2) as pool:
        stopped = pool.submit(_message, server, max_tokens=24, stop_sequences=["Paris", "zzz"],
                              **kw)
        cut = pool.submit(_message, server, max_tokens=3, **kw)
        stopped_out, cut_out = stopped.result(), cut.result()
    assert (stopped_out["stop_reason"], stopped_out["stop_sequence"]) == ("stop_sequence",
                                                                          "Paris")
    assert "Paris" not in stopped_out["content"][0]["text"]
    assert (cut_out["stop_reason"], cut_out["stop_sequence"]) == ("max_tokens", None)
    assert cut_out["usage"]["output_tokens"] == 3


def test_stream_folds_into_the_plain_message(server: Server, model: str,
                                             client: anthropic.Anthropic) -> None:
    """Greedy: the stream's events, folded (here and by the official client), are the plain
    message, stop reason and usage included."""
    kw: Dict[str, Any] = dict(model=model, max_tokens=24, temperature=0, messages=PARIS,
                              stop_sequences=["Paris"])
    with ThreadPoolExecutor(3) as pool:
        plain = pool.submit(_message, server, **kw)
        events = pool.submit(_events, server, **kw)

        def sdk_stream() -> Any:
            args = {k: v for k, v in kw.items() if k != "temperature"}
            with client.messages.stream(**args, extra_body={"temperature": 0}) as stream:
                return stream.get_final_message()
        sdk = pool.submit(sdk_stream)
        out, streamed, final = plain.result(), _fold(events.result()), sdk.result()
    assert _without_ids(streamed) == _without_ids(out)
    assert streamed["stop_reason"] == "stop_sequence"
    assert final.model_dump(exclude_none=True, exclude={"id"}) == {
        k: v for k, v in out.items() if k != "id" and v is not None}


# --- tools -------------------------------------------------------------------------------------
def test_tool_choice_any_and_tool_give_valid_tool_use(server: Server, model: str) -> None:
    """`any` (one call, disable_parallel_tool_use) and a named tool are enforced: tool_use
    blocks of a given tool whose input validates, the same streamed (greedy)."""
    kw: Dict[str, Any] = dict(model=model, max_tokens=80, temperature=0, messages=ASK,
                              tools=TOOLS)
    any_one = {**kw, "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}
    named = {**kw, "tool_choice": {"type": "tool", "name": "add"}}
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(_message, server, **any_one), pool.submit(_message, server, **named),
                   pool.submit(_events, server, **any_one), pool.submit(_events, server, **named)]
        any_out, named_out, any_events, named_events = [f.result() for f in futures]
    assert len(_tool_uses(any_out, list(SCHEMAS))) == 1
    assert [n for n, _ in _tool_uses(named_out, ["add"])] == ["add"]
    for out in (any_out, named_out):
        assert out["stop_reason"] in ("tool_use", "max_tokens")
    assert _without_ids(_fold(any_events)) == _without_ids(any_out)
    assert _without_ids(_fold(named_events)) == _without_ids(named_out)


def test_tool_use_and_tool_result_turns(server: Server, model: str) -> None:
    """A conversation with the assistant's tool_use and the user's tool_result is served as the
    chat request with its tool_calls and tool message: the same prompt tokens, the same text;
    count_tokens gives the same count. A final assistant message is continued (a prefill)."""
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
            "input": {"city": "Paris", "unit": "celsius"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1",
              "content": [{"type": "text", "text": "18 degrees, sunny"}]}
    messages = [ASK[0], {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                                          call]},
                {"role": "user", "content": [result, {"type": "text", "text": "Well?"}]}]
    chat_messages = [ASK[0],
                     {"role": "assistant", "content": "Let me look.", "tool_calls": [
                         {"id": "toolu_1", "type": "function", "function": {
                             "name": "get_weather",
                             "arguments": json.dumps(call["input"])}}]},
                     {"role": "tool", "tool_call_id": "toolu_1", "content": "18 degrees, sunny"},
                     {"role": "user", "content": "Well?"}]
    chat_tools = [{"type": "function", "function": {"name": t["name"],
                                                    "description": t["description"],
                                                    "parameters": t["input_schema"]}}
                  for t in TOOLS]
    kw: Dict[str, Any] = dict(model=model, messages=messages, tools=TOOLS)
    prefill = [*PARIS, {"role": "assistant", "content": "The capital of France is"}]
    with ThreadPoolExecutor(4) as pool:
        out = pool.submit(_message, server, max_tokens=16, temperature=0, **kw)
        count = pool.submit(_post, server, "/v1/messages/count_tokens", kw)
        chat = pool.submit(_post, server, "/v1/chat/completions",
                           {"model": model, "messages": chat_messages, "tools": chat_tools,
                            "max_tokens": 16, "temperature": 0},
                           {"Authorization": f"Bearer {KEY}"})
        continued = pool.submit(_message, server, model=model, max_tokens=8, temperature=0,
                                messages=prefill)
        out_msg, counted, reference = out.result(), count.result().json(), chat.result().json()
        continued_msg = continued.result()
    assert out_msg["usage"]["input_tokens"] == reference["usage"]["prompt_tokens"]
    assert counted == {"input_tokens": out_msg["usage"]["input_tokens"]}
    text = "".join(b.get("text", "") for b in out_msg["content"])
    assert text == (reference["choices"][0]["message"]["content"] or "")
    assert "Paris" in continued_msg["content"][0]["text"]


def test_count_tokens_equals_input_tokens(server: Server, model: str) -> None:
    kw: Dict[str, Any] = dict(model=model, system="Be brief.", messages=ASK, tools=TOOLS,
                              tool_choice={"type": "auto"})
    counted = _post(server, "/v1/messages/count_tokens", kw)
    assert counted.status_code == 200, counted.text
    out = _message(server, max_tokens=1, **kw)
    assert counted.json() == {"input_tokens": out["usage"]["input_tokens"]}


# --- errors and auth ---------------------------------------------------------------------------
@pytest.mark.parametrize("body, status, kind, names", [
    ({"messages": PARIS}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AA=="}}]}]},
     400, "invalid_request_error", "messages.0.content.0.type"),
    ({"max_tokens": 4, "messages": PARIS, "model": "claude-nope"}, 404, "not_found_error",
     "claude-nope"),
    ({"max_tokens": 4, "messages": PARIS, "tools": TOOLS, "tool_choice": {"type": "all"}},
     400, "invalid_request_error", "tool_choice.type"),
    ({"max_tokens": 4, "messages": PARIS, "tools": TOOLS,
      "tool_choice": {"type": "tool", "name": "nope"}}, 400, "invalid_request_error",
     "tool_choice"),
    ({"max_tokens": 4, "messages": PARIS, "thinking": {"type": "enabled",
                                                       "budget_tokens": 1024}},
     400, "invalid_request_error", "thinking"),
    ({"max_tokens": 4, "messages": PARIS, "frobnicate": 1}, 400, "invalid_request_error",
     "frobnicate"),
    ({"max_tokens": 4, "messages": PARIS, "tools": [{"name": "x", "input_schema": {
        "type": "string"}}]}, 400, "invalid_request_error", "tools.0.input_schema"),
])
def test_bad_requests_get_anthropic_errors(server: Server, model: str, body: Dict[str, Any],
                                           status: int, kind: str, names: str) -> None:
    r = _post(server, "/v1/messages", {"model": model, **body})
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == kind
    assert names in error["error"]["message"]


def test_client_sees_typed_errors(client: anthropic.Anthropic, model: str) -> None:
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-nope", max_tokens=4, messages=PARIS)
    with pytest.raises(anthropic.BadRequestError, match="image"):
        client.messages.create(model=model, max_tokens=4, messages=[{
            "role": "user", "content": [{"type": "image", "source": {
                "type": "url", "url": "https://example.com/a.png"}}]}])


def test_api_key_from_x_api_key_or_bearer(server: Server, model: str) -> None:
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        body = {"model": model, "messages": PARIS,
                **({"max_tokens": 1} if path == "/v1/messages" else {})}
        for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
            r = _post(server, path, body, headers)
            assert r.status_code == 401
            assert r.json()["error"]["type"] == "authentication_error"
        assert _post(server, path, body, {"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert _post(server, path, body, {"x-api-key": KEY}).status_code == 200
    # other endpoints keep OpenAI's Bearer token and error shape
    r = _post(server, "/v1/chat/completions", {"model": model, "max_tokens": 1, "messages": PARIS},
              {"x-api-key": KEY})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


# --- in process: the formatter and the error shapes ------------------------------------------
def _formatted(chunks: List[str], reasoning: str, **body: Any
               ) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
    """The plain message and the stream's events of one output given as `chunks` (text pieces,
    the last ending it by EOS), formatted in process."""
    from minisgl.server.anthropic_api import MessagesFormatter, MessagesRequest, messages_job

    request = MessagesRequest.model_validate({"model": "m", "max_tokens": 64,
                                              "messages": PARIS, **body})

    def formatter() -> MessagesFormatter:
        return MessagesFormatter("m", messages_job(request, 1), reasoning, "hermes")
    message, lines = plain_and_streamed(formatter, chunks_of(chunks))
    return message, [json.loads(line.split("\n")[1].removeprefix("data: ")) for line in lines]


def test_reasoning_is_a_thinking_block_and_calls_follow_text() -> None:
    """With a reasoning parser the thinking part is a thinking block; text, then a call, each a
    block of its own, streamed as the plain message has them."""
    chunks = ["<think>", "Paris, ", "surely.</think>", "Let me", " check.\n<tool_call>\n",
              '{"name": "get_weather", "arguments": ', '{"city": "Paris", ',
              '"unit": "celsius"}}\n</tool_call>', ""]
    message, events = _formatted(chunks, "qwen3", tools=TOOLS)
    assert [b["type"] for b in message["content"]] == ["thinking", "text", "tool_use"]
    assert message["content"][0]["thinking"] == "Paris, surely."
    assert message["content"][1]["text"].strip() == "Let me check."
    assert message["content"][2]["input"] == {"city": "Paris", "unit": "celsius"}
    assert message["stop_reason"] == "tool_use"
    assert message["usage"] == {"input_tokens": 7, "output_tokens": len(chunks)}
    assert _without_ids(_fold(events)) == _without_ids(message)


def test_error_shapes_by_path() -> None:
    """Anthropic's error types on the Messages API's paths (the server's 429 is its load:
    overloaded_error), OpenAI's bodies elsewhere; a failed stream ends with an error event."""
    from minisgl.server.admission import overloaded
    from minisgl.server.anthropic_api import MessagesFormatter, MessagesRequest
    from minisgl.server.error_shapes import error_body
    from minisgl.server.anthropic_api import messages_job
    from minisgl.server.limits import too_large
    from minisgl.server.protocol import ApiError

    cases = [(overloaded("full"), "overloaded_error"), (too_large(10), "request_too_large"),
             (ApiError(401, "no"), "authentication_error"), (ApiError(503, "down"), "api_error"),
             (ApiError(422, "bad"), "invalid_request_error")]
    for e, kind in cases:
        assert error_body(e, "/v1/messages") == {"type": "error", "error": {
            "type": kind, "message": e.message}}
        assert error_body(e, "/v1/chat/completions") == e.body()
    request = MessagesRequest.model_validate({"model": "m", "max_tokens": 4, "messages": PARIS})
    fmt = MessagesFormatter("m", messages_job(request, 1))
    assert list(fmt.error_events(ApiError(503, "down"))) == [
        'event: error\ndata: {"type": "error", "error": {"type": "api_error", '
        '"message": "down"}}\n\n']


def test_thinking_turns_the_templates_switch() -> None:
    """Anthropic's `thinking`: "enabled" (with a budget Anthropic would take) and "adaptive"
    turn the chat template's enable_thinking on, "disabled" off, absent leaves it alone (also
    for count_tokens, which has no max_tokens); a budget below 1,024 or not below max_tokens,
    or another type, is a 400 naming the field."""
    from minisgl.server.anthropic_api import (CountTokensRequest, MessagesRequest,
                                              count_tokens_prompt, messages_job)
    from minisgl.server.protocol import ApiError

    def kwargs(thinking: Any, max_tokens: int = 4096) -> Any:
        body = {"model": "m", "max_tokens": max_tokens, "messages": PARIS}
        if thinking is not None:
            body["thinking"] = thinking
        job = messages_job(MessagesRequest.model_validate(body), 1)
        return job.prompts[0].template.kwargs

    assert kwargs({"type": "enabled", "budget_tokens": 2048}) == {"enable_thinking": True}
    assert kwargs({"type": "adaptive"}) == {"enable_thinking": True}
    assert kwargs({"type": "disabled"}) == {"enable_thinking": False}
    assert kwargs(None) is None
    counted = count_tokens_prompt(CountTokensRequest.model_validate(
        {"model": "m", "messages": PARIS, "thinking": {"type": "enabled",
                                                       "budget_tokens": 9999}}))
    assert counted.template.kwargs == {"enable_thinking": True}
    for thinking, max_tokens, named in (
            ({"type": "enabled", "budget_tokens": 512}, 4096, "thinking.budget_tokens"),
            ({"type": "enabled"}, 4096, "thinking.budget_tokens"),
            ({"type": "enabled", "budget_tokens": 2048}, 2048, "thinking.budget_tokens"),
            ({"type": "on"}, 4096, "thinking.type"), ("yes", 4096, "thinking.type")):
        with pytest.raises(ApiError) as e:
            kwargs(thinking, max_tokens)
        assert e.value.status == 400 and e.value.param == named, thinking


def test_thinking_blocks_sent_back_reach_the_template_as_reasoning_content() -> None:
    """Claude Code sends an assistant turn's thinking blocks back in a tool loop: they become
    that turn's reasoning_content (the chat template keeps or drops them: Qwen3's keeps the
    loop's); redacted thinking (another model's, encrypted) is dropped; a thinking block
    without its text is a 400 naming it."""
    from minisgl.server.anthropic_api import MessagesRequest, messages_job
    from minisgl.server.protocol import ApiError
    think = {"type": "thinking", "thinking": "Need the weather.", "signature": "sig"}
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
            "input": {"city": "Paris"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}

    def chat(assistant: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        body = {"model": "m", "max_tokens": 8, "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": assistant},
            {"role": "user", "content": [result]}]}
        return messages_job(MessagesRequest.model_validate(body), 1).prompts[0].messages
    turn = chat([think, call])[1]
    assert turn["role"] == "assistant" and turn["reasoning_content"] == "Need the weather."
    assert turn["tool_calls"][0]["function"]["name"] == "get_weather"
    redacted = chat([{"type": "redacted_thinking", "data": "EuYBCkQ..."}, call])[1]
    assert "reasoning_content" not in redacted and redacted["tool_calls"]
    with pytest.raises(ApiError) as e:
        chat([{"type": "thinking", "signature": "sig"}, call])
    assert e.value.status == 400 and e.value.param == "messages.1.content.0.thinking"
