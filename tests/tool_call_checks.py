"""Checks the tool-call parsers' tests share (tests/test_tool_calls.py, test_tool_calls_xml.py,
test_tool_calls_array.py): a streamer fed an output in pieces of a size, its deltas joined as a
client joins them; the whole output against every split of it and against it cut off anywhere;
and chat responses (ChatFormatter) streamed and plain, the stream joined into the plain
response's shape."""

from __future__ import annotations

import json
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from minisgl.message.types import ReplyChunk, TokenLogprobText
from minisgl.server.protocol import Job
from minisgl.server.responses import ChatFormatter, Choice
from minisgl.server.tool_calls import CallStreamer, Parsed, ToolCall

# (content, [(name, arguments)], the deltas as dicts): what a stream joins into
Streamed = Tuple[Optional[str], List[Tuple[str, str]], List[Dict[str, Any]]]
IdCheck = Callable[[str], Any]  # whether a call id is in the format's style (truthy)


def call_id_ok(call_id: str) -> bool:
    """Whether `call_id` is in the style of every format but `mistral` (`call_...`)."""
    return call_id.startswith("call_")


def stream_in_pieces(streamer: CallStreamer, text: str, step: int, id_ok: IdCheck) -> Streamed:
    """`text` fed to `streamer` `step` characters at a time: the content and calls the deltas
    join into, and the deltas. Asserts that a call's first delta has an id `id_ok` takes (and
    type "function"), its later ones only arguments; that the calls are numbered 0, 1, ...;
    and that `streamer.parsed()` is the joined stream."""
    content, deltas = [], []
    for i in range(0, len(text), step):
        piece = streamer.feed(text[i:i + step])
        content.append(piece.content)
        deltas += [d.as_dict() for d in piece.calls]
    content.append(streamer.finish().content)
    calls: Dict[int, List[str]] = {}
    for d in deltas:
        entry = calls.setdefault(d["index"], ["", ""])
        if "id" in d:
            assert entry == ["", ""] and id_ok(d["id"]) and d["type"] == "function"
            entry[0] = d["function"]["name"]
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
        entry[1] += d["function"]["arguments"]
    joined = [(c[0], c[1]) for _, c in sorted(calls.items())]
    assert sorted(calls) == list(range(len(calls)))
    assert streamer.parsed() == Parsed("".join(content) or None, [ToolCall(*c) for c in joined])
    return "".join(content) or None, joined, deltas


def check_splits(whole: Parsed, stream: Callable[[str, int], Streamed], text: str,
                 content: Optional[str], calls: List[Tuple[str, str]],
                 steps: Iterable[int]) -> None:
    """The whole output's parse (`whole`) is `content` and `calls`, and so is `text` streamed
    in pieces of each of `steps` characters."""
    assert whole == Parsed(content, [ToolCall(*c) for c in calls])
    for step in steps:
        assert stream(text, step)[:2] == (content, calls), step


def check_cut_offs(parse: Callable[[str], Parsed], stream: Callable[[str, int], Streamed],
                   text: str, steps: Iterable[int]) -> None:
    """`text`'s finished calls have arguments that are JSON objects, and `text` cut off
    anywhere parses the same streamed (in pieces of each of `steps`) as whole."""
    for c in parse(text).calls:
        assert isinstance(json.loads(c.arguments), dict)
    for end in range(len(text) + 1):
        whole = parse(text[:end])
        for step in steps:
            got = stream(text[:end], step)
            assert got[:2] == (whole.content, [tuple(c) for c in whole.calls]), (end, step)


# --- chat responses ----------------------------------------------------------------------------
def reply_chunks(text: str, step: int, reason: str = "stop",
                 logprobs: bool = False) -> List[ReplyChunk]:
    """One chunk per `step` characters, as if each were a token (with its logprob if asked);
    the last has finish reason `reason`."""
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    return [ReplyChunk(0, p, [i], reason if i == len(pieces) - 1 else None, 3, i + 1,
                       logprobs=[TokenLogprobText(p, -0.5)] if logprobs else [])
            for i, p in enumerate(pieces)]


