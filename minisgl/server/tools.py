"""Chat requests' `tools`, `tool_choice` and `parallel_tool_calls`: checked, and turned into
what the rest of the request needs (the tools for the chat template, whether the output is
parsed for calls, and the grammar that enforces calls).

- `tools`: OpenAI function tools (`{"type": "function", "function": {"name", "description",
  "parameters", "strict"}}`); `parameters` is a JSON schema of an object (absent: no
  arguments). Anything else is an `ApiError` 400 naming the field, e.g.
  `tools[1].function.parameters`.
- `tool_choice`: "none" (the tools still go to the chat template, as in vLLM; the output is
  not parsed), "auto" (the default with tools: the model chooses; its output is parsed, not
  constrained), "required" (one or more calls; one with `parallel_tool_calls: false`), or
  `{"type": "function", "function": {"name": NAME}}` (exactly one call of NAME).
- "required" and a named function are enforced by the grammar: an xgrammar structural tag in the
  parser's own format (`tool_calls.ToolCallFormat`), each call's arguments constrained by its
  function's schema, so every call parses and validates. The output starts with a call. For the
  XML format (`qwen3_coder`) the arguments are xgrammar's Qwen XML parameters (`json_schema` with
  style "qwen_xml": strings as raw text, other values as JSON), which the parser converts back
  by the same schema. One gap there: xgrammar lets a string with `minLength` / `maxLength` hold
  `</parameter>` and counts a newline around it toward its length either way, so such a string
  may come back cut at `</parameter>` or a newline shorter than its `minLength`. For the
  array format (`mistral`) the grammar is the template's `[TOOL_CALLS] [CALL, ...]` (the marker
  is one token of Mistral's vocabularies, which xgrammar matches by its text), the space before
  `[` optional (the templates differ).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import jsonschema

from minisgl.core import StructuredOutput
from minisgl.server.tool_calls import CallStreamer, ToolCallFormat, ToolCallStreamer
from minisgl.server.tool_calls_array import ArrayToolCallStreamer
from minisgl.server.tool_calls_xml import XmlToolCallStreamer, tool_schemas

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_CHOICES = ("none", "auto", "required")
# Blanks allowed in a row inside enforced arguments: room for `{"a": 1}` or `{ "a": 1 }`, none
# for a small model to spend its whole budget on (unbounded, xgrammar's default, it can).
_MAX_WHITESPACE = 2
# Qwen3-Coder's call, around its parameters (what its chat template writes).
_XML_BEGIN = "<tool_call>\n<function={name}>\n"
_XML_END = "</function>\n</tool_call>"
# A function without parameters takes none: its arguments are always {}.
_NO_PARAMETERS: Dict[str, Any] = {"type": "object", "properties": {},
                                  "additionalProperties": False}


class ToolError(ValueError):
    """A bad `tools` / `tool_choice` / `parallel_tool_calls` value; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tools:
    """A request's tools and how they may be used. `forced` names the one function a named
    `tool_choice` asks for (then `choice` is "function")."""

    tools: Tuple[Dict[str, Any], ...]  # for the chat template, in OpenAI's shape
    choice: str  # none, auto, required or function
    parallel: bool = True
    forced: Optional[str] = None

    @property
    def parsed(self) -> bool:
        """Whether the output is read for calls."""
        return self.choice != "none"

    @property
    def called_reason(self) -> str:
        """The finish_reason of an output that ended by itself after its calls: "tool_calls",
        except for a named function, where OpenAI (and vLLM) say "stop"."""
        return "stop" if self.choice == "function" else "tool_calls"

    @property
    def max_calls(self) -> Optional[int]:
        return None if self.parallel and self.choice != "function" else 1

    def parameters(self, name: str) -> Dict[str, Any]:
        """The JSON schema of function `name`'s arguments."""
        fn = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        params = fn.get("parameters")
        return _NO_PARAMETERS if params is None else params

    def template_json(self) -> str:
        return json.dumps(list(self.tools), ensure_ascii=False)

    def streamer(self, fmt: ToolCallFormat) -> CallStreamer:
        """A reader of one choice's output for calls in `fmt` (the XML format converts values
        by these tools' schemas)."""
        if fmt.xml:
            return XmlToolCallStreamer(tool_schemas(self.tools), self.max_calls)
        if fmt.array:
            return ArrayToolCallStreamer(self.max_calls, fmt)
        return ToolCallStreamer(fmt, self.max_calls)

    def _call_tag(self, fmt: ToolCallFormat, name: str) -> Dict[str, Any]:
        """The structural tag of one call of `name` in `fmt`."""
        if fmt.enforce_named:  # Mistral v11: [TOOL_CALLS]NAME[ARGS]{...}, each call
            return {"type": "tag", "begin": f"{fmt.start}{name}[ARGS]",
                    "content": {"type": "json_schema", "json_schema": self.parameters(name),
                                "max_whitespace_cnt": _MAX_WHITESPACE},
                    "end": ""}
        if fmt.xml:
            return {"type": "tag", "begin": _XML_BEGIN.format(name=name),
                    "content": {"type": "json_schema", "json_schema": self.parameters(name),
                                "style": "qwen_xml", "max_whitespace_cnt": _MAX_WHITESPACE},
                    "end": _XML_END}
        return {"type": "tag", "begin": fmt.call_prefix(name),
                "content": {"type": "json_schema", "json_schema": self.parameters(name),
                            "max_whitespace_cnt": _MAX_WHITESPACE},
                "end": fmt.call_suffix}

    def constraint(self, fmt: ToolCallFormat) -> Optional[StructuredOutput]:
        """The grammar of the calls "required" or a named function asks for, in `fmt`: a
        structural tag (xgrammar's JSON), or None when the output is free."""
        if self.choice not in ("required", "function"):
            return None
        names = [self.forced] if self.forced is not None else [
            t["function"]["name"] for t in self.tools]
        tags = [self._call_tag(fmt, name) for name in names]
        if self.max_calls == 1 and len(tags) == 1:
            form: Dict[str, Any] = tags[0]
        else:
            form = {"type": "tags_with_separator", "tags": tags, "separator": fmt.separator,
                    "at_least_one": True, "stop_after_first": self.max_calls == 1}
        if fmt.array and not fmt.enforce_named:
            form = _in_array(fmt, form)
        spec = json.dumps({"type": "structural_tag", "format": form}, ensure_ascii=False)
        return StructuredOutput("structural_tag", spec)


