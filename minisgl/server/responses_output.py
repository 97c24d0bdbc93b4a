"""OpenAI's Responses API, reply side: the `response` object, or its stream of typed events.

Chat's formatter reads the output (the reasoning split off by the --reasoning-parser, tool
calls parsed in the --tool-call-parser format: responses.ChatFormatter) and `_Items` turns
what it reads into output items, in the order they came: a `reasoning` item (the model's
thinking as `reasoning_text` content, and as `encrypted_content` where the request's
`include` asks; no summary is written), a `message` with `output_text`,
and a `function_call` item a call. Streamed, each item is announced
(`response.output_item.added`), filled (`response.reasoning_text.delta`,
`response.output_text.delta`, `response.function_call_arguments.delta`) and closed (`.done`
events, `response.output_item.done`) before the next begins; a plain reply is what the stream
would have built, chunk by chunk as the output came, so the two always agree.

Usage counts the reasoning's tokens a chunk at a time (`ResponsesFormatter._feed`);
`cache_write_tokens` is 0: OpenAI's count of prompt tokens written to its retained, billed
cache has no counterpart here (the prefix cache keeps computed prompts while it has room).
"""

from __future__ import annotations

import copy
import json
import uuid
from typing import Any, Dict, Iterator, List, Optional, Sequence

from minisgl.message.types import ReplyChunk, TokenLogprobText
from minisgl.server.conversations import ConversationLink
from minisgl.server.protocol import ApiError, Job
from minisgl.server.responses import ChatFormatter, Choice, chat_logprobs
from minisgl.server.responses_api import (Messages, ResponsesRequest, ResponseStore,
                                          input_items, parse_include, reasoning_blob)

