"""`serve --batch-input IN --batch-output OUT`: an OpenAI batch file run through the server's own
HTTP API, after which the service stops (vLLM's `run-batch`, OpenAI's Batch API file format).

Input: one JSON object a line, `{"custom_id": str, "method": "POST", "url": one of BATCH_URLS,
"body": {...}}`; blank lines are skipped. Output: one line per request, in the input's order:
`{"id": "batch_req_<hex>", "custom_id", "response": {"status_code", "request_id", "body"},
"error": null}` holding the endpoint's answer whatever its status (an error's body is OpenAI's
error body), or, for a line that could not be sent (not JSON, no custom_id or one given
before, another method or url, a streamed body), `"response": null` and `"error": {"code",
"message"}`. Up to `concurrency` requests are in flight (the scheduler batches them). The
output is written to a temporary file beside OUT and renamed at the end: OUT is whole or
absent. Standard library only (urllib), as the shell: the launcher imports no torch.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, NamedTuple, Optional, Sequence, Set, Tuple

from tqdm import tqdm

from minisgl.server.tls import loopback_open

BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
              "/v1/messages", "/v1/score", "/v1/rerank", "/score", "/rerank", "/v1/classify",
              "/classify")
REQUEST_TIMEOUT_S = 3600.0  # one request of the batch; the server's own limits apply first


class BatchLine(NamedTuple):
    """One input line: what to send, or why it cannot be sent (`error`)."""

    custom_id: Optional[str]
    url: str = ""
    body: Any = None
    error: Optional[str] = None


class BatchSummary(NamedTuple):
    requests: int
    succeeded: int  # answered 2xx
    failed: int  # answered otherwise, or not sent


def read_lines(path: Path) -> Iterator[BatchLine]:
    """The batch file's requests in order (blank lines skipped); OSError where it cannot be
    read. A custom_id seen before makes its line an error."""
    seen: Set[str] = set()
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, 1):
            if text.strip():
                line = parse_line(text, number)
                cid = line.custom_id
                if cid is not None and line.error is None:
                    if cid in seen:
                        line = line._replace(error=f"line {number}: custom_id {cid!r} is "
                                                   f"given twice")
                    seen.add(cid)
                yield line


def parse_line(text: str, number: int) -> BatchLine:
    """Line `number` of the batch file as a request, or why it is not one."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return BatchLine(None, error=f"line {number} is not JSON: {e.msg}")
    if not isinstance(obj, dict):
        return BatchLine(None, error=f"line {number} is not a JSON object")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return BatchLine(None, error=f"line {number} has no custom_id string")
    method, url, body = obj.get("method"), obj.get("url"), obj.get("body")
    if method != "POST":
        return BatchLine(cid, error=f"line {number}: method {method!r}: only POST is served")
    if url not in BATCH_URLS:
        return BatchLine(cid, error=f"line {number}: url {url!r} is not one of "
                                    f"{', '.join(BATCH_URLS)}")
    if not isinstance(body, dict):
        return BatchLine(cid, error=f"line {number}: body is not a JSON object")
    if body.get("stream"):
        return BatchLine(cid, error=f"line {number}: a batch request cannot stream")
    return BatchLine(cid, url, body)


def send(base_url: str, line: BatchLine, api_key: Optional[str]) -> Dict[str, Any]:
    """Line's output object: the endpoint's answer, or the error that kept it from one."""
    out: Dict[str, Any] = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id,
                           "response": None, "error": None}
    if line.error is not None:
        out["error"] = {"code": "invalid_request", "message": line.error}
        return out
    request_id = f"batch-{uuid.uuid4().hex}"
    headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(base_url + line.url, json.dumps(line.body).encode(), headers)
    try:
        with loopback_open(req, REQUEST_TIMEOUT_S) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except (urllib.error.URLError, OSError) as e:
        out["error"] = {"code": "server_error", "message": f"the server did not answer: {e}"}
        return out
    try:
        body: Any = json.loads(raw)
    except ValueError:
        body = raw.decode("utf-8", "replace")
    out["response"] = {"status_code": status, "request_id": request_id, "body": body}
    return out


def answered(out: Dict[str, Any]) -> bool:
    """Whether an output object (`send`'s) holds a 2xx answer."""
    return out["response"] is not None and 200 <= out["response"]["status_code"] < 300


def send_all(base_url: str, lines: Sequence[BatchLine], api_key: Optional[str],
             concurrency: int, stopped: Callable[[], bool] = lambda: False
             ) -> Iterator[Dict[str, Any]]:
    """Each line's output object (`send`), in the lines' order, `concurrency` requests in
    flight; once `stopped()` says so, lines not sent yet are skipped (no object)."""
    def one(line: BatchLine) -> Optional[Dict[str, Any]]:
        return None if stopped() else send(base_url, line, api_key)

    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        yield from (out for out in pool.map(one, lines) if out is not None)


def run_batch(base_url: str, input_path: Path, output_path: Path, api_key: Optional[str],
              concurrency: int = 256, show_progress: bool = True) -> BatchSummary:
    """Send every request of `input_path` to the server at `base_url` and write the answers
    to `output_path` in input order (see the module's docstring); OSError where a file cannot
    be read or written."""
    lines = list(read_lines(input_path))
    tmp = output_path.with_name(f".{output_path.name}.{os.getpid()}.tmp")
    ok = 0
    try:
        with open(tmp, "w", encoding="utf-8") as f, \
                tqdm(total=len(lines), desc="batch", unit="req", disable=not show_progress) as bar:
            for out in send_all(base_url, lines, api_key, concurrency):
                ok += answered(out)
                f.write(json.dumps(out, ensure_ascii=False) + "\n")
                bar.update(1)
        os.replace(tmp, output_path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return BatchSummary(len(lines), ok, len(lines) - ok)


def summary_line(summary: BatchSummary, output_path: Path) -> str:
    return (f"batch: {summary.requests} requests, {summary.succeeded} answered, "
            f"{summary.failed} failed -> {output_path}")


def check_paths(input_path: Path, output_path: Path) -> Tuple[Path, Path]:
    """The two paths, resolved; ValueError where the input is no file or the output's
    directory is missing (checked before the service starts)."""
    i, o = input_path.expanduser().resolve(), output_path.expanduser().resolve()
    if not i.is_file():
        raise ValueError(f"batch_input {str(input_path)!r} is not a file")
    if not o.parent.is_dir():
        raise ValueError(f"batch_output's directory {str(o.parent)!r} does not exist")
    if i == o:
        raise ValueError("batch_output must not be batch_input")
    return i, o
