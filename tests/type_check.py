"""The type check of tests/test_types.py as a background process: conftest starts it when the
run begins (where the test is selected), so that mypy's ~25 s of CPU fill the time other tests
spend waiting on their servers; the test then waits for it and judges its output."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent



class Check(NamedTuple):
    proc: "subprocess.Popen[str]"
    work_dir: Path  # the user's script and mypy's cache (removed by `stop`)


# where conftest keeps the check it started
STASH: "pytest.StashKey[Check]" = pytest.StashKey()

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


def script_paths() -> List[str]:
    """scripts/*.py and benchmarks/*.py (GPU-only code paths the CPU tests never run);
    AssertionError where a pattern matches nothing (the check would pass on nothing)."""
    scripts: List[str] = []
    for pattern in ("scripts/*.py", "benchmarks/*.py"):
        found = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob(pattern))
        assert found, f"nothing matches {pattern}: moved?"
        scripts += found
    return scripts


def start() -> Check:
    """mypy over minisgl/, a user's script of the offline API and the scripts, with a cold
    cache in a directory of its own (the run depends on nothing another left)."""
    work_dir = Path(tempfile.mkdtemp(prefix="minisgl-mypy-"))
    user = work_dir / "user_script.py"
    user.write_text(USER_CODE)
    proc = subprocess.Popen([sys.executable, "-m", "mypy", "--cache-dir",
                             str(work_dir / "cache"), "minisgl", str(user), *script_paths()],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return Check(proc, work_dir)


def stop(check: Check) -> None:
    """The check ended (killed where it still runs: the test was not reached) and its
    directory removed."""
    if check.proc.poll() is None:
        check.proc.kill()
        check.proc.communicate()
    shutil.rmtree(check.work_dir, ignore_errors=True)
