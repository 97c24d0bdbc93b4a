"""Random request bodies against a live server (fixed seeds): whatever the fields and values,
every answer is a 200 or a 4xx with an error body naming a field, never a 5xx or a hang, and
afterwards nothing runs, waits or holds a KV page. Hostile values (2**64, NaN, wrong types,
empty lists) and valid ones in random combinations (bad words with streaming, logprobs with
echo and token ids, n with salts and priorities, SGLang's batches) on all three generation
endpoints. The bugs it stands guard over were real: a 2**64 priority once took a queue place
and never gave it back."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List

import httpx
import pytest

from server_helpers import CPU_ARGS, Server

HOSTILE: List[Any] = [
    None, 0, 1, -1, 7, 2 ** 31, 2 ** 63, 2 ** 64, -2 ** 63 - 1, 0.5, -0.5, 1e308, float("nan"),
    True, False, "", "a", " x", "\u00e9\U0001f642", [], [1], [0, 1, 2], ["a"], [""], [[1, 2]],
    {}, {"a": 1}, {"1": 2}, {"json": {"type": "object"}}, "x" * 300, [5] * 40]
VALID: Dict[str, List[Any]] = {
    "temperature": [0, 0.7], "top_p": [0.5], "top_k": [5], "min_p": [0.1], "seed": [1, 7],
    "presence_penalty": [0.5], "frequency_penalty": [0.5], "repetition_penalty": [1.2],
    "min_tokens": [1, 2], "ignore_eos": [True], "stop": [".", ["is", "\n"]],
    "stop_token_ids": [[2]], "skip_special_tokens": [False], "no_stop_trim": [True],
    "include_stop_str_in_output": [True], "allowed_token_ids": [[5, 6, 7, 504, 3575]],
    "n": [2, 3], "stream": [True], "logprobs": [True, 2], "top_logprobs": [2],
    "logit_bias": [{"504": 5}], "prompt_logprobs": [0, 2], "truncate_prompt_tokens": [2, -1],
    "cache_salt": ["t1", "t2"], "bad_words": [["Paris", "in Paris"], ["the"]],
    "return_tokens_as_token_ids": [True], "return_token_ids": [True], "request_id": ["r1"],
    "echo": [True], "response_format": [{"type": "json_object"}],
    "structured_outputs": [{"regex": "[0-9]+"}], "guided_choice": [["yes", "no"]],
    "add_special_tokens": [True], "priority": [0], "user": ["u"],
    "stream_options": [{"include_usage": True, "continuous_usage_stats": True}],
    "stop_regex": [[r"\d", "Par+is"], "x*y"]}
GENERATE_FIELDS = ["rid", "return_logprob", "logprob_start_len", "top_logprobs_num",
                   "return_text_in_logprobs", "stream", "lora_path", "token_ids_logprob",
                   "return_hidden_states"]
SAMPLING_FIELDS = ["max_new_tokens", "min_new_tokens", "sampling_seed", "max_tokens",
                   "temperature", "n", "stop", "regex", "json_schema", "logit_bias", "top_k",
                   "stop_regex", "stream_interval"]
CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
         [{"role": "assistant", "content": "x", "tool_calls": [
             {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
          {"role": "tool", "tool_call_id": "c", "content": "ok"}],
         [], [{"role": "bogus", "content": "x"}]]
PROMPTS = ["Hi", ["a", "b"], [1, 2, 3], [[1], [2]], "", [], [2 ** 40], "The capital of France is"]


def _body(rng: random.Random, path: str, hostile: bool) -> Dict[str, Any]:
    def value(field: str) -> Any:
        return rng.choice(HOSTILE) if hostile or field not in VALID else rng.choice(VALID[field])

    if path == "/generate":
        body: Dict[str, Any] = {rng.choice(["text", "input_ids"]): rng.choice(
            ["Hi", [1, 2, 3], ["a", "b"], [[1], [2, 3]], "", [], [2 ** 40]])}
        body.update({f: rng.choice(HOSTILE) for f in rng.sample(GENERATE_FIELDS, rng.randrange(4))})
        sampling = {f: rng.choice(HOSTILE) for f in rng.sample(SAMPLING_FIELDS, rng.randrange(4))}
        body["sampling_params"] = {"max_new_tokens": 3, **sampling}
        return body
    body = ({"messages": rng.choice(CHATS)} if path == "/v1/chat/completions"
            else {"prompt": rng.choice(PROMPTS)})
    fields = sorted(VALID) + (["tools", "tool_choice", "chat_template_kwargs"] if hostile else [])
    body.update({"max_tokens": 3, **{f: value(f) for f in rng.sample(fields, rng.randrange(6))}})
    return body


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Server]:
    srv = Server.start([*CPU_ARGS, "--max-n", "4", "--max-queued-requests", "16"],
                       tmp_path_factory.mktemp("fuzz"))
    yield srv
    srv.stop()


@pytest.mark.parametrize("seed,hostile,count", [(1, True, 100), (2, False, 50)])
def test_random_bodies_get_200s_or_4xx_and_leave_nothing_held(server: Server, seed: int,
                                                              hostile: bool, count: int) -> None:
    rng = random.Random(seed)
    statuses: Dict[int, int] = {}
    for _ in range(count):
        path = rng.choice(["/v1/chat/completions", "/v1/completions", "/generate"])
        raw = json.dumps(_body(rng, path, hostile))  # NaN as JSON's NaN, as clients send it
        r = httpx.post(server.url + path, content=raw, timeout=60,
                       headers={"content-type": "application/json"})
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code < 500, (path, raw[:300], r.text[:300])
        if 400 <= r.status_code < 500:
            assert r.json()["error"]["message"], raw[:300]
        elif '"stream": true' in raw:
            assert '"server_error"' not in r.text, (raw[:300], r.text[-300:])
    if not hostile:  # the valid combinations were mostly served
        assert statuses.get(200, 0) >= 15, statuses
    deadline = time.monotonic() + 20
    while True:
        text = httpx.get(server.url + "/metrics", timeout=10).text
        held = {k: float(v) for k, v in (line.split(" ") for line in text.splitlines()
                                         if line.startswith(("minisgl_kv_pages_used ",
                                                             "minisgl_num_requests_")))}
        if not any(held.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not any(held.values()), held
    assert "Traceback" not in server.stderr()
