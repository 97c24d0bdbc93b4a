"""Request ids and the access log (server/request_log.py): the client's X-Request-Id comes back
in the header and in the completion's id, a bad one is a 400 naming the header, and one line
per request names its status, id and scheduler uids, also when the client leaves mid-stream."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Dict, Iterator, List, Tuple, Union

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from minisgl.server.request_log import MAX_ID_CHARS, RequestLog
from server_helpers import CPU_ARGS, Server


def _app(enabled: bool = True, counts: Union[None, Dict[Tuple[str, str], int]] = None
         ) -> FastAPI:
    app = FastAPI()

    @app.get("/echo")
    async def echo(request: Request) -> JSONResponse:
        request.state.uids = [7, 8]
        return JSONResponse({"id": request.state.request_id})

    @app.get("/models/{name:path}")
    async def model(name: str) -> JSONResponse:
        return JSONResponse({"name": name})

    def count(route: str, status: str) -> None:
        if counts is not None:
            counts[route, status] = counts.get((route, status), 0) + 1

    app.add_middleware(RequestLog, enabled=enabled, count=count)
    return app


def _get(app: FastAPI, path: str, **headers: Union[str, bytes]) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, client=("10.0.0.9", 4321))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.get(path, headers=headers)
    return asyncio.run(go())


def test_the_clients_id_is_used_echoed_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="minisgl.api"):
        r = _get(_app(), "/echo", **{"X-Request-Id": "trace-42"})
    assert r.json() == {"id": "trace-42"} and r.headers["x-request-id"] == "trace-42"
    line, = [m for m in caplog.messages if "request_id=trace-42" in m]
    assert re.fullmatch(r"10\.0\.0\.9:4321 GET /echo 200 [\d.]+ ms request_id=trace-42 "
                        r"uids=7,8", line), line


def test_a_request_without_an_id_gets_one(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="minisgl.api"):
        r = _get(_app(), "/echo")
        missing = _get(_app(), "/nowhere")
    rid = r.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", rid) and r.json() == {"id": rid}
    assert missing.status_code == 404 and missing.headers["x-request-id"]
    assert any(" GET /nowhere 404 " in m for m in caplog.messages)


@pytest.mark.parametrize("bad", ["x" * (MAX_ID_CHARS + 1), "tab\there", "caf\u00e9"])
def test_a_bad_id_is_a_400_naming_the_header(bad: str) -> None:
    r = _get(_app(), "/echo", **{"X-Request-Id": bad.encode()})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "X-Request-Id" and "printable ASCII" in error["message"]
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])  # not the bad one


def test_probes_are_logged_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    app = _app()

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({})

    with caplog.at_level(logging.INFO, logger="minisgl.api"):
        _get(app, "/health")
    assert not [m for m in caplog.messages if "/health" in m]
    with caplog.at_level(logging.DEBUG, logger="minisgl.api"):
        _get(app, "/health")
    assert [r.levelno for r in caplog.records if "/health" in r.getMessage()] == [logging.DEBUG]


def test_no_lines_when_disabled(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="minisgl.api"):
        r = _get(_app(enabled=False), "/echo", **{"X-Request-Id": "quiet"})
    assert r.headers["x-request-id"] == "quiet"
    assert not [m for m in caplog.messages if "request_id=" in m]


def test_every_answer_is_counted_by_route_and_status() -> None:
    """Each request is counted once, under the route as declared (a path parameter's value
    never becomes a label), refusals before routing included; no route is "other"."""
    counts: Dict[Tuple[str, str], int] = {}
    app = _app(enabled=False, counts=counts)
    _get(app, "/echo")
    _get(app, "/echo", **{"X-Request-Id": b"tab\there"})  # refused before routing
    _get(app, "/models/org/name-1")
    _get(app, "/models/org/name-2")
    _get(app, "/nowhere")
    assert counts == {("/echo", "200"): 1, ("/echo", "400"): 1,
                      ("/models/{name:path}", "200"): 2, ("other", "404"): 1}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args: List[str] = [a if a != "warning" else "info" for a in CPU_ARGS]
    srv = Server.start([*args, "--enable-log-outputs", "--max-log-len", "12"],
                       tmp_path_factory.mktemp("log"))
    yield srv
    srv.stop()


def _wait_for_line(server: Server, needle: str, timeout_s: float = 20.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [line for line in server.stderr().splitlines() if needle in line]
        if found:
            return found[-1]
        time.sleep(0.1)
    raise AssertionError(f"no log line with {needle!r}:\n{server.stderr()[-2000:]}")


def test_served_completions_take_the_id(server: Server) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=60,
                   headers={"X-Request-Id": "job-7"})
    assert r.status_code == 200 and r.json()["id"] == "chatcmpl-job-7"
    assert r.headers["x-request-id"] == "job-7"
    line = _wait_for_line(server, "request_id=job-7")
    assert re.search(r"POST /v1/chat/completions 200 [\d.]+ ms request_id=job-7 uids=\d+$",
                     line), line
    r = httpx.post(f"{server.base_url}/completions", timeout=60, headers={"X-Request-Id": "c"},
                   json={"prompt": "Hi", "max_tokens": 2, "n": 2, "request_id": "body"})
    assert r.json()["id"] == "cmpl-c"  # the header wins over vLLM's body field
    r = httpx.post(f"{server.base_url}/chat/completions", timeout=60,
                   json={**body, "request_id": "from-body"})
    assert r.json()["id"] == "chatcmpl-from-body"
    r = httpx.post(f"{server.base_url}/chat/completions", timeout=60,
                   json={**body, "request_id": "tab\there"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"
    assert re.search(r"request_id=c uids=\d+,\d+$", _wait_for_line(server, "request_id=c "
                                                                   "uids"))


def test_outputs_are_logged_cut_to_max_log_len(server: Server) -> None:
    """--enable-log-outputs (vLLM's) with --max-log-len 12: a line per finished choice with
    the request id, finish reason, tokens and the text's first 12 characters, plain,
    streamed and a background response (under its response id); --max-log-len below 0 is
    refused."""
    from minisgl.server.args import parse_args
    body = {"messages": [{"role": "user", "content": "Count to twenty."}], "max_tokens": 12,
            "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=60,
                   headers={"X-Request-Id": "out-1"})
    text = r.json()["choices"][0]["message"]["content"]
    line = _wait_for_line(server, "request out-1 choice 0")
    assert line.endswith(f"length, 12 tokens, output {text[:12]!r}"), (line, text)
    with httpx.stream("POST", f"{server.base_url}/chat/completions", timeout=60,
                      json={**body, "stream": True, "n": 2},
                      headers={"X-Request-Id": "out-2"}) as s:
        assert s.status_code == 200 and "data: [DONE]" in list(s.iter_lines())
    assert "12 tokens" in _wait_for_line(server, "request out-2 choice 1")
    bg = httpx.post(f"{server.base_url}/responses", timeout=60, json={
        "input": "Count to twenty.", "max_output_tokens": 5, "background": True}).json()
    assert "5 tokens" in _wait_for_line(server, f"request {bg['id']} choice 0")  # its id
    with pytest.raises(ValueError, match="max_log_len must be >= 0"):
        parse_args(["--max-log-len", "-1"])


def test_a_stream_the_client_leaves_is_logged_unfinished(server: Server) -> None:
    body = {"messages": [{"role": "user", "content": "Count to a thousand."}],
            "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json=body, timeout=60,
                      headers={"X-Request-Id": "gone-1"}) as r:
        assert r.status_code == 200
        next(r.iter_lines())
    line = _wait_for_line(server, "request_id=gone-1")
    assert " 200 (unfinished) " in line and "uids=" in line


def test_refusals_before_the_scheduler_reach_the_metrics(server: Server) -> None:
    """A body that fails parsing never gets a uid, so only the HTTP counter sees it."""
    def count(status: str) -> int:
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        found = re.search(r'^minisgl_http_requests_total\{path="/v1/chat/completions",'
                          rf'status="{status}"\}} (\d+)$', text, re.M)
        return int(found.group(1)) if found else 0

    before = count("400")
    r = httpx.post(f"{server.base_url}/chat/completions", timeout=10,
                   json={"messages": "not a list"})
    assert r.status_code == 400
    assert count("400") == before + 1
