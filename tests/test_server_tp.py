"""Tensor-parallel serving: 16 concurrent streaming chats give the same outputs as tp=1.

tp=2 serves a random tiny Qwen3; the tp=1 reference is the offline `LLM` (same scheduler and
engine, in-process), greedy. The default model's tp=3 split (9 heads, 3 KV heads) is checked
offline against Hugging Face (test_tp.py) and under constrained decoding with every rank
compared each step (test_structured_output.py): a tp=3 server here added a start-up of three
ranks and nothing the tp=2 server does not exercise."""

from __future__ import annotations

from pathlib import Path

from server_helpers import check_same_as_tp1, serving, tp_args


def test_tp2_tiny_qwen3_matches_tp1(tmp_path: Path, tiny_qwen3: Path) -> None:
    with serving(tp_args(2, tiny_qwen3), tmp_path) as srv:
        check_same_as_tp1(srv, tiny_qwen3)
