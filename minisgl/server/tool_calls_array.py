"""The array tool-call formats: `mistral` (Mistral-7B-Instruct-v0.3, Mistral-Nemo,
Mistral-Small, Mixtral-8x22B), and with their own markers `granite` (`<|tool_call|>`, Granite
3.x) and `phi4_mini_json` (`functools`, Phi-4-mini): calls read into OpenAI calls streamed or
not (the contract of server/tool_calls.py). Below, `[TOOL_CALLS]` stands for the format's
marker; the v11 form and 9-character ids are Mistral's only.

The model writes `[TOOL_CALLS]` and then a JSON array of call objects,
    [TOOL_CALLS] [{"name": "NAME", "arguments": {...}}, {"name": ..., "arguments": ...}]
(with or without the space; other keys in an object, like the `"id"` the chat templates write
into past calls, are ignored; an object without `"arguments"` has `{}`). Newer tokenizers (v11
and up: Mistral-Small-3.1+, Magistral, Devstral) write a call as
`[TOOL_CALLS]NAME[ARGS]{...}` (or `NAME[CALL_ID]ID[ARGS]{...}`), one marker per call; that form
is read too.

`[TOOL_CALLS]` is a special token, so a detokenizer that skips special tokens drops it: then a
JSON array whose first element opens `{"name":` at the start of the output (after whitespace
only) is the calls, as vLLM does (the chat job keeps special tokens in the text for this parser
where the request does not ask otherwise, server/protocol.py, so calls after content are found
by their marker). The v11 form needs the markers (`[ARGS]` is a special token too).

As in the other formats, a call is announced (id, name) once its name is read and then a call:
cut off by the end of the output it keeps the arguments written so far; broken later (text other
than `,` or `]` between the array's objects, an object that does not parse) it keeps them as
written and the text from the fault on is content. Calls that break before their name is read
are content, marker, `[` and separators included. Text after the calls (after `]`, or after a v11
call's arguments object) is content again. Call ids are 9 letters and digits (`mistral_call_id`):
Mistral's chat templates refuse any other id in the conversation sent back.
"""

from __future__ import annotations

import re
from typing import List, Optional

from minisgl.server.tool_calls import (FORMATS, JsonString, Parsed, StreamerBase,
                                       ToolCallFormat, _Call, _opener_prefix, tag_tail)

MISTRAL = FORMATS["mistral"]
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_ARRAY_OPENER = re.compile(r'\[\s*\{\s*"name"\s*:')
_NAME_CHARS = re.compile(r"[A-Za-z0-9_.-]*")
_ID_CHARS = re.compile(r"[A-Za-z0-9]*")
_HEADER = re.compile(r"([A-Za-z0-9_.-]+)(?:\[CALL_ID\][A-Za-z0-9]+)?(?:\[ARGS\])?")


def _array_may_open(tail: str) -> bool:
    """Whether `tail` (starting with `[`) may grow into `[{"name":` (with any spaces)."""
    rest = tail[1:].lstrip()
    return not rest or (rest[0] == "{" and _opener_prefix(rest))


def _header_may_grow(text: str) -> bool:
    """Whether a v11 call's header read so far (the text after the marker, before `{`) may
    still become `NAME`, `NAME[ARGS]` or `NAME[CALL_ID]ID[ARGS]`."""
    name = _NAME_CHARS.match(text)
    rest = text[name.end():] if name else text
    if not rest:
        return True
    if not name or not name.group():
        return False
    if ARGS.startswith(rest) or CALL_ID.startswith(rest):
        return True
    if not rest.startswith(CALL_ID):
        return False
    ident = _ID_CHARS.match(rest, len(CALL_ID))
    after = rest[ident.end():] if ident else ""
    return not after or (ident is not None and ident.group() != "" and ARGS.startswith(after))


class _Args:
    """A v11 call's arguments object, scanned for its end: raw text, nesting and strings."""

    def __init__(self) -> None:
        self.raw: List[str] = []
        self.depth = 0
        self.string = JsonString()

    @property
    def closed(self) -> bool:
        return bool(self.raw) and self.depth == 0

    def feed(self, ch: str) -> None:
        self.raw.append(ch)
        if self.string.inside:
            self.string.ends_with(ch)
        elif ch == '"':
            self.string.inside = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1


