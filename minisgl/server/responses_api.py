"""OpenAI's Responses API (`POST /v1/responses`), request side: a request becomes the chat
request it is served as (server/responses_output.py builds the reply).

A request's `instructions` (a system message), the conversation of its `previous_response_id`
and its `input` (a string, or a list of items: messages with text content, `function_call`
items and their `function_call_output`s, `reasoning` items, whose thinking goes with the
assistant turn after them as `reasoning_content` for the chat template to keep or drop) become
one chat prompt. Function `tools` (the API's flat shape), `tool_choice` and
`parallel_tool_calls` go to the chat path's tools (calls read in the server's
--tool-call-parser format and, where required or named, enforced); `text.format` (json_object,
json_schema) to its structured output; `reasoning.effort` to the chat template as Chat
Completions' `reasoning_effort` does. Finished conversations are kept in memory, the newest
`ResponseStore.capacity` of them, so that a later request can continue one; `store: false`
keeps none. `include: ["message.output_text.logprobs"]` with `top_logprobs` asks for the output
text's log-probabilities as Chat Completions' logprobs; `include:
["reasoning.encrypted_content"]` gives each reasoning item an `encrypted_content` that a client
keeping no state (store false) sends back to continue with the thinking (encoded, not
encrypted: `reasoning_blob`). A stored response's input items are listed by GET
/v1/responses/{id}/input_items (`items_page`). Hosted tools (web search, file search, MCP
...), other `include` values and prompt templates get a 400 naming the field; `truncation:
"auto"` drops the conversation's oldest turns where it outgrows the context
(tokenizer/truncation.py). A request's
`conversation` (the Conversations API's: conversations.py) comes before its input, and its
turn is recorded there. `background: true` runs the response after the request is answered
(responses_background.py).
"""

from __future__ import annotations

import base64
import dataclasses
import collections
import json
import re
import zlib
import uuid
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Union

from pydantic import BaseModel, ConfigDict, ValidationError

from minisgl.models.generation import SamplingDefaults
from minisgl.server.protocol import ApiError, ChatRequest, Job, chat_job

Messages = List[Dict[str, Any]]
REASONING_SUMMARIES = (None, "auto", "concise", "detailed")


def _reasoning(value: Any) -> Optional[str]:
    """The chat template's reasoning_effort of a `reasoning` object (effort and summary; the
    summary is accepted, as clients send "auto" by default, but none is written: reasoning
    items carry the model's own thinking as content). ApiError 400 naming `reasoning`."""
    if value is None:
        return None
    if (not isinstance(value, dict) or not set(value) <= {"effort", "summary"}
            or value.get("summary") not in REASONING_SUMMARIES
            or not isinstance(value.get("effort"), (str, type(None)))):
        raise ApiError(400, f"reasoning: an object of `effort` (a string) and `summary` (one "
                            f"of auto, concise, detailed), got {json.dumps(value):.120}",
                       "reasoning")
    return value.get("effort")


LOGPROBS_INCLUDE = "message.output_text.logprobs"
REASONING_INCLUDE = "reasoning.encrypted_content"
# What a reasoning item's encrypted_content holds here: its thinking, zlib-compressed, in URL-safe
# base64 after this prefix. Encoded, not encrypted (the thinking is in the item's content too):
# it only has to come back unchanged from a client that keeps no state (store false).
_BLOB_PREFIX = "minisgl-reasoning-v1."


class Include(NamedTuple):
    """What a request's `include` asks for beyond the defaults."""

    logprobs: bool = False  # the output text's log-probabilities
    reasoning: bool = False  # reasoning items' thinking as encrypted_content, to send back


def parse_include(include: Any) -> Include:
    """`include` read; ApiError 400 naming it for another value (tool results and the rest are
    not produced here)."""
    if include is None:
        return Include()
    served = (LOGPROBS_INCLUDE, REASONING_INCLUDE)
    if not isinstance(include, list) or any(v not in served for v in include):
        raise ApiError(400, f"include: only {' and '.join(map(repr, served))} are served, got "
                            f"{json.dumps(include):.120}", "include")
    return Include(LOGPROBS_INCLUDE in include, REASONING_INCLUDE in include)


def reasoning_blob(thinking: str) -> str:
    """A reasoning item's encrypted_content for `thinking` (see _BLOB_PREFIX)."""
    packed = base64.urlsafe_b64encode(zlib.compress(thinking.encode("utf-8")))
    return _BLOB_PREFIX + packed.decode("ascii")


