"""The structured-output fields of a request body, read into one `core.StructuredOutput`.

OpenAI's `response_format` ({"type": "json_object"}, {"type": "json_schema", "json_schema":
{"name", "schema", "strict"}}; {"type": "text"} asks for nothing), vLLM's `structured_outputs`
({json | regex | choice | grammar | json_object | structural_tag}) and its older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`, and SGLang's `regex`, `ebnf`, `json_schema`
and `choice`. At most one constraint per request (a 400 names the second field); the shape of
each value is checked here, whether it compiles by the tokenizer process (a 400 naming the same
field, see `Job.structured_param`).
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, NamedTuple, Optional

from minisgl.core import StructuredOutput

# vLLM's structured_outputs keys: the constraint ones, then options this server takes as given
# (its JSON is compact already; xgrammar is the only backend).
_SO_KINDS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar",
             "json_object": "json_object", "structural_tag": "structural_tag"}
_SO_OPTIONS = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties",
               "backend")
# Top-level fields: name -> kind.
_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar", "json_schema": "json", "regex": "regex",
           "ebnf": "grammar", "choice": "choice", "structural_tag": "structural_tag"}
FIELDS = ("response_format", "structured_outputs", *_FIELDS)


class Constraint(NamedTuple):
    structured: StructuredOutput
    param: str  # the request field it came from (errors name it)


class FieldError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _spec(kind: str, value: Any, param: str) -> StructuredOutput:
    """The constraint of one field's value, checked for shape."""
    if kind == "json":
        if isinstance(value, str):
            return StructuredOutput("json", value)
        if isinstance(value, (dict, bool)):
            return StructuredOutput("json", json.dumps(value))
        raise FieldError(f"{param}: a JSON schema must be an object or its JSON text, got "
                         f"{type(value).__name__}", param)
    if kind == "choice":
        if (not isinstance(value, list) or not value
                or not all(isinstance(c, str) for c in value)):
            raise FieldError(f"{param}: must be a non-empty list of strings", param)
        return StructuredOutput("choice", json.dumps(value))
    if kind == "json_object":
        if value is not True:
            raise FieldError(f"{param}: json_object takes true, got {json.dumps(value)}", param)
        return StructuredOutput("json_object")
    if kind == "structural_tag" and isinstance(value, dict):
        return StructuredOutput("structural_tag", json.dumps(value))
    if not isinstance(value, str) or not value:
        raise FieldError(f"{param}: must be a non-empty string, got {json.dumps(value)}", param)
    return StructuredOutput(kind, value)  # type: ignore[arg-type]


def _response_format(value: Any) -> Optional[StructuredOutput]:
    param = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise FieldError(f"{param}: must be an object with a type", param)
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        inner = value.get("json_schema")
        if not isinstance(inner, dict):
            raise FieldError(f"{param}: type json_schema needs a json_schema object with the "
                             f"schema", param)
        if "schema" not in inner:  # OpenAI's schema is optional: any JSON object then
            return StructuredOutput("json_object")
        return _spec("json", inner["schema"], param)
    if kind == "structural_tag":  # vLLM's: xgrammar's structural tag, this object itself
        return StructuredOutput("structural_tag", json.dumps(value))
    raise FieldError(f"{param}: unknown type {kind!r}; expected text, json_object, json_schema "
                     f"or structural_tag", param)


def _structured_outputs(value: Any) -> List[Constraint]:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise FieldError(f"{param}: must be an object", param)
    unknown = [k for k in value if k not in _SO_KINDS and k not in _SO_OPTIONS]
    if unknown:
        raise FieldError(f"{param}: unsupported key {unknown[0]!r}; expected one of "
                         f"{', '.join(_SO_KINDS)}", param)
    return [Constraint(_spec(_SO_KINDS[k], v, param), param) for k, v in value.items()
            if k in _SO_KINDS and v is not None and v is not False]


def constraint(extra: Dict[str, Any]) -> Optional[Constraint]:
    """The one constraint the body's fields ask for (None for none); FieldError naming the
    field for a malformed value or a second constraint."""
    found: List[Constraint] = []
    for name in FIELDS:
        value = extra.get(name)
        if value is None:
            continue
        if name == "response_format":
            rf = _response_format(value)
            found.extend([Constraint(rf, name)] if rf is not None else [])
        elif name == "structured_outputs":
            found.extend(_structured_outputs(value))
        else:
            found.append(Constraint(_spec(_FIELDS[name], value, name), name))
        if len(found) > 1:
            first, second = found[0].param, found[1].param
            what = f"{first} sets two constraints" if first == second else (
                f"{first} and {second} both constrain the output")
            raise FieldError(f"{what}; send one", second)
    return found[0] if found else None