class ArrayToolCallStreamer(StreamerBase[_Call]):
    """One choice's output, delta by delta, split into content and calls of array format `fmt`
    (`mistral` by default); the interface and guarantees of `tool_calls.ToolCallStreamer`.
    With `max_calls`, the calls after the first `max_calls` are dropped
    (`parallel_tool_calls: false`). `calls` holds the array calls read (announced or not),
    `sent` every call announced (v11 ones too)."""

    def __init__(self, max_calls: Optional[int] = None, fmt: ToolCallFormat = MISTRAL) -> None:
        super().__init__(max_calls)
        self.fmt = fmt
        self.marker = fmt.start
        # text, marker (after it: `[` or a v11 name?), item (before an object), call (in one),
        # between (after one: `,` or `]`), header (a v11 name), args (a v11 arguments object)
        self._states = {"text": self._on_text, "marker": self._on_marker, "item": self._on_item,
                        "call": self._on_call, "between": self._on_between,
                        "header": self._on_header, "args": self._on_args}
        self._markup = ""  # markup read since the last call: content if no call follows
        self._args: Optional[_Args] = None  # a v11 call's arguments being read
        self._args_id: Optional[str] = None  # its id (None: past max_calls, dropped)
        self._after_call = False  # the current array has had a call (sent or dropped)
        self._begun = False  # the output has had content other than whitespace, or a call

    def _finish(self, held: str) -> None:
        """Held text is content, and so is markup and a call cut off before its name was read;
        a call announced keeps the arguments sent."""
        if self._state == "text":
            self._content(held)
        elif self._state == "call":
            self._close_call(self._current)
        elif self._state in ("marker", "header") or (self._state == "item"
                                                     and not self._after_call):
            self._content(self._markup + held)
        # (after a call, in "item" or "between", what is left is separators; in "args", a
        # v11 call's arguments were sent as read)
        self._state, self._markup, self._args = "text", "", None

    # --- the states: each takes the unread text and returns what it leaves -------------------
    def _on_text(self, buf: str) -> str:
        """Content up to the marker (or, at the start of the output, a bare array of calls)."""
        at = buf.find(self.marker)
        bare = None if self._begun else _ARRAY_OPENER.match(buf, len(buf) - len(buf.lstrip()))
        if bare is not None and (at < 0 or bare.start() < at):
            self._content(buf[:bare.start()])
            self._start_calls("[")
            self._state = "item"
            return buf[bare.start() + 1:]
        if at >= 0:
            self._content(buf[:at])
            self._start_calls(self.marker)
            self._state = "marker"
            return buf[at + len(self.marker):]
        keep = tag_tail(buf, self.marker)
        stripped = buf.lstrip()
        if not self._begun and stripped.startswith("[") and _array_may_open(stripped):
            keep = max(keep, len(stripped))
        self._content(buf[:len(buf) - keep])
        self._held = buf[len(buf) - keep:]
        return ""

    def _on_marker(self, buf: str) -> str:
        """After the marker: whitespace, then `[` (an array of calls) or a v11 call's name."""
        rest = buf.lstrip()
        self._markup += buf[:len(buf) - len(rest)]
        if not rest:
            return ""
        if rest[0] == "[":
            self._markup += "["
            self._state = "item"
            return rest[1:]
        if not self.fmt.named_calls:  # only Mistral writes NAME[ARGS]{...}
            return self._broken(rest)
        self._state = "header"
        return rest

    def _on_item(self, buf: str) -> str:
        """Before an array's object: whitespace, then `{`; anything else ends the calls."""
        rest = buf.lstrip()
        self._markup += buf[:len(buf) - len(rest)]
        if not rest:
            return ""
        if rest[0] != "{":
            return self._broken(rest)
        self._call = _Call(self._announced, ("arguments",))
        self._state = "call"
        return rest

    def _on_call(self, buf: str) -> str:
        """An array's call object, character by character (server/tool_calls.py's scanner)."""
        call = self._current
        for i, ch in enumerate(buf):
            call.feed(ch)
            if call.closed:
                self._json_call_deltas(call)
                self._close_call(call)
                # an object that is not a call ends the calls: the rest is text
                self._state = "between" if self._after_call else "text"
                return buf[i + 1:]
            if call.error is not None:  # the faulty character goes on as text
                call.raw.pop()
                self._json_call_deltas(call)
                self._close_call(call)
                self._state = "text"
                return buf[i:]
        self._json_call_deltas(call)
        return ""

    def _on_between(self, buf: str) -> str:
        """After an array's object: `,` (another follows) or `]` (the calls end)."""
        rest = buf.lstrip()
        self._markup += buf[:len(buf) - len(rest)]
        if not rest:
            return ""
        if rest[0] == ",":
            self._markup += ","
            self._state = "item"
            return rest[1:]
        if rest[0] == "]":
            self._markup, self._state = "", "text"
            return rest[1:]
        return self._broken(rest)

    def _on_header(self, buf: str) -> str:
        """A v11 call's name (and `[CALL_ID]ID`, `[ARGS]`) up to its arguments' `{`."""
        header = self._markup[self._markup.index(self.marker) + len(self.marker):].lstrip()
        end = buf.find("{")
        part = buf if end < 0 else buf[:end]
        if not _header_may_grow(header + part) or (
                end >= 0 and not _HEADER.fullmatch(header + part)):
            return self._broken(buf)
        self._markup += part
        if end < 0:
            return ""
        match = _HEADER.fullmatch(header + part)
        assert match is not None
        index, self._markup = self._announced, ""
        self._args_id = None if self._extra(index) else self._announce(index, match.group(1), "")
        self._args, self._state = _Args(), "args"
        return buf[end:]

    def _on_args(self, buf: str) -> str:
        """A v11 call's arguments object, sent as written, up to its closing brace."""
        args = self._args
        assert args is not None
        for i, ch in enumerate(buf):
            args.feed(ch)
            if args.closed:
                self._more_arguments(self._args_id, buf[:i + 1])
                self._args, self._state = None, "text"
                return buf[i + 1:]
        self._more_arguments(self._args_id, buf)
        return ""

    # --- helpers ---------------------------------------------------------------------------------
    def _new_id(self) -> str:
        return self.fmt.new_id()

    def _start_calls(self, opener: str) -> None:
        """Calls begin at `opener` (the marker, or a bare array's `[`)."""
        self._markup, self._begun, self._after_call = opener, True, False
        self._break_content()

    def _content(self, text: str) -> None:
        """As `StreamerBase._content`; content other than whitespace also ends the chance of a
        bare array of calls (`_begun`)."""
        self._begun = self._begun or bool(text.strip())
        super()._content(text)

    def _broken(self, rest: str) -> str:
        """The calls end at a fault: the markup read since the last call is content, and so
        is `rest`."""
        markup, self._markup = self._markup, ""
        self._state = "text"
        self._content(markup)
        return rest

    def _close_call(self, call: _Call) -> None:
        """An array's call ends (closed, broken or cut off): one never announced is content,
        markup before it included, unless it is past `max_calls` (dropped)."""
        self._end_call()
        self._after_call = call.id is not None or self._extra(call.index)
        if not self._after_call:
            self._content(self._markup + "".join(call.raw))
        self._markup = ""

    def _announce(self, index: int, name: str, arguments: str) -> str:
        """As `StreamerBase._announce`; the markup before the call is the call's."""
        self._markup = ""
        return super()._announce(index, name, arguments)

    def _more_arguments(self, call_id: Optional[str], arguments: str) -> None:
        """More of the last announced call's arguments (none for a dropped call)."""
        if call_id is not None and arguments:
            self._send_arguments(self._announced - 1, arguments)


def parse_array_tool_calls(text: str, max_calls: Optional[int] = None,
                             fmt: ToolCallFormat = MISTRAL) -> Parsed:
    """The content and calls of a whole output in array format `fmt` (see the module's
    contract)."""
    streamer = ArrayToolCallStreamer(max_calls, fmt)
    streamer.feed(text)
    streamer.finish()
    return streamer.parsed()
