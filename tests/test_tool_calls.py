"""Tool calling without a model: the parsers (server/tool_calls.py) on hand-written outputs of
each format, streamed in pieces of every size and joined equal to the plain parse; the checks of
`tools` / `tool_choice` (server/tools.py) and the grammar they build; the chat response shapes
(server/responses.py ChatFormatter) and the messages the chat template gets."""

from __future__ import annotations

import json
from functools import partial
from typing import Any, Dict, List, Optional, Tuple

import pytest

from minisgl.core import SamplingParams
from minisgl.server.protocol import ApiError, ChatRequest, Job, Prompt, chat_job
from minisgl.server.responses import ChatFormatter
from minisgl.server.tool_calls import (FORMATS, Parsed, ToolCall, ToolCallStreamer,
                                       default_tool_call_parser, parse_tool_calls)
from minisgl.server.tools import Tools, parse_tools
from minisgl.tokenizer.chat_template import template_messages
from tool_call_checks import (Streamed, call_id_ok, check_splits, full_choice, joined_choice,
                              plain_choice, reply_chunks, stream_in_pieces, streamed_choices)

HERMES, LLAMA = FORMATS["hermes"], FORMATS["llama3_json"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}

# (format, output, content, [(name, arguments)])
CASES: List[Tuple[Any, str, Optional[str], List[Tuple[str, str]]]] = [
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     None, [("get_weather", '{"city": "Paris"}')]),
    (HERMES, 'Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": '
             '{"city": "Paris", "unit": "c"}}\n</tool_call>',
     "Let me look that up.\n", [("get_weather", '{"city": "Paris", "unit": "c"}')]),
    (HERMES, '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2, {"c": "}{"}]}}\n'
             '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
             '"Rome \\"x\\""}}\n</tool_call>\n',
     None, [("add", '{"a": 1, "b": [2, {"c": "}{"}]}'),
            ("get_weather", '{"city": "Rome \\"x\\""}')]),
    # the end tag may be missing when the output ends with the call; arguments may come first
    (HERMES, '<tool_call>{"arguments": {"a": -1.5e3}, "name": "add"}', None,
     [("add", '{"a": -1.5e3}')]),
    (HERMES, '<tool_call>\n{"name": "now"}\n</tool_call>', None, [("now", "{}")]),
    (HERMES, "No tools needed: 4.", "No tools needed: 4.", []),
    (HERMES, "a <tool_ca", "a <tool_ca", []),
    (LLAMA, '{"name": "get_weather", "parameters": {"city": "Oslo"}}', None,
     [("get_weather", '{"city": "Oslo"}')]),
    (LLAMA, 'Sure.<|python_tag|>{"name": "add", "parameters": {"a": 1}}; '
            '{"name": "get_weather", "arguments": {"city": "Oslo"}}', "Sure.",
     [("add", '{"a": 1}'), ("get_weather", '{"city": "Oslo"}')]),
    (LLAMA, 'A set {"x": 1} is not a call.', 'A set {"x": 1} is not a call.', []),
]
# malformed or cut-off calls: before the name is read, all of the text is content; after it, a
# call with its arguments as far as written (what a stream has sent by then), and the text from
# the fault on is content
MALFORMED: List[Tuple[Any, str, Optional[str], List[Tuple[str, str]]]] = [
    (HERMES, 'hi <tool_call>not json</tool_call>', 'hi <tool_call>not json</tool_call>', []),
    (HERMES, '<tool_call>\n{"name": "no', '<tool_call>\n{"name": "no', []),
    (LLAMA, '{"name": 7, "parameters": {}}', '{"name": 7, "parameters": {}}', []),
    (HERMES, '<tool_call>\n{"name": "now", "arguments": ', None, [("now", "")]),
    (HERMES, 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1', "Sure.\n",
     [("add", '{"a": 1')]),
    (HERMES, '<tool_call>\n{"name": "add", "arguments": {"a": 1}\n</tool_call>', "</tool_call>",
     [("add", '{"a": 1}')]),
    (HERMES, '<tool_call>\n{"name": "add", "arguments": [1]}\n</tool_call>', None,
     [("add", "[1]")]),
    (LLAMA, '{"name": "add", "parameters": {"a": tru}}', None, [("add", '{"a": tru}')]),
]


