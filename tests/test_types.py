"""The package, scripts/*.py and benchmarks/*.py type-check (mypy, configured in pyproject.toml's
[tool.mypy]).

Two bugs it found when first run (twenty-fifth session) had passed every other test on the CPU:
a dataclass field added in the middle took a positional argument meant for the next one (the
Triton backend's long-prompt attention silently off), and `LLM(cpu_threads=...)` at tp=1
calling a function with an argument missing (TypeError)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parent.parent


# A user's code as a type checker sees it: `LLM` is imported lazily at run time (module
# __getattr__), and was `object` to mypy until the package named it for type checkers.
USER_CODE = """
from typing import List
from minisgl import LLM, SamplingParams

def first_tokens(llm: LLM, prompts: List[str]) -> List[List[int]]:
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=1))]

def open_default() -> LLM:
    return LLM(None, max_kv_tokens=256)
"""


def test_package_type_checks(tmp_path: Path) -> None:
    """mypy over minisgl/, a user's script of the offline API, and the benchmark scripts
    (scripts/*.py, benchmarks/*.py: GPU-only code paths that the CPU tests never run, so a
    renamed field or a changed signature shows here first): no error. One run, as they share
    most of what mypy reads (torch). Bounded: ~40 s and ~2 GB on one core with a cold cache
    (kept in tmp_path, so the run depends on nothing left by another)."""
    user = tmp_path / "user_script.py"
    user.write_text(USER_CODE)
    scripts: List[str] = []
    for pattern in ("scripts/*.py", "benchmarks/*.py"):
        found = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob(pattern))
        assert found, f"nothing matches {pattern}: moved? (this check would pass on nothing)"
        scripts += found
    proc = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"),
                           "minisgl", str(user), *scripts],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "Success: no issues found" in proc.stdout
