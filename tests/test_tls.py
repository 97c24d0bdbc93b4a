"""HTTPS on the API port (vLLM's and SGLang's --ssl-keyfile / --ssl-certfile): a self-signed
certificate made with the openssl command; the service speaks TLS only, its ready line names
https://, and its requests to itself (the Batch API, --batch-input) reach it; settings that
cannot work are refused at start-up, naming them."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import time
from pathlib import Path
from typing import Tuple

import httpx
import pytest

from minisgl.server.args import parse_args
from server_helpers import CPU_ARGS, run_serve, serving

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> Tuple[Path, Path]:
    """(key, certificate) for localhost and 127.0.0.1, valid for a day."""
    d = tmp_path_factory.mktemp("tls")
    key, cert = d / "key.pem", d / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return key, cert


def test_tls_settings_are_checked(certificate: Tuple[Path, Path], tmp_path: Path) -> None:
    key, cert = certificate
    with pytest.raises(ValueError, match="ssl_keyfile needs its partner"):
        parse_args(["--ssl-keyfile", str(key)])
    with pytest.raises(ValueError, match=f"ssl_certfile {key} with ssl_keyfile {cert} do not "
                                         f"load"):
        parse_args(["--ssl-keyfile", str(cert), "--ssl-certfile", str(key)])
    missing = tmp_path / "none.pem"
    run = run_serve(["--device", "cpu", "--ssl-keyfile", str(key), "--ssl-certfile",
                     str(missing)], tmp_path)
    assert run.returncode != 0 and f"ssl_certfile {missing}" in run.stderr


def test_the_api_speaks_https_and_reaches_itself(certificate: Tuple[Path, Path],
                                                 tiny_qwen3: Path, tmp_path: Path) -> None:
    key, cert = certificate
    tls = ["--ssl-keyfile", str(key), "--ssl-certfile", str(cert)]
    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": [5, 71, 300], "max_tokens": 3, "temperature": 0}})
    with serving(["--model", str(tiny_qwen3), *CPU_ARGS, *tls], tmp_path) as srv:
        assert srv.url.startswith("https://127.0.0.1:")
        trust = ssl.create_default_context(cafile=str(cert))
        with httpx.Client(base_url=srv.url, verify=trust, timeout=60) as client:
            assert client.get("/v1/models").json()["data"][0]["id"]
            done = client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
            assert len(done.json()["choices"][0]["text"]) > 0
            # the Batch API sends each line to the server's own https:// address
            uploaded = client.post("/v1/files", files={"file": ("in.jsonl", line.encode())},
                                   data={"purpose": "batch"}).json()
            batch = client.post("/v1/batches", json={
                "input_file_id": uploaded["id"], "endpoint": "/v1/completions",
                "completion_window": "24h"}).json()
            for _ in range(600):
                batch = client.get(f"/v1/batches/{batch['id']}").json()
                if batch["status"] not in ("validating", "in_progress"):
                    break
                time.sleep(0.05)
            assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 1
        with pytest.raises(httpx.HTTPError):  # plain HTTP is not served
            httpx.get(srv.url.replace("https://", "http://") + "/health", timeout=10)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(line + "\n")
    run = run_serve(["--model", str(tiny_qwen3), *CPU_ARGS, *tls, "--batch-input", str(src),
                     "--batch-output", str(dst)], tmp_path, timeout_s=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(dst.read_text())
    assert out["response"]["status_code"] == 200 and out["error"] is None