def _stream(fmt: Any, text: str, step: int, max_calls: Optional[int] = None) -> Streamed:
    """The output fed `step` characters at a time (tool_call_checks.stream_in_pieces)."""
    return stream_in_pieces(ToolCallStreamer(fmt, max_calls), text, step, call_id_ok)


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_parsers_split_content_and_calls_alike_streamed_or_not(fmt: Any, text: str,
                                                              content: Optional[str],
                                                              calls: List[Tuple[str, str]]) -> None:
    check_splits(parse_tool_calls(fmt, text), partial(_stream, fmt), text, content, calls,
                 (1, 2, 3, 7, len(text)))
    for call in calls:
        json.loads(call[1])


def test_arguments_stream_incrementally_after_the_name() -> None:
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 30}}\n</tool_call>'
    _, calls, deltas = _stream(HERMES, text, 4)
    assert deltas[0]["function"]["name"] == "add" and len(deltas) > 3
    assert calls == [("add", '{"a": 12, "b": 30}')]


@pytest.mark.parametrize("fmt,text,content,calls", MALFORMED)
def test_malformed_calls_split_alike_streamed_or_not(fmt: Any, text: str, content: Optional[str],
                                                     calls: List[Tuple[str, str]]) -> None:
    """Whether a call is one does not depend on where the text is split: a fault found in the
    same piece as the name still leaves a call (the old parse made it content when unsplit)."""
    check_splits(parse_tool_calls(fmt, text), partial(_stream, fmt), text, content, calls,
                 (1, 2, 3, 7, len(text)))


def test_a_call_never_announced_takes_no_index() -> None:
    """Streamed calls are numbered 0, 1, ... with no gap where a malformed call was content;
    with `max_calls` 1 that call does not use up the one call allowed."""
    text = 'a <tool_call>oops</tool_call> <tool_call>{"name": "b", "arguments": {}}</tool_call>'
    for max_calls in (None, 1):
        content, calls, deltas = _stream(HERMES, text, 4, max_calls)
        assert (content, calls) == ("a <tool_call>oops</tool_call> ", [("b", "{}")])
        assert {d["index"] for d in deltas} == {0}


def test_a_malformed_call_never_announced_streams_as_content() -> None:
    text = 'hi <tool_call>not json</tool_call> bye'
    assert _stream(HERMES, text, 2)[:2] == (text, [])


def test_max_calls_drops_the_calls_after_the_first() -> None:
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
            '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    assert parse_tool_calls(HERMES, text, max_calls=1) == Parsed(None, [ToolCall("a", "{}")])
    assert _stream(HERMES, text, 5, max_calls=1)[:2] == (None, [("a", "{}")])


def test_default_parser_from_the_chat_template() -> None:
    assert default_tool_call_parser("{{ '<tool_call>' }}") == "hermes"
    assert default_tool_call_parser('{{- "<|python_tag|>" }}') == "llama3_json"
    assert default_tool_call_parser("{% for m in messages %}{{ m.content }}{% endfor %}") \
        == "hermes"
    assert default_tool_call_parser(None) == "hermes"


# --- request checks ------------------------------------------------------------------------------
def _bad(tools: Any, choice: Any = None, parallel: Any = None) -> str:
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
    if choice is not None:
        body["tool_choice"] = choice
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    with pytest.raises(ApiError) as e:
        chat_job(ChatRequest.model_validate(body), 4)
    assert e.value.status == 400 and e.value.param is not None and e.value.param in e.value.message
    return e.value.param


@pytest.mark.parametrize("tools,choice,param", [
    ([WEATHER, {"type": "retrieval"}], None, "tools[1].type"),
    ([{"type": "function"}], None, "tools[0].function"),
    ([{"type": "function", "function": {"name": "has space"}}], None, "tools[0].function.name"),
    ([{"type": "function", "function": {"parameters": {}}}], None, "tools[0].function.name"),
    ([WEATHER, WEATHER], None, "tools[1].function.name"),
    ([WEATHER, {"type": "function", "function": {"name": "f", "parameters": "{}"}}], None,
     "tools[1].function.parameters"),
    ([WEATHER, {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}], None,
     "tools[1].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], None,
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(a"}}}}}],
     "required", "tools[0].function.parameters"),
    ({"a": WEATHER}, None, "tools"),
    ([WEATHER], "always", "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "add"}}, "tool_choice"),
    ([WEATHER], {"type": "function"}, "tool_choice"),
    ([], "required", "tool_choice"),
    ([WEATHER], None, "parallel_tool_calls"),
])
def test_bad_tools_are_refused_naming_the_field(tools: Any, choice: Any, param: str) -> None:
    parallel = "yes" if param == "parallel_tool_calls" else None
    assert _bad(tools, choice, parallel) == param


def test_bad_assistant_tool_calls_are_refused_naming_the_field() -> None:
    body = {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "tool_calls": [
                             {"id": "call_1", "type": "function",
                              "function": {"name": "add", "arguments": "{oops"}}]}]}
    with pytest.raises(ApiError) as e:
        chat_job(ChatRequest.model_validate(body), 4)
    assert e.value.param == "messages.1.tool_calls[0].function.arguments"


