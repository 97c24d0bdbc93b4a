"""Tensor-parallel serving: 16 concurrent streaming chats give the same outputs as tp=1.

tp=2 serves a random tiny Qwen3; tp=3 serves the default model (9 heads, 3 KV heads). The tp=1
reference is the offline `LLM` (same scheduler and engine, in-process), greedy."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import List, Optional, Tuple

import openai

from server_helpers import Server, serving, tp_args

from minisgl import LLM, SamplingParams

MAX_TOKENS = 12
TOPICS = ["France", "the ocean", "a cat", "mathematics", "the moon", "coffee", "winter",
          "music", "Python", "bread", "trains", "a forest", "gold", "rain", "chess", "tea"]
CHATS = [[{"role": "user", "content": f"Tell me one fact about {t}."}] for t in TOPICS]


def _stream(client: openai.OpenAI, model: str, messages: list) -> Tuple[str, Optional[int]]:
    chunks = client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=MAX_TOKENS, stream=True,
        stream_options={"include_usage": True})
    text, used = "", None
    for chunk in chunks:
        if chunk.usage is not None:
            used = chunk.usage.completion_tokens
        for c in chunk.choices:
            text += c.delta.content or ""
    return text, used


def _check_same_as_tp1(server: Server, model_dir: Optional[Path]) -> None:
    with LLM(None if model_dir is None else str(model_dir), max_kv_tokens=8192,
             show_progress=False) as llm:
        refs = llm.chat(CHATS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0,
                           timeout=300)
    model = client.models.list().data[0].id
    with ThreadPoolExecutor(len(CHATS)) as pool:
        got: List[Tuple[str, Optional[int]]] = list(
            pool.map(lambda m: _stream(client, model, m), CHATS))
    assert [g[0] for g in got] == [r.text for r in refs]
    assert [g[1] for g in got] == [len(r.token_ids) for r in refs]


def test_tp2_tiny_qwen3_matches_tp1(tmp_path: Path, tiny_qwen3: Path) -> None:
    with serving(tp_args(2, tiny_qwen3), tmp_path) as srv:
        _check_same_as_tp1(srv, tiny_qwen3)


def test_tp3_default_model_matches_tp1(tmp_path: Path, default_model_dir: Path) -> None:
    with serving(tp_args(3), tmp_path) as srv:
        _check_same_as_tp1(srv, None)
