"""The `qwen3_coder` tool-call format without a model (server/tool_calls_xml.py): hand-written
Qwen3-Coder outputs parsed whole and streamed in pieces of every size (joined equal to the whole),
values converted to the schema's types, cut-off and malformed calls, `max_calls`; the parser
chosen for Qwen3-Coder's chat template; the grammar enforcing "required" / a named function in
this format; and chat responses (ChatFormatter) streamed and plain alike."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Tuple

import pytest

from minisgl.core import SamplingParams
from minisgl.server.protocol import ChatRequest, Job, Prompt, chat_job
from minisgl.server.tool_calls import FORMATS, Parsed, ToolCall, default_tool_call_parser
from minisgl.server.tool_calls_xml import (XmlToolCallStreamer, convert_value,
                                           parse_xml_tool_calls, tool_schemas)
from minisgl.server.tools import parse_tools
from tool_call_checks import (Streamed, call_id_ok, chat_plain, check_chats_alike_cut_off,
                              check_cut_offs, check_splits, stream_in_pieces)

QWEN = FORMATS["qwen3_coder"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]},
                                         "days": {"type": "integer"}},
        "required": ["city"]}}}
TYPED = {"type": "function", "function": {"name": "typed", "parameters": {
    "type": "object", "properties": {
        "i": {"type": "integer"}, "n": {"type": "number"}, "b": {"type": "boolean"},
        "o": {"type": "object"}, "a": {"type": "array", "items": {"type": "integer"}},
        "s": {"type": "string"}, "maybe": {"type": ["integer", "null"]},
        "ref": {"$ref": "#/$defs/Count"}, "any": {"anyOf": [{"type": "number"},
                                                             {"type": "string"}]}},
    "$defs": {"Count": {"type": "integer"}}}}}
NOW = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, TYPED, NOW]
SCHEMAS = tool_schemas(TOOLS)


def call(name: str, *params: Tuple[str, str]) -> str:
    """A call as Qwen3-Coder's chat template writes it."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


CODE = 'def f(x):\n    return "</function>" if x < 2 else "<parameter=y>"\n'
# (output, content, [(name, arguments)])
CASES: List[Tuple[str, Optional[str], List[Tuple[str, str]]]] = [
    (call("get_weather", ("city", "Paris")), None, [("get_weather", '{"city": "Paris"}')]),
    ("Let me check.\n\n" + call("get_weather", ("city", "Paris"), ("unit", "c")),
     "Let me check.\n\n", [("get_weather", '{"city": "Paris", "unit": "c"}')]),
    (call("get_weather", ("city", "Rome"), ("days", "3")) + "\n" + call("now") + "\n"
     + call("typed", ("s", CODE)),
     None, [("get_weather", '{"city": "Rome", "days": 3}'), ("now", "{}"),
            ("typed", json.dumps({"s": CODE}))]),
    # a bare <function=, a missing </tool_call>, no newlines around values, text after the calls
    ('<function=get_weather>\n<parameter=city>Oslo</parameter>\n</function>\nDone.', "Done.",
     [("get_weather", '{"city": "Oslo"}')]),
    # a parameter the schema does not have, a function not among the tools: strings
    (call("get_weather", ("city", "Oslo"), ("extra", "7")) + call("unknown", ("x", "1")), None,
     [("get_weather", '{"city": "Oslo", "extra": "7"}'), ("unknown", '{"x": "1"}')]),
    ("No tools needed: 4 < 5.", "No tools needed: 4 < 5.", []),
    ("a <tool_ca", "a <tool_ca", []),
    ("use <function=f(x)\n> here", "use <function=f(x)\n> here", []),
]
# cut off or malformed: before the name is read all of it is content; after it, the call with
# the parameters finished so far (unclosed), and the text from the fault on is content
MALFORMED: List[Tuple[str, Optional[str], List[Tuple[str, str]]]] = [
    ("hi <tool_call>\n{\"name\": \"now\"}\n</tool_call>",
     "hi <tool_call>\n{\"name\": \"now\"}\n</tool_call>", []),
    ("<tool_call>\n<function=get_wea", "<tool_call>\n<function=get_wea", []),
    ("<tool_call>\n<function=>\n</function>", "<tool_call>\n<function=>\n</function>", []),
    ("<tool_call>\n<function=now>\n", None, [("now", "")]),
    ("Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
     "<parameter=days>\n2", "Sure.\n", [("get_weather", '{"city": "Paris"')]),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\noops\n"
     "</function>\n</tool_call>", "oops\n</function>\n</tool_call>",
     [("get_weather", '{"city": "Paris"')]),
    ("<tool_call>\n<function=get_weather>\n<parameter=ci\nty>x</parameter></function>",
     "<parameter=ci\nty>x</parameter></function>", [("get_weather", "")]),
    ("<tool_call>\n<function=now>\n</tool_call> ok", "</tool_call> ok", [("now", "")]),
]


