"""Response bodies of the HTTP API: OpenAI chat/completion objects and SSE chunks, the native
/generate format, usage accounting, and the streamed response that always cleans up."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Dict, Iterator, List, Optional, Sequence, Union

import anyio
from fastapi.responses import StreamingResponse

from minisgl.message.types import ReplyChunk, TokenLogprobText, WireTensor
from minisgl.server import generate_meta
from minisgl.server.protocol import ApiError, Job
from minisgl.server.reasoning import ReasoningSplitter, split_reasoning
from minisgl.server.tool_calls import CallStreamer, call_dict, tool_call_format


@dataclass
class Choice:
    """What one choice (one uid) produced so far."""

    text: List[str] = field(default_factory=list)
    text_tokens: List[int] = field(default_factory=list)  # the tokens of each piece of `text`
    token_ids: List[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: List[TokenLogprobText] = field(default_factory=list)
    logprob_chars: int = 0  # length of the logprobs' token texts: the next text_offset
    matched_stop: Union[None, int, str] = None  # the stop string or token id that ended it
    prompt_logprobs: List[TokenLogprobText] = field(default_factory=list)  # one per prompt token
    prompt_ids: Optional[List[int]] = None  # where the request asked (return_token_ids)
    embedding: Optional[bytes] = None  # an embedding request's (float32 little-endian)
    # the hidden states' rows so far, a part a chunk (return_hidden_states; `hidden` joins them)
    hidden_parts: List[WireTensor] = field(default_factory=list)

    @property
    def hidden(self) -> Optional[WireTensor]:
        """The hidden states' rows so far, joined (None: none came)."""
        return WireTensor.joined(self.hidden_parts)

    def add(self, chunk: ReplyChunk) -> None:
        """Accumulate a chunk; an echoed prompt goes first, into text and logprobs alike."""
        if chunk.embedding is not None:
            self.embedding = chunk.embedding
        if chunk.tensor is not None:
            self.hidden_parts.append(chunk.tensor)
        if chunk.prompt_logprobs:
            self.prompt_logprobs = list(chunk.prompt_logprobs)
        if chunk.prompt_ids is not None:
            self.prompt_ids = list(chunk.prompt_ids)
        if chunk.prompt_text is not None:
            self.text.append(chunk.prompt_text)
            self.text_tokens.append(0)
            self.logprobs.extend(chunk.prompt_logprobs)
            self.logprob_chars += sum(len(e.token) for e in chunk.prompt_logprobs)
        self.text.append(chunk.text)
        self.text_tokens.append(len(chunk.token_ids))
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        self.logprob_chars += sum(len(e.token) for e in chunk.logprobs)
        self.finish_reason = chunk.finish_reason or self.finish_reason
        if chunk.finish_reason is not None:
            self.matched_stop = chunk.matched_stop
        self.prompt_tokens = max(self.prompt_tokens, chunk.prompt_tokens)
        self.completion_tokens = max(self.completion_tokens, chunk.completion_tokens)
        self.cached_tokens = max(self.cached_tokens, chunk.cached_tokens)


def usage(choices: List[Choice], n: int, details: bool = True) -> Dict[str, Any]:
    """OpenAI usage: prompt tokens once per prompt (the first of its n choices), and with
    `details` the prompt tokens' details (cached_tokens: those the prefix cache held)."""
    firsts = choices[::n]
    prompt = sum(c.prompt_tokens for c in firsts)
    completion = sum(c.completion_tokens for c in choices)
    out: Dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                           "total_tokens": prompt + completion}
    if details:
        out["prompt_tokens_details"] = {"cached_tokens": sum(c.cached_tokens for c in firsts)}
    return out


def choice_usage(choice: Choice) -> Dict[str, Any]:
    """One choice's usage so far (vLLM's continuous_usage_stats, on every streamed chunk)."""
    return {"prompt_tokens": choice.prompt_tokens, "completion_tokens": choice.completion_tokens,
            "total_tokens": choice.prompt_tokens + choice.completion_tokens}


