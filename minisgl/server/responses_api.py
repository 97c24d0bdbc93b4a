"""OpenAI's Responses API (`POST /v1/responses`) on top of the chat path: text in, text out.

A request's `instructions` (a system message), the conversation of its `previous_response_id`
and its `input` (a string, or a list of messages with text content) become one chat prompt; the
reply is a `response` object with one output message, or, streamed, the API's typed events
(`response.created` ... `response.output_text.delta` ... `response.completed`). Finished
conversations are kept in memory, the newest `ResponseStore.capacity` of them, so that a later
request can continue one; `store: false` keeps none. `reasoning.effort` goes to the chat
template as Chat Completions' `reasoning_effort` does; tools, structured text formats, other
reasoning options (summaries) and background runs get a 400 naming the field.
"""

from __future__ import annotations

import collections
import json
from typing import Any, Callable, Dict, Iterator, List, Optional, Union

from pydantic import BaseModel, ConfigDict, ValidationError

from minisgl.message.types import ReplyChunk
from minisgl.models.generation import SamplingDefaults
from minisgl.server.protocol import ApiError, ChatRequest, Job, chat_job
from minisgl.server.responses import Choice, Formatter

Messages = List[Dict[str, str]]
def _effort_only(reasoning: Any) -> bool:
    """Whether a `reasoning` object sets nothing but `effort` (a string: the chat template's
    reasoning_effort); reasoning summaries are not produced."""
    return (isinstance(reasoning, dict) and set(reasoning) <= {"effort", "summary"}
            and reasoning.get("summary") is None
            and isinstance(reasoning.get("effort"), (str, type(None))))


_INERT: Dict[str, Callable[[Any], bool]] = {
    "tools": lambda v: not v,
    "tool_choice": lambda v: v in (None, "none", "auto"),
    "text": lambda v: v is None or (v.get("format") or {"type": "text"}) == {"type": "text"},
    "reasoning": lambda v: v is None or _effort_only(v),
    "background": lambda v: v in (None, False),
    "include": lambda v: not v,
    "prompt": lambda v: v is None,
    "conversation": lambda v: v is None,
    "truncation": lambda v: v in (None, "disabled"),
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


class ResponseStore:
    """The newest `capacity` finished conversations by response id (oldest dropped first)."""

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._items: "collections.OrderedDict[str, Messages]" = collections.OrderedDict()

    def get(self, response_id: str) -> Messages:
        if response_id not in self._items:
            raise ApiError(404, f"previous_response_id: no stored response {response_id!r} (the "
                                f"server keeps the newest {self.capacity})",
                           "previous_response_id", "response_not_found", "not_found_error")
        return self._items[response_id]

    def put(self, response_id: str, messages: Messages) -> None:
        self._items[response_id] = messages
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)


def _item_text(i: int, item: Dict[str, Any]) -> Dict[str, str]:
    role, content = item.get("role"), item.get("content")
    if item.get("type", "message") != "message" or not isinstance(role, str):
        raise ApiError(400, f"input.{i}: only messages (role and content) are supported",
                       "input")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list) or any(
            not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text")
            or not isinstance(p.get("text"), str) for p in content):
        raise ApiError(400, f"input.{i}.content: only text parts are supported", "input")
    return {"role": role, "content": "".join(p["text"] for p in content)}


def response_messages(body: ResponsesRequest, store: ResponseStore) -> Messages:
    """The whole conversation the request continues, its input last."""
    messages: Messages = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if body.previous_response_id is not None:
        messages += [m for m in store.get(body.previous_response_id) if m["role"] != "system"]
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
    else:
        messages += [_item_text(i, item) for i, item in enumerate(body.input)]
    return messages