def test_chat_job_with_tools_renders_them_and_constrains_required() -> None:
    conversation = [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    body = ChatRequest.model_validate({"messages": conversation, "tools": [WEATHER, ADD],
                                       "tool_choice": "required"})
    job = chat_job(body, 4)
    prompt = job.prompts[0]
    assert json.loads(prompt.tools_json or "") == [WEATHER, ADD]
    assert prompt.messages[2] == {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}
    # the template gets the arguments as an object
    assert template_messages(prompt.messages)[1]["tool_calls"][0]["function"]["arguments"] == \
        {"city": "Paris"}
    assert job.tools is not None and job.tools.parsed
    structured = job.params.structured
    assert structured is not None and structured.kind == "structural_tag"
    form = json.loads(structured.spec)["format"]
    assert form["type"] == "tags_with_separator" and form["at_least_one"]
    assert [t["begin"] for t in form["tags"]] == [
        '<tool_call>\n{"name": "get_weather", "arguments": ',
        '<tool_call>\n{"name": "add", "arguments": ']
    # "auto" reads the output without constraining it; "none" neither
    auto = chat_job(body.model_copy(update={"tool_choice": None}), 4)
    assert auto.tools is not None and auto.tools.choice == "auto" and auto.params.structured is None
    none = chat_job(body.model_copy(update={"tool_choice": "none"}), 4)
    assert none.tools is not None and not none.tools.parsed and none.params.structured is None
    assert none.prompts[0].tools_json is not None  # the template still gets the tools


def test_a_named_function_is_one_call_in_the_parsers_format() -> None:
    tools = parse_tools([WEATHER, ADD], {"type": "function", "function": {"name": "add"}}, None)
    assert tools is not None and tools.max_calls == 1
    for fmt, begin in ((HERMES, '<tool_call>\n{"name": "add", "arguments": '),
                       (LLAMA, '{"name": "add", "parameters": ')):
        structured = tools.constraint(fmt)
        assert structured is not None
        form = json.loads(structured.spec)["format"]
        assert form["type"] == "tag" and form["begin"] == begin
        assert form["content"]["json_schema"] == ADD["function"]["parameters"]
    single = parse_tools([WEATHER, ADD], "required", False)
    assert single is not None
    form = json.loads((single.constraint(HERMES) or pytest.fail()).spec)["format"]
    assert form["stop_after_first"] and form["at_least_one"]


@pytest.mark.parametrize("fmt,good", [
    (HERMES, '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'),
    (LLAMA, '{"name": "add", "parameters": {"a": 1, "b": 2}}; '
            '{"name": "get_weather", "parameters": {"city": "Rome"}}'),
])
def test_tool_constraints_compile_and_admit_only_the_tools(fmt: Any, good: str) -> None:
    xgr = pytest.importorskip("xgrammar")
    # a tiny byte-level vocabulary is enough to compile and walk the grammar
    info = xgr.TokenizerInfo([chr(i) for i in range(32, 127)] + ["\n"])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    tools = parse_tools([WEATHER, ADD], "required", True)
    assert tools is not None
    grammar = compiler.compile_structural_tag((tools.constraint(fmt) or pytest.fail()).spec)
    matcher = xgr.GrammarMatcher(grammar)
    assert matcher.accept_string(good) and matcher.is_terminated() is False
    assert parse_tool_calls(fmt, good).calls == [ToolCall("add", '{"a": 1, "b": 2}'),
                                                 ToolCall("get_weather", '{"city": "Rome"}')]
    prefix = fmt.call_prefix
    for bad in (prefix("sub") + "{}", prefix("add") + '{"a": "one"}', "Sure, ",
                prefix("get_weather") + '{"unit": "k"}'):
        assert not xgr.GrammarMatcher(grammar).accept_string(bad), bad


# --- response shapes --------------------------------------------------------------------------
def _tool_job(stream: bool, choice: str = "auto", logprobs: Optional[int] = None) -> Job:
    tools = parse_tools([WEATHER, ADD], choice, None)
    return Job([Prompt(messages=[{"role": "user", "content": "?"}])],
               SamplingParams(logprobs=logprobs), 1, (), True, stream, False, tools=tools)


CALL_TEXT = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
             '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
             '</tool_call>')