def blob_reasoning(blob: str) -> Optional[str]:
    """The thinking of a `reasoning_blob`, or None for one this server did not write (another
    provider's encrypted content: it cannot be read, so the turn goes on without it)."""
    if not blob.startswith(_BLOB_PREFIX):
        return None
    try:
        packed = base64.urlsafe_b64decode(blob[len(_BLOB_PREFIX):].encode("ascii"))
        return zlib.decompress(packed).decode("utf-8")
    except (ValueError, zlib.error):
        return None


_INERT: Dict[str, Callable[[Any], bool]] = {
    "prompt": lambda v: v is None,
    "max_tool_calls": lambda v: v is None,
}


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: Optional[str] = None
    input: Union[str, List[Dict[str, Any]]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: bool = False
    store: bool = True
    previous_response_id: Optional[str] = None
    metadata: Optional[Dict[str, str]] = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    text: Any = None
    reasoning: Any = None
    include: Any = None
    top_logprobs: Optional[int] = None
    background: Optional[bool] = None
    conversation: Any = None  # an id or {"id": ...} (conversations.conversation_id)
    truncation: Optional[str] = None  # "auto": the oldest turns dropped to fit; "disabled"


class Stored(NamedTuple):
    messages: Messages  # the conversation, the response's turn last
    response: Dict[str, Any]  # the response object as it was answered
    items: List[Dict[str, Any]]  # its request's input items (`input_items`)


class ResponseStore:
    """The newest `capacity` finished responses by id (oldest dropped first): each one's
    conversation (what `previous_response_id` continues) and its response object (what GET
    /v1/responses/{id} answers). Only the API server's event loop touches it."""

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._items: "collections.OrderedDict[str, Stored]" = collections.OrderedDict()

    def stored(self, response_id: str, param: Optional[str] = None) -> Stored:
        """The response `response_id`; ApiError 404 naming `param` where it is not kept."""
        if response_id not in self._items:
            where = f"{param}: no" if param else "No"
            raise ApiError(404, f"{where} stored response {response_id!r} (the server keeps "
                                f"the newest {self.capacity})", param, "response_not_found",
                           "not_found_error")
        return self._items[response_id]

    def get(self, response_id: str) -> Messages:
        """The conversation a request's previous_response_id continues (ApiError 400 while
        that response still runs in the background)."""
        stored = self.stored(response_id, "previous_response_id")
        if stored.response.get("status") == "in_progress":
            raise ApiError(400, f"previous_response_id: response {response_id!r} is still in "
                                f"progress", "previous_response_id")
        return stored.messages

    def put(self, response_id: str, messages: Messages, response: Dict[str, Any],
            items: Sequence[Dict[str, Any]] = ()) -> None:
        self._items[response_id] = Stored(messages, response, list(items))
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def delete(self, response_id: str) -> None:
        self.stored(response_id)
        del self._items[response_id]


# --- input items -> chat messages -----------------------------------------------------------------
_TEXT_PARTS = ("input_text", "output_text", "text")


def _text(where: str, content: Any) -> str:
    """A string, or text parts joined (images and files are not served)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or any(
            not isinstance(p, dict) or p.get("type") not in _TEXT_PARTS
            or not isinstance(p.get("text"), str) for p in content):
        raise ApiError(400, f"{where}: only text parts (input_text, output_text) are supported",
                       where)
    return "".join(p["text"] for p in content)


def _strings(where: str, item: Dict[str, Any], *keys: str) -> List[str]:
    values = [item.get(k) for k in keys]
    missing = [k for k, v in zip(keys, values) if not isinstance(v, str)]
    if missing:
        raise ApiError(400, f"{where}.{missing[0]}: a {item.get('type')} item needs "
                            f"{', '.join(keys)} (strings)", f"{where}.{missing[0]}")
    return values  # type: ignore[return-value]


def _thinking(where: str, item: Dict[str, Any]) -> Optional[str]:
    """A reasoning item's thinking: its reasoning_text content, else what its
    encrypted_content holds where this server wrote it, else None (a summary is not the
    thinking; another provider's encrypted content cannot be read)."""
    content = item.get("content")
    if content:
        if not isinstance(content, list) or any(
                not isinstance(p, dict) or p.get("type") != "reasoning_text"
                or not isinstance(p.get("text"), str) for p in content):
            raise ApiError(400, f"{where}.content: reasoning content is a list of "
                                f"reasoning_text parts", f"{where}.content")
        return "".join(p["text"] for p in content)
    blob = item.get("encrypted_content")
    if blob is not None and not isinstance(blob, str):
        raise ApiError(400, f"{where}.encrypted_content: must be a string",
                       f"{where}.encrypted_content")
    return blob_reasoning(blob) if blob else None


def _assistant(out: Messages, thinking: Optional[str]) -> Dict[str, Any]:
    """The assistant message a call joins: the last message where it is the assistant's and
    no thinking came between, else a new one (with the thinking that came before it)."""
    if out and out[-1]["role"] == "assistant" and thinking is None:
        return out[-1]
    out.append({"role": "assistant", "content": "",
                **({"reasoning_content": thinking} if thinking is not None else {})})
    return out[-1]


def input_messages(items: List[Dict[str, Any]], param: str = "input") -> Messages:
    """Input items as chat messages, in order: a `function_call` joins the assistant message
    just before it (or starts one), its `function_call_output` is a tool message; a
    `reasoning` item's thinking goes with the assistant message after it (as
    `reasoning_content`, for the chat template), and is dropped where none follows. ApiError
    400 names a bad item as `param`.i."""
    out: Messages = []
    thinking: Optional[str] = None  # of a reasoning item, until the model's next turn
    for i, item in enumerate(items):
        where, kind = f"{param}.{i}", item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str):
                raise ApiError(400, f"{where}.role: a message needs a role", f"{where}.role")
            out.append({"role": role, "content": _text(f"{where}.content", item.get("content")),
                        **({"reasoning_content": thinking}
                           if role == "assistant" and thinking is not None else {})})
            thinking = None
        elif kind == "function_call":
            call_id, name, args = _strings(where, item, "call_id", "name", "arguments")
            call = {"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": args}}
            _assistant(out, thinking).setdefault("tool_calls", []).append(call)
            thinking = None
        elif kind == "function_call_output":
            (call_id,) = _strings(where, item, "call_id")
            out.append({"role": "tool", "tool_call_id": call_id,
                        "content": _text(f"{where}.output", item.get("output"))})
            thinking = None
        elif kind == "reasoning":
            more = _thinking(where, item)
            thinking = more if thinking is None else thinking + (more or "")
        else:
            raise ApiError(400, f"{where}.type: {json.dumps(kind)} items are not supported "
                                f"(supported: message, function_call, function_call_output, "
                                f"reasoning)", f"{where}.type")
    return out


