"""OpenAI's Files and Batch APIs (as SGLang serves them): upload a batch file, run it in the
background through this server's own endpoints, read the results.

- `POST /v1/files` (multipart: `file`, `purpose`), `GET /v1/files`, `GET /v1/files/{id}`,
  `GET /v1/files/{id}/content`, `DELETE /v1/files/{id}`.
- `POST /v1/batches` {"input_file_id", "endpoint", "completion_window", "metadata"},
  `GET /v1/batches`, `GET /v1/batches/{id}`, `POST /v1/batches/{id}/cancel`.
A batch's lines are server/batch_file.py's (checked and sent as `serve --batch-input` sends
them: to this server over loopback, `concurrency` at a time); it ends "completed" with an
output file of the 2xx answers and an error file of the rest (OpenAI's split), or
"cancelled" (lines not sent by then are not run). Files and batches live in this process's
memory, up to `max_bytes` of files in all (a 413 beyond), and are gone when the server stops.
"""

from __future__ import annotations

import asyncio
import email.parser
import email.policy
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Dict, List, Optional, Tuple

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from minisgl.server.batch_file import BATCH_URLS, answered, parse_line, send_all
from minisgl.server.metrics import Gauge
from minisgl.server.openapi import App
from minisgl.server.protocol import ApiError, Body, parse_body

FILE_PURPOSES = ("batch", "batch_output")


class BatchBody(Body):
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: Optional[Dict[str, str]] = None


@dataclass
class StoredFile:
    id: str
    filename: str
    purpose: str
    data: bytes
    created_at: int = field(default_factory=lambda: int(time.time()))

    def card(self) -> Dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": len(self.data),
                "created_at": self.created_at, "filename": self.filename,
                "purpose": self.purpose, "status": "processed"}


@dataclass
class BatchJob:
    id: str
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: Optional[Dict[str, str]]
    status: str = "validating"
    created_at: int = field(default_factory=lambda: int(time.time()))
    times: Dict[str, int] = field(default_factory=dict)  # in_progress_at, completed_at, ...
    counts: Dict[str, int] = field(default_factory=lambda: {"total": 0, "completed": 0,
                                                             "failed": 0})
    output_file_id: Optional[str] = None
    error_file_id: Optional[str] = None
    cancel: bool = False
    errors: Optional[Dict[str, Any]] = None  # why the job failed (OpenAI's `errors`)

    def card(self) -> Dict[str, Any]:
        out = {"id": self.id, "object": "batch", "endpoint": self.endpoint,
               "errors": self.errors,
               "input_file_id": self.input_file_id,
               "completion_window": self.completion_window, "status": self.status,
               "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
               "created_at": self.created_at, "request_counts": dict(self.counts),
               "metadata": self.metadata}
        for key in ("in_progress_at", "finalizing_at", "completed_at", "failed_at",
                    "cancelling_at", "cancelled_at", "expires_at", "expired_at"):
            out[key] = self.times.get(key)
        return out


