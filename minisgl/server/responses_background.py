"""Background responses: the Responses API's `background: true`. The request is answered at once
with the response in progress (stored, so that GET /v1/responses/{id} polls it); its job runs
as a task of the API server's event loop, which collects the output with no client waiting
(no disconnect check; --request-timeout still bounds it) and stores the response as it ends:
completed or incomplete, failed (with its error) or cancelled (POST .../cancel).

Who frees what: the task releases its job's stream however it ends (a cancel aborts what is
still running, so the KV accounting balances); the draining server waits for it like any
request in flight.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Dict, List, Optional

from minisgl.message.types import ReplyChunk
from minisgl.server.admission import Deadline
from minisgl.server.protocol import ApiError
from minisgl.server.responses import Choice
from minisgl.server.responses_output import ResponsesFormatter
from minisgl.server.streams import RequestStream, RequestStreams

# Checks a reply chunk: raises its ApiError (naming the request's field) if it is an error.
ChunkCheck = Callable[[ReplyChunk, ResponsesFormatter], None]


class BackgroundRuns:
    """The background responses still running, by response id (only the event loop touches
    it)."""

    def __init__(self, streams: RequestStreams, request_timeout: Optional[float],
                 check: ChunkCheck,
                 on_end: Optional[Callable[[str, List[Choice]], None]] = None) -> None:
        """`on_end`: hears a run's response id and choices once they all ended (api.py's
        --log-outputs)."""
        self.streams, self.request_timeout, self.check = streams, request_timeout, check
        self.on_end = on_end
        self.tasks: Dict[str, "asyncio.Task[None]"] = {}

    def start(self, fmt: ResponsesFormatter) -> Dict[str, Any]:
        """Submit the job (a refusal, such as overload, raises here: the request gets it) and
        answer the response in progress."""
        stream = self.streams.submit(fmt.job)
        pending = fmt.pending()
        self.tasks[fmt.id] = asyncio.ensure_future(self._run(fmt, stream))
        return pending

    async def _run(self, fmt: ResponsesFormatter, stream: RequestStream) -> None:
        deadline = Deadline.of({}, self.request_timeout, stream=False)
        choices: List[Choice] = [Choice() for _ in stream.uids]
        try:
            while stream.unfinished or not stream.queue.empty():
                chunk = await stream.get(deadline.timeout(started=False))
                if chunk is None:
                    stream.abort_reason = "timeout"
                    raise deadline.error()
                self.check(chunk, fmt)
                choices[stream.index[chunk.uid]].add(chunk)
            if self.on_end is not None:
                self.on_end(fmt.id, choices)
            fmt.full(choices)  # stores the response
        except ApiError as e:
            fmt.ended("failed", e)
        except asyncio.CancelledError:
            fmt.ended("cancelled")
        finally:
            self.streams.release(stream)
            self.tasks.pop(fmt.id, None)

    async def cancel(self, response_id: str) -> None:
        """Stop a running background response (its stored status becomes cancelled);
        ApiError 400 where none of that id runs."""
        if response_id not in self.tasks:
            raise ApiError(400, f"response {response_id!r} is not a background response that is "
                                f"still running", "response_id")
        await self.stop(response_id)

    async def stop(self, response_id: str) -> None:
        """Stop the background response `response_id` if it runs (its task has ended, and
        stored it as cancelled, when this returns); nothing otherwise."""
        task = self.tasks.get(response_id)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
