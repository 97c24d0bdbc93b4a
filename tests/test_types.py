"""The package, scripts/*.py and benchmarks/*.py type-check (mypy, configured in pyproject.toml's
[tool.mypy]).

Two bugs it found when first run (twenty-fifth session) had passed every other test on the CPU:
a dataclass field added in the middle took a positional argument meant for the next one (the
Triton backend's long-prompt attention silently off), and `LLM(cpu_threads=...)` at tp=1
calling a function with an argument missing (TypeError)."""

from __future__ import annotations

import pytest

import type_check


def test_package_type_checks(request: pytest.FixtureRequest) -> None:
    """mypy over minisgl/, a user's script of the offline API, and the benchmark scripts
    (scripts/*.py, benchmarks/*.py: GPU-only code paths that the CPU tests never run, so a
    renamed field or a changed signature shows here first): no error. One run, as they share
    most of what mypy reads (torch), started when the test run began where conftest could
    (tests/type_check.py). Bounded: ~40 s and ~2 GB on one core with a cold cache."""
    check = request.config.stash.get(type_check.STASH, None)
    if check is None:
        check = request.config.stash[type_check.STASH] = type_check.start()
    out, err = check.proc.communicate(timeout=600)
    assert check.proc.returncode == 0, out[-4000:] + err[-2000:]
    assert "Success: no issues found" in out