def upload(body: bytes, content_type: str) -> Tuple[str, str, bytes]:
    """(filename, purpose, content) of a multipart/form-data upload; ApiError 400 naming
    what is missing."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise ApiError(400, "a file upload is multipart/form-data with `file` and `purpose`")
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        f"Content-Type: {content_type}\r\n\r\n".encode() + body)
    fields: Dict[str, Tuple[Optional[str], bytes]] = {}
    for part in message.iter_parts() if message.is_multipart() else []:
        name = part.get_param("name", header="content-disposition")
        if isinstance(name, str):
            raw = part.get_payload(decode=True)
            fields[name] = (part.get_filename(), raw if isinstance(raw, bytes) else b"")
    if "file" not in fields:
        raise ApiError(400, "the upload has no `file` part", "file")
    purpose = fields.get("purpose", (None, b""))[1].decode("utf-8", "replace").strip()
    if purpose not in FILE_PURPOSES:
        raise ApiError(400, f"purpose {purpose!r} is not supported; supported: batch",
                       "purpose")
    filename, data = fields["file"]
    return filename or "upload.jsonl", purpose, data


class Batches:
    """Files and batch jobs of this server (see the module's docstring)."""

    def __init__(self, max_bytes: int, api_key: Optional[str], concurrency: int = 64) -> None:
        self.max_bytes, self.api_key, self.concurrency = max_bytes, api_key, concurrency
        self.files: Dict[str, StoredFile] = {}
        self.jobs: Dict[str, BatchJob] = {}
        self._tasks: List["asyncio.Task[None]"] = []

    @property
    def held_bytes(self) -> int:
        """Bytes of the files held."""
        return sum(len(f.data) for f in self.files.values())

    def gauges(self) -> List[Gauge]:
        """`minisgl_batches` by status and `minisgl_batch_file_bytes` for /metrics."""
        counts: Dict[Optional[str], float] = {}
        for job in self.jobs.values():
            counts[job.status] = counts.get(job.status, 0) + 1
        return [Gauge("minisgl_batches", "Batch jobs of the Batch API, by status.", counts,
                      "status"),
                Gauge("minisgl_batch_file_bytes", "Bytes of the Files API's files held.",
                      {None: self.held_bytes})]

    def add_file(self, filename: str, purpose: str, data: bytes) -> StoredFile:
        held = self.held_bytes
        if held + len(data) > self.max_bytes:
            raise ApiError(413, f"the server holds {held} bytes of files; this one's "
                                f"{len(data)} would pass its {self.max_bytes}: delete some")
        stored = StoredFile(f"file-{uuid.uuid4().hex}", filename, purpose, data)
        self.files[stored.id] = stored
        return stored

    def file(self, file_id: str) -> StoredFile:
        stored = self.files.get(file_id)
        if stored is None:
            raise ApiError(404, f"No such File object: {file_id}", "file_id")
        return stored

    def job(self, batch_id: str) -> BatchJob:
        job = self.jobs.get(batch_id)
        if job is None:
            raise ApiError(404, f"No such Batch object: {batch_id}", "batch_id")
        return job

    def create(self, body: BatchBody, base_url: str) -> BatchJob:
        if body.endpoint not in BATCH_URLS:
            raise ApiError(400, f"endpoint {body.endpoint!r} is not one of "
                                f"{', '.join(BATCH_URLS)}", "endpoint")
        source = self.file(body.input_file_id)
        if source.purpose != "batch":
            raise ApiError(400, f"file {source.id} has purpose {source.purpose!r}, not "
                                f"'batch'", "input_file_id")
        job = BatchJob(f"batch_{uuid.uuid4().hex}", source.id, body.endpoint,
                       body.completion_window, body.metadata)
        self.jobs[job.id] = job
        self._tasks = [t for t in self._tasks if not t.done()]  # kept while they run
        self._tasks.append(asyncio.ensure_future(self._guarded(job, source.data, base_url)))
        return job

    async def _guarded(self, job: BatchJob, data: bytes, base_url: str) -> None:
        """`_run`; an unexpected error fails the job, saying so, instead of leaving it."""
        try:
            await self._run(job, data, base_url)
        except Exception as e:  # noqa: BLE001 (any: the job must end)
            job.status, job.times["failed_at"] = "failed", int(time.time())
            job.errors = {"object": "list", "data": [{"code": "server_error",
                                                      "message": f"{type(e).__name__}: {e}"}]}

    async def _run(self, job: BatchJob, data: bytes, base_url: str) -> None:
        """Send the job's lines (those for another endpoint than the job's are errors) and
        store the two result files."""
        lines = [parse_line(text, n) for n, text in
                 enumerate(data.decode("utf-8", "replace").splitlines(), 1) if text.strip()]
        lines = [line if line.error or line.url == job.endpoint else line._replace(
            error=f"url {line.url!r} is not the batch's endpoint {job.endpoint!r}")
            for line in lines]
        job.counts["total"] = len(lines)
        job.status, job.times["in_progress_at"] = "in_progress", int(time.time())
        outs = await asyncio.to_thread(self._send_all, job, lines, base_url)
        job.times["finalizing_at"] = int(time.time())
        good: List[Dict[str, Any]] = []
        bad: List[Dict[str, Any]] = []
        for out in outs:
            (good if answered(out) else bad).append(out)
        if good:
            job.output_file_id = self._results(job, "output", good)
        if bad:
            job.error_file_id = self._results(job, "error", bad)
        job.status = "cancelled" if job.cancel else "completed"
        job.times["cancelled_at" if job.cancel else "completed_at"] = int(time.time())

    def _send_all(self, job: BatchJob, lines: List[Any], base_url: str) -> List[Dict[str, Any]]:
        """Each line's output object, in order (none for a line not sent: cancelled), the
        job's counts kept as they come."""
        outs: List[Dict[str, Any]] = []
        for out in send_all(base_url, lines, self.api_key, self.concurrency,
                            lambda: job.cancel):
            job.counts["completed" if answered(out) else "failed"] += 1
            outs.append(out)
        return outs

    def _results(self, job: BatchJob, kind: str, outs: List[Dict[str, Any]]) -> str:
        data = "".join(json.dumps(o, ensure_ascii=False) + "\n" for o in outs).encode()
        stored = StoredFile(f"file-{uuid.uuid4().hex}", f"{job.id}_{kind}.jsonl",
                            "batch_output", data)
        self.files[stored.id] = stored
        return stored.id


def install_batch_routes(app: App, batches: Batches, base_url: Callable[[], str],
                         read_body: Callable[[Request], Awaitable[bytes]]) -> None:
    """The Files and Batch API routes; `base_url`: this server's own (for the batches'
    requests); `read_body`: a JSON body's bytes (api.json_body)."""
    app.body_models.append(BatchBody)

    @app.post("/v1/files")
    async def create_file(request: Request) -> Response:
        name, purpose, data = upload(await request.body(),
                                     request.headers.get("content-type", ""))
        return JSONResponse(batches.add_file(name, purpose, data).card())

    @app.get("/v1/files")
    async def list_files() -> Response:
        return JSONResponse({"object": "list",
                             "data": [f.card() for f in batches.files.values()]})

    @app.get("/v1/files/{file_id}")
    async def get_file(file_id: str) -> Response:
        return JSONResponse(batches.file(file_id).card())

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str) -> Response:
        return Response(batches.file(file_id).data, media_type="application/jsonl")

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str) -> Response:
        batches.file(file_id)
        del batches.files[file_id]
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    @app.post("/v1/batches")
    async def create_batch(request: Request) -> Response:
        body = parse_body(await read_body(request), BatchBody)
        return JSONResponse(batches.create(body, base_url()).card())

    @app.get("/v1/batches")
    async def list_batches() -> Response:
        return JSONResponse({"object": "list", "data": [j.card() for j in batches.jobs.values()],
                             "has_more": False})

    @app.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: str) -> Response:
        return JSONResponse(batches.job(batch_id).card())

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str) -> Response:
        job = batches.job(batch_id)
        if job.status in ("validating", "in_progress"):
            job.cancel, job.status = True, "cancelling"
            job.times["cancelling_at"] = int(time.time())
        return JSONResponse(job.card())
