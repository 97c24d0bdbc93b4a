"""Helpers for the server tests: run `./serve` as a real process and talk to it over HTTP.

`Server.start(args)` runs the launcher with `--port 0`, waits for its ready line and parses the
URL; `stop()` sends a signal and reports how the launcher exited. `serving(args)` does both around
a `with` body. The launcher's runtime directory goes under `tmp_dir` (TMPDIR), so a test can check
that no socket file is left behind.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import httpx

REPO = Path(__file__).resolve().parent.parent
READY = re.compile(r"minisgl ready: (http://\S+)")
CPU_ARGS = ("--device", "cpu", "--max-kv-tokens", "8192", "--log-level", "warning")


def tp_args(tp: int, model: Optional[Path] = None) -> List[str]:
    """`serve` arguments for a CPU service of `tp` ranks serving `model` (None: the default)."""
    model_args = [] if model is None else ["--model", str(model)]
    return [*model_args, "--tp", str(tp), *CPU_ARGS]


class Exit(NamedTuple):
    code: int
    seconds: float


def child_pids(pid: int) -> List[int]:
    """Direct children of `pid` (from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == pid:
            out.append(int(entry.name))
    return out


def alive(pid: int) -> bool:
    """True if `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    tmp_dir: Path
    stderr_path: Path
    children: List[int]

    @classmethod
    def start(cls, args: Sequence[str], tmp_dir: Path, timeout_s: float = 180.0) -> "Server":
        tmp_dir.mkdir(parents=True, exist_ok=True)
        err_path = tmp_dir / "server.stderr"
        proc, lines = _launch(args, tmp_dir, err_path)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                proc.kill()
                raise RuntimeError(f"no ready line within {timeout_s} s:\n"
                                   f"{err_path.read_text()[-3000:]}")
            if line is None:
                proc.wait()
                raise RuntimeError(f"server exited with {proc.returncode} before ready:\n"
                                   f"{err_path.read_text()[-3000:]}")
            m = READY.search(line)
            if m:
                return cls(proc, m.group(1), tmp_dir, err_path, child_pids(proc.pid))

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> Exit:
        t0 = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill_all()
            raise
        return Exit(code, time.monotonic() - t0)

    def kill_all(self) -> None:
        for pid in self.children + [self.proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()

    def metrics(self) -> Dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def wait_metrics(self, cond: Callable[[Dict[str, float]], bool], timeout_s: float = 15.0
                     ) -> Dict[str, float]:
        """Poll /metrics until `cond` holds or `timeout_s` passes; the last reading."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            if cond(m) or time.monotonic() > deadline:
                return m
            time.sleep(0.1)


@contextlib.contextmanager
def serving(args: Sequence[str], tmp_dir: Path) -> Iterator[Server]:
    """A started server for the `with` body, stopped after it. The clean exit (code 0) is checked
    only when the body succeeded: if the body fails, the server is stopped (killed if it hangs)
    and the body's own error propagates, not masked by a failing stop."""
    srv = Server.start(args, tmp_dir)
    try:
        yield srv
    except BaseException:
        with contextlib.suppress(Exception):
            srv.stop()
        raise
    result = srv.stop()
    assert result.code == 0, f"serve exited with {result.code}:\n{srv.stderr()[-3000:]}"


def run_serve(args: Sequence[str], tmp_dir: Path, timeout_s: float = 120.0
              ) -> subprocess.CompletedProcess:
    """Run `serve` expecting it to exit by itself (start-up failures)."""
    env = {**os.environ, "TMPDIR": str(tmp_dir)}
    return subprocess.run([sys.executable, str(REPO / "serve"), *args], capture_output=True,
                          text=True, timeout=timeout_s, env=env, cwd=str(tmp_dir))


def _launch(args: Sequence[str], tmp_dir: Path, err_path: Path
            ) -> Tuple[subprocess.Popen, "queue.Queue[Optional[str]]"]:
    env = {**os.environ, "TMPDIR": str(tmp_dir)}
    err = open(err_path, "w")
    proc = subprocess.Popen([sys.executable, str(REPO / "serve"), "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                            cwd=str(tmp_dir))
    err.close()
    lines: "queue.Queue[Optional[str]]" = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return proc, lines


def runtime_dirs(tmp_dir: Path) -> List[Path]:
    return sorted(p for p in tmp_dir.glob("minisgl-*"))