def _full(text: str, reason: str = "stop", choice: str = "auto",
          parser: Optional[str] = None) -> Dict[str, Any]:
    return full_choice(ChatFormatter("m", _tool_job(False, choice), parser),
                       reply_chunks(text, 5, reason))


def _streamed(text: str, reason: str = "stop", choice: str = "auto",
              parser: Optional[str] = None, step: int = 3,
              logprobs: bool = False) -> List[Dict[str, Any]]:
    """The choice items of the stream's delta chunks (the role chunk aside)."""
    fmt = ChatFormatter("m", _tool_job(True, choice, 0 if logprobs else None), parser)
    return streamed_choices(fmt, reply_chunks(text, step, reason, logprobs))


def _joined(deltas: List[Dict[str, Any]], parser: Optional[str] = None) -> Dict[str, Any]:
    """A stream's deltas joined as a client does (with reasoning where there is a reasoning
    parser); in the plain response's shape (see `_plain`)."""
    return joined_choice(deltas, call_id_ok, reasoning=parser is not None)


def _plain(item: Dict[str, Any]) -> Dict[str, Any]:
    """A plain response's choice as `_joined` builds it: the calls' functions (ids differ)."""
    return plain_choice(item, call_id_ok)


def test_chat_response_with_tool_calls_streamed_and_not() -> None:
    item = _full(CALL_TEXT)
    assert item["finish_reason"] == "tool_calls"
    message = item["message"]
    assert message["content"] == "Checking.\n"
    calls = message["tool_calls"]
    assert [c["function"] for c in calls] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"name": "add", "arguments": '{"a": 1, "b": 2}'}]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2

    deltas = _streamed(CALL_TEXT)
    assert deltas[-1]["finish_reason"] == "tool_calls"
    assert all(d["finish_reason"] is None for d in deltas[:-1])
    assert _joined(deltas) == _plain(item)


def test_chat_response_without_a_call_or_cut_off_before_its_name_is_content() -> None:
    assert _full("It is sunny.")["message"] == {"role": "assistant", "content": "It is sunny."}
    assert _full("It is sunny.")["finish_reason"] == "stop"
    cut = '<tool_call>\n{"name": "ad'
    item = _full(cut, reason="length")
    assert item["message"] == {"role": "assistant", "content": cut}
    assert item["finish_reason"] == "length"


@pytest.mark.parametrize("choice", ["auto", "required"])
@pytest.mark.parametrize("parser", [None, "qwen3"])
def test_streamed_deltas_join_into_the_plain_response_whole_or_cut_off(
        choice: str, parser: Optional[str]) -> None:
    """The audit's case: cut off by max_tokens after a call's name, the plain response has
    that call (as the stream sent it, arguments so far) and finish_reason "length", not the
    raw text as content. And for the whole output and for it cut off after every character,
    the stream joins into the plain response, however it is split into tokens."""
    cut = '<tool_call>\n{"name": "now", "arguments": '
    want = {"message": {"role": "assistant", "content": None,
                        "tool_calls": [{"name": "now", "arguments": ""}]},
            "finish_reason": "length"}
    assert _plain(_full(cut, "length", choice)) == want
    assert _joined(_streamed(cut, "length", choice)) == want
    text = ("<think>\nNeed the weather.\n</think>\n\n" if parser else "") + CALL_TEXT
    for end in range(1, len(text) + 1):
        reason = "stop" if end == len(text) else "length"
        plain = _plain(_full(text[:end], reason, choice, parser))
        for step in (1, 4):
            deltas = _streamed(text[:end], reason, choice, parser, step)
            assert _joined(deltas, parser) == plain, (end, step)
    assert plain["finish_reason"] == "tool_calls" and len(plain["message"]["tool_calls"]) == 2


@pytest.mark.parametrize("parser", [None, "qwen3"])
def test_held_back_text_sends_no_empty_chunk(parser: Optional[str]) -> None:
    """Text the tool-call or reasoning parser holds back (a call's markup, `<think>`) sends no
    chunk of its own, as in vLLM: every chunk has a delta or the finish reason, and the stream
    still joins into the plain response. With logprobs asked, each token's chunk is sent (the
    logprobs of held-back text ride on an empty delta)."""
    text = ("<think>\nNeed the weather.\n</think>\n\n" if parser else "") + CALL_TEXT
    plain = _plain(_full(text, parser=parser))
    for step in (1, 3):
        deltas = _streamed(text, parser=parser, step=step)
        assert all(d["delta"] or d["finish_reason"] is not None for d in deltas)
        assert len(deltas) < len(text) / step / 2  # most of the text is markup, held back
        assert _joined(deltas, parser) == plain
        with_logprobs = _streamed(text, parser=parser, step=step, logprobs=True)
        assert len(with_logprobs) == len(reply_chunks(text, step))
        assert ["".join(t["token"] for t in d["logprobs"]["content"]) for d in with_logprobs] \
            == [c.text for c in reply_chunks(text, step)]
        assert _joined(with_logprobs, parser) == plain


