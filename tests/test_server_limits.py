"""A service under overload and hostile requests: admission (429), deadlines, body limits, the API
key and the Host check, fresh /metrics, long prompts; and the settings a deployment sets
(--root-path, --no-auto-tool-choice, --enable-force-include-usage,
--return-tokens-as-token-ids, --max-logprobs, --uvicorn-log-level,
--no-prompt-tokens-details). One `serve` process (default
model, CPU) for the module, with small limits: one request runs at a time, so the others
queue."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple
from urllib.parse import urlparse

import httpx
import openai
import pytest

from server_helpers import CPU_ARGS, Server, comm, descendant_pids

KEY = "sk-test-front-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "SmolLM2-135M-Instruct"
MAX_QUEUED_REQUESTS = 2
MAX_QUEUED_TOKENS = 100
MAX_BYTES = 1 << 20
BODY_TIMEOUT_S = 1.0
# SmolLM2's longest vocabulary entry is 81 characters: no prompt of more can fit 8192 tokens.
MAX_PROMPT_CHARS = 8192 * 81
SHORT = [{"role": "user", "content": "Hi"}]
APP_ORIGIN = "https://app.example"  # --allowed-origins
MAX_LOGPROBS = 30  # vLLM's default is 20
ROOT = "/minisgl"  # --root-path: requests come as a proxy forwards them, without it


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Server]:
    srv = Server.start([*CPU_ARGS, "--max-running-requests", "1",
                        "--max-queued-requests", str(MAX_QUEUED_REQUESTS),
                        "--max-queued-tokens", str(MAX_QUEUED_TOKENS),
                        "--max-request-bytes", str(MAX_BYTES),
                        "--body-timeout", str(BODY_TIMEOUT_S), "--api-key", KEY,
                        "--allowed-origins", APP_ORIGIN, "--root-path", ROOT,
                        "--no-auto-tool-choice", "--enable-force-include-usage",
                        "--return-tokens-as-token-ids", "--max-logprobs", str(MAX_LOGPROBS),
                        "--uvicorn-log-level", "warning", "--no-prompt-tokens-details",
                        "--response-role", "bot", "--trust-request-chat-template",
                        "--stats-interval", "0.2"], tmp_path_factory.mktemp("limits"))
    yield srv
    srv.stop()


def _metrics(server: Server) -> Dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text  # no key needed
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines()
                                     if line and not line.startswith("#"))}


def _idle(server: Server, timeout_s: float = 30.0) -> Dict[str, float]:
    """/metrics once nothing runs or waits and no KV page is held (the accounting, which the
    scheduler checks whenever it idles, balanced)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = _metrics(server)
        if (m["minisgl_num_requests_running"] == m["minisgl_num_requests_waiting"] == 0
                and m["minisgl_kv_pages_used"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def _chat(messages: list = SHORT, **fields: object) -> dict:
    return {"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0, **fields}


def _post(server: Server, path: str, body: object, timeout: float = 120, **headers: str
          ) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=timeout,
                      headers={**AUTH, **headers})


class Hold:
    """A long streamed request that occupies the one running slot until closed."""

    def __init__(self, server: Server) -> None:
        self.client = httpx.Client(timeout=120, headers=AUTH)
        self.cm = self.client.stream("POST", f"{server.url}/v1/chat/completions",
                                     json=_chat(max_tokens=4000, ignore_eos=True, stream=True))
        self.response = self.cm.__enter__()
        assert self.response.status_code == 200
        self.lines = self.response.iter_lines()  # kept: a dropped iterator closes the stream
        next(self.lines)  # running: its first token came

    def close(self) -> None:
        self.cm.__exit__(None, None, None)
        self.client.close()


def _in_background(server: Server, body: dict, path: str = "/v1/chat/completions"
                   ) -> Tuple[threading.Thread, List[httpx.Response]]:
    out: List[httpx.Response] = []
    t = threading.Thread(target=lambda: out.append(_post(server, path, body, timeout=300)))
    t.start()
    return t, out


def _wait_waiting(server: Server, n: int) -> None:
    deadline = time.monotonic() + 20
    while _metrics(server)["minisgl_num_requests_waiting"] < n:
        assert time.monotonic() < deadline, "the requests never queued"
        time.sleep(0.05)


def _overloaded(r: httpx.Response) -> None:
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"] == "1"
    error = r.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"


# --- admission ------------------------------------------------------------------------------------
def test_beyond_max_queued_requests_429_and_streams_refused_before_200(server: Server) -> None:
    hold = Hold(server)
    waiting = [_in_background(server, _chat()) for _ in range(MAX_QUEUED_REQUESTS)]
    rejected = 'minisgl_requests_finished_total{reason="rejected"}'
    try:
        _wait_waiting(server, MAX_QUEUED_REQUESTS)
        before = _metrics(server).get(rejected, 0)
        _overloaded(_post(server, "/v1/chat/completions", _chat()))
        assert _metrics(server)[rejected] == before + 1  # counted as refused for load
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", headers=AUTH,
                          json=_chat(stream=True), timeout=30) as r:
            r.read()
            _overloaded(r)  # a refused stream never started: no 200, no event
        with pytest.raises(openai.RateLimitError):
            openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0).chat.\
                completions.create(model=MODEL, messages=SHORT, max_tokens=2)
    finally:
        hold.close()
    for t, out in waiting:
        t.join(60)
        assert out and out[0].status_code == 200, out
    _idle(server)