def responses_job(body: ResponsesRequest, messages: Messages, max_n: int,
                  defaults: SamplingDefaults = SamplingDefaults()) -> Job:
    for name, value in (body.model_extra or {}).items():
        inert = _INERT.get(name)
        if inert is not None and not inert(value):
            raise ApiError(400, f"{name} is not supported by this server", name)
    reasoning = (body.model_extra or {}).get("reasoning") or {}
    fields = {"messages": messages, "max_tokens": body.max_output_tokens,
              "temperature": body.temperature, "top_p": body.top_p, "stream": body.stream,
              "reasoning_effort": reasoning.get("effort")}
    try:
        chat = ChatRequest.model_validate(fields)
    except ValidationError as e:
        raise ApiError(400, f"input: {e.errors()[0]['msg']}", "input") from None
    try:
        return chat_job(chat, max_n, defaults=defaults)
    except ApiError as e:
        param = {"max_tokens": "max_output_tokens", "messages": "input",
                 "reasoning_effort": "reasoning"}.get(e.param or "", e.param)
        raise ApiError(e.status, e.message.replace("max_tokens", "max_output_tokens"),
                       param) from None


def _event(kind: str, seq: int, **fields: Any) -> str:
    body = {"type": kind, "sequence_number": seq, **fields}
    return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"


class ResponsesFormatter(Formatter):
    """The `response` object, and the streamed events around the text deltas. The finished
    conversation goes to `store` under the response id (unless `body.store` is false)."""

    id_prefix = "resp"
    prompt_param = "input"

    def __init__(self, model: str, job: Job, body: ResponsesRequest, messages: Messages,
                 store: ResponseStore) -> None:
        super().__init__(model, job)
        self.body, self.messages, self.store = body, messages, store
        self.item_id = "msg-" + self.id.split("-", 1)[1]
        self.seq = 0

    def _message(self, text: str, status: str) -> Dict[str, Any]:
        content = [] if status == "in_progress" and not text else [
            {"type": "output_text", "text": text, "annotations": []}]
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant",
                "content": content}

    def _response(self, choice: Optional[Choice]) -> Dict[str, Any]:
        body = self.body
        out: Dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created, "model": self.model,
            "status": "in_progress", "output": [], "error": None, "incomplete_details": None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "previous_response_id": body.previous_response_id,
            "temperature": self.job.params.temperature, "top_p": self.job.params.top_p,
            "parallel_tool_calls": False, "tool_choice": "none", "tools": [],
            "text": {"format": {"type": "text"}}, "metadata": body.metadata or {},
            "store": body.store, "usage": None}
        if choice is None:
            return out
        text = "".join(choice.text)
        incomplete = choice.finish_reason == "length"
        out.update(status="incomplete" if incomplete else "completed",
                   output=[self._message(text, "incomplete" if incomplete else "completed")],
                   incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
                   usage={"input_tokens": choice.prompt_tokens,
                          "input_tokens_details": {"cached_tokens": choice.cached_tokens},
                          "output_tokens": choice.completion_tokens,
                          "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": choice.prompt_tokens + choice.completion_tokens})
        if self.body.store:
            self.store.put(self.id, [*self.messages, {"role": "assistant", "content": text}])
        return out

    def full(self, choices: List[Choice]) -> Dict[str, Any]:
        return self._response(choices[0])

    def _next(self, kind: str, **fields: Any) -> str:
        self.seq += 1
        return _event(kind, self.seq - 1, **fields)

    def opening(self, index: int, choice: Choice) -> Iterator[str]:
        yield self._next("response.created", response=self._response(None))
        yield self._next("response.in_progress", response=self._response(None))
        yield self._next("response.output_item.added", output_index=0,
                         item=self._message("", "in_progress"))
        yield self._next("response.content_part.added", item_id=self.item_id, output_index=0,
                         content_index=0,
                         part={"type": "output_text", "text": "", "annotations": []})

    def delta(self, index: int, chunk: ReplyChunk, choice: Choice) -> Iterator[str]:
        if chunk.text:
            yield self._next("response.output_text.delta", item_id=self.item_id,
                             output_index=0, content_index=0, delta=chunk.text, logprobs=[])

    def closing(self, choices: List[Choice]) -> Iterator[str]:
        final = self._response(choices[0])
        text = "".join(choices[0].text)
        yield self._next("response.output_text.done", item_id=self.item_id, output_index=0,
                         content_index=0, text=text, logprobs=[])
        yield self._next("response.content_part.done", item_id=self.item_id, output_index=0,
                         content_index=0, part=final["output"][0]["content"][0])
        yield self._next("response.output_item.done", output_index=0, item=final["output"][0])
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        yield self._next(kind, response=final)
