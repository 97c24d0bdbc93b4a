"""The `mistral` tool-call format without a model (server/tool_calls_array.py): hand-written
Mistral outputs, with the `[TOOL_CALLS]` marker and without it (a detokenizer that skips special
tokens drops it), parsed whole and streamed in pieces of every size (joined equal to the whole);
the v11 form; cut-off and malformed calls; `max_calls`; content with brackets passed through;
9-character call ids; the parser chosen for Mistral's chat templates; the grammar enforcing
"required" / a named function in this format; the chat job keeping special tokens; and chat
responses (ChatFormatter) streamed and plain alike."""

from __future__ import annotations

import json
import re
from typing import Any, List, Optional, Tuple

import pytest

from minisgl.core import SamplingParams
from minisgl.server.protocol import ChatRequest, Job, Prompt, chat_job
from minisgl.server.tool_calls import FORMATS, TOOL_CALL_PARSERS, default_tool_call_parser
from minisgl.server.tool_calls_array import ArrayToolCallStreamer, parse_array_tool_calls
from minisgl.server.tools import parse_tools
from tool_call_checks import (Streamed, chat_plain, check_chats_alike_cut_off, check_cut_offs,
                              check_splits, stream_in_pieces)

MISTRAL = FORMATS["mistral"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"},
                                         "unit": {"enum": ["c", "f"]}},
        "required": ["city"], "additionalProperties": False}}}
NOW = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, NOW]
_ID = re.compile(r"[A-Za-z0-9]{9}")