def test_beyond_max_queued_tokens_429(server: Server) -> None:
    long_chat = [{"role": "user", "content": "Tell me about the sea. " * 12}]  # > 60 tokens
    hold = Hold(server)
    try:
        t, out = _in_background(server, _chat(long_chat))
        _wait_waiting(server, 1)
        _overloaded(_post(server, "/v1/chat/completions", _chat(long_chat, stream=True)))
        r = _post(server, "/v1/chat/completions", _chat(long_chat))
        _overloaded(r)
        message = r.json()["error"]["message"]
        assert "prompt tokens queued and this request's" in message, message  # its own count
    finally:
        hold.close()
    t.join(60)
    assert out and out[0].status_code == 200
    m = _idle(server)
    # refused for load, not failed (before: counted as "error", beside client mistakes)
    assert m['minisgl_requests_finished_total{reason="rejected"}'] >= 2
    bad = _post(server, "/v1/chat/completions", _chat(max_tokens=10 ** 6))
    assert bad.status_code == 400, bad.text
    m = _metrics(server)
    assert m['minisgl_requests_finished_total{reason="invalid"}'] >= 1
    assert 'minisgl_requests_finished_total{reason="error"}' not in m


def test_many_requests_at_once_are_admitted_or_told_to_retry(server: Server) -> None:
    """A burst (5,000 at once, in small): every request gets a 200 or a 429 with Retry-After,
    never a 5xx; the admitted ones finish and the KV pages balance after."""
    async def burst() -> List[httpx.Response]:
        async with httpx.AsyncClient(timeout=120, headers=AUTH) as client:
            return list(await asyncio.gather(*[
                client.post(f"{server.url}/v1/chat/completions", json=_chat(max_tokens=1))
                for _ in range(40)]))

    statuses = [r.status_code for r in asyncio.run(burst())]
    assert set(statuses) <= {200, 429} and statuses.count(429) > 0 and statuses.count(200) > 0
    m = _idle(server)
    assert m["minisgl_kv_pages_used"] == 0


# --- deadlines ------------------------------------------------------------------------------------
def test_client_timeout_header_aborts_and_frees_the_request(server: Server) -> None:
    """The OpenAI client says how long it reads (X-Stainless-Read-Timeout): past it the request
    is aborted even though the connection stays open, and its KV pages are freed. /metrics
    counts it as finished by "timeout", not by "abort" (a client gone)."""
    before = _idle(server)
    t0 = time.monotonic()
    r = _post(server, "/v1/chat/completions", _chat(max_tokens=4000, ignore_eos=True),
              timeout=60, **{"X-Stainless-Read-Timeout": "1.5"})
    assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout"
    assert time.monotonic() - t0 < 10
    m = _idle(server)
    assert m["minisgl_kv_pages_used"] == 0
    def count(metrics: Dict[str, float], reason: str) -> float:
        return metrics.get(f'minisgl_requests_finished_total{{reason="{reason}"}}', 0.0)

    assert count(m, "timeout") - count(before, "timeout") == 1
    assert count(m, "abort") == count(before, "abort")