def full_choice(fmt: ChatFormatter, chunks: List[ReplyChunk]) -> Dict[str, Any]:
    """The plain response's choice for one choice's `chunks`."""
    c = Choice()
    for chunk in chunks:
        c.add(chunk)
    item: Dict[str, Any] = fmt.full([c])["choices"][0]
    return item


def streamed_choices(fmt: ChatFormatter, chunks: List[ReplyChunk]) -> List[Dict[str, Any]]:
    """The choice items of the stream's delta chunks for one choice's `chunks` (the role chunk
    aside)."""
    c, out = Choice(), []
    for chunk in chunks:
        c.add(chunk)
        out += [json.loads(line[6:])["choices"][0] for line in fmt.delta(0, chunk, c)]
    return out


def joined_choice(deltas: List[Dict[str, Any]], id_ok: IdCheck,
                  reasoning: bool = False) -> Dict[str, Any]:
    """A stream's deltas joined as a client does: content (and, with `reasoning`, reasoning)
    concatenated, each call's name and arguments by its index; in `plain_choice`'s shape.
    Asserts that call ids are ones `id_ok` takes and the calls are numbered 0, 1, ..."""
    texts = {k: "".join(d["delta"].get(k, "") for d in deltas)
             for k in ("content", "reasoning_content", "reasoning")}
    message: Dict[str, Any] = {"role": "assistant", "content": texts["content"] or None}
    if reasoning:  # both names carry the same text (vLLM's and SGLang's)
        message["reasoning_content"] = texts["reasoning_content"] or None
        message["reasoning"] = texts["reasoning"] or None
    calls: Dict[int, Dict[str, str]] = {}
    for d in deltas:
        for tc in d["delta"].get("tool_calls", []):
            entry = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
            if "id" in tc:
                assert id_ok(tc["id"])
            entry["name"] += tc["function"].get("name") or ""
            entry["arguments"] += tc["function"]["arguments"]
    if calls:
        assert sorted(calls) == list(range(len(calls)))
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return {"message": message, "finish_reason": deltas[-1]["finish_reason"]}


def plain_choice(item: Dict[str, Any], id_ok: IdCheck) -> Dict[str, Any]:
    """A plain response's choice as `joined_choice` builds it: the calls' functions (ids
    differ; asserts they are ones `id_ok` takes)."""
    message = dict(item["message"])
    if "tool_calls" in message:
        assert all(id_ok(t["id"]) for t in message["tool_calls"])
        message["tool_calls"] = [t["function"] for t in message["tool_calls"]]
    return {"message": message, "finish_reason": item["finish_reason"]}


def chat_plain(job: Callable[[bool], Job], parser: str, text: str, reason: str,
               id_ok: IdCheck) -> Dict[str, Any]:
    """The plain chat response's choice for output `text` (in 5-character tokens) read by tool
    call parser `parser`; `job(stream)` is the request."""
    fmt = ChatFormatter("m", job(False), None, parser)
    return plain_choice(full_choice(fmt, reply_chunks(text, 5, reason)), id_ok)


def chat_joined(job: Callable[[bool], Job], parser: str, text: str, reason: str, step: int,
                id_ok: IdCheck) -> Dict[str, Any]:
    """The streamed chat response for output `text` (in `step`-character tokens), joined."""
    fmt = ChatFormatter("m", job(True), None, parser)
    return joined_choice(streamed_choices(fmt, reply_chunks(text, step, reason)), id_ok)


def check_chats_alike_cut_off(job: Callable[[bool], Job], parser: str, text: str,
                              id_ok: IdCheck, steps: Iterable[int] = (1, 6)) -> None:
    """For `text` cut off after every character (finish reason "length", "stop" for the whole),
    the stream in tokens of each of `steps` characters joins into the plain response."""
    for end in range(1, len(text) + 1):
        reason = "stop" if end == len(text) else "length"
        plain = chat_plain(job, parser, text[:end], reason, id_ok)
        for step in steps:
            assert chat_joined(job, parser, text[:end], reason, step, id_ok) == plain, (end, step)