def _stream(text: str, step: int, max_calls: Optional[int] = None) -> Streamed:
    """The output fed `step` characters at a time (tool_call_checks.stream_in_pieces)."""
    return stream_in_pieces(XmlToolCallStreamer(SCHEMAS, max_calls), text, step, call_id_ok)


@pytest.mark.parametrize("text,content,calls", CASES + MALFORMED)
def test_every_split_gives_the_whole_outputs_calls_and_content(
        text: str, content: Optional[str], calls: List[Tuple[str, str]]) -> None:
    check_splits(parse_xml_tool_calls(text, SCHEMAS), _stream, text, content, calls,
                 range(1, len(text) + 1))


@pytest.mark.parametrize("text", [c[0] for c in CASES])
def test_whole_calls_have_arguments_that_parse_and_cut_offs_split_alike(text: str) -> None:
    """A finished call's arguments are a JSON object; the output cut off anywhere parses the
    same streamed (in pieces of 1 and 5) as whole."""
    check_cut_offs(lambda t: parse_xml_tool_calls(t, SCHEMAS), _stream, text, (1, 5))


def test_a_call_is_announced_when_its_name_ends_and_sends_a_parameter_at_a_time() -> None:
    text = call("get_weather", ("city", "Paris"), ("days", "2"))
    _, calls, deltas = _stream(text, 1)
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert [d["function"]["arguments"] for d in deltas[1:]] == ['{"city": "Paris"', ', "days": 2',
                                                                "}"]
    assert calls == [("get_weather", '{"city": "Paris", "days": 2}')]


def test_values_take_the_type_the_schema_declares() -> None:
    text = call("typed", ("i", "-12"), ("n", "2.5"), ("b", "True"), ("o", '{"k": [1]}'),
                ("a", "[1, 2]"), ("s", "42"), ("maybe", "None"), ("ref", "7"), ("any", "1e3"))
    args = json.loads(parse_xml_tool_calls(text, SCHEMAS).calls[0].arguments)
    assert args == {"i": -12, "n": 2.5, "b": True, "o": {"k": [1]}, "a": [1, 2], "s": "42",
                    "maybe": None, "ref": 7, "any": 1000.0}
    # what does not convert stays the text
    text = call("typed", ("i", "twelve"), ("n", "1e999"), ("b", "yes"), ("o", "[1]"),
                ("a", "{bad"), ("maybe", "null!"))
    args = json.loads(parse_xml_tool_calls(text, SCHEMAS).calls[0].arguments)
    assert args == {"i": "twelve", "n": "1e999", "b": "yes", "o": "[1]", "a": "{bad",
                    "maybe": "null!"}


def test_value_conversion_keeps_strings_as_written() -> None:
    root: Dict[str, Any] = {}
    assert convert_value("  two spaces\n", {"type": "string"}, root) == "  two spaces\n"
    assert convert_value("null", {"type": "string"}, root) == "null"
    assert convert_value(" c ", {"enum": ["c", "f"]}, root) == "c"
    assert convert_value(" AB\n", {"type": "string", "pattern": "^[A-Z]+$"}, root) == "AB"
    assert convert_value("7", {"$ref": "#/$defs/N"}, {"$defs": {"N": {"type": "integer"}}}) == 7
    assert convert_value("7", {"$ref": "#/$defs/Missing"}, root) == "7"
    assert convert_value("3", None, root) == "3"
    assert convert_value("3", {"enum": [1, 3]}, root) == 3
    # one newline at each end is the template's, the rest is the value's
    text = call("typed", ("s", "\nindented\n"))
    assert json.loads(parse_xml_tool_calls(text, SCHEMAS).calls[0].arguments) == \
        {"s": "\nindented\n"}


def test_max_calls_keeps_only_the_first_call() -> None:
    text = "Sure. " + call("now") + "\n" + call("get_weather", ("city", "Oslo"))
    assert parse_xml_tool_calls(text, SCHEMAS, max_calls=1) == Parsed("Sure. ",
                                                                      [ToolCall("now", "{}")])
    for step in (1, 4, len(text)):
        content, calls, deltas = _stream(text, step, max_calls=1)
        assert (content, calls) == ("Sure. ", [("now", "{}")])
        assert {d["index"] for d in deltas} == {0}


