"""The reasoning parsers (server/reasoning.py) and the chat responses built with them: the
thinking part in reasoning_content, streamed and not, equal however the text is split."""

from __future__ import annotations

import json
from typing import Any, Dict, List

import pytest

from minisgl.core import SamplingParams
from minisgl.message.types import ReplyChunk
from minisgl.server.args import parse_args
from minisgl.server.protocol import Job, Prompt
from minisgl.server.reasoning import ReasoningSplitter, split_reasoning
from minisgl.server.responses import ChatFormatter, Choice

QWEN = "<think>\nThe user asks 2+2.\n</think>\n\nIt is 4."
R1 = "The user asks 2+2.\n</think>\n\nIt is 4."
GRANITE = ("Here is my thought process:\nThe user asks 2+2.\nHere is my response:\nIt is 4. "
           "Here is my response: stays.")


@pytest.mark.parametrize("name,text,want", [
    ("qwen3", QWEN, ("\nThe user asks 2+2.\n", "\n\nIt is 4.")),
    ("qwen3", "It is 4.", ("", "It is 4.")),  # thinking off: no tags
    ("qwen3", "<think>still thinking", ("still thinking", "")),
    ("deepseek-r1", R1, ("The user asks 2+2.\n", "\n\nIt is 4.")),
    ("deepseek-r1", "<think>" + R1, ("The user asks 2+2.\n", "\n\nIt is 4.")),
    ("deepseek-r1", "no end tag", ("no end tag", "")),
    ("qwen3", "a <thin b", ("", "a <thin b")),  # a partial tag that never completes
    ("granite", GRANITE, ("\nThe user asks 2+2.\n", "\nIt is 4. Here is my response: stays.")),
    ("granite", "Here's my thought process: a Here's my response: b", (" a ", " b")),
    ("granite", "It is 4.", ("", "It is 4.")),  # thinking off
    ("granite", "Here is my thought process: still", (" still", "")),
    ("mistral", "[THINK]The user asks 2+2.[/THINK]It is 4.", ("The user asks 2+2.", "It is 4.")),
    ("mistral", "It is 4.", ("", "It is 4.")),  # no thinking
    ("mistral", "[THINK]a [/THIN", ("a [/THIN", "")),  # cut off inside the thinking
])
def test_split_whole_and_streamed_agree(name: str, text: str, want: tuple) -> None:
    assert tuple(split_reasoning(name, text)) == want
    for step in (1, 2, 3, 5):
        splitter = ReasoningSplitter(name)
        parts = [splitter.feed(text[i:i + step]) for i in range(0, len(text), step)]
        parts.append(splitter.flush())
        assert ("".join(p.reasoning for p in parts), "".join(p.content for p in parts)) == want


def test_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="qwen3"):
        ReasoningSplitter("o1")
    with pytest.raises(SystemExit):
        parse_args(["--reasoning-parser", "o1"])
    assert parse_args(["--reasoning-parser", "deepseek-r1"]).reasoning_parser == "deepseek-r1"
    assert parse_args([]).reasoning_parser is None


@pytest.mark.parametrize("parser,body,keep", [
    ("mistral", {}, True),  # [THINK] is a special token: kept for the splitter
    ("mistral", {"skip_special_tokens": True}, False),  # the request's word stands
    ("qwen3", {}, False), (None, {}, False)])
def test_special_token_markers_keep_special_tokens(parser: Any, body: Dict[str, Any],
                                                   keep: bool) -> None:
    """A chat job under a parser whose markers are special tokens keeps them in its output
    (skip_special_tokens false) unless the request says; the others skip them."""
    from minisgl.server.protocol import ChatRequest, chat_job
    request = ChatRequest.model_validate({"messages": [{"role": "user", "content": "2+2?"}],
                                          **body})
    job = chat_job(request, 4, reasoning_parser=parser)
    assert job.skip_special_tokens is not keep


def _job(stream: bool) -> Job:
    return Job([Prompt(messages=[{"role": "user", "content": "2+2?"}])], SamplingParams(), 1,
               (), True, stream, False)


def _chunks(text: str, step: int) -> List[ReplyChunk]:
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    return [ReplyChunk(0, p, [i], "stop" if i == len(pieces) - 1 else None, 3, i + 1)
            for i, p in enumerate(pieces)]


@pytest.mark.parametrize("parser", [None, "qwen3"])
def test_chat_formatter_puts_thinking_into_reasoning_content(parser: Any) -> None:
    fmt = ChatFormatter("m", _job(False), parser)
    choice = Choice()
    for c in _chunks(QWEN, 4):
        choice.add(c)
    message = fmt.full([choice])["choices"][0]["message"]
    if parser is None:
        assert message == {"role": "assistant", "content": QWEN}
        return
    assert message["reasoning_content"] == "\nThe user asks 2+2.\n"
    assert message["reasoning"] == message["reasoning_content"]  # vLLM's name, the same text
    assert message["content"] == "\n\nIt is 4."

    fmt = ChatFormatter("m", _job(True), parser)
    choice = Choice()
    deltas: List[Dict[str, Any]] = []
    for c in _chunks(QWEN, 3):
        choice.add(c)
        deltas += [json.loads(line[6:])["choices"][0] for line in fmt.delta(0, c, choice)]
    for name in ("reasoning_content", "reasoning"):
        assert "".join(d["delta"].get(name, "") for d in deltas) == message[name]
    assert "".join(d["delta"].get("content", "") for d in deltas) == message["content"]
    assert [d["finish_reason"] for d in deltas][-1] == "stop"


def test_think_tags_send_no_empty_chunk() -> None:
    """The tags' characters, held back by the parser, send no chunk of their own (vLLM skips
    them): every chunk has a delta or the finish reason, and the stream joins as before."""
    fmt = ChatFormatter("m", _job(True), "qwen3")
    choice = Choice()
    deltas: List[Dict[str, Any]] = []
    for c in _chunks(QWEN, 1):
        choice.add(c)
        deltas += [json.loads(line[6:])["choices"][0] for line in fmt.delta(0, c, choice)]
    assert all(d["delta"] or d["finish_reason"] is not None for d in deltas)
    # one per character outside the tags (the last one's also carries the finish reason)
    assert len(deltas) == len(QWEN) - len("<think></think>")
    assert "".join(d["delta"].get("reasoning_content", "") for d in deltas) == \
        "\nThe user asks 2+2.\n"
    assert "".join(d["delta"].get("content", "") for d in deltas) == "\n\nIt is 4."