def completion_logprobs(entries: Sequence[TokenLogprobText], offset: int, k: int
                        ) -> Dict[str, Any]:
    """The legacy completions `logprobs` object. `text_offset` counts the token texts from
    `offset` (each token's text taken on its own, as `tokens` lists them); each
    `top_logprobs` map holds the `k` most likely tokens and the sampled one (null, as its
    logprob, for an echoed prompt's first token)."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {"tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [None if e.logprob is None else
                             {**dict(zip(e.top_tokens[:k], e.top_logprobs[:k])),
                              e.token: e.logprob}
                             for e in entries],
            "text_offset": offsets}


def prompt_logprobs(entries: Sequence[TokenLogprobText], k: int
                    ) -> List[Optional[Dict[str, Dict[str, Any]]]]:
    """vLLM's `prompt_logprobs`: per prompt token, null for the first (nothing precedes it),
    else a map from token id (as a string) to its `logprob`, `rank` (1: the most likely) and
    `decoded_token`, holding the prompt token itself first and the `k` most likely tokens."""
    out: List[Optional[Dict[str, Dict[str, Any]]]] = []
    for e in entries:
        if e.logprob is None:
            out.append(None)
            continue
        item = {str(e.token_id): {"logprob": e.logprob, "rank": e.rank, "decoded_token": e.token}}
        for rank, (tid, text, lp) in enumerate(zip(e.top_ids[:k], e.top_tokens[:k],
                                                    e.top_logprobs[:k]), start=1):
            item[str(tid)] = {"logprob": lp, "rank": rank, "decoded_token": text}
        out.append(item)
    return out


def chat_logprobs(entries: Sequence[TokenLogprobText]) -> Dict[str, Any]:
    """The chat `logprobs` object: per token, its text, bytes (its raw bytes where the text
    alone is only part of a character), log-probability and the most likely alternatives."""
    def item(token: str, logprob: Optional[float], raw: Optional[bytes]) -> Dict[str, Any]:
        return {"token": token, "logprob": logprob,
                "bytes": list(raw if raw is not None else token.encode("utf-8"))}
    return {"content": [{**item(e.token, e.logprob, e.token_bytes),
                         "top_logprobs": [item(t, v, b) for t, v, b in zip(
                             e.top_tokens, e.top_logprobs,
                             e.top_bytes or (None,) * len(e.top_tokens))]}
                        for e in entries]}


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class SSEResponse(StreamingResponse):
    """A streamed response that always runs `on_close` (synchronously) when it ends, however it
    ends, and stops streaming as soon as the client disconnects."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    with contextlib.suppress(OSError):
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                async def watch() -> None:
                    await self.listen_for_disconnect(receive)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                tg.start_soon(watch)
        finally:
            self.on_close()


class Formatter(ABC):
    """Builds one endpoint's response objects: `full` for a plain response; for a streamed one,
    `opening` lines per choice, `delta` lines per chunk (given the choice with that chunk
    added), then `closing` lines. One subclass per endpoint; `id` and `created` are fixed per
    request."""

    id_prefix = ""
    prompt_param = "prompt"  # the request field an error about the prompt names

    def __init__(self, model: str, job: Job) -> None:
        self.model, self.job = model, job
        self.id = f"{self.id_prefix}-{job.request_id or uuid.uuid4().hex}"
        self.created = int(time.time())

    @abstractmethod
    def full(self, choices: List[Choice]) -> Union[Dict[str, Any], List[Dict[str, Any]]]: ...

    def opening(self, index: int, choice: Choice) -> Iterator[str]:
        """`choice` holds only the prompt's token count and log-probabilities."""
        return iter(())

    @abstractmethod
    def delta(self, index: int, chunk: ReplyChunk, choice: Choice) -> Iterator[str]: ...

    @abstractmethod
    def closing(self, choices: List[Choice]) -> Iterator[str]: ...

    def error_events(self, e: ApiError) -> Iterator[str]:
        """The lines that end a stream that failed after it began: an OpenAI error body as a
        data line, then `[DONE]` (the Messages and Responses APIs send their error event)."""
        yield sse(e.body())
        yield "data: [DONE]\n\n"


