"""Tool calls in chat output (`--tool-call-parser`): the model's text split into content and
OpenAI tool calls, streamed or not.

Formats (the names vLLM and SGLang use):
- `hermes` (Hermes, Qwen2.5, Qwen3, SmolLM3): each call is
  `<tool_call>\\n{"name": "NAME", "arguments": {...}}\\n</tool_call>`; a final call may lack
  its end tag when the output ends right after its JSON.
- `llama3_json` (Llama 3.1 / 3.2 / 3.3): each call is a bare `{"name": "NAME", "parameters":
  {...}}` (or `"arguments"`), calls separated by `;` or whitespace; the `<|python_tag|>` Llama
  writes before calls (a special token, so usually skipped by the detokenizer) is dropped.
- `qwen3_coder` (Qwen3-Coder): XML calls, `<tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n
  </parameter>\n</function>\n</tool_call>`, read by server/tool_calls_xml.py (its values
  converted to the types the tools' schemas declare; its own notes on streaming).
- `mistral` (Mistral-7B-Instruct-v0.3, Mistral-Nemo, Mistral-Small, Mixtral-8x22B):
  `[TOOL_CALLS] [{"name": "NAME", "arguments": {...}}, ...]`, a JSON array of calls after a
  special token the detokenizer may skip (v11+ tokenizers: `[TOOL_CALLS]NAME[ARGS]{...}` per
  call), read by server/tool_calls_array.py; its call ids are 9 letters and digits.

Contract, one parse for both modes: the whole text goes through `ToolCallStreamer` at once for
a plain response, delta by delta for a stream, and however the text is split the streamed deltas
join into exactly the unstreamed calls and content. A call's `arguments` is its arguments
object as the model wrote it (raw JSON text). Content is the text outside the calls, except
text that is only whitespace (around and between calls).

A stream sends a call (its id and name) as soon as its name has been read, and cannot take it
back, so in both modes a call is a call from that point on (as in vLLM, whose plain responses
follow its streams): a call cut off by the end of the output (finish_reason "length") keeps the
arguments written so far, which do not parse; one found malformed later (JSON that does not
parse, arguments that are not an object) keeps them as written, and the text from the fault on
is content. A call that is cut off or breaks before its name is read (or whose name is not a
string) is content, start tag and all.
"""

from __future__ import annotations

import json
import random
import re
import string
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import (Any, Callable, Dict, Generic, List, NamedTuple, Optional, Protocol, Tuple,
                    TypeVar)

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "qwen3_coder", "mistral", "granite",
                     "phi4_mini_json")


@dataclass(frozen=True)
class ToolCallFormat:
    """How a model writes calls. `start` opens a call and `end` closes it ("" for none: the call
    is its JSON object, found by `opener`); `markers` are dropped from content;
    `arguments_keys` name the arguments field (the first is the one the model is made to write);
    `separator` goes between constrained parallel calls. `xml`: the calls are XML
    (server/tool_calls_xml.py), not JSON; `array`: the calls are a JSON array after `start`
    (server/tool_calls_array.py); `named_calls`: Mistral v11's `START NAME[ARGS]{...}` too,
    and with `enforce_named` enforced calls take that form (each with its marker, nothing
    between them) instead of the array;
    `short_ids`: call ids of 9 letters and digits (Mistral's templates take no others);
    `call_prefix` / `call_suffix` are the JSON formats' (one call object, in `array` without
    `start`)."""

    name: str
    start: str
    end: str
    arguments_keys: Tuple[str, ...]
    separator: str
    markers: Tuple[str, ...] = ()
    xml: bool = False
    array: bool = False
    named_calls: bool = False
    short_ids: bool = False
    enforce_named: bool = False

    def call_prefix(self, function: str) -> str:
        """The text that opens a call of `function`, up to its arguments object."""
        key = self.arguments_keys[0]
        prefix = f'{{"name": {json.dumps(function, ensure_ascii=False)}, "{key}": '
        return f"{self.start}\n{prefix}" if self.start and not self.array else prefix

    @property
    def call_suffix(self) -> str:
        """The text that closes a call after its arguments object."""
        return f"}}\n{self.end}" if self.end else "}"

    def new_id(self) -> str:
        """A new call's id in this format's style."""
        return mistral_call_id() if self.short_ids else new_call_id()


