"""Child processes of the launcher and of `LLM(tp>1)`: spawning, the ready handshake, watching
and stopping.

Every child runs `child_main`, which names the process (`minisgl-rank0` in ps), ignores SIGINT (a
terminal's Ctrl-C reaches the whole process group; only the parent acts on it), tags its log
lines, exits when its parent (the launcher, or the `LLM` process) disappears (no orphans even
after `kill -9` of the parent), beats its `Pulse` (`message/pulse.py`: the parent sees a
stopped or frozen child), then runs its entry function. An entry function takes `conn` (its
end of a duplex pipe to the parent) as its last argument and sends exactly one of
`("ready", name, info)` or `("error", name, message)` on it (`message.startup.report_startup`),
after any number of `("progress", name, text)` (start-up steps, for the parent to show);
the parent may send it start-up data on the same pipe afterwards (the tokenizer gets the KV
capacity the ranks reported). This module imports nothing heavy (no torch, no HTTP stack).

Children start by `spawn` (a fresh interpreter each, which imports torch anew), or, where the
caller asks (`LLM(tp>1)`'s ranks under MINISGL_START_METHOD=forkserver), are forked from this
process's fork server, which imported torch and the ranks' entry module once: a parent that
starts ranks again and again (a notebook, a test run) pays those imports once. The launcher
always spawns: it starts its children once, in parallel, and a fork server's imports would only
delay them. Either way a child gets the parent's environment as it was at `spawn` (a forked
child would otherwise have the fork server's), and watches a lifeline pipe, not its parent pid
(a forked child's parent is the fork server): the parent holds the pipe's write end, never
writes, and closes it only once the child has ended; the end closes with the parent however
it dies.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import multiprocessing.forkserver as mp_forkserver
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from minisgl.log import setup_logging
from minisgl.message.pulse import BEAT_INTERVAL_S, Pulse

logger = logging.getLogger("minisgl.launcher")
_SPAWN = mp.get_context("spawn")
_FORKSERVER = mp.get_context("forkserver")
START_METHOD_ENV = "MINISGL_START_METHOD"
START_METHODS = ("spawn", "forkserver")
# What a fork server imports once, for every child it forks: torch and the ranks' entry module
# (named, not imported, here). Not transformers or huggingface_hub: they read HF_* variables
# when imported, and a child must see the environment of its own start.
_FORKSERVER_PRELOAD = ["torch", "minisgl.scheduler.main"]


def start_method(env: Mapping[str, str]) -> str:
    """How children start: `env[START_METHOD_ENV]`, "spawn" when unset. ValueError naming the
    value and the methods taken otherwise."""
    method = env.get(START_METHOD_ENV, "spawn")
    if method not in START_METHODS:
        raise ValueError(f"{START_METHOD_ENV}={method!r}: expected one of "
                         f"{', '.join(START_METHODS)}")
    return method


def prestart(env: Mapping[str, str]) -> bool:
    """Whether ranks start from the fork server (`start_method`), which this starts now if so,
    so that its imports run while the caller prepares (an `LLM` loads its tokenizer).
    ValueError for a method not taken."""
    if start_method(env) != "forkserver":
        return False
    _FORKSERVER.set_forkserver_preload(_FORKSERVER_PRELOAD)  # read as the server starts
    with _main_left_alone():
        mp_forkserver.ensure_running()
    return True


class StartupError(Exception):
    """The service could not start (its one-line reason is the message)."""


class ChildStartupError(StartupError):
    """`child` reported an error or died before reporting ready; `reason` says which, without
    the child's name (the message has it)."""

    def __init__(self, message: str, child: "Child", reason: str) -> None:
        super().__init__(message)
        self.child, self.reason = child, reason


def _watch_parent(lifeline: mpc.Connection, run_dir: str, pulse: Pulse) -> None:
    """Beat `pulse` every BEAT_INTERVAL_S; once the parent is gone (killed with SIGKILL: the
    `lifeline`, a read end of a pipe only the parent writes to, reads EOF), remove its runtime
    directory and exit."""
    while True:
        pulse.beat()
        if lifeline.poll(BEAT_INTERVAL_S):
            shutil.rmtree(run_dir, ignore_errors=True)
            os._exit(3)