PARIS = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
NESTED = '{"name": "now", "arguments": {"q": "a ] } [ {", "l": [1, {"x": []}]}}'
# (output, content, [(name, arguments)])
CASES: List[Tuple[str, Optional[str], List[Tuple[str, str]]]] = [
    (f"[TOOL_CALLS] [{PARIS}]", None, [("get_weather", '{"city": "Paris", "unit": "c"}')]),
    (f"[TOOL_CALLS][{PARIS}, {NESTED}]", None,
     [("get_weather", '{"city": "Paris", "unit": "c"}'),
      ("now", '{"q": "a ] } [ {", "l": [1, {"x": []}]}')]),
    # no marker (skipped as a special token): a bare array at the start is the calls
    (f"[{PARIS}]", None, [("get_weather", '{"city": "Paris", "unit": "c"}')]),
    (f' \n[ {PARIS},{{"name": "now"}} ]', None,
     [("get_weather", '{"city": "Paris", "unit": "c"}'), ("now", "{}")]),
    # content before the marker; text after the array; an "id" key (as the templates write)
    ('Let me check.\n[TOOL_CALLS] [{"name": "now", "arguments": {}, "id": "a1b2c3d4e"}]'
     " Done.", "Let me check.\n Done.", [("now", "{}")]),
    # the v11 form: one marker per call, [ARGS] (and [CALL_ID]) written out
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]now[CALL_ID]ab12CD34e[ARGS]{}',
     None, [("get_weather", '{"city": "Oslo"}'), ("now", "{}")]),
    ('Sure.[TOOL_CALLS]now{"a": "}"}', "Sure.", [("now", '{"a": "}"}')]),
    # content that merely holds brackets
    ("See [the docs](http://x.y/[1]) or [this]; [x, y] = [1, 2].",
     "See [the docs](http://x.y/[1]) or [this]; [x, y] = [1, 2].", []),
    ("- [ ] todo\n- [x] done", "- [ ] todo\n- [x] done", []),
    ('[{"a": 1}, {"b": 2}]', '[{"a": 1}, {"b": 2}]', []),
    ('Data: [{"name": "x"}]', 'Data: [{"name": "x"}]', []),
    ("[TOOL", "[TOOL", []),
    ("a [TOOL_CALL", "a [TOOL_CALL", []),
]
# cut off or malformed: before a name is read all of it is content, marker and all; after it,
# the call with the arguments written so far, and the text from the fault on is content
MALFORMED: List[Tuple[str, Optional[str], List[Tuple[str, str]]]] = [
    ("[TOOL_CALLS] [", "[TOOL_CALLS] [", []),
    ('[TOOL_CALLS] [{"name": "get_wea', '[TOOL_CALLS] [{"name": "get_wea', []),
    ('[{"name": 5, "arguments": {}}]', '[{"name": 5, "arguments": {}}]', []),
    ('[TOOL_CALLS] [{"name": "now", "arguments": {"x": [1', None, [("now", '{"x": [1')]),
    (f'Hm. [TOOL_CALLS] [{PARIS}, {{"name": "now", "argu', "Hm. ",
     [("get_weather", '{"city": "Paris", "unit": "c"}'), ("now", "")]),
    (f"[TOOL_CALLS] [{PARIS}, ", None, [("get_weather", '{"city": "Paris", "unit": "c"}')]),
    (f"[TOOL_CALLS] [{PARIS} and more", " and more",
     [("get_weather", '{"city": "Paris", "unit": "c"}')]),
    (f'[TOOL_CALLS] [{PARIS}, {{"city": 1}}]', ', {"city": 1}]',
     [("get_weather", '{"city": "Paris", "unit": "c"}')]),
    ('[TOOL_CALLS] [{"name": "now", "arguments": {}, oops}]', "oops}]", [("now", "{}")]),
    ("[TOOL_CALLS] [1, 2]", "[TOOL_CALLS] [1, 2]", []),
    ("[TOOL_CALLS] Sure, here", "[TOOL_CALLS] Sure, here", []),
    ("[TOOL_CALLS]get_weather[ARG", "[TOOL_CALLS]get_weather[ARG", []),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Pa', None, [("get_weather", '{"city": "Pa')]),
]


def _stream(text: str, step: int, max_calls: Optional[int] = None) -> Streamed:
    """The output fed `step` characters at a time (tool_call_checks.stream_in_pieces)."""
    return stream_in_pieces(ArrayToolCallStreamer(max_calls), text, step, _ID.fullmatch)


@pytest.mark.parametrize("text,content,calls", CASES + MALFORMED)
def test_every_split_gives_the_whole_outputs_calls_and_content(
        text: str, content: Optional[str], calls: List[Tuple[str, str]]) -> None:
    check_splits(parse_array_tool_calls(text), _stream, text, content, calls,
                 range(1, len(text) + 1))


@pytest.mark.parametrize("text", [c[0] for c in CASES])
def test_cut_offs_anywhere_split_alike(text: str) -> None:
    """The output cut off anywhere parses the same streamed (in pieces of 1 and 4) as whole;
    a finished call's arguments parse."""
    check_cut_offs(parse_array_tool_calls, _stream, text, (1, 4))


def test_a_call_is_announced_when_its_name_is_read() -> None:
    streamer = ArrayToolCallStreamer()
    assert streamer.feed('[TOOL_CALLS] [{"name": "no').calls == []
    piece = streamer.feed('w", ')
    assert [(d.index, d.name, d.arguments) for d in piece.calls] == [(0, "now", "")]
    assert streamer.any_call
    piece = streamer.feed('"arguments": {"a": 1')
    assert [(d.id, d.arguments) for d in piece.calls] == [(None, '{"a": 1')]


def test_content_with_brackets_is_not_held_back() -> None:
    streamer = ArrayToolCallStreamer()
    assert streamer.feed("Steps: [1] open").content == "Steps: [1] open"
    assert streamer.feed(" [").content == " "  # "[" may open [TOOL_CALLS]
    assert streamer.feed("2] go").content == "[2] go"
    start = ArrayToolCallStreamer()
    assert start.feed("[").content == ""  # may open a bare array of calls
    assert start.feed("[x]").content == "[[x]"


@pytest.mark.parametrize("text", [
    f"[TOOL_CALLS] [{PARIS}, {NESTED}, {PARIS}]",
    '[TOOL_CALLS]now[ARGS]{}[TOOL_CALLS]get_weather[ARGS]{"city": "R"}[TOOL_CALLS]now[ARGS]{}'])
def test_max_calls_keeps_only_the_first_call(text: str) -> None:
    whole = parse_array_tool_calls(text, max_calls=1)
    assert len(whole.calls) == 1 and whole.content is None
    assert whole.calls[0] == parse_array_tool_calls(text).calls[0]
    for step in (1, 3, len(text)):
        assert _stream(text, step, 1)[:2] == (None, [tuple(whole.calls[0])])


def test_call_ids_are_nine_letters_and_digits() -> None:
    assert _ID.fullmatch(MISTRAL.new_id())
    assert FORMATS["hermes"].new_id().startswith("call_")


# --- the chat template -----------------------------------------------------------------------
# Mistral-7B-Instruct-v0.3's chat template, in part (its tools and its calls)
MISTRAL_TEMPLATE = (
    '{%- for message in loop_messages %}{%- if message["role"] == "user" %}'
    '{%- if tools is not none and (message == user_messages[-1]) %}'
    '{{- "[AVAILABLE_TOOLS] [" }}{%- for tool in tools %}{%- set tool = tool.function %}'
    '{{- \'{"type": "function", "function": {\' }}{%- endfor %}{{- "[/AVAILABLE_TOOLS]" }}'
    '{%- endif %}{{- "[INST] " + message["content"] + "[/INST]" }}'
    '{%- elif message.tool_calls is defined and message.tool_calls is not none %}'
    '{{- "[TOOL_CALLS] [" }}{%- for tool_call in message.tool_calls %}'
    '{%- set out = tool_call.function|tojson %}{{- out[:-1] }}'
    '{%- if not tool_call.id is defined or tool_call.id|length != 9 %}'
    '{{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}'
    '{%- endif %}{{- \', "id": "\' + tool_call.id + \'"}\' }}{%- endfor %}{%- endif %}'
    '{%- endfor %}')


def test_mistrals_template_picks_mistral_and_the_others_keep_theirs() -> None:
    assert "mistral" in TOOL_CALL_PARSERS
    assert default_tool_call_parser(MISTRAL_TEMPLATE) == "mistral"
    assert default_tool_call_parser(MISTRAL_TEMPLATE.replace("parameters", "")) == "mistral"
    assert default_tool_call_parser("{{ '<tool_call>' }}") == "hermes"
    assert default_tool_call_parser("{{ '<|python_tag|>' }}") == "llama3_json"
    assert default_tool_call_parser("{{ '<function=' }}{{ '<parameter=' }}") == "qwen3_coder"
    assert default_tool_call_parser("{{ messages }}") == "hermes"


# --- enforcement -------------------------------------------------------------------------------
def _grammar(choice: Any, parallel: Optional[bool] = None) -> Tuple[Any, Any, int]:
    """xgrammar, the compiled grammar of `choice` in this format over a vocabulary of single
    characters, `[TOOL_CALLS]` (one token, as in Mistral's vocabularies) and an EOS, and the
    EOS's id."""
    xgr = pytest.importorskip("xgrammar")
    vocab = [chr(i) for i in range(32, 127)] + ["\n", "[TOOL_CALLS]", "</s>"]
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1])
    tools = parse_tools(TOOLS, choice, parallel)
    assert tools is not None
    structured = tools.constraint(MISTRAL)
    assert structured is not None and structured.kind == "structural_tag"
    grammar = xgr.GrammarCompiler(info, max_threads=1).compile_structural_tag(structured.spec)
    return xgr, grammar, len(vocab) - 1