FORMATS: Dict[str, ToolCallFormat] = {
    "hermes": ToolCallFormat("hermes", "<tool_call>", "</tool_call>", ("arguments",), "\n"),
    "llama3_json": ToolCallFormat("llama3_json", "", "", ("parameters", "arguments"), "; ",
                                  markers=("<|python_tag|>",)),
    "qwen3_coder": ToolCallFormat("qwen3_coder", "<tool_call>", "</tool_call>", ("arguments",),
                                  "\n", xml=True),
    "mistral": ToolCallFormat("mistral", "[TOOL_CALLS]", "", ("arguments",), ", ", array=True,
                              named_calls=True, short_ids=True),
    # Mistral's v11 tokenizers' templates (Mistral-Small-3.1+, Magistral, Devstral): read as
    # `mistral`, enforced as they write calls, `[TOOL_CALLS]NAME[ARGS]{...}` each
    "mistral_v11": ToolCallFormat("mistral_v11", "[TOOL_CALLS]", "", ("arguments",), "",
                                  array=True, named_calls=True, short_ids=True,
                                  enforce_named=True),
    # IBM Granite 3.x: `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]`
    "granite": ToolCallFormat("granite", "<|tool_call|>", "", ("arguments",), ", ", array=True),
    # Phi-4-mini: `functools[{"name": ..., "arguments": {...}}, ...]`
    "phi4_mini_json": ToolCallFormat("phi4_mini_json", "functools", "", ("arguments",), ", ",
                                     array=True),
}


def tool_call_format(name: str) -> ToolCallFormat:
    fmt = FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"tool call parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got "
                         f"{name!r}")
    return fmt


def default_tool_call_parser(chat_template: Optional[str]) -> str:
    """The parser for a chat template: `qwen3_coder` for Qwen3-Coder's (it writes calls as
    `<function=NAME>` and `<parameter=NAME>`), `mistral` for Mistral's (they write
    `[TOOL_CALLS]`), `granite` for Granite 3.x's (`<|tool_call|>`), `phi4_mini_json` for
    Phi-4-mini's (`functools[`), `llama3_json` for Llama 3.x's (they write `<|python_tag|>`
    or `"parameters"`), else `hermes`, the most common format (Qwen, Hermes, SmolLM3), also
    for templates that do not render tools at all."""
    text = chat_template or ""
    if "<function=" in text and "<parameter=" in text:
        return "qwen3_coder"
    if "[TOOL_CALLS]" in text:
        return mistral_variant("mistral", text)
    if "<|tool_call|>" in text:
        return "granite"
    if "functools[" in text:
        return "phi4_mini_json"
    if "<tool_call>" in text:
        return "hermes"
    if "<|python_tag|>" in text or '"parameters"' in text:
        return "llama3_json"
    return "hermes"


def mistral_variant(parser: str, chat_template: Optional[str]) -> str:
    """`parser`, or for `mistral` with a template of Mistral's v11 tokenizers (it writes
    `[ARGS]`) the `mistral_v11` format: the same reader, the calls enforced in that form."""
    if parser == "mistral" and "[ARGS]" in (chat_template or ""):
        return "mistral_v11"
    return parser


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_call_id() -> str:
    """A call id Mistral's chat templates accept in the conversation sent back: 9 letters and
    digits (they refuse any other)."""
    return "".join(random.choices(_ID_ALPHABET, k=9))


class ToolCall(NamedTuple):
    name: str
    arguments: str  # the arguments object as JSON text


class Parsed(NamedTuple):
    content: Optional[str]  # None when there is none (only whitespace, or only calls)
    calls: List[ToolCall]


class ToolCallDelta(NamedTuple):
    """A streamed call's piece: the first of a call carries `id` and `name`, later ones pieces
    of its arguments."""

    index: int  # type: ignore[assignment]  # OpenAI's name; shadows tuple.index, never called
    id: Optional[str]
    name: Optional[str]
    arguments: str

    def as_dict(self) -> Dict[str, Any]:
        function: Dict[str, Any] = {"arguments": self.arguments}
        out: Dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out["id"], out["type"] = self.id, "function"
            function = {"name": self.name, "arguments": self.arguments}
        out["function"] = function
        return out