class GenerateFormatter(Formatter):
    """The /generate format: text and token ids, one object per chunk, no choices; SGLang's
    `output_ids` and `meta_info` (server/generate_meta.py) beside our own fields. A batch, or
    n > 1, answers a list of those objects (prompt-major, as SGLang), each with its `index`.
    Streamed, each chunk repeats everything so far (the text, the ids, the log-probabilities),
    as SGLang streams by default; with `incremental` (SGLang's
    --incremental-streaming-output) it carries only what is new (the prompt's
    log-probabilities on the first chunk)."""

    id_prefix = "gen"
    prompt_param = "input_ids"

    def __init__(self, model: str, job: Job, incremental: bool = False,
                 weight_version: Callable[[], str] = lambda: "default") -> None:
        """`weight_version`: the served weights' version as a chunk is written (SGLang's
        meta_info.weight_version: a request held behind an update names the new one)."""
        super().__init__(model, job)
        self.incremental = incremental
        self.weight_version = weight_version

    @property
    def single(self) -> bool:
        return len(self.job.prompts) * self.job.n == 1

    def full(self, choices: List[Choice]) -> Union[Dict[str, Any], List[Dict[str, Any]]]:
        if self.single:
            return {**self._item(0, choices[0]), "usage": usage(choices, self.job.n)}
        return [{**self._item(i, c), "usage": usage([c], 1)} for i, c in enumerate(choices)]

    def _item(self, index: int, c: Choice) -> Dict[str, Any]:
        item = {"id": self._id(index, self.id), "text": "".join(c.text), "token_ids": c.token_ids,
                "output_ids": c.token_ids, "finish_reason": c.finish_reason,
                "meta_info": self._meta(index, c, c.finish_reason, c.matched_stop,
                                        c.prompt_logprobs, c.logprobs)}
        return item if self.single else {**item, "index": index}

    def delta(self, index: int, chunk: ReplyChunk, choice: Choice) -> Iterator[str]:
        if not self.incremental:  # the choice so far (its finish is this chunk's)
            yield sse(self._item(index, choice))
            return
        event = {"id": self._id(index, self.id), "text": chunk.text,
                 "token_ids": list(chunk.token_ids),
                 "output_ids": list(chunk.token_ids), "finish_reason": chunk.finish_reason,
                 "meta_info": self._meta(index, choice, chunk.finish_reason, chunk.matched_stop,
                                         chunk.prompt_logprobs, chunk.logprobs)}
        yield sse(event if self.single else {**event, "index": index})

    def _id(self, index: int, base: str) -> str:
        """Choice `index`'s id: `base`, suffixed with the index in a batch or n > 1."""
        return base if self.single else f"{base}-{index}"

    def _meta(self, index: int, c: Choice, reason: Optional[str],
              matched: Union[None, int, str], prompt: Sequence[TokenLogprobText],
              output: Sequence[TokenLogprobText]) -> Dict[str, Any]:
        meta: Dict[str, Any] = {
            "id": self._id(index, self.job.request_id or self.id),  # SGLang's rid
            "finish_reason": generate_meta.finish_reason(reason, matched, c.completion_tokens),
            "prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
            "cached_tokens": c.cached_tokens, "weight_version": self.weight_version()}
        if self.job.generate_logprobs is not None:
            meta.update(generate_meta.logprob_fields(self.job.generate_logprobs, prompt, output))
        if self.job.params.return_hidden_states and reason is not None:
            meta["hidden_states"] = generate_meta.hidden_states(c.hidden, c.prompt_tokens)
        return meta

    def closing(self, choices: List[Choice]) -> Iterator[str]:
        yield "data: [DONE]\n\n"