def _accepts(xgr: Any, grammar: Any, eos: int, text: str) -> bool:
    """Whether the grammar takes the whole of `text` and may end there."""
    matcher = xgr.GrammarMatcher(grammar)
    return bool(matcher.accept_string(text) and matcher.accept_token(eos))


def test_required_calls_are_enforced_as_the_template_writes_them() -> None:
    xgr, grammar, eos = _grammar("required")
    good = [f"[TOOL_CALLS] [{PARIS}]",
            f'[TOOL_CALLS][{PARIS}, {{"name": "now", "arguments": {{}}}}]',
            '[TOOL_CALLS] [{"name": "now", "arguments": {}}, {"name": "now", "arguments": {}}]']
    for text in good:
        assert _accepts(xgr, grammar, eos, text), text
        parsed = parse_array_tool_calls(text)
        assert parsed.calls and parsed.content is None
    for bad in ("Sure. " + good[0], f"[{PARIS}]", "[TOOL_CALLS] []",
                '[TOOL_CALLS] [{"name": "sub", "arguments": {}}]',
                '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"unit": "c"}}]',
                '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "R", "unit": "k"}}]',
                '[TOOL_CALLS] [{"name": "now", "arguments": {"x": 1}}]',
                f"[TOOL_CALLS] [{PARIS}", f"[TOOL_CALLS] [{PARIS}] more"):
        assert not _accepts(xgr, grammar, eos, bad), bad