def _in_array(fmt: ToolCallFormat, calls: Dict[str, Any]) -> Dict[str, Any]:
    """`calls` (one call's tag, or calls with separators) as the array format writes them:
    `START [` (the space optional), the calls, `]`."""
    def text(value: str) -> Dict[str, Any]:
        return {"type": "const_string", "value": value}
    opening = {"type": "or", "elements": [text(f"{fmt.start} ["), text(f"{fmt.start}[")]}
    return {"type": "sequence", "elements": [opening, calls, text("]")]}


def _check_parameters(where: str, params: Any) -> None:
    if not isinstance(params, dict):
        raise ToolError(f"{where}: must be a JSON schema object, got "
                        f"{json.dumps(params)[:80]}", where)
    kind = params.get("type", "object")
    if kind != "object":
        raise ToolError(f"{where}: the arguments' schema must have type \"object\", got "
                        f"{json.dumps(kind)}", where)
    try:
        jsonschema.validators.validator_for(params).check_schema(params)
    except jsonschema.SchemaError as e:
        path = "".join(f"[{json.dumps(p)}]" for p in e.path)
        raise ToolError(f"{where}: not a valid JSON schema: {e.message}"
                        f"{f' (at {path})' if path else ''}", where) from None


def _check_tool(i: int, tool: Any) -> Dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise ToolError(f"{where}: must be an object with type \"function\"", where)
    if tool.get("type") != "function":
        raise ToolError(f"{where}.type: unknown tool type {json.dumps(tool.get('type'))}; "
                        f"only \"function\" is supported", f"{where}.type")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise ToolError(f"{where}.function: missing, or not an object", f"{where}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ToolError(f"{where}.function.name: must be 1 to 64 letters, digits, '_' or '-', "
                        f"got {json.dumps(name)}", f"{where}.function.name")
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise ToolError(f"{where}.function.description: must be a string",
                        f"{where}.function.description")
    if fn.get("strict") is not None and not isinstance(fn.get("strict"), bool):
        raise ToolError(f"{where}.function.strict: must be true or false",
                        f"{where}.function.strict")
    if fn.get("parameters") is not None:
        _check_parameters(f"{where}.function.parameters", fn["parameters"])
    return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}


def _forced_name(choice: Dict[str, Any]) -> str:
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise ToolError("tool_choice: an object must be {\"type\": \"function\", \"function\": "
                        "{\"name\": NAME}}", "tool_choice")
    return name


def parse_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> Optional[Tools]:
    """The request's tools, or None when it has none (and asks for none); ToolError naming the
    field otherwise."""
    if tools is not None and not isinstance(tools, list):
        raise ToolError("tools: must be a list of tools", "tools")
    checked = [_check_tool(i, t) for i, t in enumerate(tools or [])]
    names = [t["function"]["name"] for t in checked]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ToolError(f"tools[{i}].function.name: {name!r} is given twice",
                            f"tools[{i}].function.name")
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ToolError("parallel_tool_calls: must be true or false", "parallel_tool_calls")
    parallel = parallel_tool_calls is not False
    if tool_choice is None:
        choice, forced = ("auto" if checked else "none"), None
    elif isinstance(tool_choice, str):
        if tool_choice not in _CHOICES:
            raise ToolError(f"tool_choice: must be one of {', '.join(_CHOICES)} or a named "
                            f"function, got {tool_choice!r}", "tool_choice")
        choice, forced = tool_choice, None
    elif isinstance(tool_choice, dict):
        choice, forced = "function", _forced_name(tool_choice)
        if forced not in names:
            known = ", ".join(names) or "none"
            raise ToolError(f"tool_choice: function {forced!r} is not among the tools "
                            f"(given: {known})", "tool_choice")
    else:
        raise ToolError("tool_choice: must be a string or an object", "tool_choice")
    if choice in ("auto", "required") and not checked and tool_choice is not None:
        raise ToolError(f"tool_choice: {choice!r} needs tools", "tool_choice")
    if not checked:
        return None
    return Tools(tuple(checked), choice, parallel, forced)


def assistant_tool_calls(where: str, calls: Any) -> List[Dict[str, Any]]:
    """An assistant message's `tool_calls`, checked (each `function.arguments` a JSON text, as
    OpenAI sends them back); ToolError naming the field."""
    if not isinstance(calls, list):
        raise ToolError(f"{where}: must be a list", where)
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolError(f"{at}: must be {{\"id\", \"type\": \"function\", \"function\": "
                            f"{{\"name\", \"arguments\"}}}}", at)
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            raise ToolError(f"{at}.function.arguments: must be a JSON text (a string)",
                            f"{at}.function.arguments")
        try:
            json.loads(args)
        except json.JSONDecodeError as e:
            raise ToolError(f"{at}.function.arguments: not valid JSON: {e}",
                            f"{at}.function.arguments") from None
        call_id = call.get("id")
        out.append({"id": call_id if isinstance(call_id, str) else f"call_{j}",
                    "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out