class _OpenAIFormatter(Formatter):
    """OpenAI envelopes around per-choice items. Streamed, a chunk carries the new text, its
    tokens' logprobs (when asked for) and, on the last token's chunk, the finish reason (with
    SGLang's `matched_stop`); usage closes the stream when asked for, or rides on every chunk
    (`continuous_usage_stats`)."""

    full_object = ""
    chunk_object = ""

    @property
    def wants_logprobs(self) -> bool:
        return self.job.params.logprobs is not None

    def _prompt_logprobs(self, choice: Choice) -> Dict[str, Any]:
        """The `prompt_logprobs` field (vLLM's shape) where the request asked for it."""
        k = self.job.prompt_logprobs
        return {} if k is None else {"prompt_logprobs": prompt_logprobs(choice.prompt_logprobs, k)}

    def _envelope(self, obj: str, choices: List[Any]) -> Dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    @abstractmethod
    def _item(self, index: int, choice: Choice) -> Dict[str, Any]: ...

    @abstractmethod
    def _chunk_item(self, index: int, text: Optional[str], reason: Optional[str],
                    logprobs: Optional[Dict[str, Any]] = None) -> Dict[str, Any]: ...

    @abstractmethod
    def _logprobs(self, entries: Sequence[TokenLogprobText], offset: int) -> Dict[str, Any]: ...

    @abstractmethod
    def _has_text(self, item: Dict[str, Any]) -> bool:
        """Whether a streamed choice item built by `_chunk_item` carries any output."""

    def _choice_logprobs(self, choice: Choice) -> Optional[Dict[str, Any]]:
        return self._logprobs(choice.logprobs, 0) if self.wants_logprobs else None

    def full(self, choices: List[Choice]) -> Dict[str, Any]:
        items = [{**self._item(i, c), "matched_stop": c.matched_stop,
                  **self._token_ids(c.token_ids), **self._hidden(c)}
                 for i, c in enumerate(choices)]
        return {**self._envelope(self.full_object, items),
                "usage": usage(choices, self.job.n, self.job.prompt_tokens_details)}

    def _hidden(self, choice: Choice) -> Dict[str, Any]:
        """SGLang's choice `hidden_states` (return_hidden_states): the final hidden state of
        the position that gave the last token ([] for a one-token reply, as SGLang's); a
        stream's choice carries it on its last chunk."""
        if not self.job.params.return_hidden_states:
            return {}
        rows = generate_meta.hidden_states(choice.hidden, choice.prompt_tokens)
        return {"hidden_states": rows[-1] if len(rows) > 1 else []}

    def _token_ids(self, ids: Sequence[int]) -> Dict[str, Any]:
        """A choice item's `token_ids` (vLLM's return_token_ids): all of them, or a chunk's."""
        return {"token_ids": list(ids)} if self.job.return_token_ids else {}

    def _prompt_token_ids(self, ids: Optional[List[int]]) -> Dict[str, Any]:
        """The prompt's `prompt_token_ids` (vLLM's return_token_ids), where it came."""
        return {"prompt_token_ids": ids} if self.job.return_token_ids and ids else {}

    def _chunk(self, index: int, choice: Choice, item: Dict[str, Any],
               top: Optional[Dict[str, Any]] = None) -> str:
        """One streamed chunk of choice `index`, with `top`'s fields beside `choices`."""
        body = {**self._envelope(self.chunk_object, [item]), **(top or {})}
        if self.job.continuous_usage:
            body["usage"] = choice_usage(choice)
        return sse(body)

    def delta(self, index: int, chunk: ReplyChunk, choice: Choice) -> Iterator[str]:
        """The chunk's streamed item, or nothing where it carries no output (text held back by
        the detokenizer or by a parser), no logprobs, no finish reason and no prompt
        logprobs, as in vLLM. A token whose text is held back (an incomplete character, a
        possible stop string, markup) still sends its logprobs."""
        echoed = chunk.prompt_logprobs if chunk.prompt_text is not None else []
        entries = [*echoed, *chunk.logprobs]  # an echoed prompt goes first
        text = (chunk.prompt_text or "") + chunk.text
        logprobs = None
        if self.wants_logprobs and entries:
            start = choice.logprob_chars - sum(len(e.token) for e in entries)
            logprobs = self._logprobs(entries, start)
        reason = chunk.finish_reason
        prompt = self._chunk_prompt_logprobs(chunk)
        # Built for every chunk: the chat parsers must see all the text, and may hold it back.
        item = {**self._chunk_item(index, text, reason, logprobs), **prompt,
                **self._token_ids(chunk.token_ids)}
        ids = self.job.return_token_ids and bool(chunk.token_ids)  # ids of held-back text too
        if self._has_text(item) or logprobs is not None or reason is not None or prompt or ids:
            if reason is not None:  # the choice's last chunk: what a whole reply adds
                item.update(matched_stop=chunk.matched_stop, **self._hidden(choice))
            yield self._chunk(index, choice, item)

    def _chunk_prompt_logprobs(self, chunk: ReplyChunk) -> Dict[str, Any]:
        """What a streamed choice item carries of the prompt's log-probabilities (completions:
        vLLM's field on the choice's first chunk; chat puts it on the stream's first chunk)."""
        return {}

    def closing(self, choices: List[Choice]) -> Iterator[str]:
        if self.job.include_usage:
            yield sse({**self._envelope(self.chunk_object, []),
                       "usage": usage(choices, self.job.n, self.job.prompt_tokens_details)})
        yield "data: [DONE]\n\n"