def test_tool_choice_none_leaves_the_output_alone() -> None:
    item = _full(CALL_TEXT, choice="none")
    assert item["message"] == {"role": "assistant", "content": CALL_TEXT}
    assert item["finish_reason"] == "stop"


def test_tools_type() -> None:
    tools = parse_tools([WEATHER], None, None)
    assert isinstance(tools, Tools) and tools.choice == "auto" and tools.parallel
    assert parse_tools(None, None, None) is None
    assert parse_tools([], "none", None) is None


# --- the chat template gets the tools -------------------------------------------------------------
TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}|{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments.city }}"
    "{% endfor %}{% if m.tool_call_id %} [{{ m.tool_call_id }}]{% endif %}|{% endfor %}")


def test_the_tokenizer_renders_tools_and_tool_messages(default_model_dir: Any) -> None:
    from minisgl.core import Limits
    from minisgl.message.types import TextRequest
    from minisgl.tokenizer.text import load_tokenizer
    from minisgl.tokenizer.tokenize_worker import Tokenizer
    tok = load_tokenizer(default_model_dir, TOOL_TEMPLATE)
    logic = Tokenizer(tok, Limits(max_context=1000, vocab_size=len(tok), num_pages=64,
                                  page_size=16, max_prefill_tokens=1000))
    body = ChatRequest.model_validate({"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_9", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "cold"}],
        "tools": [WEATHER, ADD], "add_generation_prompt": False})
    prompt = chat_job(body, 1).prompts[0]
    reply = logic.answer(TextRequest(1, messages=prompt.messages, tools_json=prompt.tools_json,
                                     add_generation_prompt=False))
    assert reply.error is None
    assert tok.decode(reply.token_ids) == ("TOOLS: get_weather add|user: weather?|"
                                           "assistant: CALL get_weather Oslo|"
                                           "tool: cold [call_9]|")


def test_enforced_calls_cannot_be_combined_with_another_output_format() -> None:
    body = ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                       "tools": [WEATHER], "tool_choice": "required",
                                       "response_format": {"type": "json_object"}})
    with pytest.raises(ApiError) as e:
        chat_job(body, 4)
    assert e.value.param == "tool_choice" and "response_format" in e.value.message
    auto = chat_job(body.model_copy(update={"tool_choice": "auto"}), 4)
    assert auto.params.structured is not None and auto.params.structured.kind == "json_object"


def test_the_models_own_template_is_read_without_the_tokenizer(tmp_path: Any) -> None:
    from minisgl.tokenizer.text import model_chat_template
    assert model_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "{{ '<|python_tag|>' }}"},
        {"name": "default", "template": "{{ messages }}"}]}))
    assert default_tool_call_parser(model_chat_template(tmp_path)) == "llama3_json"
    (tmp_path / "chat_template.jinja").write_text("{{ '<tool_call>' }}")
    assert default_tool_call_parser(model_chat_template(tmp_path)) == "hermes"


def test_tool_calls_after_the_thinking_of_a_reasoning_model() -> None:
    text = "<think>\nNeed the weather.\n</think>\n\n" + CALL_TEXT
    item = full_choice(ChatFormatter("m", _tool_job(False), "qwen3"), reply_chunks(text, 4))
    assert item["message"]["reasoning_content"] == "\nNeed the weather.\n"
    assert item["message"]["content"] == "\n\nChecking.\n"
    assert [t["function"]["name"] for t in item["message"]["tool_calls"]] == ["get_weather",
                                                                              "add"]
    deltas = streamed_choices(ChatFormatter("m", _tool_job(True), "qwen3"), reply_chunks(text, 3))
    assert "".join(d["delta"].get("reasoning_content", "") for d in deltas) == \
        "\nNeed the weather.\n"
    assert "".join(d["delta"].get("content", "") for d in deltas) == "\n\nChecking.\n"
    assert deltas[-1]["finish_reason"] == "tool_calls"