_PARTS = {"reasoning": "reasoning_text", "message": "output_text"}
_DELTA = {"reasoning": "response.reasoning_text.delta", "message": "response.output_text.delta"}
_DONE = {"reasoning": "response.reasoning_text.done", "message": "response.output_text.done"}


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Items:
    """The output items of one response, built from chat's streamed deltas (reasoning, content,
    tool-call pieces) as Responses events (dicts without their sequence numbers): one item
    open at a time, closed when another begins or the output ends. `items` holds every item
    so far, its text as far as it came."""

    def __init__(self, logprobs: bool = False, blobs: bool = False) -> None:
        self.items: List[Dict[str, Any]] = []
        self.open = False  # whether the last item is still being written
        self.logprobs = logprobs  # whether message text carries its tokens' logprobs
        self.blobs = blobs  # whether a closed reasoning item carries its encrypted_content

    @property
    def _last(self) -> Dict[str, Any]:
        return self.items[-1]

    def _refs(self) -> Dict[str, Any]:
        return {"item_id": self._last["id"], "output_index": len(self.items) - 1}

    def _start(self, item: Dict[str, Any]) -> List[Dict[str, Any]]:
        events = self.close("completed")
        self.items.append(item)
        self.open = True
        events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                       "item": copy.deepcopy(item)})
        if item["type"] in _PARTS:
            events.append({"type": "response.content_part.added", **self._refs(),
                           "content_index": 0, "part": self._part("")})
        return events

    def _part(self, text: str) -> Dict[str, Any]:
        kind = _PARTS[self._last["type"]]
        if kind != "output_text":
            return {"type": kind, "text": text}
        return {"type": kind, "text": text, "annotations": [],
                **({"logprobs": []} if self.logprobs else {})}

    def _new_text_item(self, kind: str) -> List[Dict[str, Any]]:
        """Start a reasoning or message item with one empty content part."""
        item: Dict[str, Any]
        if kind == "reasoning":
            item = {"type": "reasoning", "id": _item_id("rs"), "summary": [], "content": [],
                    "encrypted_content": None, "status": "in_progress"}
        else:
            item = {"type": "message", "id": _item_id("msg"), "status": "in_progress",
                    "role": "assistant", "content": []}
        events = self._start(item)
        item["content"].append(self._part(""))
        return events

    def _text(self, kind: str, piece: str, logprobs: Optional[List[Dict[str, Any]]] = None
              ) -> List[Dict[str, Any]]:
        """`piece` appended to the open item of `kind` (one is started if not), with its
        tokens' `logprobs` (message text, where asked)."""
        events: List[Dict[str, Any]] = []
        if not (self.open and self._last["type"] == kind):
            events = self._new_text_item(kind)
        part = self._last["content"][0]
        part["text"] += piece
        if logprobs and "logprobs" in part:
            part["logprobs"] += logprobs
        extra: Dict[str, Any] = {"logprobs": logprobs or []} if kind == "message" else {}
        events.append({"type": _DELTA[kind], **self._refs(), "content_index": 0,
                       "delta": piece, **extra})
        return events

    def _arguments(self, piece: str) -> List[Dict[str, Any]]:
        if not piece or not (self.open and self._last["type"] == "function_call"):
            return []
        self._last["arguments"] += piece
        return [{"type": "response.function_call_arguments.delta", **self._refs(),
                 "delta": piece}]

    def feed(self, delta: Dict[str, Any], logprobs: Optional[List[Dict[str, Any]]] = None
             ) -> List[Dict[str, Any]]:
        """The events of one chat delta: its reasoning, then the arguments of the call under
        way, then its content (with `logprobs`, its tokens'), then the calls it begins."""
        events: List[Dict[str, Any]] = []
        if delta.get("reasoning_content"):
            events += self._text("reasoning", delta["reasoning_content"])
        calls = delta.get("tool_calls") or []
        for call in [c for c in calls if "id" not in c]:
            events += self._arguments(call["function"].get("arguments") or "")
        if delta.get("content"):
            events += self._text("message", delta["content"], logprobs)
        for call in [c for c in calls if "id" in c]:
            events += self._start({"type": "function_call", "id": _item_id("fc"),
                                   "call_id": call["id"], "name": call["function"]["name"],
                                   "arguments": "", "status": "in_progress"})
            events += self._arguments(call["function"].get("arguments") or "")
        return events

    def close(self, status: str) -> List[Dict[str, Any]]:
        """The events that close the open item, with `status` (completed, or incomplete where
        the output was cut off)."""
        if not self.open:
            return []
        self.open = False
        item, refs = self._last, self._refs()
        item["status"] = status
        if item["type"] == "reasoning" and self.blobs:
            item["encrypted_content"] = reasoning_blob(item["content"][0]["text"])
        events: List[Dict[str, Any]] = []
        if item["type"] in _PARTS:
            part = item["content"][0]
            extra: Dict[str, Any] = ({"logprobs": part.get("logprobs", [])}
                                     if item["type"] == "message" else {})
            events += [{"type": _DONE[item["type"]], **refs, "content_index": 0,
                        "text": part["text"], **extra},
                       {"type": "response.content_part.done", **refs, "content_index": 0,
                        "part": dict(part)}]
        else:
            events.append({"type": "response.function_call_arguments.done", **refs,
                           "name": item["name"], "arguments": item["arguments"]})
        events.append({"type": "response.output_item.done", "output_index": refs["output_index"],
                       "item": copy.deepcopy(item)})
        return events

    def finish(self, status: str) -> List[Dict[str, Any]]:
        """Close the output; an output with no item gets an empty message (as OpenAI's)."""
        events = [] if self.items else self._new_text_item("message")
        return events + self.close(status)

    def conversation_turn(self) -> Dict[str, Any]:
        """The assistant message these items are in a chat conversation (what a later request
        continuing this response sees: its thinking as `reasoning_content`, which the chat
        template keeps or drops as it does for input reasoning items)."""
        def text(kind: str) -> str:
            return "".join(i["content"][0]["text"] for i in self.items if i["type"] == kind)
        calls = [{"id": i["call_id"], "type": "function",
                  "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.items if i["type"] == "function_call"]
        thinking = text("reasoning")
        return {"role": "assistant", "content": text("message"),
                **({"reasoning_content": thinking} if thinking else {}),
                **({"tool_calls": calls} if calls else {})}


class ResponsesFormatter(ChatFormatter):
    """The `response` object, or its stream of events (see the module's doc). The finished
    conversation goes to `store` under the response id (unless `body.store` is false)."""

    id_prefix = "resp"
    prompt_param = "input"

    def __init__(self, model: str, job: Job, body: ResponsesRequest, messages: Messages,
                 store: ResponseStore, reasoning_parser: Optional[str] = None,
                 tool_parser: Optional[str] = None,
                 conversation: Optional[ConversationLink] = None) -> None:
        """`conversation`: the one the request continues, where its input and output items
        are recorded once it ends with its output (completed or incomplete)."""
        super().__init__(model, job, reasoning_parser, tool_parser)
        self.body, self.messages, self.store = body, messages, store
        self.conversation = conversation
        self.input_items = input_items(body)  # what GET .../input_items lists
        self.items = _Items(self.wants_logprobs, parse_include(body.include).reasoning)
        self.seq = 0
        self.held_logprobs: List[Dict[str, Any]] = []  # of tokens whose text is held back
        self.thinking = False  # whether the output is inside its reasoning
        self.reasoning_tokens = 0

    def _feed(self, text: str, reason: Optional[str], tokens: int,
              logprobs: Sequence[TokenLogprobText]) -> List[Dict[str, Any]]:
        """The events of one piece of output of `tokens` tokens, `logprobs` theirs (where
        asked: one entry a token). Tokens are placed a chunk at a time: they count as reasoning from
        the first reasoning text until content or a call begins (a chunk that holds the end
        of the thinking and the start of the answer counts as answer); where asked, their
        logprobs go with the message text they end in (those of reasoning and calls are not
        given, as OpenAI gives none)."""
        delta = self._chunk_item(0, text, reason)["delta"]
        self.thinking = (bool(delta.get("reasoning_content")) or self.thinking) and not (
            delta.get("content") or delta.get("tool_calls"))
        self.reasoning_tokens += tokens if self.thinking else 0
        if logprobs and not self.thinking:
            self.held_logprobs += chat_logprobs(logprobs)["content"]
        placed = self.held_logprobs if delta.get("content") else None
        if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
            self.held_logprobs = []
        return self.items.feed(delta, placed)

    def _response(self, choice: Optional[Choice]) -> Dict[str, Any]:
        """The response object: in progress (no choice yet), or final."""
        body = self.body
        reasoning = body.reasoning or {}
        out: Dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created, "model": self.model,
            "status": "in_progress", "output": [], "error": None, "incomplete_details": None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "previous_response_id": body.previous_response_id,
            "temperature": self.job.params.temperature, "top_p": self.job.params.top_p,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "tool_choice": body.tool_choice or ("auto" if body.tools else "none"),
            "tools": body.tools or [],
            "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
            "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
            "metadata": body.metadata or {}, "store": body.store,
            "truncation": body.truncation or "disabled",
            "background": body.background, "usage": None,
            "conversation": None if self.conversation is None else {
                "id": self.conversation.id}}
        if choice is None:
            return out
        incomplete = choice.finish_reason == "length"
        out.update(status="incomplete" if incomplete else "completed",
                   output=copy.deepcopy(self.items.items),
                   incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
                   usage={"input_tokens": choice.prompt_tokens,
                          "input_tokens_details": {"cached_tokens": choice.cached_tokens,
                                                   "cache_write_tokens": 0},
                          "output_tokens": choice.completion_tokens,
                          "output_tokens_details": {
                              "reasoning_tokens": self.reasoning_tokens},
                          "total_tokens": choice.prompt_tokens + choice.completion_tokens})
        if self.body.store:
            self.store.put(self.id, [*self.messages, self.items.conversation_turn()],
                           copy.deepcopy(out), self.input_items)
        if self.conversation is not None:
            self.conversation.store.record(self.conversation.id, [
                *copy.deepcopy(self.input_items), *copy.deepcopy(self.items.items)])
        return out

    def pending(self) -> Dict[str, Any]:
        """A background response as it starts: in progress, stored (GET polls it)."""
        out = self._response(None)
        self.store.put(self.id, self.messages, copy.deepcopy(out), self.input_items)
        return out

    def ended(self, status: str, error: Optional[ApiError] = None) -> None:
        """Store a background response that ended without its output: cancelled, or failed
        with `error` (in OpenAI's codes: the request's fault an invalid_prompt, overload
        rate_limit_exceeded, the rest server_error)."""
        out = self._response(None)
        out["status"] = status
        if error is not None:
            code = ("rate_limit_exceeded" if error.status == 429 else
                    "invalid_prompt" if 400 <= error.status < 500 and error.status != 408
                    else "server_error")
            out["error"] = {"code": code, "message": error.message}
        self.store.put(self.id, self.messages, out, self.input_items)

    def _end(self, choice: Choice) -> List[Dict[str, Any]]:
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        events = self.items.finish(status)
        final = self._response(choice)
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return [*events, {"type": kind, "response": final}]

    def full(self, choices: List[Choice]) -> Dict[str, Any]:
        choice = choices[0]
        texts, counts = choice.text or [""], choice.text_tokens or [0]
        at = 0
        for k, (text, n) in enumerate(zip(texts, counts)):
            self._feed(text, choice.finish_reason if k == len(texts) - 1 else None, n,
                       choice.logprobs[at:at + n])
            at += n
        return self._end(choice)[-1]["response"]

    def _lines(self, events: List[Dict[str, Any]]) -> Iterator[str]:
        for event in events:
            event = {**event, "sequence_number": self.seq}
            self.seq += 1
            yield f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

    def opening(self, index: int, choice: Choice) -> Iterator[str]:
        return self._lines([{"type": "response.created", "response": self._response(None)},
                            {"type": "response.in_progress", "response": self._response(None)}])

    def delta(self, index: int, chunk: ReplyChunk, choice: Choice) -> Iterator[str]:
        return self._lines(self._feed(chunk.text, chunk.finish_reason, len(chunk.token_ids),
                                      chunk.logprobs))

    def closing(self, choices: List[Choice]) -> Iterator[str]:
        return self._lines(self._end(choices[0]))

    def error_events(self, e: ApiError) -> Iterator[str]:
        """What ends a stream that fails after it began: an `error` event."""
        return self._lines([{"type": "error", "code": e.code, "message": e.message,
                             "param": e.param}])