class StreamPiece(NamedTuple):
    content: str
    calls: List[ToolCallDelta]


class CallStreamer(Protocol):
    """What reads one choice's output for calls, in any format: `ToolCallStreamer` (JSON),
    `tool_calls_xml.XmlToolCallStreamer` (XML). `feed` returns the content and call deltas a
    delta completes, `finish` the rest at the end of the output; then `parsed` is the stream
    joined (the plain response), and `any_call` says whether a call was announced."""

    def feed(self, text: str) -> StreamPiece: ...

    def finish(self) -> StreamPiece: ...

    def parsed(self) -> Parsed: ...

    @property
    def any_call(self) -> bool: ...


_SPACES = " \t\r\n"
_ID_ALPHABET = string.ascii_letters + string.digits
_OPENER = re.compile(r'\{\s*"name"\s*:')


def _opener_prefix(tail: str) -> bool:
    """Whether `tail` (starting with `{`) may grow into `{"name":` (with any spaces)."""
    rest = tail[1:].lstrip()
    if rest.startswith('"name"'):
        return rest[len('"name"'):].strip() == ""
    return '"name"'.startswith(rest)


def tag_tail(buf: str, tag: str) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(buf)), 0, -1):
        if buf.endswith(tag[:k]):
            return k
    return 0


@dataclass
class JsonString:
    """Whether JSON text, read character by character, is inside a string. The escapes are why
    this is more than counting quotes: a quote after an odd run of backslashes is text."""

    inside: bool = False
    escape: bool = False

    def ends_with(self, ch: str) -> bool:
        """Reads `ch`, a character inside a string; True when it is the closing quote."""
        if self.escape:
            self.escape = False
        elif ch == "\\":
            self.escape = True
        elif ch == '"':
            self.inside = False
            return True
        return False


@dataclass
class _Call:
    """One call's JSON object being scanned, character by character: the top-level keys and
    the raw text of their values."""

    index: int  # its place among the output's calls, should it be announced
    arguments_keys: Tuple[str, ...]
    raw: List[str] = field(default_factory=list)
    depth: int = 0
    string: JsonString = field(default_factory=JsonString)
    phase: str = "open"  # open, key, colon, value, comma, done
    key: Optional[str] = None
    key_start: int = -1
    value_start: int = -1
    values: Dict[str, str] = field(default_factory=dict)
    error: Optional[str] = None
    id: Optional[str] = None  # set once announced, with the name sent
    sent_name: str = ""
    sent_arguments: str = ""  # the arguments streamed so far (all of them once it has ended)

    @property
    def closed(self) -> bool:
        return self.phase == "done"

    def feed(self, ch: str) -> None:
        if self.error is not None or self.closed:
            return
        pos = len(self.raw)
        self.raw.append(ch)
        if self.string.inside:
            if self.string.ends_with(ch) and self.depth == 1:
                self._string_ended(pos)
            return
        if ch.isspace():
            if self.depth == 1 and self.phase == "value" and self.value_start >= 0 \
                    and self.raw[self.value_start] not in "{[":
                self._value_ended(pos)
            return
        if self.phase == "open":
            if ch != "{":
                self.error = "a call must be a JSON object"
                return
            self.depth, self.phase = 1, "key"
            return
        if self.depth == 1:
            self._top_level(ch, pos)
            return
        if ch == '"':
            self.string.inside = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 1 and self.phase == "value":
                self._value_ended(pos + 1)

    def _top_level(self, ch: str, pos: int) -> None:
        """A character outside strings at the object's own level."""
        if self.phase == "value" and self.value_start >= 0 and ch in ",}":
            self._value_ended(pos)  # a number or literal ends at the next , or }
        if self.phase == "key":
            if ch == '"':
                self.string.inside, self.key_start = True, pos
            elif ch == "}" and not self.values:
                self.phase, self.depth = "done", 0
            else:
                self.error = "expected a key"
        elif self.phase == "colon":
            self.phase = "value" if ch == ":" else self.phase
            self.value_start = -1
            if ch != ":":
                self.error = "expected ':'"
        elif self.phase == "value":
            if self.value_start < 0:
                self.value_start = pos
                if ch == '"':
                    self.string.inside = True
                elif ch in "{[":
                    self.depth += 1
                elif ch in ",}]":
                    self.error = "expected a value"
        elif self.phase == "comma":
            if ch == ",":
                self.phase = "key"
            elif ch == "}":
                self.phase, self.depth = "done", 0
            else:
                self.error = "expected ',' or '}'"

    def _string_ended(self, pos: int) -> None:
        if self.phase == "key":
            try:
                self.key = json.loads("".join(self.raw[self.key_start:pos + 1]))
            except json.JSONDecodeError:
                self.error = "a key is not a valid JSON string"
                return
            self.phase = "colon"
        elif self.phase == "value":
            self._value_ended(pos + 1)

    def _value_ended(self, end: int) -> None:
        assert self.key is not None
        self.values[self.key] = "".join(self.raw[self.value_start:end])
        self.phase, self.value_start = "comma", -1

    # --- what the call says so far ---------------------------------------------------------
    @property
    def name(self) -> Optional[str]:
        raw = self.values.get("name")
        if raw is None:
            return None
        try:
            name = json.loads(raw)
        except json.JSONDecodeError:
            return None
        return name if isinstance(name, str) else None

    @property
    def arguments_key(self) -> Optional[str]:
        return next((k for k in self.arguments_keys if k in self.values
                     or (self.key == k and self.phase == "value")), None)

    def arguments_so_far(self) -> str:
        """The raw arguments object as far as written (complete once the call is closed; "{}"
        for a closed call without one)."""
        key = self.arguments_key
        if key is None:
            return "{}" if self.closed else ""
        if key in self.values:
            return self.values[key]
        if self.value_start < 0:
            return ""
        return "".join(self.raw[self.value_start:])