# --- bodies ---------------------------------------------------------------------------------------
def _raw(server: Server, head: str, body: bytes = b"", wait_s: float = 10.0) -> bytes:
    """Send `head` and `body` on a fresh connection; what came back until it closed."""
    url = urlparse(server.url)
    with socket.create_connection((url.hostname, url.port), timeout=wait_s) as s:
        s.sendall(head.encode() + body)
        out = b""
        while True:
            try:
                data = s.recv(65536)
            except (socket.timeout, ConnectionResetError):
                break
            if not data:
                break
            out += data
    return out


def _head(server: Server, length: Optional[int], chunked: bool = False) -> str:
    url = urlparse(server.url)
    lines = ["POST /v1/chat/completions HTTP/1.1", f"Host: {url.hostname}:{url.port}",
             f"Authorization: Bearer {KEY}", "Content-Type: application/json"]
    lines.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {length}")
    return "\r\n".join(lines) + "\r\n\r\n"


def test_body_beyond_max_request_bytes_413(server: Server) -> None:
    out = _raw(server, _head(server, 10 ** 9))  # refused from the header: no byte is read
    assert out.startswith(b"HTTP/1.1 413") and b'"invalid_request_error"' in out
    chunk = b"x" * (16 << 10)  # a body without a length, counted as it comes
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk)
                    for _ in range(MAX_BYTES // len(chunk) + 1)) + b"0\r\n\r\n"
    assert _raw(server, _head(server, None, chunked=True), body).startswith(b"HTTP/1.1 413")


def test_body_shorter_than_its_length_times_out(server: Server) -> None:
    t0 = time.monotonic()
    out = _raw(server, _head(server, 100), b'{"model": ', wait_s=BODY_TIMEOUT_S + 10)
    took = time.monotonic() - t0
    assert out.startswith(b"HTTP/1.1 408"), out[:200]
    assert BODY_TIMEOUT_S * 0.9 <= took < BODY_TIMEOUT_S + 5  # answered, then closed


# --- authentication and exposure ------------------------------------------------------------------
def test_api_key_required_except_health_and_metrics(server: Server) -> None:
    url = server.url
    for headers, code in (({}, 401), ({"Authorization": "Bearer wrong"}, 401),
                          ({"Authorization": KEY}, 401), (AUTH, 200)):
        r = httpx.get(f"{url}/v1/models", headers=headers, timeout=10)
        assert r.status_code == code, r.text
        if code == 401:
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.post(f"{url}/v1/chat/completions", json=_chat(), timeout=10).status_code == 401
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{url}/metrics", timeout=10).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).models.list()
    ok = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
    assert ok.models.list().data[0].id == MODEL


def test_host_header_must_be_loopback_and_cross_origin_text_refused(server: Server) -> None:
    port = urlparse(server.url).port
    for host, code in ((f"evil.example:{port}", 403), ("evil.example", 403),
                       (f"127.0.0.1.evil.example:{port}", 403), (f"localhost:{port}", 200),
                       (f"127.0.0.1:{port}", 200), (f"[::1]:{port}", 200)):
        r = httpx.get(f"{server.url}/v1/models", headers={**AUTH, "Host": host}, timeout=10)
        assert r.status_code == code, (host, r.text)
    r = httpx.post(f"{server.url}/v1/chat/completions", content=json.dumps(_chat()),
                   headers={**AUTH, "Content-Type": "text/plain",
                            "Origin": "http://evil.example"}, timeout=10)
    assert r.status_code == 415


def test_cors_answers_the_allowed_origin_only(server: Server) -> None:
    """--allowed-origins: a preflight from that origin is answered (before the key check: it
    carries none), and the answers carry its Access-Control-Allow-Origin; another origin's
    preflight is refused and its answers carry none, so its page cannot read them. Settings
    that cannot work are refused by name."""
    from minisgl.server.args import parse_args
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    url = f"{server.url}/v1/chat/completions"
    ok = httpx.options(url, headers={**preflight, "Origin": APP_ORIGIN}, timeout=10)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == APP_ORIGIN
    bad = httpx.options(url, headers={**preflight, "Origin": "https://evil.example"},
                        timeout=10)
    assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
    got = httpx.post(url, json=_chat(max_tokens=1), headers={**AUTH, "Origin": APP_ORIGIN},
                     timeout=60)
    assert got.status_code == 200 and got.headers["access-control-allow-origin"] == APP_ORIGIN
    other = httpx.get(f"{server.url}/v1/models", headers={**AUTH, "Origin": "https://x.example"},
                      timeout=10)
    assert "access-control-allow-origin" not in other.headers
    assert parse_args(["--allowed-origins", '["https://a.example", "http://b:3000/"]']
                      ).origins == ("https://a.example", "http://b:3000")
    for bad_value, named in (("*", "needs api_key"), ("a.example", "is not an origin"),
                             ("https://a.example/app", "is not an origin"),
                             ("[1]", "list of strings")):
        with pytest.raises(ValueError, match=named):
            parse_args(["--allowed-origins", bad_value])


def test_openapi_describes_request_bodies(server: Server) -> None:
    doc = httpx.get(f"{server.url}/openapi.json", headers=AUTH, timeout=10).json()
    schemas = doc["components"]["schemas"]
    for path, model in (("/v1/chat/completions", "ChatRequest"),
                        ("/v1/completions", "CompletionRequest"), ("/generate", "GenerateRequest"),
                        ("/v1/responses", "ResponsesRequest"), ("/tokenize", "TokenizeBody"),
                        ("/detokenize", "DetokenizeBody")):
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert ref == {"$ref": f"#/components/schemas/{model}"}
        assert schemas[model]["properties"]
    assert "messages" in schemas["ChatRequest"]["required"]
    assert schemas["ChatMessage"]["properties"]["role"]


@pytest.mark.parametrize("flags,served", [([], True), (["--no-openapi"], False),
                                           (["--disable-fastapi-docs"], False)])
def test_disable_fastapi_docs_hides_the_openapi_document(tmp_path: Path, flags: List[str],
                                                         served: bool) -> None:
    """vLLM's --disable-fastapi-docs (minisgl's --no-openapi): no /openapi.json; the API
    itself is unchanged (the app alone: no service behind it)."""
    from fastapi.testclient import TestClient
    from minisgl.server.api import ApiConfig, create_app
    from minisgl.server.args import parse_args
    openapi = parse_args(flags).openapi
    assert openapi is served
    cfg = ApiConfig("m", 2048, 1, f"ipc://{tmp_path}/tok", f"ipc://{tmp_path}/api",
                    str(tmp_path / "health"), openapi=openapi)
    client = TestClient(create_app(cfg, lambda: True))
    assert client.get("/health").headers["x-request-id"]  # every answer names its request
    r = client.get("/openapi.json")
    assert r.status_code == (200 if served else 404), r.text
    if served:  # OpenAPI's rule, which code generators rely on: one id per operation
        ids = [op["operationId"] for ops in r.json()["paths"].values() for op in ops.values()]
        assert len(ids) == len(set(ids)) and "health_ping_post" in ids
    assert client.head("/health").status_code == client.post("/ping").status_code == 200
    assert client.post("/v1/chat/completions", content=b"{").status_code == 400


def test_request_id_headers_on_unless_turned_off(tmp_path: Path) -> None:
    """vLLM's --enable-request-id-headers asks for what is done by default (X-Request-Id on
    every answer, the client's where it sent one); --no-request-id-headers leaves it out."""
    from fastapi.testclient import TestClient
    from minisgl.server.api import ApiConfig, create_app
    from minisgl.server.args import parse_args
    for flags, echoed in ((["--enable-request-id-headers"], True), ([], True),
                          (["--no-request-id-headers"], False)):
        cfg = ApiConfig("m", 2048, 1, f"ipc://{tmp_path}/tok", f"ipc://{tmp_path}/api",
                        str(tmp_path / "health"),
                        request_id_headers=parse_args(flags).request_id_headers)
        r = TestClient(create_app(cfg, lambda: True)).get(
            "/health", headers={"X-Request-Id": "rid-7"})
        assert r.headers.get("x-request-id") == ("rid-7" if echoed else None), flags


def test_cors_methods_headers_and_credentials(tmp_path: Path) -> None:
    """vLLM's --allowed-methods / --allowed-headers / --allow-credentials: a preflight asking
    for a method or a header beyond them is refused (400), one within them answered, with
    Access-Control-Allow-Credentials where allowed; by default any method and header, no
    credentials; a bad entry is refused by name (the app alone: no service behind it)."""
    from fastapi.testclient import TestClient
    from minisgl.server.api import ApiConfig, create_app
    from minisgl.server.args import parse_args
    origin = ["--allowed-origins", APP_ORIGIN]

    def preflight(flags: List[str], method: str, headers: str) -> httpx.Response:
        cfg = ApiConfig("m", 2048, 1, f"ipc://{tmp_path}/tok", f"ipc://{tmp_path}/api",
                        str(tmp_path / "health"), cors=parse_args([*origin, *flags]).cors)
        return TestClient(create_app(cfg, lambda: True)).options(
            "/v1/chat/completions", headers={"Origin": APP_ORIGIN,
                                             "Access-Control-Request-Method": method,
                                             "Access-Control-Request-Headers": headers})
    narrow = ["--allowed-methods", "GET,POST", "--allowed-headers",
              '["Authorization", "Content-Type"]', "--allow-credentials"]
    ok = preflight(narrow, "POST", "authorization, content-type")
    assert ok.status_code == 200 and ok.headers["access-control-allow-credentials"] == "true"
    assert preflight(narrow, "DELETE", "authorization").status_code == 400
    assert preflight(narrow, "POST", "x-other").status_code == 400
    wide = preflight([], "DELETE", "x-other")
    assert wide.status_code == 200 and "access-control-allow-credentials" not in wide.headers
    with pytest.raises(ValueError, match="allowed_methods: 'GET POST' is not an HTTP method"):
        parse_args([*origin, "--allowed-methods", "GET POST"])


# --- hostile input --------------------------------------------------------------------------------
@pytest.mark.parametrize("depth", [1000, 100_000])
def test_deeply_nested_json_400(server: Server, depth: int) -> None:
    body = b'{"model": "x", "messages": ' + b"[" * depth + b"]" * depth + b"}"
    r = httpx.post(f"{server.url}/v1/chat/completions", content=body, timeout=30,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400 and "nested" in r.json()["error"]["message"]


@pytest.mark.parametrize("key", ["²", "١٢", "1²", " 12"])
def test_logit_bias_keys_ascii_digits_only(server: Server, key: str) -> None:
    r = _post(server, "/v1/chat/completions", _chat(logit_bias={key: 1}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"


# --- metrics --------------------------------------------------------------------------------------
def test_metrics_fresh_during_a_long_forward(server: Server) -> None:
    """Rank 0 pushes its state on a timer: the pool's size is known at any time, and a request
    in its prefill shows (waiting, its pages held) while the forward runs. With stats only in
    replies, a one-token request's pages would never be seen: its reply comes after they are
    freed."""
    assert _idle(server)["minisgl_kv_pages_total"] == 512
    words = " ".join(f"w{i}" for i in range(120))  # a prompt no earlier request shares
    t, out = _in_background(server, {"model": MODEL, "prompt": words, "max_tokens": 1},
                            "/v1/completions")
    seen = []
    while t.is_alive():
        seen.append(_metrics(server))
        time.sleep(0.05)
    t.join()
    assert out and out[0].status_code == 200
    assert any(m["minisgl_kv_pages_used"] > 0 and m["minisgl_num_requests_waiting"] == 1
               for m in seen), seen[-3:]
    assert _idle(server)["minisgl_kv_pages_used"] == 0


# --- long prompts ---------------------------------------------------------------------------------
def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def test_prompt_longer_than_any_context_refused_without_tokenizing(server: Server) -> None:
    t0 = time.monotonic()
    r = _post(server, "/v1/chat/completions",
              _chat([{"role": "user", "content": "a" * (MAX_PROMPT_CHARS + 1)}]))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages" and "characters" in error["message"]
    assert time.monotonic() - t0 < 5  # not tokenized (that takes a few seconds here)


def test_short_request_not_held_up_behind_a_long_prompt(server: Server) -> None:
    """A long prompt is tokenized beside the loop: a short /tokenize sent just after it
    answers long before it, and the tokenizer's memory goes back down afterwards."""
    tokenizer = next(p for p in descendant_pids(server.proc.pid) if comm(p) == "minisgl-tokeniz")
    rss_before = _rss_kb(tokenizer)
    text = "The quick brown fox jumps over the lazy dog. " * (MAX_PROMPT_CHARS // 46)
    done: Dict[str, float] = {}

    def long() -> None:
        _post(server, "/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 1})
        done["long"] = time.monotonic()

    t0 = time.monotonic()
    worker = threading.Thread(target=long)
    worker.start()
    time.sleep(0.05)  # the long prompt is being tokenized (a few tenths of a second)
    r = _post(server, "/tokenize", {"prompt": "hello"})
    done["short"] = time.monotonic()
    worker.join(120)
    assert r.status_code == 200 and r.json()["count"] >= 1
    # Ordering, not a time ratio (timed assertions flake on a loaded machine): tokenized in
    # turn, the short request would answer only after the long one.
    assert done["short"] < done["long"], (done["short"] - t0, done["long"] - t0)
    assert _rss_kb(tokenizer) < rss_before + 200_000  # kB: the long prompt's memory returned


@pytest.mark.parametrize("field", ["priority", "truncate_prompt_tokens"])
def test_integers_beyond_a_message_are_400s_that_hold_no_place(server: Server,
                                                               field: str) -> None:
    """A number too large for a message's 64 bits used to fail after the request took its
    place in the queue (a 500, and the place never given back: after MAX_QUEUED_REQUESTS of
    them every request got a 429). Now: a 400 naming the field, and nothing held."""
    for _ in range(MAX_QUEUED_REQUESTS + 1):
        r = _post(server, "/v1/chat/completions", _chat(**{field: 2 ** 64}))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field
    assert _post(server, "/v1/chat/completions", _chat()).status_code == 200


def test_a_prompt_to_truncate_may_be_longer_than_any_context(server: Server) -> None:
    """truncate_prompt_tokens (vLLM's): a prompt the character check would refuse is
    tokenized and cut to its last tokens, as vLLM cuts it."""
    words = "hi " * (MAX_PROMPT_CHARS // 3 + 1)
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": words, "max_tokens": 2,
                                          "truncate_prompt_tokens": 16})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 16


def test_root_path_behind_a_proxy(server: Server) -> None:
    """--root-path: requests as the proxy forwards them (its prefix removed) are served, their
    paths tested as routes (the open /health, the Messages API's x-api-key and its error
    shape); the OpenAPI document's servers and the chat page's requests name the prefix."""
    assert httpx.get(f"{server.url}/openapi.json", headers=AUTH).json()["servers"] == [
        {"url": ROOT}]
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200  # no key needed
    assert f'const ROOT = "{ROOT}";' in httpx.get(f"{server.url}/", headers=AUTH).text
    ask = {"model": MODEL, "max_tokens": 2, "messages": SHORT}
    ok = httpx.post(f"{server.url}/v1/messages", json=ask, headers={"x-api-key": KEY},
                    timeout=120)
    assert ok.status_code == 200 and ok.json()["type"] == "message"
    bad = httpx.post(f"{server.url}/v1/messages", json=ask, headers={"x-api-key": "no"},
                     timeout=120)
    assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
    with pytest.raises(ValueError, match="root_path must be a path"):
        from minisgl.server.args import parse_args
        parse_args(["--root-path", "minisgl/"])
    from minisgl.server.limits import route_path
    assert route_path({"path": "/minisgl/v1/models", "root_path": ROOT}) == "/v1/models"
    assert route_path({"path": "/minisglx/v1", "root_path": ROOT}) == "/minisglx/v1"
    assert route_path({"path": "/health"}) == "/health"


def test_trusted_request_chat_templates_replace_the_models(server: Server) -> None:
    """--trust-request-chat-template: a chat or /tokenize request's own template (the
    `chat_template` field, or chat_template_kwargs' chat_template) renders its messages."""
    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    for fields in ({"chat_template": template},
                   {"chat_template_kwargs": {"chat_template": template}}):
        ids = _post(server, "/tokenize", {"messages": SHORT, **fields}).json()["tokens"]
        text = _post(server, "/detokenize", {"tokens": ids}).json()["prompt"]
        assert text == "".join(f"<<{m['content']}>>" for m in SHORT)
        r = _post(server, "/v1/chat/completions", _chat(**fields))
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids), r.text
    # vLLM's documents reach the template (a RAG template shows them)
    rag = "{% for d in documents %}[{{ d['title'] }}: {{ d['text'] }}]{% endfor %}"
    ids = _post(server, "/tokenize", {"messages": SHORT, "chat_template": rag, "documents": [
        {"title": "A", "text": "one"}, {"title": "B", "text": "two"}]}).json()["tokens"]
    assert _post(server, "/detokenize", {"tokens": ids}).json()["prompt"] == "[A: one][B: two]"
    bad = _post(server, "/tokenize", {"messages": SHORT, "documents": [{"title": 1}]})
    assert bad.status_code == 400 and "documents" in bad.text


def test_tool_choice_auto_off_usage_forced_tokens_as_ids(server: Server) -> None:
    """--no-auto-tool-choice: tools with tool_choice auto (given, or the default with tools)
    are a 400 naming tool_choice, on chat and the Responses API; required is served.
    --enable-force-include-usage: a stream that did not ask still ends with its usage.
    --return-tokens-as-token-ids: logprob tokens as "token_id:N" unless the request says
    false. --no-prompt-tokens-details: usage without prompt_tokens_details. --response-role
    bot: chat messages and the stream's first delta name it, but where the request continues
    its last message (add_generation_prompt false), which names its own."""
    from minisgl.server.args import parse_args
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
        "required": ["city"]}}}
    for body in (_chat(tools=[weather]), _chat(tools=[weather], tool_choice="auto")):
        r = _post(server, "/v1/chat/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
    flat = {"type": "function", **weather["function"]}
    r = _post(server, "/v1/responses", {"model": MODEL, "input": "hi", "tools": [flat]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    ok = _post(server, "/v1/chat/completions", _chat(tools=[weather], tool_choice="required",
                                                     max_tokens=30))
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["tool_calls"]
    with httpx.stream("POST", f"{server.url}/v1/completions", headers=AUTH, timeout=60,
                      json={"model": MODEL, "prompt": "Hi", "max_tokens": 3,
                            "stream": True}) as r:
        data = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "data: [DONE]"
    streamed_usage = json.loads(data[-2].removeprefix("data: "))["usage"]
    assert streamed_usage["completion_tokens"] == 3
    # --no-prompt-tokens-details (vLLM's default): usage without prompt_tokens_details
    assert "prompt_tokens_details" not in streamed_usage
    reply = _post(server, "/v1/chat/completions", _chat()).json()
    plain = reply["usage"]
    assert plain["prompt_tokens"] > 0 and "prompt_tokens_details" not in plain
    assert reply["choices"][0]["message"]["role"] == "bot"
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", headers=AUTH, timeout=60,
                      json={**_chat(), "stream": True}) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
    assert json.loads(first[6:])["choices"][0]["delta"]["role"] == "bot"
    continued = _post(server, "/v1/chat/completions", {
        **_chat(), "messages": [*SHORT, {"role": "assistant", "content": "The"}],
        "add_generation_prompt": False, "continue_final_message": True}).json()
    assert continued["choices"][0]["message"]["role"] == "assistant", continued
    with pytest.raises(ValueError, match="response_role must not be empty"):
        parse_args(["--response-role", " "])
    assert parse_args(["--enable-prompt-tokens-details"]).prompt_tokens_details

    def tokens(**fields: object) -> list:
        r = _post(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2,
                                              "logprobs": 1, "temperature": 0, **fields})
        assert r.status_code == 200, r.text
        return list(r.json()["choices"][0]["logprobs"]["tokens"])
    assert all(t.startswith("token_id:") for t in tokens())
    assert not any(t.startswith("token_id:") for t in tokens(return_tokens_as_token_ids=False))


def test_max_logprobs_is_the_cap_of_every_api(server: Server) -> None:
    """--max-logprobs 30: 30 alternatives served (OpenAI's own cap is 20); 31 a 400 naming the
    field each API calls it by, with the numbers; the service goes on."""
    r = _post(server, "/v1/chat/completions", _chat(logprobs=True, top_logprobs=MAX_LOGPROBS))
    assert r.status_code == 200, r.text
    steps = r.json()["choices"][0]["logprobs"]["content"]
    assert steps and all(len(s["top_logprobs"]) == MAX_LOGPROBS for s in steps)
    over = MAX_LOGPROBS + 1
    for path, body, param in (
            ("/v1/chat/completions", _chat(logprobs=True, top_logprobs=over), "top_logprobs"),
            ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2,
                                 "logprobs": over}, "logprobs"),
            ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2,
                                 "prompt_logprobs": over}, "prompt_logprobs"),
            ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2},
                           "return_logprob": True, "top_logprobs_num": over},
             "top_logprobs_num")):
        r = _post(server, path, body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and error["message"] == (
            f"{param} asks for the {over} most likely tokens, more than this engine returns "
            f"(max_logprobs {MAX_LOGPROBS})"), error
    assert _post(server, "/v1/chat/completions", _chat()).status_code == 200