_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                "reasoning": "rs"}


def listed_item(item: Dict[str, Any]) -> Dict[str, Any]:
    """One input item as the API lists it: its id (the client's, else a new one), status
    completed, a message's content as parts (input_text; an assistant's output_text)."""
    kind = item.get("type", "message")
    out = {**item, "type": kind, "status": "completed",
           "id": item.get("id") or f"{_ID_PREFIXES[kind]}_{uuid.uuid4().hex}"}
    if kind == "message":
        parts = item["content"] if isinstance(item["content"], list) else [
            {"text": item["content"]}]
        out["content"] = [{"type": "output_text", "text": p["text"], "annotations": []}
                          if item["role"] == "assistant" else
                          {"type": "input_text", "text": p["text"]} for p in parts]
    elif kind == "reasoning":
        out.pop("status")
        out.setdefault("summary", [])
    return out


def input_items(body: ResponsesRequest) -> List[Dict[str, Any]]:
    """The request's `input` as items in order (a string: one user message), as GET
    /v1/responses/{id}/input_items lists them. `input` was checked by `response_messages`."""
    given = ([{"type": "message", "role": "user", "content": body.input}]
             if isinstance(body.input, str) else body.input)
    return [listed_item(item) for item in given]


def items_page(items: List[Dict[str, Any]], limit: Any = 20, order: Any = "desc",
               after: Optional[str] = None, holder: str = "this response") -> Dict[str, Any]:
    """A page of items (a response's input items, a conversation's) in the API's list shape:
    `limit` (1 to 100) of them in `order` (asc: as given; desc, the default: newest first)
    after the item `after`; ApiError 400 naming a bad parameter."""
    try:
        count = int(limit)
    except (TypeError, ValueError):
        count = 0
    if not 1 <= count <= 100:
        raise ApiError(400, f"limit must be an integer from 1 to 100, got {limit!r}", "limit")
    if order not in ("asc", "desc"):
        raise ApiError(400, f"order must be asc or desc, got {order!r}", "order")
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise ApiError(400, f"after: no item {after!r} in {holder}", "after")
        start = ids.index(after) + 1
    page = ordered[start:start + count]
    return {"object": "list", "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": start + count < len(ordered)}


def response_messages(body: ResponsesRequest, store: ResponseStore,
                      conversation: Sequence[Dict[str, Any]] = ()) -> Messages:
    """The whole conversation the request continues, its input last: the instructions, the
    stored turns of its previous_response_id, or `conversation` (the messages of the
    Conversations API's conversation it names: conversations.py), then its input."""
    if body.conversation is not None and body.previous_response_id is not None:
        raise ApiError(400, "conversation and previous_response_id are mutually exclusive: "
                            "give one", "conversation")
    messages: Messages = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    messages += conversation
    if body.previous_response_id is not None:
        messages += [m for m in store.get(body.previous_response_id) if m["role"] != "system"]
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
    else:
        messages += input_messages(body.input)
    return messages