C = TypeVar("C")  # a streamer's record of one call being read


class StreamerBase(ABC, Generic[C]):
    """What every format's streamer shares: the feed loop over its states, content (whitespace
    held until more arrives), the calls announced and their deltas, and `parsed` / `any_call`.

    A subclass reads the text in states: `_states` maps each state's name to its handler, which
    takes the unread text and returns what it leaves (putting what may still grow into markup in
    `_held`), and `_state` names the current one (or it overrides `_step`). It ends the output
    in `_finish`. It sends content through `_content`, announces a call with
    `_announce` and sends more of its arguments with `_send_arguments`: `parsed()` is these
    joined, so it is the stream joined by construction. Calls past `max_calls` (`_extra`) are
    never announced."""

    def __init__(self, max_calls: Optional[int] = None) -> None:
        self.max_calls = max_calls
        self.calls: List[C] = []  # every call read, announced or not
        self.content: List[str] = []  # content sent
        self.sent: List[Tuple[str, str]] = []  # (name, arguments) of each announced call
        self._call: Optional[C] = None  # the call being read
        self._state = "text"  # the state whose handler reads the text next
        self._states: Dict[str, Callable[[str], str]] = {}  # each state's handler, by name
        self._held = ""  # text not yet known to be content or part of a call
        self._spaces = ""  # whitespace-only content waiting for more
        self._live = False  # this stretch of content has had more than whitespace
        self._announced = 0
        self._pending: List[str] = []  # content of the current feed
        self._deltas: List[ToolCallDelta] = []  # call deltas of the current feed

    # --- the interface ------------------------------------------------------------------------
    def feed(self, text: str) -> StreamPiece:
        """The content and call deltas `text` (the next delta of the output) completes."""
        buf, self._held = self._held + text, ""
        while buf:
            buf = self._step(buf)
        return self._flush()

    def finish(self) -> StreamPiece:
        """The end of the output: the content what was held back turns out to be (`_finish`);
        no call deltas (a call announced was sent all it read when its text was fed)."""
        held, self._held = self._held, ""
        self._finish(held)
        return self._flush()

    def parsed(self) -> Parsed:
        """After `finish`: the content and the calls sent, as the joined stream has them."""
        content = "".join(self.content)
        return Parsed(content or None, [ToolCall(n, a) for n, a in self.sent])

    @property
    def any_call(self) -> bool:
        """Whether a call has been announced in the stream."""
        return self._announced > 0

    # --- for the formats ----------------------------------------------------------------------
    def _step(self, buf: str) -> str:
        """The current state's handler on the unread text `buf`; returns what it leaves."""
        return self._states[self._state](buf)

    @abstractmethod
    def _finish(self, held: str) -> None:
        """The end of the output, with `held` the text held back: what is content."""

    def _new_id(self) -> str:
        """A new call's id (the format's style)."""
        return new_call_id()

    def _flush(self) -> StreamPiece:
        """The content and call deltas gathered since the last flush."""
        content, self._pending = "".join(self._pending), []
        deltas, self._deltas = self._deltas, []
        return StreamPiece(content, deltas)

    def _content(self, text: str) -> None:
        """`text` is content: sent, except that whitespace-only text at the start of a stretch
        of content waits (with the whitespace after it) until text other than whitespace
        follows; calls starting drop it (`_break_content`)."""
        if not text:
            return
        if not self._live:
            if not text.strip():
                self._spaces += text
                return
            text, self._spaces, self._live = self._spaces + text, "", True
        self._pending.append(text)
        self.content.append(text)

    def _break_content(self) -> None:
        """The stretch of content ends (calls start): whitespace waiting in it is dropped."""
        self._spaces, self._live = "", False

    @property
    def _current(self) -> C:
        """The call being read (there must be one)."""
        assert self._call is not None
        return self._call

    def _end_call(self) -> None:
        """The call being read ends (closed, broken or cut off): it joins `calls`."""
        self.calls.append(self._current)
        self._call = None

    def _extra(self, index: int) -> bool:
        """Whether the call at `index` is past `max_calls` (dropped, never announced)."""
        return self.max_calls is not None and index >= self.max_calls

    def _announce(self, index: int, name: str, arguments: str) -> str:
        """A call's name is read: its id, name and first `arguments` go out; returns its id."""
        call_id = self._new_id()
        self._announced += 1
        self.sent.append((name, arguments))
        self._deltas.append(ToolCallDelta(index, call_id, name, arguments))
        return call_id

    def _send_arguments(self, index: int, arguments: str) -> None:
        """More of announced call `index`'s arguments go out."""
        name, sent = self.sent[index]
        self.sent[index] = (name, sent + arguments)
        self._deltas.append(ToolCallDelta(index, None, None, arguments))

    def _json_call_deltas(self, call: _Call) -> None:
        """What a JSON `call` (being read, just closed, or just found malformed) adds to the
        stream: its announcement once its name is read, then the arguments read since (none
        past `max_calls`)."""
        if self._extra(call.index):
            return
        if call.id is None:
            name = call.name
            if name is not None:
                call.sent_name, call.sent_arguments = name, call.arguments_so_far()
                call.id = self._announce(call.index, name, call.sent_arguments)
            return
        args = call.arguments_so_far()
        # (arguments that no longer extend what was sent, e.g. a second arguments key, are
        # not sent: a stream cannot take back what it sent)
        if len(args) > len(call.sent_arguments) and args.startswith(call.sent_arguments):
            delta, call.sent_arguments = args[len(call.sent_arguments):], args
            self._send_arguments(call.index, delta)


