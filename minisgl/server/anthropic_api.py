"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) on top of the
chat path, as vLLM serves it: Anthropic clients (the `anthropic` SDKs, Claude Code through
`ANTHROPIC_BASE_URL`) can use the served model.

A request becomes a `ChatRequest` (`chat_request`) and goes through `chat_job` with the server's
sampling defaults and tool-call parser, so it is tokenized, constrained and read for tool calls
exactly as a chat request:
- `system` (a string or text blocks) is a system message; `messages` alternate `user` and
  `assistant`, each a string or blocks: `text`; an assistant's `tool_use` blocks are its OpenAI
  `tool_calls` (`input` as the arguments' JSON text); a user's `tool_result` blocks are `tool`
  messages (content a string or text blocks) before the rest of that user message; an
  assistant's `thinking` blocks are its `reasoning_content`, which the chat template keeps
  (Qwen3's: a tool loop's, after the last user message) or drops; `redacted_thinking` blocks
  (another model's, encrypted) are dropped. Any other block (`image`, `document`, ...) is a
  400 naming it. A final assistant message is a prefill: the reply continues it
  (`continue_final_message`).
- `tools` (`{name, description, input_schema}`) are function tools; `tool_choice` `auto`, `any`
  ("required"), `tool` (a named function) or `none`, `disable_parallel_tool_use` is
  `parallel_tool_calls: false`. `any` and `tool` are enforced by the grammar (tools.py).
- `stop_sequences`, `temperature`, `top_p`, `top_k`, `max_tokens` (required), `stream`;
  `metadata`, `cache_control`, `service_tier` and the like have no effect (`_INERT`).
  `thinking` turns the chat template's `enable_thinking` on ("enabled", "adaptive") or off
  ("disabled"); its `budget_tokens` is checked as Anthropic checks it but not enforced
  (max_tokens bounds the reply).
  Documented fields this server does not serve (`output_config`, `container`,
  `mcp_servers`, ...) are a 400 naming them unless
  their value asks for nothing, and so is any field the API does not have (as Anthropic's own
  API answers).

The reply (`MessagesFormatter`) is a `message` with `text`, `tool_use` (`id` "toolu_...",
`input` an object) and, with `--reasoning-parser`, `thinking` blocks, or, streamed, the API's
events (`message_start`, `content_block_start` / `_delta` / `_stop`, `message_delta`,
`message_stop`). The plain message is built by folding the very events a stream of the same
output sends (`fold_events`), so the two always agree. Errors on these paths take Anthropic's
shape (error_shapes.py), in the handlers and in the middleware alike.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, ValidationError

from minisgl.message.types import ReplyChunk
from minisgl.models.generation import SamplingDefaults
from minisgl.server.error_shapes import anthropic_error_body
from minisgl.server.protocol import ApiError, ChatRequest, Job, Prompt, chat_job
from minisgl.server.responses import ChatFormatter, Choice

# Fields of Anthropic's API this server does not serve, each with the test for a value that asks
# for nothing (accepted); `metadata` (declared) and these inert ones have no effect at all.
_UNSERVED: Dict[str, Callable[[Any], bool]] = {
    "output_config": lambda v: not v,
    "output_format": lambda v: v is None,
    "container": lambda v: v is None,
    "context_management": lambda v: v is None,
    "mcp_servers": lambda v: not v,
    "diagnostics": lambda v: v is None,
}
# routing, billing and caching hints (this server's prefix cache needs none): no effect on output
_INERT = frozenset({"service_tier", "inference_geo", "speed", "cache_control", "workspace_id",
                    "user_profile_id"})
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
_MIN_THINKING_BUDGET = 1024  # Anthropic's least budget_tokens


# --- request bodies -----------------------------------------------------------------------------
class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class InputMessage(_Body):
    role: str
    content: Union[str, List[Dict[str, Any]]]


class CountTokensRequest(_Body):
    """POST /v1/messages/count_tokens: what a messages request's prompt is made of."""

    model: str
    messages: List[InputMessage]
    system: Union[None, str, List[Dict[str, Any]]] = None
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Optional[Dict[str, Any]] = None
    thinking: Any = None  # checked by _thinking, which names the field at fault


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int
    stop_sequences: Optional[List[str]] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    stream: Optional[bool] = None  # null: false
    metadata: Optional[Dict[str, Any]] = None  # a user id: no effect


# --- conversion to a chat request ---------------------------------------------------------------
def _text_of(where: str, blocks: Union[str, List[Dict[str, Any]]]) -> str:
    """The text of a string or of text blocks (joined with newlines, as the chat path joins a
    message's text parts); ApiError naming the first other block."""
    if isinstance(blocks, str):
        return blocks
    texts = []
    for j, block in enumerate(blocks):
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise ApiError(400, f"{where}.{j}: only text blocks are supported here, got type "
                                f"{json.dumps(block.get('type'))}", f"{where}.{j}.type")
        texts.append(block["text"])
    return "\n".join(texts)


def _tool_call(where: str, block: Dict[str, Any]) -> Dict[str, Any]:
    """An assistant's `tool_use` block as an OpenAI tool call."""
    call_id, name, args = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(args, dict):
        raise ApiError(400, f"{where}: a tool_use block needs an `id` and a `name` (strings) and "
                            f"an `input` object", where)
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def _tool_message(where: str, block: Dict[str, Any]) -> Dict[str, Any]:
    """A user's `tool_result` block as an OpenAI tool message (`is_error` has no place in a
    chat template: the content says what went wrong)."""
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str):
        raise ApiError(400, f"{where}.tool_use_id: a tool_result block answers a tool_use id "
                            f"(a string)", f"{where}.tool_use_id")
    content = block.get("content", "")
    if not isinstance(content, (str, list)) or isinstance(content, list) and any(
            not isinstance(b, dict) for b in content):
        raise ApiError(400, f"{where}.content: a string or a list of text blocks",
                       f"{where}.content")
    return {"role": "tool", "tool_call_id": call_id,
            "content": _text_of(f"{where}.content", content)}


@dataclass
class _Turn:
    """One Anthropic message being turned into chat messages (text and calls so far)."""

    role: str
    texts: List[str] = field(default_factory=list)
    calls: List[Dict[str, Any]] = field(default_factory=list)
    thinking: List[str] = field(default_factory=list)  # an assistant's thinking blocks

    def flush(self, out: List[Dict[str, Any]]) -> None:
        if self.texts or self.calls or self.thinking:
            msg: Dict[str, Any] = {"role": self.role, "content": "\n".join(self.texts)}
            if self.thinking:
                msg["reasoning_content"] = "\n".join(self.thinking)
            if self.calls:
                msg["tool_calls"] = self.calls
            out.append(msg)
        self.texts, self.calls, self.thinking = [], [], []


def _chat_messages(i: int, msg: InputMessage) -> List[Dict[str, Any]]:
    """One Anthropic message as chat messages, in order (a user's tool results become tool
    messages, its text a user message after them)."""
    where = f"messages.{i}"
    if msg.role not in ("user", "assistant"):
        raise ApiError(400, f"{where}.role: must be \"user\" or \"assistant\", got "
                            f"{msg.role!r}", f"{where}.role")
    if isinstance(msg.content, str):
        return [{"role": msg.role, "content": msg.content}]
    out: List[Dict[str, Any]] = []
    turn = _Turn(msg.role)
    allowed = {"user": ("text", "tool_result"),
               "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}[msg.role]
    for j, block in enumerate(msg.content):
        at, kind = f"{where}.content.{j}", block.get("type")
        if kind not in allowed:
            raise ApiError(400, f"{at}.type: {json.dumps(kind)} blocks are not supported in "
                                f"{msg.role} messages by this server (supported: "
                                f"{', '.join(allowed)})", f"{at}.type")
        if kind == "text":
            turn.texts.append(_text_of(f"{where}.content", [block]))
        elif kind == "tool_use":
            turn.calls.append(_tool_call(at, block))
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise ApiError(400, f"{at}.thinking: a thinking block's text (a string)",
                               f"{at}.thinking")
            turn.thinking.append(block["thinking"])
        elif kind == "tool_result":
            turn.flush(out)
            out.append(_tool_message(at, block))
    turn.flush(out)
    if not out:  # only redacted thinking, or no blocks: an empty turn keeps the alternation
        out.append({"role": msg.role, "content": ""})
    return out


def _tool(i: int, tool: Dict[str, Any]) -> Dict[str, Any]:
    """An Anthropic (custom) tool as an OpenAI function tool (checked by the chat path)."""
    if tool.get("type", "custom") != "custom":
        raise ApiError(400, f"tools.{i}.type: {json.dumps(tool.get('type'))} tools are not "
                            f"served; only custom tools (name, description, input_schema)",
                       f"tools.{i}.type")
    if "input_schema" not in tool:
        raise ApiError(400, f"tools.{i}.input_schema: Field required", f"tools.{i}.input_schema")
    fn = {"name": tool.get("name"), "description": tool.get("description"),
          "parameters": tool["input_schema"], "strict": tool.get("strict")}
    return {"type": "function", "function": fn}


def _tool_choice(choice: Optional[Dict[str, Any]]) -> Tuple[Any, Optional[bool]]:
    """`tool_choice` as chat's `tool_choice` and `parallel_tool_calls`."""
    if choice is None:
        return None, None
    kind, name = choice.get("type"), choice.get("name")
    no_parallel = choice.get("disable_parallel_tool_use")
    if no_parallel is not None and not isinstance(no_parallel, bool):
        raise ApiError(400, "tool_choice.disable_parallel_tool_use: must be true or false",
                       "tool_choice.disable_parallel_tool_use")
    parallel = None if no_parallel is None else not no_parallel
    if kind in _TOOL_CHOICES:
        return _TOOL_CHOICES[kind], parallel
    if kind == "tool":
        if not isinstance(name, str):
            raise ApiError(400, "tool_choice.name: a tool choice of type \"tool\" names the tool",
                           "tool_choice.name")
        return {"type": "function", "function": {"name": name}}, parallel
    raise ApiError(400, f"tool_choice.type: must be one of auto, any, tool, none, got "
                        f"{json.dumps(kind)}", "tool_choice.type")


def _check_fields(body: CountTokensRequest) -> None:
    """400 for a field this server does not serve (unless inert) or the API does not have."""
    for name, value in (body.model_extra or {}).items():
        inert = _UNSERVED.get(name)
        if inert is not None and not inert(value):
            raise ApiError(400, f"{name} is not supported by this server", name)
        if inert is None and name not in _INERT:
            raise ApiError(400, f"{name}: Extra inputs are not permitted", name)


_OPENAI_TOOL_PARAM = re.compile(r"tools\[(\d+)\]\.function\.(parameters|name|description)")
_ANTHROPIC_TOOL_FIELD = {"parameters": "input_schema", "name": "name",
                         "description": "description"}


def _anthropic_names(e: ApiError) -> ApiError:
    """An error of the chat path, naming this API's fields instead of chat's."""
    def rename(text: str) -> str:
        text = _OPENAI_TOOL_PARAM.sub(
            lambda m: f"tools.{m.group(1)}.{_ANTHROPIC_TOOL_FIELD[m.group(2)]}", text)
        return text.replace("stop strings", "stop sequences").replace("stop:", "stop_sequences:")
    param = {"stop": "stop_sequences", "continue_final_message": "messages"}.get(
        e.param or "", e.param)
    return ApiError(e.status, rename(e.message), rename(param) if param else None,
                    e.code, e.kind, e.headers)


def _thinking(value: Any, max_tokens: Optional[int]) -> Optional[Dict[str, bool]]:
    """The chat template keywords of Anthropic's `thinking`: `enable_thinking` true for
    "enabled" or "adaptive", false for "disabled" (Qwen3's, GLM's, DeepSeek's switch); None
    where it is absent. `budget_tokens` is checked as Anthropic checks it (at least 1,024 and
    below max_tokens), not enforced: max_tokens bounds the whole reply. ApiError 400 naming
    the field."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("enabled", "adaptive", "disabled"):
        raise ApiError(400, f"thinking.type: must be enabled, adaptive or disabled, got "
                            f"{json.dumps(kind)}", "thinking.type")
    if kind == "enabled":
        budget = value.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or (
                budget < _MIN_THINKING_BUDGET):
            raise ApiError(400, f"thinking.budget_tokens: must be an integer of at least "
                                f"{_MIN_THINKING_BUDGET}, got {json.dumps(budget)}",
                           "thinking.budget_tokens")
        if max_tokens is not None and budget >= max_tokens:
            raise ApiError(400, f"thinking.budget_tokens: must be less than max_tokens "
                                f"({max_tokens}), got {budget}", "thinking.budget_tokens")
    return {"enable_thinking": kind != "disabled"}


def chat_request(body: CountTokensRequest) -> ChatRequest:
    """The chat request a messages request (or a count_tokens one) is served as; ApiError 400
    naming the field at fault."""
    _check_fields(body)
    if not body.messages:
        raise ApiError(400, "messages: at least one message is required", "messages")
    messages: List[Dict[str, Any]] = []
    system = _text_of("system", body.system) if body.system is not None else ""
    if system:
        messages.append({"role": "system", "content": system})
    for i, msg in enumerate(body.messages):
        messages += _chat_messages(i, msg)
    prefill = body.messages[-1].role == "assistant"
    if prefill and "tool_calls" in messages[-1]:
        raise ApiError(400, f"messages.{len(body.messages) - 1}: a final assistant message (a "
                            f"prefill) must be text", f"messages.{len(body.messages) - 1}")
    choice, parallel = _tool_choice(body.tool_choice)
    max_tokens = body.max_tokens if isinstance(body, MessagesRequest) else None
    fields: Dict[str, Any] = {
        "messages": messages, "add_generation_prompt": not prefill,
        "continue_final_message": prefill,
        "tools": [_tool(i, t) for i, t in enumerate(body.tools)] if body.tools else None,
        "tool_choice": choice, "parallel_tool_calls": parallel,
        "chat_template_kwargs": _thinking(body.thinking, max_tokens)}
    if isinstance(body, MessagesRequest):
        if body.max_tokens < 1:
            raise ApiError(400, f"max_tokens: must be at least 1, got {body.max_tokens}",
                           "max_tokens")
        fields.update(max_tokens=body.max_tokens, stop=body.stop_sequences,
                      temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                      stream=bool(body.stream))
    try:
        return ChatRequest.model_validate(fields)
    except ValidationError as e:  # what the checks above let through: a bug, named anyway
        raise ApiError(400, f"messages: {e.errors()[0]['msg']}", "messages") from None


def messages_job(body: MessagesRequest, max_n: int, tool_parser: Optional[str] = None,
                 defaults: SamplingDefaults = SamplingDefaults(),
                 reasoning_parser: Optional[str] = None) -> Job:
    """A messages request's job: its chat request's, with the server's tool-call parser (the
    format calls are read and enforced in), sampling defaults and reasoning parser."""
    chat = chat_request(body)
    try:
        return chat_job(chat, max_n, tool_parser, defaults, reasoning_parser)
    except ApiError as e:
        raise _anthropic_names(e) from None


def count_tokens_prompt(body: CountTokensRequest, tool_parser: Optional[str] = None) -> Prompt:
    """The prompt a messages request with these messages, system and tools would have (the
    same chat template, tools and options): count_tokens tokenizes it."""
    chat = chat_request(body)
    try:
        return chat_job(chat, 1, tool_parser).prompts[0]
    except ApiError as e:
        raise _anthropic_names(e) from None


# --- the reply ----------------------------------------------------------------------------------
def _event(kind: str, **fields: Any) -> Dict[str, Any]:
    return {"type": kind, **fields}


def sse_event(event: Dict[str, Any]) -> str:
    """One server-sent event, named by its type (Anthropic's framing)."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


class _Blocks:
    """The content blocks of one output, built from chat's streamed deltas (reasoning, content,
    tool-call pieces) as Anthropic stream events: one block open at a time, closed when
    another begins or the output ends."""

    def __init__(self) -> None:
        self.count = 0  # blocks started
        self.open: Optional[str] = None  # the open block's type
        self.tool_uses = 0

    def _start(self, block: Dict[str, Any]) -> List[Dict[str, Any]]:
        events = self.close()
        events.append(_event("content_block_start", index=self.count, content_block=block))
        self.open, self.count = block["type"], self.count + 1
        return events

    def _delta(self, kind: str, delta: Dict[str, Any]) -> List[Dict[str, Any]]:
        """A delta of the open block, which is of `kind` (one is started if not)."""
        events: List[Dict[str, Any]] = []
        if self.open != kind:
            empty = {"text": {"type": "text", "text": ""},
                     "thinking": {"type": "thinking", "thinking": "", "signature": ""}}[kind]
            events = self._start(empty)
        events.append(_event("content_block_delta", index=self.count - 1, delta=delta))
        return events

    def close(self) -> List[Dict[str, Any]]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", index=self.count - 1)]

    def feed(self, delta: Dict[str, Any]) -> List[Dict[str, Any]]:
        """The events of one chat delta: its reasoning, then the arguments of the call under
        way, then its content, then the calls it begins."""
        events: List[Dict[str, Any]] = []
        if delta.get("reasoning_content"):
            events += self._delta("thinking", {"type": "thinking_delta",
                                               "thinking": delta["reasoning_content"]})
        calls = delta.get("tool_calls") or []
        for call in [c for c in calls if "id" not in c and self.open == "tool_use"]:
            events += self._arguments(call["function"]["arguments"])
        if delta.get("content"):
            events += self._delta("text", {"type": "text_delta", "text": delta["content"]})
        begun = False
        for call in calls:
            if "id" in call:
                begun = True
                self.tool_uses += 1
                events += self._start({"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}",
                                       "name": call["function"]["name"], "input": {}})
            if begun:
                events += self._arguments(call["function"]["arguments"])
        return events

    def _arguments(self, piece: str) -> List[Dict[str, Any]]:
        if not piece or self.open != "tool_use":
            return []
        return [_event("content_block_delta", index=self.count - 1,
                       delta={"type": "input_json_delta", "partial_json": piece})]


def _tool_input(partial_json: str) -> Dict[str, Any]:
    """A tool_use block's `input`: its streamed JSON, or {} where that is not a whole object
    (a call cut off by max_tokens)."""
    try:
        value = json.loads(partial_json or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def fold_events(events: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The message a client assembles from a stream's events (as the anthropic SDK does)."""
    message: Dict[str, Any] = {}
    partial: Dict[int, str] = {}
    for e in events:
        kind = e["type"]
        if kind == "message_start":
            message = {**e["message"], "content": [], "usage": dict(e["message"]["usage"])}
        elif kind == "content_block_start":
            message["content"].append(dict(e["content_block"]))
            partial[e["index"]] = ""
        elif kind == "content_block_delta":
            block, delta = message["content"][e["index"]], e["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            else:
                partial[e["index"]] += delta["partial_json"]
        elif kind == "content_block_stop":
            block = message["content"][e["index"]]
            if block["type"] == "tool_use":
                block["input"] = _tool_input(partial[e["index"]])
        elif kind == "message_delta":
            message.update(e["delta"])
            message["usage"].update(e["usage"])
    return message


class MessagesFormatter(ChatFormatter):
    """The `message` object, or its stream of events. Chat's formatter reads the output
    (reasoning split, tool calls parsed: responses.ChatFormatter) and `_Blocks` turns what it
    reads into content blocks; a plain reply is the fold of the events its stream would send,
    chunk by chunk as the output came."""

    def __init__(self, model: str, job: Job, reasoning_parser: Optional[str] = None,
                 tool_parser: Optional[str] = None) -> None:
        super().__init__(model, job, reasoning_parser, tool_parser)
        self.id = f"msg_{job.request_id or uuid.uuid4().hex}"
        self.blocks = _Blocks()
        self.reason: Optional[str] = None  # chat's finish reason (tool calls counted)

    def _start(self, choice: Choice) -> Dict[str, Any]:
        return _event("message", id=self.id, role="assistant", model=self.model, content=[],
                      stop_reason=None, stop_sequence=None,
                      usage={"input_tokens": choice.prompt_tokens, "output_tokens": 0})

    def _feed(self, text: str, reason: Optional[str]) -> List[Dict[str, Any]]:
        item = self._chunk_item(0, text, reason)
        self.reason = item["finish_reason"] or self.reason
        return self.blocks.feed(item["delta"])

    def _end(self, choice: Choice) -> List[Dict[str, Any]]:
        stop = choice.matched_stop if isinstance(choice.matched_stop, str) else None
        if self.reason == "length":
            stop_reason = "max_tokens"
        elif stop is not None and stop in self.job.stop:
            stop_reason = "stop_sequence"
        elif self.blocks.tool_uses:
            stop_reason = "tool_use"
        else:
            stop_reason = "end_turn"
        delta = {"stop_reason": stop_reason,
                 "stop_sequence": stop if stop_reason == "stop_sequence" else None}
        usage = {"input_tokens": choice.prompt_tokens, "output_tokens": choice.completion_tokens}
        return [*self.blocks.close(), _event("message_delta", delta=delta, usage=usage),
                _event("message_stop")]

    def full(self, choices: List[Choice]) -> Dict[str, Any]:
        choice = choices[0]
        events = [_event("message_start", message=self._start(choice))]
        texts = choice.text or [""]
        for k, text in enumerate(texts):
            events += self._feed(text, choice.finish_reason if k == len(texts) - 1 else None)
        return fold_events([*events, *self._end(choice)])

    def opening(self, index: int, choice: Choice) -> Iterator[str]:
        yield sse_event(_event("message_start", message=self._start(choice)))

    def delta(self, index: int, chunk: ReplyChunk, choice: Choice) -> Iterator[str]:
        for event in self._feed(chunk.text, chunk.finish_reason):
            yield sse_event(event)

    def closing(self, choices: List[Choice]) -> Iterator[str]:
        for event in self._end(choices[0]):
            yield sse_event(event)

    def error_events(self, e: ApiError) -> Iterator[str]:
        """What ends a stream that fails after it began: an `error` event."""
        yield sse_event(anthropic_error_body(e))
