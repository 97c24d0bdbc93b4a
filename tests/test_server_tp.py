"""Tensor-parallel serving: 16 concurrent streaming chats give the same outputs as tp=1.

tp=2 serves a random tiny Qwen3; tp=3 serves the default model (9 heads, 3 KV heads). The tp=1
reference is the offline `LLM` (same scheduler and engine, in-process), greedy."""

from __future__ import annotations

from pathlib import Path

from server_helpers import check_same_as_tp1, serving, tp_args


def test_tp2_tiny_qwen3_matches_tp1(tmp_path: Path, tiny_qwen3: Path) -> None:
    with serving(tp_args(2, tiny_qwen3), tmp_path) as srv:
        check_same_as_tp1(srv, tiny_qwen3)


def test_tp3_default_model_matches_tp1(tmp_path: Path, default_model_dir: Path) -> None:
    with serving(tp_args(3), tmp_path) as srv:
        check_same_as_tp1(srv, None)