class ChatFormatter(_OpenAIFormatter):
    """With a `reasoning_parser` (server/reasoning.py), the thinking part of each choice goes
    into `message.reasoning_content` / `delta.reasoning_content` (DeepSeek's and SGLang's name)
    and, the same text, `reasoning` (vLLM's since 0.11, OpenRouter's): clients read one or the
    other. The rest goes into `content`. With
    tools that the output may call (`job.tools.parsed`), that rest is read for calls in the
    `tool_parser` format (server/tool_calls.py): `message.tool_calls` / `delta.tool_calls`, and
    finish_reason "tool_calls" when an output with calls ended by itself ("stop" for a named
    function, as OpenAI). `role`: the role each message names (vLLM's --response-role), unless
    the job continues its last message (`Job.role`)."""

    id_prefix = "chatcmpl"
    prompt_param = "messages"
    full_object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, model: str, job: Job, reasoning_parser: Optional[str] = None,
                 tool_parser: Optional[str] = None, role: str = "assistant") -> None:
        super().__init__(model, job)
        self.role = job.role or role
        echo = job.echo_message
        self.echo = echo[1] if echo is not None and echo[0] == self.role else ""
        self.reasoning_parser = reasoning_parser
        self.splitters: Dict[int, ReasoningSplitter] = {}
        tools = job.tools
        self.tool_format = (tool_call_format(tool_parser or "hermes")
                            if tools is not None and tools.parsed else None)
        self.streamers: Dict[int, CallStreamer] = {}

    def _streamer(self, index: int) -> Optional[CallStreamer]:
        if self.tool_format is None:
            return None
        if index not in self.streamers:
            assert self.job.tools is not None
            self.streamers[index] = self.job.tools.streamer(self.tool_format)
        return self.streamers[index]

    def _logprobs(self, entries: Sequence[TokenLogprobText], offset: int) -> Dict[str, Any]:
        return chat_logprobs(entries)

    def full(self, choices: List[Choice]) -> Dict[str, Any]:
        """vLLM's chat response carries the prompt's log-probabilities once, at the top (every
        choice has the same prompt)."""
        return {**super().full(choices), **self._prompt_logprobs(choices[0]),
                **self._prompt_token_ids(choices[0].prompt_ids)}

    def _item(self, index: int, choice: Choice) -> Dict[str, Any]:
        """The choice's message: what its stream would have sent, joined (the tool-call parser
        reads the content the same way in both modes, server/tool_calls.py)."""
        parts = split_reasoning(self.reasoning_parser, "".join(choice.text))
        message: Dict[str, Any] = {"role": self.role, "content": parts.content}
        if self.reasoning_parser is not None:
            message["reasoning_content"] = message["reasoning"] = parts.reasoning or None
        reason = choice.finish_reason
        streamer = self._streamer(index)
        if streamer is not None:
            streamer.feed(parts.content)
            streamer.finish()
            parsed = streamer.parsed()
            message["content"] = parsed.content
            if parsed.calls:
                assert self.tool_format is not None  # (a streamer implies one)
                message["tool_calls"] = [call_dict(c, self.tool_format.new_id())
                                         for c in parsed.calls]
                reason = self._called(reason)
        if self.echo:
            message["content"] = self.echo + (message["content"] or "")
        return {"index": index, "message": message,
                "logprobs": self._choice_logprobs(choice), "finish_reason": reason}

    def opening(self, index: int, choice: Choice) -> Iterator[str]:
        """The role chunk of each choice; the stream's first also carries the prompt's
        log-probabilities where asked (as a chat response does, at the top)."""
        yield self._chunk(index, choice, {
            "index": index, "delta": {"role": self.role, "content": self.echo},
            "logprobs": None, "finish_reason": None},
            {**self._prompt_logprobs(choice), **self._prompt_token_ids(choice.prompt_ids)}
            if index == 0 else {})

    def _chunk_item(self, index: int, text: Optional[str], reason: Optional[str],
                    logprobs: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        delta: Dict[str, Any] = {}
        content = text or ""
        if self.reasoning_parser is not None:
            splitter = self.splitters.setdefault(index, ReasoningSplitter(self.reasoning_parser))
            reasoning, content = splitter.feed(content)
            if reason is not None:
                rest = splitter.flush()
                reasoning, content = reasoning + rest.reasoning, content + rest.content
            if reasoning:
                delta["reasoning_content"] = delta["reasoning"] = reasoning
        streamer = self._streamer(index)
        if streamer is not None:
            piece = streamer.feed(content)
            content, calls = piece.content, [d.as_dict() for d in piece.calls]
            if reason is not None:
                content += streamer.finish().content
                reason = self._called(reason) if streamer.any_call else reason
            if calls:
                delta["tool_calls"] = calls
        if content:
            delta["content"] = content
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}

    def _called(self, reason: Optional[str]) -> Optional[str]:
        """The finish reason of an output with calls: a natural stop becomes the tools'."""
        assert self.job.tools is not None
        return self.job.tools.called_reason if reason == "stop" else reason

    def _has_text(self, item: Dict[str, Any]) -> bool:
        return bool(item["delta"])


class CompletionFormatter(_OpenAIFormatter):
    id_prefix = "cmpl"
    full_object = chunk_object = "text_completion"

    def _logprobs(self, entries: Sequence[TokenLogprobText], offset: int) -> Dict[str, Any]:
        return completion_logprobs(entries, offset, self.job.params.logprobs or 0)

    def _item(self, index: int, choice: Choice) -> Dict[str, Any]:
        return {"index": index, "text": "".join(choice.text),
                "logprobs": self._choice_logprobs(choice), "finish_reason": choice.finish_reason,
                **self._prompt_logprobs(choice), **self._prompt_token_ids(choice.prompt_ids)}

    def _chunk_prompt_logprobs(self, chunk: ReplyChunk) -> Dict[str, Any]:
        """A choice's first chunk carries the prompt's log-probabilities and ids where asked."""
        out = self._prompt_token_ids(chunk.prompt_ids)
        if chunk.prompt_logprobs:
            out.update(self._prompt_logprobs(Choice(prompt_logprobs=list(chunk.prompt_logprobs))))
        return out

    def _chunk_item(self, index: int, text: Optional[str], reason: Optional[str],
                    logprobs: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": reason}

    def _has_text(self, item: Dict[str, Any]) -> bool:
        return bool(item["text"])
