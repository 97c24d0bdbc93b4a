"""torch.profiler over a rank's steps, between a start and a stop (vLLM's and SGLang's
/start_profile and /stop_profile; `LLM.start_profile` / `stop_profile`).

Every rank of a replica starts and stops at the same step (a `ProfileMsg` reaches each as
any change does) and writes its own trace, `{dir}/{name}-rank{r}.trace.json.gz`, r its rank
among every replica's (replica x tp + rank), in Chrome's trace format (Perfetto and
chrome://tracing open it): CPU activity everywhere, CUDA's where there is a GPU. A start or
stop that fails on one rank (a directory it cannot write) fails on all: the ranks vote (gloo),
and a rank that started where another failed stops and writes nothing.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch
from torch.distributed import ProcessGroup

from minisgl.distributed import min_over_ranks

logger = logging.getLogger(__name__)


class RankProfiler:
    """One rank's profiler; `start` and `stop` return None or why not (every rank's answer:
    see the module doc)."""

    def __init__(self, rank: int, global_rank: int, output_dir: Optional[str],
                 cpu_group: Optional[ProcessGroup]) -> None:
        """`global_rank`: this rank among every replica's, in its traces' names;
        `output_dir`: where traces go (None: profiling is off, every start refused)."""
        self.rank, self.global_rank = rank, global_rank
        self.output_dir, self.cpu_group = output_dir, cpu_group
        self._profile: Optional[torch.profiler.profile] = None
        self._name = ""

    def _agreed(self, error: Optional[str], what: str) -> Optional[str]:
        ok = min_over_ranks(int(error is None), self.cpu_group) == 1
        return None if ok else error or f"{what} failed on another rank (its log says why)"

    def start(self, name: str) -> Optional[str]:
        """Start recording; the traces will be named `name`."""
        error = self._start(name)
        agreed = self._agreed(error, "starting the profiler")
        if agreed is not None and error is None and self._profile is not None:
            self._profile.stop()  # another rank failed: this one records nothing
            self._profile = None
        return agreed

    def _start(self, name: str) -> Optional[str]:
        if self.output_dir is None:
            return ("profiling is off: set profile_dir (--profile-dir, or "
                    "VLLM_TORCH_PROFILER_DIR / SGLANG_TORCH_PROFILER_DIR)")
        if self._profile is not None:
            return "the profiler is already running: stop it first"
        try:
            os.makedirs(self.output_dir, exist_ok=True)
        except OSError as e:
            return f"cannot create profile_dir {self.output_dir}: {e}"
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(activities=activities)
        self._profile.start()
        self._name = name
        logger.info("rank %d: profiler started", self.rank)
        return None

    def stop(self) -> Optional[str]:
        """Stop recording and write this rank's trace."""
        error = self._stop()
        return self._agreed(error, "stopping the profiler")

    def _stop(self) -> Optional[str]:
        profile, self._profile = self._profile, None
        if profile is None:
            return "the profiler is not running: start it first"
        profile.stop()
        path = os.path.join(self.output_dir or ".",
                            f"{self._name}-rank{self.global_rank}.trace.json.gz")
        try:
            profile.export_chrome_trace(path)
        except OSError as e:
            return f"cannot write the trace {path}: {e}"
        logger.info("rank %d: profiler stopped, trace written to %s", self.rank, path)
        return None
