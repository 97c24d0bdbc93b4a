"""`serve --batch-input IN --batch-output OUT` (vLLM's run-batch): an OpenAI batch file through
the server's own API, one answer line per request in the input's order, then exit 0; lines that
cannot be sent get an error of their own and the rest go on."""

from __future__ import annotations

import json
import os
import subprocess
import time
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

from server_helpers import CPU_ARGS, REPO

from minisgl import LLM, SamplingParams
from minisgl.server.args import parse_args
from minisgl.server.batch_file import parse_line

PROMPT = [5, 71, 300, 12, 9, 44]


def _line(cid: str, url: str, body: Dict[str, Any]) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def _serve(args: List[str], tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "serve"), *args], capture_output=True,
                          text=True, timeout=300, cwd=str(tmp_path),
                          env={**os.environ, "TMPDIR": str(tmp_path)})


def test_a_batch_file_runs_through_the_api_in_order(tiny_qwen3: Path, tmp_path: Path) -> None:
    greedy = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    lines = [
        _line("chat", "/v1/chat/completions",
              {"messages": [{"role": "user", "content": "Hi"}], **greedy}),
        _line("ids", "/v1/completions", {"prompt": PROMPT, "return_token_ids": True, **greedy}),
        "",
        _line("embed", "/v1/embeddings", {"input": "hello"}),
        _line("bad-param", "/v1/completions", {"prompt": "x", "max_tokens": -1}),
        '{"custom_id": "broken", ',
        _line("models", "/v1/models", {}),
        _line("stream", "/v1/completions", {"prompt": "x", "stream": True}),
        _line("ids", "/v1/completions", {"prompt": "again"}),
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    run = _serve(["--model", str(tiny_qwen3), *CPU_ARGS[:4], "--batch-input", str(src),
                  "--batch-output", str(dst)], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"batch: 8 requests, 3 answered, 5 failed -> {dst}" in run.stdout
    outs = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [o["custom_id"] for o in outs] == ["chat", "ids", "embed", "bad-param", None,
                                              "models", "stream", "ids"]
    assert len({o["id"] for o in outs}) == 8 and all(o["id"].startswith("batch_req_")
                                                       for o in outs)
    chat, ids, embed, bad = (o["response"] for o in outs[:4])
    assert chat["status_code"] == 200 and chat["body"]["choices"][0]["message"]["content"]
    assert chat["body"]["id"].endswith(chat["request_id"])  # the id is built from ours
    with LLM(str(tiny_qwen3), device="cpu", max_kv_tokens=2048, show_progress=False) as llm:
        want = llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0.0,
                                                     ignore_eos=True))[0].token_ids
    assert ids["body"]["choices"][0]["token_ids"] == want
    assert len(embed["body"]["data"][0]["embedding"]) > 0
    assert bad["status_code"] == 400 and bad["body"]["error"]["param"] == "max_tokens"
    errors = [o["error"]["message"] for o in outs[4:]]
    assert "line 6 is not JSON" in errors[0]
    assert "url '/v1/models' is not one of" in errors[1]
    assert "cannot stream" in errors[2] and "custom_id 'ids' is given twice" in errors[3]
    assert all(o["response"] is None for o in outs[4:])
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".out")) == []


def test_batch_settings_are_checked_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="batch_input and batch_output go together"):
        parse_args(["--batch-input", "in.jsonl"])
    with pytest.raises(ValueError, match="shell and batch_input exclude each other"):
        parse_args(["--input-file", "a", "--output-file", "b", "--shell"])
    run = _serve(["--device", "cpu", "--batch-input", str(tmp_path / "missing.jsonl"),
                  "--batch-output", str(tmp_path / "out.jsonl")], tmp_path)
    assert run.returncode == 1 and "missing.jsonl' is not a file" in run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize("text,error", [
    ("[1]", "line 3 is not a JSON object"),
    ('{"custom_id": 5}', "line 3 has no custom_id string"),
    ('{"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}',
     "method 'GET': only POST is served"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": []}',
     "body is not a JSON object"),
])
def test_lines_that_are_not_requests_say_why(text: str, error: str) -> None:
    line = parse_line(text, 3)
    assert line.error is not None and error in line.error


def test_openai_files_and_batches_run_through_the_server(tiny_qwen3: Path,
                                                         tmp_path: Path) -> None:
    """OpenAI's Batch API with its own client: upload, create, poll until done, read the
    output (2xx answers) and error (the rest) files; unknown ids are 404s."""
    import openai
    from server_helpers import serving
    lines = [_line("a", "/v1/completions", {"prompt": PROMPT, "max_tokens": 4,
                                            "temperature": 0, "return_token_ids": True}),
             _line("b", "/v1/completions", {"prompt": "x", "max_tokens": -1}),
             _line("c", "/v1/embeddings", {"input": "other endpoint"})]
    with serving(["--model", str(tiny_qwen3), *CPU_ARGS], tmp_path) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
        uploaded = client.files.create(file=("in.jsonl", "\n".join(lines).encode()),
                                       purpose="batch")
        assert uploaded.bytes == len("\n".join(lines))
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                      completion_window="24h")
        for _ in range(600):
            batch = client.batches.retrieve(batch.id)
            if batch.status in ("completed", "failed", "cancelled"):
                break
            time.sleep(0.1)
        assert batch.status == "completed", batch
        assert batch.request_counts is not None
        assert (batch.request_counts.total, batch.request_counts.completed,
                batch.request_counts.failed) == (3, 1, 2)
        assert batch.output_file_id is not None and batch.error_file_id is not None
        good = [json.loads(x) for x in client.files.content(batch.output_file_id).text.split("\n")
                if x]
        bad = [json.loads(x) for x in client.files.content(batch.error_file_id).text.split("\n")
               if x]
        assert [g["custom_id"] for g in good] == ["a"]
        assert len(good[0]["response"]["body"]["choices"][0]["token_ids"]) == 4
        assert [b["custom_id"] for b in bad] == ["b", "c"]
        assert bad[0]["response"]["status_code"] == 400
        assert "not the batch's endpoint" in bad[1]["error"]["message"]
        assert [b.id for b in client.batches.list().data] == [batch.id]
        metrics = srv.metrics()
        assert metrics['minisgl_batches{status="completed"}'] == 1
        assert metrics["minisgl_batch_file_bytes"] > len("\n".join(lines))
        with pytest.raises(openai.NotFoundError):
            client.batches.retrieve("batch_nope")
        with pytest.raises(openai.BadRequestError):
            client.batches.create(input_file_id=uploaded.id, endpoint="/v1/models",
                                  completion_window="24h")
        assert client.files.delete(uploaded.id).deleted
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(uploaded.id)
