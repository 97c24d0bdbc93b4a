"""Tool calling through the service and the official `openai` client (CPU, default model):
tool_choice "required" and a named function give calls that parse, name a given tool and whose
arguments validate against its schema, streamed deltas join into the same calls (a call cut off
by max_tokens too), "auto" answers in either shape, and bad tools are 400s naming the field
while the service goes on."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, Iterator, List, Tuple

import httpx
import jsonschema
import openai
import pytest

from server_helpers import Server, api_server, openai_client

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object",
                   "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 1000},
                                  "b": {"type": "integer", "minimum": 0, "maximum": 1000}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris? Also add 2 and 3."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from api_server(tmp_path_factory.mktemp("tools"))


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai_client(server)


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _check_calls(calls: List[Tuple[str, str]], names: List[str]) -> None:
    assert calls
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def _streamed(client: openai.OpenAI, **kw: Any) -> Tuple[str, List[Tuple[str, str]], str]:
    """The content, the calls the deltas join into, and the finish reason of a stream."""
    content, calls, reason = [], {}, ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            for tc in choice.delta.tool_calls or []:
                if tc.index not in calls:  # the first delta of a call: id and name
                    assert tc.id and tc.id.startswith("call_") and tc.function.name
                    calls[tc.index] = [tc.function.name, ""]
                else:
                    assert tc.id is None and not tc.function.name
                calls[tc.index][1] += tc.function.arguments or ""
            reason = choice.finish_reason or reason
    return "".join(content), [tuple(calls[i]) for i in sorted(calls)], reason


def _calls(out: Any) -> List[Tuple[str, str]]:
    for c in out.message.tool_calls or []:
        assert c.id.startswith("call_") and c.type == "function"
    return [(c.function.name, c.function.arguments) for c in out.message.tool_calls or []]


def test_required_calls_parse_and_validate_streamed_alike(client: openai.OpenAI) -> None:
    """The three requests run at once (one batch: a third of the time on two cores)."""
    kw: Dict[str, Any] = dict(model=_model(client), messages=ASK, tools=TOOLS,
                              tool_choice="required", temperature=0, max_tokens=160)
    one_call = {**kw, "parallel_tool_calls": False, "temperature": 0.8, "seed": 5}
    with ThreadPoolExecutor(3) as pool:
        plain = pool.submit(lambda: client.chat.completions.create(**kw).choices[0])
        stream = pool.submit(lambda: _streamed(client, **kw))
        single = pool.submit(lambda: client.chat.completions.create(**one_call).choices[0])
        out, (content, streamed, reason), one = plain.result(), stream.result(), single.result()
    assert out.finish_reason == "tool_calls"
    calls = _calls(out)
    _check_calls(calls, list(SCHEMAS))
    assert (streamed, reason) == (calls, "tool_calls")
    assert (content or None) == out.message.content
    assert one.finish_reason == "tool_calls" and len(_calls(one)) == 1
    _check_calls(_calls(one), list(SCHEMAS))


def test_a_call_cut_off_by_max_tokens_is_the_same_streamed_or_not(client: openai.OpenAI) -> None:
    """The audit's case: "required" with max_tokens too small for the call. Both modes give the
    call as far as written (its name, the arguments so far) and finish_reason "length"; the
    stream used to send the call while the plain response gave the raw text as content."""
    kw: Dict[str, Any] = dict(model=_model(client), messages=ASK, tools=TOOLS,
                              tool_choice="required", temperature=0, max_tokens=20)
    with ThreadPoolExecutor(2) as pool:
        stream = pool.submit(lambda: _streamed(client, **kw))
        out = client.chat.completions.create(**kw).choices[0]
        content, streamed, reason = stream.result()
    assert out.finish_reason == reason == "length"
    assert streamed == _calls(out) and len(streamed) == 1 and streamed[0][0] in SCHEMAS
    assert (content or None) == out.message.content is None


def test_named_function_is_called_with_valid_arguments(client: openai.OpenAI) -> None:
    kw: Dict[str, Any] = dict(model=_model(client), messages=ASK, tools=TOOLS,
                              tool_choice={"type": "function",
                                           "function": {"name": "get_weather"}},
                              temperature=0.8, seed=1, max_tokens=80)
    with ThreadPoolExecutor(2) as pool:
        stream = pool.submit(lambda: _streamed(client, **kw))
        out = client.chat.completions.create(**kw).choices[0]
        streamed = stream.result()
    calls = _calls(out)
    # OpenAI (and vLLM) end a named function's call with "stop", "required"'s with "tool_calls"
    assert len(calls) == 1 and out.finish_reason == "stop"
    _check_calls(calls, ["get_weather"])
    assert streamed[1:] == (calls, "stop")


def test_auto_answers_with_content_or_calls(client: openai.OpenAI) -> None:
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather",
                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    for msgs in (ASK, messages):
        out = client.chat.completions.create(model=_model(client), messages=msgs, tools=TOOLS,
                                             temperature=0, max_tokens=24).choices[0]
        if out.message.tool_calls:
            assert out.finish_reason in ("tool_calls", "length")
            for c in out.message.tool_calls:  # a call cut off ("length") has part of them
                assert c.id.startswith("call_")
                if out.finish_reason == "tool_calls":
                    assert isinstance(json.loads(c.function.arguments), dict)
        else:
            assert out.message.content and out.finish_reason in ("stop", "length")


@pytest.mark.parametrize("fields,param", [
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     "tools[1].function.parameters"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "sub"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_bad_tools_get_400_naming_the_field(server: Server, fields: Dict[str, Any],
                                           param: str) -> None:
    body = {"messages": ASK, "max_tokens": 4, **fields}
    r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"]


def test_tools_on_completions_are_refused_and_the_service_goes_on(server: Server,
                                                                 client: openai.OpenAI) -> None:
    r = httpx.post(f"{server.base_url}/completions",
                   json={"prompt": "hi", "tools": TOOLS, "max_tokens": 2}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    out = client.chat.completions.create(model=_model(client), messages=ASK, max_tokens=4,
                                         temperature=0)
    assert out.choices[0].message.content
