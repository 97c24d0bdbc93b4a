"""The `qwen3_coder` tool-call format (Qwen3-Coder): calls written as XML, their parameters as
text, read into OpenAI calls streamed or not (the contract of server/tool_calls.py).

Each call is
    <tool_call>
    <function=NAME>
    <parameter=PARAM>
    VALUE (free text, any number of lines)
    </parameter>
    ...
    </function>
    </tool_call>
with calls one after another and content before them. A bare `<function=` (without
`<tool_call>`, which some outputs leave out) opens a call too, and `</tool_call>` after
`</function>` may be missing. A value is the text up to the next `</parameter>`, less one
newline at each end (the template writes one); unlike vLLM, `<parameter=` or `</function>` inside
it are part of the value (code may hold them), so a value without `</parameter>` runs on.

Values become the JSON type the tool's schema declares for the parameter (`convert_value`), so
`arguments` is a JSON object text: `{"PARAM": VALUE, ...}` in the order written, as
`json.dumps(..., ensure_ascii=False)` writes it (a parameter written twice is written twice).
Streamed, a call is announced (id, name) once `>` ends its name; its arguments go out a parameter
at a time, as each `</parameter>` arrives (`{"a": 1`, then `, "b": 2`), and `}` with `</function>`
(`{}` for a call without parameters). So a call cut off by the end of the output keeps its
finished parameters, unclosed (they do not parse), or "" before the first; one that breaks after
its name (text other than whitespace, `<parameter=` or `</function>` in its body, a parameter
name with a newline or `<`) keeps what was sent, and the text from the fault on is content. A call
cut off or broken before its name is read is content, start tag and all.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

import jsonschema

from minisgl.server.tool_calls import Parsed, StreamerBase, tag_tail

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
FUNCTION_START = "<function="
FUNCTION_END = "</function>"
PARAM_START = "<parameter="
PARAM_END = "</parameter>"
_NAME_BREAKS = "\n<"  # a function or parameter name never holds these

# --- values: text to the schema's type -----------------------------------------------------
_INTEGER = re.compile(r"[-+]?\d+")
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_JSON_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
               (type(None), "null"), (list, "array"), (dict, "object"))


def _resolve(schema: Any, root: Mapping[str, Any]) -> Any:
    """`schema` with a local `$ref` ("#/$defs/X", "#/definitions/X") followed (None where it
    does not resolve, or is not local)."""
    for _ in range(16):  # a chain of references, not a loop
        ref = schema.get("$ref") if isinstance(schema, dict) else None
        if not isinstance(ref, str):
            return schema
        if not ref.startswith("#"):
            return None
        node: Any = root
        for part in filter(None, ref[1:].split("/")):
            key = part.replace("~1", "/").replace("~0", "~")
            node = node.get(key) if isinstance(node, dict) else None
        schema = node
    return None


def _value_type(value: Any) -> str:
    return next(name for kind, name in _JSON_TYPES if isinstance(value, kind))


def declared_types(schema: Any, root: Mapping[str, Any]) -> List[str]:
    """The JSON types `schema` allows: its `type`, else those of its `anyOf` / `oneOf` /
    `allOf` members, else those of its `enum` / `const` values; [] when it says none."""
    schema = _resolve(schema, root)
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list):
            return [t for member in schema[key] for t in declared_types(member, root)]
    enum = schema.get("enum")
    values = enum if isinstance(enum, list) else [schema["const"]] if "const" in schema else []
    return [_value_type(v) for v in values]


def _satisfies(value: str, schema: Any, root: Mapping[str, Any]) -> bool:
    """Whether the string `value` validates against `schema` (False where it cannot be
    checked, e.g. a `$ref` that does not resolve)."""
    schema = _resolve(schema, root)
    if not isinstance(schema, dict):
        return True
    try:
        return bool(jsonschema.validators.validator_for(schema)(schema).is_valid(value))
    except Exception:  # an unresolvable $ref: its kind of error depends on jsonschema's version
        return False


def _as_type(text: str, kind: str) -> Tuple[bool, Any]:
    """(True, the value) when `text` reads as JSON type `kind` (not "string"), else (False,
    None). Literals in any case (`True`, `NULL`), numbers with a sign or leading zeros."""
    word = text.strip()
    if kind == "null":  # the chat template writes Python's None
        return word.lower() in ("null", "none"), None
    if kind == "boolean":
        return word.lower() in ("true", "false"), word.lower() == "true"
    if kind == "integer" and _INTEGER.fullmatch(word):
        return True, int(word)
    if kind == "number" and _NUMBER.fullmatch(word):
        if _INTEGER.fullmatch(word):
            return True, int(word)
        number = float(word)
        return math.isfinite(number), number
    if kind in ("object", "array"):
        try:
            value = json.loads(word)
        except ValueError:
            return False, None
        return isinstance(value, dict if kind == "object" else list), value
    return False, None


def convert_value(text: str, schema: Any, root: Mapping[str, Any]) -> Any:
    """A parameter's text as the type its `schema` declares (`root`: the tool's parameters
    schema, for `$ref`): null, boolean, integer, number, object or array where the text reads as
    one of the declared types (tried in that order), else the text itself, a string. A string
    that does not satisfy its schema (an `enum`, a `pattern`, a length) but does once stripped of
    surrounding whitespace is stripped (xgrammar's Qwen XML lets whitespace surround a value).
    A parameter the schema does not describe is a string."""
    types = declared_types(schema, root)
    for kind in ("null", "boolean", "integer", "number", "object", "array"):
        if kind in types:
            ok, value = _as_type(text, kind)
            if ok:
                return value
    word = text.strip()
    if word != text and schema is not None and not _satisfies(text, schema, root) \
            and _satisfies(word, schema, root):
        return word
    return text


def parameter_schema(parameters: Mapping[str, Any], name: str) -> Any:
    """The schema of parameter `name` in a tool's `parameters` schema: its property, else
    `additionalProperties` where that is a schema, else None."""
    props = parameters.get("properties")
    if isinstance(props, dict) and name in props:
        return props[name]
    extra = parameters.get("additionalProperties")
    return extra if isinstance(extra, dict) else None


def _strip_newlines(value: str) -> str:
    """A value less the newline the template writes after `>` and before `</parameter>`."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


# --- the stream ------------------------------------------------------------------------------
@dataclass
class _XmlCall:
    """One call being read: its place among the output's calls (should it be announced), the
    text read before its name ended (content, should it not be a call), its parameters."""

    index: int
    raw: str = ""
    name: Optional[str] = None
    id: Optional[str] = None  # set once announced
    params: int = 0  # parameters written into the arguments
    param: Optional[str] = None  # the name of the parameter whose value is being read
    value: List[str] = field(default_factory=list)


class XmlToolCallStreamer(StreamerBase[_XmlCall]):
    """One choice's output, delta by delta, split into content and `qwen3_coder` calls; the
    interface and guarantees of `tool_calls.ToolCallStreamer`. `schemas` maps each tool's name to
    its parameters schema (a call of another name takes its values as strings); with
    `max_calls`, the calls after the first `max_calls` are dropped."""

    def __init__(self, schemas: Mapping[str, Mapping[str, Any]],
                 max_calls: Optional[int] = None) -> None:
        super().__init__(max_calls)
        self.schemas = schemas
        # text, open, name, body, pname, value, after
        self._states = {"text": self._on_text, "open": self._on_open, "name": self._on_name,
                        "body": self._on_body, "pname": self._on_pname, "value": self._on_value,
                        "after": self._on_after}

    def _finish(self, held: str) -> None:
        """Held text is content, and so is a call cut off before its name was read; a call
        announced keeps the arguments sent."""
        call = self._call
        if self._state == "text":
            self._content(held)
        elif call is not None and call.id is None and not self._extra(call.index):
            self._content(call.raw + (held if self._state in ("open", "name") else ""))
        if call is not None:
            self._end_call()
        self._state = "text"

    # --- the states: each takes the unread text and returns what it leaves -------------------
    def _on_text(self, buf: str) -> str:
        """Content up to the next call's start (`<tool_call>` or a bare `<function=`)."""
        starts = [(at, tag) for tag in (CALL_START, FUNCTION_START)
                  if (at := buf.find(tag)) >= 0]
        if not starts:
            keep = max(tag_tail(buf, CALL_START), tag_tail(buf, FUNCTION_START))
            self._content(buf[:len(buf) - keep])
            self._held = buf[len(buf) - keep:]
            return ""
        at, tag = min(starts)
        self._content(buf[:at])
        self._break_content()
        self._call = _XmlCall(self._announced, raw=tag)
        self._state = "open" if tag == CALL_START else "name"
        return buf[at + len(tag):]

    def _on_open(self, buf: str) -> str:
        """After `<tool_call>`: whitespace, then `<function=`; anything else makes it content."""
        call = self._call
        assert call is not None
        rest = buf.lstrip()
        call.raw += buf[:len(buf) - len(rest)]
        if rest.startswith(FUNCTION_START):
            call.raw += FUNCTION_START
            self._state = "name"
            return rest[len(FUNCTION_START):]
        if FUNCTION_START.startswith(rest):
            self._held = rest
            return ""
        return self._not_a_call(rest)

    def _on_name(self, buf: str) -> str:
        """The function's name, up to `>`: then the call is announced."""
        call = self._call
        assert call is not None
        end = buf.find(">")
        cut = next((i for i, ch in enumerate(buf[:end if end >= 0 else len(buf)])
                    if ch in _NAME_BREAKS), -1)
        if cut >= 0:
            call.raw += buf[:cut]
            return self._not_a_call(buf[cut:])
        if end < 0:
            call.raw += buf
            return ""
        name = (call.raw.split(FUNCTION_START, 1)[1] + buf[:end]).strip()
        call.raw += buf[:end + 1]
        if not name:
            return self._not_a_call(buf[end + 1:])
        call.name = name
        if not self._extra(call.index):
            call.id = self._announce(call.index, name, "")
        self._state = "body"
        return buf[end + 1:]

    def _on_body(self, buf: str) -> str:
        """Between parameters: whitespace, then `<parameter=` or `</function>`."""
        rest = buf.lstrip()
        if rest.startswith(PARAM_START):
            self._state = "pname"
            assert self._call is not None
            self._call.param = ""
            return rest[len(PARAM_START):]
        if rest.startswith(FUNCTION_END):
            self._send("}" if self._current.params else "{}")
            self._end_call()
            self._state = "after"
            return rest[len(FUNCTION_END):]
        if rest and not PARAM_START.startswith(rest) and not FUNCTION_END.startswith(rest):
            return self._broken(rest)
        self._held = rest
        return ""

    def _on_pname(self, buf: str) -> str:
        """A parameter's name, up to `>`."""
        call = self._current
        end = buf.find(">")
        part = buf if end < 0 else buf[:end]
        name = (call.param or "") + part
        if any(ch in _NAME_BREAKS for ch in part) or (end >= 0 and not name.strip()):
            return self._broken(PARAM_START + name + buf[len(part):])
        call.param = name
        if end < 0:
            return ""
        call.param, call.value = name.strip(), []
        self._state = "value"
        return buf[end + 1:]

    def _on_value(self, buf: str) -> str:
        """A parameter's value, up to `</parameter>`: then it goes into the arguments."""
        call = self._current
        end = buf.find(PARAM_END)
        if end < 0:
            keep = tag_tail(buf, PARAM_END)
            call.value.append(buf[:len(buf) - keep])
            self._held = buf[len(buf) - keep:]
            return ""
        call.value.append(buf[:end])
        self._add_parameter(call)
        self._state = "body"
        return buf[end + len(PARAM_END):]

    def _on_after(self, buf: str) -> str:
        """After `</function>`: whitespace and `</tool_call>` (which may be missing)."""
        rest = buf.lstrip()
        if rest.startswith(CALL_END):
            self._state = "text"
            return rest[len(CALL_END):]
        if rest and not CALL_END.startswith(rest):
            self._state = "text"
            return rest
        self._held = buf
        return ""

    # --- helpers ---------------------------------------------------------------------------------
    def _not_a_call(self, rest: str) -> str:
        """A call broken before its name was read: its text is content (unless it is a call
        past `max_calls`, dropped); reading goes on with `rest` as text."""
        call = self._current
        if not self._extra(call.index):
            self._content(call.raw)
        self._end_call()
        self._state = "text"
        return rest

    def _broken(self, rest: str) -> str:
        """A call broken after its name was read keeps what was sent; `rest` is text."""
        self._end_call()
        self._state = "text"
        return rest

    def _send(self, arguments: str) -> None:
        """More of the current call's arguments (sent where it was announced)."""
        call = self._current
        if call.id is not None:
            self._send_arguments(call.index, arguments)

    def _add_parameter(self, call: _XmlCall) -> None:
        """The finished parameter, converted to its schema's type, into the arguments."""
        name = call.param or ""
        schema = self.schemas.get(call.name or "", {})
        value = convert_value(_strip_newlines("".join(call.value)),
                              parameter_schema(schema, name), schema)
        item = f"{json.dumps(name, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
        self._send(("{" if call.params == 0 else ", ") + item)
        call.params += 1
        call.param, call.value = None, []


def parse_xml_tool_calls(text: str, schemas: Mapping[str, Mapping[str, Any]],
                         max_calls: Optional[int] = None) -> Parsed:
    """The content and calls of a whole output (see the module's contract)."""
    streamer = XmlToolCallStreamer(schemas, max_calls)
    streamer.feed(text)
    streamer.finish()
    return streamer.parsed()


def tool_schemas(tools: Any) -> Dict[str, Mapping[str, Any]]:
    """Each tool's name to its parameters schema ({} where it has none), from OpenAI tools."""
    return {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
