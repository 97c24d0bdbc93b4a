"""Shared fixtures: the default model, random tiny models of every family, the gpu marker."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable, List, MutableMapping

import pytest
import torch

from minisgl.cpu_threads import available_cores

sys.path.insert(0, str(Path(__file__).parent))


def share_cores(env: MutableMapping[str, str]) -> int:
    """Under pytest-xdist, each worker's share of the cores this process may use
    (cpu_threads.available_cores: affinity and cgroup quota) as its torch thread count, in this
    process and, through OMP_NUM_THREADS, in the servers and ranks its tests start; 0 (nothing
    set) outside xdist or where the user set OMP_NUM_THREADS. On two cores, two workers of two
    threads each ran a sample of the suite 18% slower than one process (OpenMP's spinning
    threads crowd each other out); one thread each ran the whole suite in 12 min 20 s against
    19 min 5 s."""
    workers = env.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is None or "OMP_NUM_THREADS" in env:
        return 0
    threads = max(1, available_cores() // int(workers))
    env["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    return threads


share_cores(os.environ)
# LLM(tp>1)'s ranks forked from a fork server that imported torch once: an LLM(tp=2) starts in
# 0.4 s instead of 1.8 s on two cores (tests/test_start_method.py runs both ways). On a GPU
# machine they start as users' do (spawn) until a GPU run has tried the fork server there.
if not torch.cuda.is_available():
    os.environ.setdefault("MINISGL_START_METHOD", "forkserver")

import type_check  # noqa: E402
from tiny_models import build_tiny  # noqa: E402


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the type check (tests/test_types.py) as the run begins, where it is selected; not
    in an xdist worker (each collects every test, and the workers keep the cores busy)."""
    if hasattr(session.config, "workerinput"):
        return
    if any(item.nodeid.startswith("tests/test_types.py") for item in session.items):
        session.config.stash[type_check.STASH] = type_check.start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    check = session.config.stash.get(type_check.STASH, None)
    if check is not None:
        type_check.stop(check)


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from minisgl.models.default_model import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path
               ) -> Callable[..., Path]:
    """tiny_model("qwen3") -> a saved random-weight HF checkpoint of that family (cached)."""
    cache: dict = {}

    def make(family: str, **overrides: object) -> Path:
        key = (family, tuple(sorted(overrides.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"tiny-{family}")
            cache[key] = build_tiny(family, out, default_model_dir, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_model: Callable[..., Path]) -> Path:
    """The random tiny Qwen3 the server tests serve (a module may override it)."""
    return tiny_model("qwen3")


@pytest.fixture(scope="session")
def two_llamas(tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
               ) -> List[Path]:
    """Two tiny Llama checkpoints of one shape and other weights: one served, one pushed into
    it (tests/pushed_weights.py)."""
    from tiny_models import build_tiny
    return [tiny_model("llama"), build_tiny("llama", tmp_path_factory.mktemp("pushed") / "b",
                                            None, seed=5)]