def _set_process_name(name: str) -> None:
    """Show `name` in ps/top (Linux: the 15-character comm); elsewhere a no-op."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass


def child_main(name: str, log_level: str, env: Dict[str, str], lifeline: mpc.Connection,
               run_dir: str, pulse: Pulse, target: Callable[..., None],
               args: Tuple[Any, ...]) -> None:
    """A child's first and only frame: the parent's `env`, then `target(*args)` (module doc)."""
    os.environ.clear()
    os.environ.update(env)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _set_process_name(f"minisgl-{name}")
    setup_logging(name, log_level)
    threading.Thread(target=_watch_parent, args=(lifeline, run_dir, pulse),
                     daemon=True).start()
    target(*args)


@dataclass
class Child:
    name: str
    process: Any  # multiprocessing.Process
    conn: Any  # the parent's end of the pipe to the child
    pulse: Pulse  # its signs of life (message/pulse.py)
    # the parent's end of the child's lifeline (None: not watched)
    lifeline: Optional[mpc.Connection] = None
    info: Optional[Dict[str, Any]] = None  # set once the child reported ready

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    @property
    def ending(self) -> str:
        """How the process ended: "was killed by signal 9", "exited with code 1"."""
        code = self.process.exitcode
        return f"was killed by signal {-code}" if code is not None and code < 0 else \
            f"exited with code {code}"

    @property
    def label(self) -> str:
        return f"{self.name} (pid {self.process.pid})"

    def describe_death(self) -> str:
        return f"{self.label} {self.ending}"


@contextlib.contextmanager
def _main_left_alone() -> Iterator[None]:
    """Keep spawn from running the parent's main script again in the child, as it does to find
    functions defined there: a child runs only minisgl's own functions, and a script without an
    `if __name__ == "__main__":` guard would otherwise start the children again from each child
    (and a script read from stdin cannot be run again at all). Spawn reads `__spec__` and
    `__file__` of `__main__` while `start` runs; they are put back at once."""
    main = sys.modules.get("__main__")
    saved: Dict[str, Any] = {k: main.__dict__[k] for k in ("__spec__", "__file__")
             if main is not None and k in main.__dict__}
    try:
        if main is not None:
            main.__dict__["__spec__"] = None
            main.__dict__.pop("__file__", None)
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)


def new_pulse() -> Pulse:
    """A pulse to hand to `spawn` and, where the child's entry uses it too, to its arguments."""
    return Pulse(_SPAWN)


def spawn(name: str, target: Callable[..., None], args: Sequence[Any], log_level: str,
          run_dir: str, pulse: Optional[Pulse] = None, forkserver: bool = False) -> Child:
    """Start `target(*args, conn)` in a new process named `name` (module doc); `run_dir` is the
    parent's runtime directory (removed by the child if the parent dies without cleaning).
    The child beats `pulse` (a new one if None) while it runs. `forkserver`: forked from this
    process's fork server (`prestart`) instead of spawned."""
    pulse = pulse if pulse is not None else new_pulse()
    ctx = _FORKSERVER if forkserver else _SPAWN
    ours, theirs = ctx.Pipe(duplex=True)
    life_r, life_w = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=child_main, name=f"minisgl-{name}", daemon=True,
                       args=(name, log_level, dict(os.environ), life_r, run_dir, pulse, target,
                             (*args, theirs)))
    with _main_left_alone():
        proc.start()
    theirs.close()
    life_r.close()
    return Child(name, proc, ours, pulse, life_w)


def _log_step(child: "Child", text: str) -> None:
    logger.info("%s: %s", child.name, text)


def wait_ready(children: List[Child], should_stop: Callable[[], bool],
               on_progress: Callable[[], None] = lambda: None,
               check: Callable[[], None] = lambda: None,
               on_step: Callable[[Child, str], None] = _log_step) -> None:
    """Block until every child reported ready. ChildStartupError when one reports an error or
    dies first; StartupError when `should_stop()` turns true (a signal during start-up).
    `on_progress` runs after each child's report; `check` runs every turn and may raise
    StartupError itself (another node failed); `on_step` gets each start-up step a child
    tells (logged by default)."""
    while True:
        waiting = [c for c in children if c.info is None]
        if not waiting:
            return
        if should_stop():
            raise StartupError("interrupted during start-up")
        check()
        handles = [c.conn for c in waiting] + [c.process.sentinel for c in waiting]
        mpc.wait(handles, timeout=0.2)
        for child in waiting:
            _poll_ready(child, on_step)
            if child.info is not None:
                on_progress()


def _poll_ready(child: Child, on_step: Callable[[Child, str], None]) -> None:
    try:
        while child.conn.poll():
            status, _, info = child.conn.recv()
            if status == "progress":
                on_step(child, str(info))
                continue
            if status != "ready":
                raise ChildStartupError(f"{child.name} failed to start: {info}", child, str(info))
            child.info = info
            logger.debug("%s ready", child.name)
            return
    except (EOFError, OSError):
        pass
    if not child.alive:
        raise ChildStartupError(f"{child.describe_death()} during start-up", child,
                                f"the process {child.ending}")


def first_dead(children: List[Child]) -> Optional[Child]:
    """The first child whose process has exited, or None while all run."""
    return next((c for c in children if not c.alive), None)


def stop_children(children: List[Child], first_wait_s: float, term_wait_s: float) -> None:
    """Wait up to `first_wait_s` for the children to exit by themselves, then SIGTERM the rest,
    then SIGKILL whatever is left after `term_wait_s` more (a rank stuck in a device call may
    not die of SIGTERM). Every child is reaped."""
    _join_all(children, first_wait_s)
    for c in children:
        if c.alive:
            c.process.terminate()
    _join_all(children, term_wait_s)
    for c in children:
        if c.alive:
            logger.warning("%s did not stop; killing it", c.name)
            c.process.kill()
    _join_all(children, 2.0)
    for c in children:
        c.conn.close()
        if c.lifeline is not None:
            c.lifeline.close()


def _join_all(children: List[Child], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for c in children:
        c.process.join(max(0.0, deadline - time.monotonic()))