def test_the_marker_token_itself_opens_the_calls() -> None:
    xgr, grammar, eos = _grammar("required")
    matcher = xgr.GrammarMatcher(grammar)
    assert matcher.accept_token(96)  # the vocabulary's [TOOL_CALLS]
    assert matcher.accept_string(f" [{PARIS}]") and matcher.accept_token(eos)


def test_a_named_function_or_no_parallel_calls_is_one_call() -> None:
    xgr, grammar, eos = _grammar({"type": "function", "function": {"name": "now"}})
    assert _accepts(xgr, grammar, eos, '[TOOL_CALLS] [{"name": "now", "arguments": {}}]')
    assert not _accepts(xgr, grammar, eos, f"[TOOL_CALLS] [{PARIS}]")
    assert not _accepts(xgr, grammar, eos, '[TOOL_CALLS] [{"name": "now", "arguments": {}}, '
                                           '{"name": "now", "arguments": {}}]')
    xgr, grammar, eos = _grammar("required", parallel=False)
    assert _accepts(xgr, grammar, eos, f"[TOOL_CALLS] [{PARIS}]")
    assert not _accepts(xgr, grammar, eos, f"[TOOL_CALLS] [{PARIS}, {PARIS}]")


def _chat(parser: str, **extra: Any) -> Job:
    body = ChatRequest.model_validate({"messages": [{"role": "user", "content": "?"}],
                                       "tools": TOOLS, **extra})
    return chat_job(body, 1, parser)


def test_chat_job_keeps_special_tokens_for_mistral_unless_asked() -> None:
    assert _chat("mistral").skip_special_tokens is False
    assert _chat("mistral", tool_choice="none").skip_special_tokens is True
    assert _chat("mistral", skip_special_tokens=True).skip_special_tokens is True
    assert _chat("hermes").skip_special_tokens is True
    job = _chat("mistral", tool_choice="required")
    assert job.params.structured is not None and job.skip_special_tokens is False
    form = json.loads(job.params.structured.spec)["format"]
    assert form["type"] == "sequence"
    assert [t["begin"] for t in form["elements"][1]["tags"]] == [
        f'{{"name": "{t["function"]["name"]}", "arguments": ' for t in TOOLS]


# --- chat responses --------------------------------------------------------------------------
def _job(stream: bool) -> Job:
    return Job([Prompt(messages=[{"role": "user", "content": "?"}])], SamplingParams(), 1, (),
               False, stream, False, tools=parse_tools(TOOLS, "auto", None))


