"""torch.profiler over a rank's steps, between a start and a stop (vLLM's and SGLang's
/start_profile and /stop_profile; `LLM.start_profile` / `stop_profile`).

Every rank of a replica starts and stops at the same step (a `ProfileMsg` reaches each as
any change does) and writes its own trace, `{dir}/{name}-rank{r}.trace.json.gz`, r its rank
among every replica's (replica x tp + rank), in Chrome's trace format (Perfetto and
chrome://tracing open it): CPU activity everywhere, CUDA's where there is a GPU. A start or
stop that fails on one rank (a directory it cannot write) fails on all: the ranks vote (gloo),
and a rank that started where another failed stops and writes nothing. A start may ask for a
number of steps (SGLang's num_steps): every rank counts the batches it launches, the same on
all, and stops and writes its trace after that many (a failure to write is logged; no vote).
"""

from __future__ import annotations

import logging
import os
from typing import List, Optional, Tuple

import torch
from torch.distributed import ProcessGroup

from minisgl.distributed import agreed_error
from minisgl.message.types import ProfileMsg

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
        self._path = ""  # the running profile's trace, once written
        self._steps_left: Optional[int] = None  # a start's num_steps still to record

    def start(self, msg: ProfileMsg) -> Optional[str]:
        """Start recording as `msg` asks (its name, options)."""
        error = self._start(msg)
        agreed = agreed_error(error, self.cpu_group, "starting the profiler")
        if agreed is not None and error is None and self._profile is not None:
            self._profile.stop()  # another rank failed: this one records nothing
            self._profile = None
        return agreed

    def _directory(self, msg: ProfileMsg) -> str:
        """Where `msg`'s trace goes; ValueError where profiling is off or its output_dir lies
        outside profile_dir."""
        if self.output_dir is None:
            raise ValueError("profiling is off: set profile_dir (--profile-dir, or "
                             "VLLM_TORCH_PROFILER_DIR / SGLANG_TORCH_PROFILER_DIR)")
        root = os.path.realpath(self.output_dir)
        if msg.output_dir is None:
            return root
        wanted = os.path.realpath(os.path.join(root, msg.output_dir))
        if os.path.commonpath([root, wanted]) != root:
            raise ValueError(f"output_dir {msg.output_dir} is outside the server's profile_dir "
                             f"{root}: traces are written there or below")
        return wanted

    def _start(self, msg: ProfileMsg) -> Optional[str]:
        if self._profile is not None:
            return "the profiler is already running: stop it first"
        try:
            directory = self._directory(msg)
        except ValueError as e:
            return str(e)
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            return f"cannot create the profile directory {directory}: {e.strerror}"
        self._profile = torch.profiler.profile(
            activities=_activities(msg.activities), with_stack=msg.with_stack,
            record_shapes=msg.record_shapes, profile_memory="MEM" in msg.activities)
        self._profile.start()
        self._path = os.path.join(directory, f"{msg.name}-rank{self.global_rank}.trace.json.gz")
        self._steps_left = msg.num_steps
        logger.info("rank %d: profiler started%s", self.rank, "" if msg.num_steps is None
                    else f" for {msg.num_steps} steps")
        return None

    def stop(self) -> Optional[str]:
        """Stop recording and write this rank's trace."""
        error = self._stop()
        return agreed_error(error, self.cpu_group, "stopping the profiler")

    def stepped(self) -> None:
        """A batch was launched: where a start asked for a number of steps and they have all
        run, stop and write the trace (every rank at the same step)."""
        if self._profile is None or self._steps_left is None:
            return
        self._steps_left -= 1
        if self._steps_left <= 0:
            error = self._stop()
            if error is not None:
                logger.warning("rank %d: %s", self.rank, error)

    def _stop(self) -> Optional[str]:
        profile, self._profile = self._profile, None
        if profile is None:
            return "the profiler is not running: start it first"
        profile.stop()
        try:
            profile.export_chrome_trace(self._path)
        except OSError as e:
            return f"cannot write the trace {self._path}: {e}"
        logger.info("rank %d: profiler stopped, trace written to %s", self.rank, self._path)
        return None


def _activities(names: Tuple[str, ...]) -> List[torch.profiler.ProfilerActivity]:
    """torch's activities for SGLang's names: CPU, and GPU (CUDA) where there is one; MEM is
    an option of the profile, not an activity."""
    out = []
    if "CPU" in names:
        out.append(torch.profiler.ProfilerActivity.CPU)
    if "GPU" in names and torch.cuda.is_available():
        out.append(torch.profiler.ProfilerActivity.CUDA)
    return out or [torch.profiler.ProfilerActivity.CPU]