# --- tools and text formats -> chat's ----------------------------------------------------------
def _tool(i: int, tool: Any) -> Dict[str, Any]:
    """A function tool (the API's flat shape) as chat's; the chat path checks its fields."""
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise ApiError(400, f"tools.{i}.type: {json.dumps(kind)} tools are not served; only "
                            f"function tools (name, description, parameters, strict)",
                       f"tools.{i}.type")
    fn = {k: tool.get(k) for k in ("name", "description", "parameters", "strict")}
    return {"type": "function", "function": fn}


def _tool_choice(choice: Any) -> Any:
    """`tool_choice` as chat's: the same strings; {"type": "function", "name": ...} named."""
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    kind = choice.get("type") if isinstance(choice, dict) else None
    raise ApiError(400, f"tool_choice: none, auto, required or {{\"type\": \"function\", "
                        f"\"name\": ...}}, got type {json.dumps(kind)}", "tool_choice")


def _response_format(text: Any) -> Optional[Dict[str, Any]]:
    """`text.format` as chat's response_format (None: plain text)."""
    if text is None:
        return None
    if not isinstance(text, dict) or not set(text) <= {"format"}:
        extra = sorted(set(text) - {"format"}) if isinstance(text, dict) else []
        param = f"text.{extra[0]}" if extra else "text"
        raise ApiError(400, f"{param}: only text.format is supported", param)
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise ApiError(400, "text.format: must be an object with a type", "text.format")
    if fmt.get("type") != "json_schema":
        return fmt  # text, json_object, or a type chat's check names
    schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}


_CHAT_TOOL_FIELD = re.compile(r"tools\[(\d+)\]\.function\.")


def _responses_names(text: str) -> str:
    """A chat path's field names in an error, as this API names them."""
    text = _CHAT_TOOL_FIELD.sub(lambda m: f"tools.{m.group(1)}.", text)
    for chat, ours in (("max_tokens", "max_output_tokens"), ("response_format", "text.format"),
                       ("reasoning_effort", "reasoning"),
                       ("logprobs: true", f"include [{LOGPROBS_INCLUDE!r}]")):
        text = text.replace(chat, ours)
    return text


def responses_job(body: ResponsesRequest, messages: Messages, max_n: int,
                  defaults: SamplingDefaults = SamplingDefaults(),
                  tool_parser: Optional[str] = None,
                  reasoning_parser: Optional[str] = None) -> Job:
    """The request's job: the chat request it is served as, with the server's tool-call
    parser, sampling defaults and reasoning parser. ApiError 400 naming the field (this
    API's name for it)."""
    for name, value in (body.model_extra or {}).items():
        inert = _INERT.get(name)
        if inert is not None and not inert(value):
            raise ApiError(400, f"{name} is not supported by this server", name)
    if body.background and (body.stream or not body.store):
        raise ApiError(400, "background: a background response is stored and polled (store "
                            "true, stream false)", "background")
    tools = body.tools
    if tools is not None and not isinstance(tools, list):
        raise ApiError(400, "tools: must be a list of tools", "tools")
    fields = {"messages": messages, "max_tokens": body.max_output_tokens,
              "temperature": body.temperature, "top_p": body.top_p, "stream": body.stream,
              "reasoning_effort": _reasoning(body.reasoning),
              "tools": [_tool(i, t) for i, t in enumerate(tools)] if tools else None,
              "tool_choice": _tool_choice(body.tool_choice),
              "parallel_tool_calls": body.parallel_tool_calls,
              "response_format": _response_format(body.text),
              "logprobs": parse_include(body.include).logprobs or None,
              "top_logprobs": body.top_logprobs}
    try:
        chat = ChatRequest.model_validate(fields)
    except ValidationError as e:
        raise ApiError(400, f"input: {e.errors()[0]['msg']}", "input") from None
    if body.truncation not in (None, "disabled", "auto"):
        raise ApiError(400, f"truncation: must be auto or disabled, got {body.truncation!r}",
                       "truncation")
    try:
        job = chat_job(chat, max_n, tool_parser, defaults, reasoning_parser)
    except ApiError as e:
        param = "input" if (e.param or "").startswith("messages") else e.param
        raise ApiError(e.status, _responses_names(e.message),
                       _responses_names(param) if param else None) from None
    if body.truncation != "auto":
        return job
    # the oldest turns go where the conversation outgrows the context (tokenizer/truncation.py)
    return dataclasses.replace(job, prompts=[dataclasses.replace(p, drop_oldest=True)
                                             for p in job.prompts])