@pytest.mark.parametrize("marker", ["[TOOL_CALLS] ", ""])
def test_chat_responses_streamed_and_plain_alike_whole_or_cut_off(marker: str) -> None:
    text = f'{marker}[{PARIS}, {{"name": "now", "arguments": {{}}}}]'
    whole = chat_plain(_job, "mistral", text, "stop", _ID.fullmatch)
    assert whole == {"message": {"role": "assistant", "content": None, "tool_calls": [
        {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
        {"name": "now", "arguments": "{}"}]}, "finish_reason": "tool_calls"}
    check_chats_alike_cut_off(_job, "mistral", text, _ID.fullmatch)


def test_conversation_call_ids_become_ones_mistrals_template_takes() -> None:
    """OpenAI's and Anthropic's call ids (and a missing one) are not 9 letters and digits, which
    Mistral's templates refuse: where the chat template is Mistral's, the tokenizer maps every
    call id in the conversation to 9 letters and digits (chat, /tokenize and count_tokens
    alike), a call and its answer alike, two ids apart, and a 9-character id as it is; other
    templates get ids unchanged."""
    from jinja2 import Environment

    from minisgl.tokenizer.chat_template import takes_mistral_call_ids
    from minisgl.tokenizer.chat_template import template_messages

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    long_ids = ["call_" + "a" * 24, "toolu_01ABCDEF", "abcdefghi"]
    messages = [{"role": "user", "content": "?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": i, "type": "function",
                     "function": {"name": "get_weather", "arguments": "{}"}}
                    for i in long_ids] + [{"type": "function",
                                           "function": {"name": "get_weather",
                                                        "arguments": "{}"}}]}]
    messages += [{"role": "tool", "tool_call_id": i, "content": "sunny"} for i in long_ids]
    body = ChatRequest.model_validate({"messages": messages, "tools": TOOLS})
    job_messages = chat_job(body, 1, "mistral").prompts[0].messages
    assert job_messages is not None
    assert takes_mistral_call_ids(MISTRAL_TEMPLATE)
    assert not takes_mistral_call_ids("{{ '<tool_call>' }}") and not takes_mistral_call_ids(None)
    sent = template_messages(job_messages, mistral_ids=True)
    ids = [c["id"] for c in sent[1]["tool_calls"]]
    assert all(_ID.fullmatch(i) for i in ids) and len(set(ids)) == 4
    assert ids[2] == "abcdefghi"
    assert [m["tool_call_id"] for m in sent[2:]] == ids[:3]
    env = Environment()
    env.globals["raise_exception"] = raise_exception
    template = env.from_string(MISTRAL_TEMPLATE)
    out = template.render(loop_messages=sent, user_messages=[sent[0]], tools=None)
    assert all(f'"id": "{i}"' in out for i in ids)
    with pytest.raises(ValueError, match="length 9"):  # what the ids were
        template.render(loop_messages=body.model_dump()["messages"][:2],
                        user_messages=[sent[0]], tools=None)
    hermes = template_messages(job_messages)
    assert hermes[1]["tool_calls"][0]["id"] == long_ids[0]


# --- the same array reader with other markers: Granite 3.x and Phi-4-mini ----------------------
@pytest.mark.parametrize("name,marker", [("granite", "<|tool_call|>"),
                                         ("phi4_mini_json", "functools")])
def test_granite_and_phi4_mini_calls_read_streamed_and_whole(name: str, marker: str) -> None:
    """Their marker, then the JSON array Mistral's calls use: calls whole and in pieces, content
    before; the marker without an array is content (no v11 form here); call ids are OpenAI's."""
    fmt = FORMATS[name]

    def stream(text: str, step: int, max_calls: Optional[int] = None) -> Streamed:
        return stream_in_pieces(ArrayToolCallStreamer(max_calls, fmt), text, step,
                                lambda i: i.startswith("call_"))

    cases = [(f"{marker}[{PARIS}, {NESTED}]", None,
              [("get_weather", '{"city": "Paris", "unit": "c"}'),
               ("now", '{"q": "a ] } [ {", "l": [1, {"x": []}]}')]),
             (f'Checking.{marker} [{{"name": "now", "arguments": {{}}}}]', "Checking.",
              [("now", "{}")]),
             (f"[{PARIS}]", None, [("get_weather", '{"city": "Paris", "unit": "c"}')]),
             (f'{marker}now[ARGS]{{}}', f'{marker}now[ARGS]{{}}', []),
             ("[TOOL_CALLS] [1]", "[TOOL_CALLS] [1]", [])]
    for text, content, calls in cases:
        check_splits(parse_array_tool_calls(text, None, fmt), stream, text, content, calls,
                     range(1, len(text) + 1))