class ToolCallStreamer(StreamerBase[_Call]):
    """One choice's output, delta by delta, split into content and calls in `fmt`.

    `feed(text)` returns the content and call deltas that text completes; `finish()` the rest
    at the end of the output. Text that may be the start of a call (a partial start tag, a
    `{` that may open `{"name":`) is held back until known, and so is whitespace-only text until
    something else follows it in the same stretch of content. After finish, `parsed()` is what
    the stream sent, joined: the plain response. With `max_calls`, the calls after the first
    `max_calls` are dropped (`parallel_tool_calls: false`)."""

    def __init__(self, fmt: ToolCallFormat, max_calls: Optional[int] = None) -> None:
        super().__init__(max_calls)
        self.fmt = fmt
        self._after_call = False  # between a call's object and its end tag

    # --- the state machine ------------------------------------------------------------------
    def _step(self, buf: str) -> str:
        if self._call is not None:
            return self._feed_call(buf)
        if self._after_call:
            return self._feed_after_call(buf)
        return self._feed_text(buf)

    def _finish(self, held: str) -> None:
        """Held text is content (whitespace alone is dropped); a call cut off before it was
        announced is content too (one announced was sent all the arguments read, when the last
        text was fed)."""
        if self._call is not None:
            call = self._call
            self._end_call()
            if call.id is None and not self._extra(call.index):
                self._abandon(call)
        elif not self._after_call and held:
            self._content(held)

    def _feed_text(self, buf: str) -> str:
        """Content up to the next call's start; returns what is left after it."""
        for marker in self.fmt.markers:
            buf = buf.replace(marker, "")
        at, skip = self._find_start(buf)
        if at < 0:
            keep = self._possible_start(buf)
            self._content(buf[:len(buf) - keep])
            self._held = buf[len(buf) - keep:]
            return ""
        self._content(buf[:at])
        # A call never announced is not one: only the announced ones count.
        self._break_content()
        self._call = _Call(self._announced, self.fmt.arguments_keys)
        return buf[at + skip:]

    def _find_start(self, buf: str) -> Tuple[int, int]:
        """Where the next call starts in `buf` and how much of it is the start tag."""
        if self.fmt.start:
            return buf.find(self.fmt.start), len(self.fmt.start)
        m = _OPENER.search(buf)
        return (m.start(), 0) if m else (-1, 0)

    def _possible_start(self, buf: str) -> int:
        """Length of the tail of `buf` that may still become a call's start (or a marker)."""
        keep = max([tag_tail(buf, m) for m in self.fmt.markers] + [0])
        if self.fmt.start:
            return max(keep, tag_tail(buf, self.fmt.start))
        at = buf.rfind("{")
        while at >= 0:
            if _opener_prefix(buf[at:]):
                return max(keep, len(buf) - at)
            at = buf.rfind("{", 0, at)
        return keep

    def _feed_call(self, buf: str) -> str:
        """The call's characters; returns what follows its object. A call that turns out
        malformed before it was announced goes back to being content; one that turns out
        malformed after its name is read is announced there (and sent the arguments read), so
        that where the text is split does not decide whether it is a call."""
        call = self._current
        for i, ch in enumerate(buf):
            call.feed(ch)
            if call.closed:
                self._json_call_deltas(call)
                self._end_call()
                self._after_call = True
                if call.id is None and not self._extra(call.index):
                    self._abandon(call)
                return buf[i + 1:]
            if call.error is not None:  # the faulty character goes on as text
                call.raw.pop()
                self._json_call_deltas(call)
                self._end_call()
                if call.id is None and not self._extra(call.index):
                    self._abandon(call)
                return buf[i:]
        self._json_call_deltas(call)
        return ""

    def _abandon(self, call: _Call) -> None:
        """An unannounced call's text, start tag and all, is content after all."""
        self._content(self.fmt.start + "".join(call.raw))

    def _feed_after_call(self, buf: str) -> str:
        """Whitespace, then the end tag (or anything else: the rest is text again); without an
        end tag, whitespace and the separators between calls."""
        end = self.fmt.end
        stripped = buf.lstrip() if end else buf.lstrip(_SPACES + self.fmt.separator)
        if not stripped:
            return ""
        if not end:
            self._after_call = False
            return stripped
        if stripped.startswith(end):
            self._after_call = False
            return stripped[len(end):]
        if end.startswith(stripped):
            self._held = buf
            return ""
        self._after_call = False  # no end tag: the call stands, what follows is text
        return stripped


def parse_tool_calls(fmt: ToolCallFormat, text: str, max_calls: Optional[int] = None) -> Parsed:
    """The content and calls of a whole output (see the module's contract)."""
    streamer = ToolCallStreamer(fmt, max_calls)
    streamer.feed(text)
    streamer.finish()
    return streamer.parsed()


def call_dict(call: ToolCall, call_id: Optional[str] = None) -> Dict[str, Any]:
    """One call in OpenAI's `message.tool_calls` shape."""
    return {"id": call_id or new_call_id(), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}