def test_a_call_never_announced_takes_no_index() -> None:
    text = "a <tool_call>\noops</tool_call> " + call("now")
    for max_calls in (None, 1):
        content, calls, deltas = _stream(text, 3, max_calls)
        assert (content, calls) == ("a <tool_call>\noops</tool_call> ", [("now", "{}")])
        assert {d["index"] for d in deltas} == {0}


QWEN3_CODER_TEMPLATE = (
    "{%- for tool_call in message.tool_calls %}"
    "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
    "{%- for args_name, args_value in tool_call.arguments|items %}"
    "{{- '<parameter=' + args_name + '>\\n' }}{{- args_value }}{{- '\\n</parameter>\\n' }}"
    "{%- endfor %}{{- '</function>\\n</tool_call>' }}{%- endfor %}")


def test_qwen3_coders_template_picks_qwen3_coder() -> None:
    assert default_tool_call_parser(QWEN3_CODER_TEMPLATE) == "qwen3_coder"
    assert default_tool_call_parser("{{ '<tool_call>' }}") == "hermes"
    assert default_tool_call_parser("{{ messages }}") == "hermes"


# --- enforcement -------------------------------------------------------------------------------
def _grammar(choice: Any, parallel: Optional[bool] = None) -> Any:
    xgr = pytest.importorskip("xgrammar")
    info = xgr.TokenizerInfo([chr(i) for i in range(32, 127)] + ["\n"])
    tools = parse_tools([WEATHER, NOW], choice, parallel)
    assert tools is not None
    structured = tools.constraint(QWEN)
    assert structured is not None and structured.kind == "structural_tag"
    return xgr, xgr.GrammarCompiler(info, max_threads=1).compile_structural_tag(structured.spec)


def test_required_calls_are_enforced_in_the_xml_format() -> None:
    xgr, grammar = _grammar("required")
    good = call("get_weather", ("city", "Rome"), ("unit", "c"), ("days", "2")) + "\n" + call("now")
    assert xgr.GrammarMatcher(grammar).accept_string(good)
    assert parse_xml_tool_calls(good, SCHEMAS).calls == [
        ToolCall("get_weather", '{"city": "Rome", "unit": "c", "days": 2}'), ToolCall("now", "{}")]
    for bad in ("Sure, " + call("now"), call("sub"), call("get_weather", ("unit", "c")),
                call("get_weather", ("city", "Rome"), ("unit", "k")),
                call("get_weather", ("city", "Rome"), ("days", "two")),
                call("now", ("x", "1"))):
        assert not xgr.GrammarMatcher(grammar).accept_string(bad), bad


def test_a_named_function_is_one_call_of_it() -> None:
    xgr, grammar = _grammar({"type": "function", "function": {"name": "now"}})
    matcher = xgr.GrammarMatcher(grammar)
    assert matcher.accept_string(call("now"))
    assert not matcher.accept_string("\n" + call("now"))
    assert not xgr.GrammarMatcher(grammar).accept_string(call("get_weather", ("city", "R")))


def test_chat_job_constrains_required_in_the_parsers_format() -> None:
    body = ChatRequest.model_validate({"messages": [{"role": "user", "content": "?"}],
                                       "tools": TOOLS, "tool_choice": "required"})
    job = chat_job(body, 1, "qwen3_coder")
    assert job.params.structured is not None
    form = json.loads(job.params.structured.spec)["format"]
    assert [t["begin"] for t in form["tags"]] == [
        f"<tool_call>\n<function={t['function']['name']}>\n" for t in TOOLS]
    assert {t["content"]["style"] for t in form["tags"]} == {"qwen_xml"}


# --- chat responses --------------------------------------------------------------------------
def _job(stream: bool) -> Job:
    return Job([Prompt(messages=[{"role": "user", "content": "?"}])], SamplingParams(), 1, (),
               True, stream, False, tools=parse_tools(TOOLS, "auto", None))


def test_chat_responses_streamed_and_plain_alike_whole_or_cut_off() -> None:
    text = "Checking.\n" + call("get_weather", ("city", "Paris"), ("days", "2")) + "\n" + \
        call("typed", ("b", "false"))
    whole = chat_plain(_job, "qwen3_coder", text, "stop", call_id_ok)
    assert whole == {"message": {"role": "assistant", "content": "Checking.\n", "tool_calls": [
        {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
        {"name": "typed", "arguments": '{"b": false}'}]}, "finish_reason": "tool_calls"}
    check_chats_alike_cut_off(_job, "qwen3_coder", text, call_id_ok)