def test_granite_and_phi4_mini_templates_pick_their_formats_and_enforce_them() -> None:
    xgr = pytest.importorskip("xgrammar")
    assert default_tool_call_parser("{{ '<|tool_call|>' + tool_calls|tojson }}") == "granite"
    assert default_tool_call_parser("{{ 'functools[' }}") == "phi4_mini_json"
    vocab = [chr(i) for i in range(32, 127)] + ["\n", "<|tool_call|>", "</s>"]
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1])
    tools = parse_tools(TOOLS, "required", None)
    assert tools is not None
    for name, marker in (("granite", "<|tool_call|>"), ("phi4_mini_json", "functools")):
        structured = tools.constraint(FORMATS[name])
        assert structured is not None
        grammar = xgr.GrammarCompiler(info, max_threads=1).compile_structural_tag(
            structured.spec)
        assert _accepts(xgr, grammar, len(vocab) - 1, f"{marker}[{PARIS}]")
        assert not _accepts(xgr, grammar, len(vocab) - 1, f"[TOOL_CALLS] [{PARIS}]")


def test_v11_templates_enforce_calls_as_v11_models_write_them() -> None:
    """Mistral's v11 tokenizers' templates (they write `[ARGS]`) pick `mistral_v11`: read as
    `mistral`, and "required" / a named function enforced as `[TOOL_CALLS]NAME[ARGS]{...}`
    per call (the form those models are trained on), not as an array."""
    from minisgl.server.tool_calls import mistral_variant
    v11 = '{{- "[TOOL_CALLS]" + tool_call.function.name + "[ARGS]" + arguments }}'
    assert default_tool_call_parser(v11) == "mistral_v11"
    assert mistral_variant("mistral", v11) == "mistral_v11"
    assert mistral_variant("mistral", MISTRAL_TEMPLATE) == "mistral"
    assert mistral_variant("hermes", v11) == "hermes"
    xgr = pytest.importorskip("xgrammar")
    vocab = [chr(i) for i in range(32, 127)] + ["\n", "[TOOL_CALLS]", "[ARGS]", "</s>"]
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1])
    fmt = FORMATS["mistral_v11"]
    for choice, good, bad in (
            ("required", ['[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
                          '[TOOL_CALLS]now[ARGS]{}[TOOL_CALLS]get_weather[ARGS]{"city": "R"}'],
             [f"[TOOL_CALLS] [{PARIS}]", '[TOOL_CALLS]get_weather[ARGS]{"unit": "c"}',
              '[TOOL_CALLS]now[ARGS]{} [TOOL_CALLS]now[ARGS]{}']),
            ({"type": "function", "function": {"name": "now"}}, ["[TOOL_CALLS]now[ARGS]{}"],
             ["[TOOL_CALLS]now[ARGS]{}[TOOL_CALLS]now[ARGS]{}",
              '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'])):
        tools = parse_tools(TOOLS, choice, None)
        assert tools is not None
        structured = tools.constraint(fmt)
        assert structured is not None
        grammar = xgr.GrammarCompiler(info, max_threads=1).compile_structural_tag(
            structured.spec)
        for text in good:
            assert _accepts(xgr, grammar, len(vocab) - 1, text), text
            assert parse_array_tool_calls(text, None, fmt).calls
        for text in bad:
            assert not _accepts(xgr, grammar, len(vocab) - 1, text), text
