"""Helpers for the server tests: run `./serve` as a real process and talk to it over HTTP.

`Server.start(args)` runs the launcher with `--port 0`, waits for its ready line and parses the
URL; `stop()` sends a signal and reports how the launcher exited. `serving(args)` does both around
a `with` body. The launcher's runtime directory goes under `tmp_dir` (TMPDIR), so a test can check
that no socket file is left behind. `Server.begin(args)` starts a launcher without waiting, for
launchers that wait for each other (the nodes of one service; a node other than 0 prints
`NODE_READY` and has no URL).

`check_same_as_tp1(server, model_dir)`: 16 concurrent streaming chats through HTTP give the
offline `LLM`'s greedy texts and token counts (tp=1, in-process).
"""

from __future__ import annotations

import contextlib
import functools
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
from concurrent.futures import ThreadPoolExecutor
from typing import (TYPE_CHECKING, Callable, Dict, Iterator, List, NamedTuple, Optional,
                    Sequence, Tuple)

import httpx

from minisgl import LLM, SamplingParams

if TYPE_CHECKING:
    import openai

REPO = Path(__file__).resolve().parent.parent
READY = re.compile(r"minisgl ready: (https?://\S+)")
NODE_READY = re.compile(r"minisgl node \d+ ready: ")
CPU_ARGS = ("--device", "cpu", "--max-kv-tokens", "8192", "--log-level", "warning")


def api_server(tmp: Path) -> Iterator["Server"]:
    """A module fixture's body: the default model served on CPU (n up to 4), stopped after."""
    srv = Server.start([*CPU_ARGS, "--max-n", "4"], tmp)
    yield srv
    srv.stop()


def openai_client(server: "Server") -> "openai.OpenAI":
    """The official client against `server`, without retries (a failure shows at once)."""
    import openai  # here: GPU machines have no openai client, and most tests need none
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def tp_args(tp: int, model: Optional[Path] = None) -> List[str]:
    """`serve` arguments for a CPU service of `tp` ranks serving `model` (None: the default)."""
    model_args = [] if model is None else ["--model", str(model)]
    return [*model_args, "--tp", str(tp), *CPU_ARGS]


class Exit(NamedTuple):
    code: int
    seconds: float


def _parents() -> Dict[int, int]:
    """Every process's parent pid (from /proc)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        out[int(entry.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
    return out


def descendant_pids(pid: int) -> List[int]:
    """Every process below `pid`: its children and theirs (children forked by a fork server
    are the launcher's grandchildren)."""
    parents = _parents()
    found: List[int] = []
    frontier = [pid]
    while frontier:
        kids = [p for p, parent in parents.items() if parent in frontier]
        found += kids
        frontier = kids
    return found


def error_line(stderr: str) -> str:
    """The launcher's last stderr line, which must be its one `serve: error: ...` line."""
    lines = stderr.strip().splitlines()
    assert lines and lines[-1].startswith("serve: error: "), stderr[-2000:]
    return lines[-1]


def gone(pids: Sequence[int], within_s: float = 3.0) -> bool:
    """True once none of `pids` runs, within `within_s`."""
    deadline = time.monotonic() + within_s
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def comm(pid: int) -> str:
    """The process name of `pid` (minisgl-rank0, ...), "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


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
    children: List[int]  # every process below the launcher once ready (descendant_pids)
    ready_line: str = ""

    @classmethod
    def start(cls, args: Sequence[str], tmp_dir: Path, timeout_s: float = 180.0) -> "Server":
        return cls.begin(args, tmp_dir).ready(timeout_s)

    @classmethod
    def begin(cls, args: Sequence[str], tmp_dir: Path, ready: "re.Pattern[str]" = READY
              ) -> "Starting":
        """The launcher, started; `.ready()` waits for its ready line."""
        tmp_dir.mkdir(parents=True, exist_ok=True)
        err_path = tmp_dir / "server.stderr"
        proc, lines = _launch(args, tmp_dir, err_path)
        return Starting(proc, lines, tmp_dir, err_path, ready)

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


@dataclass
class Starting:
    proc: subprocess.Popen
    lines: "queue.Queue[Optional[str]]"
    tmp_dir: Path
    err_path: Path
    pattern: "re.Pattern[str]"

    def ready(self, timeout_s: float = 180.0) -> Server:
        """The server once its ready line came (RuntimeError, the launcher killed, if none did
        within `timeout_s`, or if it exited first)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.proc.kill()
                raise RuntimeError(f"no ready line within {timeout_s} s:\n"
                                   f"{self.err_path.read_text()[-3000:]}")
            if line is None:
                self.proc.wait()
                raise RuntimeError(f"server exited with {self.proc.returncode} before ready:\n"
                                   f"{self.err_path.read_text()[-3000:]}")
            m = self.pattern.search(line)
            if m:
                url = m.group(1) if m.groups() else ""
                return Server(self.proc, url, self.tmp_dir, self.err_path,
                              descendant_pids(self.proc.pid), line.strip())


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
                            cwd=str(tmp_dir), preexec_fn=_stop_with_parent)
    err.close()
    lines: "queue.Queue[Optional[str]]" = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return proc, lines


def _stop_with_parent() -> None:
    """In the launcher before it runs (Linux): SIGTERM it when the test process dies, so that
    a killed or timed-out test run leaves no service behind (its children follow it)."""
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def runtime_dirs(tmp_dir: Path) -> List[Path]:
    return sorted(p for p in tmp_dir.glob("minisgl-*"))


# --- the same outputs as tp=1 ---------------------------------------------------------------------
MAX_TOKENS = 12
TOPICS = ["France", "the ocean", "a cat", "mathematics", "the moon", "coffee", "winter",
          "music", "Python", "bread", "trains", "a forest", "gold", "rain", "chess", "tea"]
CHATS = [[{"role": "user", "content": f"Tell me one fact about {t}."}] for t in TOPICS]


def _stream(client: "openai.OpenAI", model: str, messages: list) -> Tuple[str, Optional[int]]:
    chunks = client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=MAX_TOKENS, stream=True,
        stream_options={"include_usage": True})
    text, used = "", None
    for chunk in chunks:
        if chunk.usage is not None:
            used = chunk.usage.completion_tokens
        for c in chunk.choices:
            text += c.delta.content or ""
    return text, used


@functools.lru_cache(maxsize=None)
def _tp1_answers(model_dir: Optional[Path]) -> Tuple[Tuple[str, int], ...]:
    """The offline tp=1 engine's greedy answers to CHATS (text, tokens), once per model: four
    tests serve the same tiny model at other tp / dp / node counts."""
    with LLM(None if model_dir is None else str(model_dir), max_kv_tokens=8192,
             show_progress=False) as llm:
        refs = llm.chat(CHATS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    return tuple((r.text, len(r.token_ids)) for r in refs)


def check_same_as_tp1(server: Server, model_dir: Optional[Path]) -> None:
    refs = _tp1_answers(model_dir)
    client = openai_client(server).with_options(timeout=300)
    model = client.models.list().data[0].id
    with ThreadPoolExecutor(len(CHATS)) as pool:
        got: List[Tuple[str, Optional[int]]] = list(
            pool.map(lambda m: _stream(client, model, m), CHATS))
    assert [g[0] for g in got] == [text for text, _ in refs]
    assert [g[1] for g in got] == [n for _, n in refs]


def stream_generate(url: str, prompt: Sequence[int], max_new_tokens: int, chunks: List[dict],
                    rid: Optional[str] = None) -> threading.Thread:
    """A long greedy generation streamed from SGLang's /generate on a thread, each data
    line's object appended to `chunks` (the output so far); returned once its first chunk
    came, the thread still reading."""
    import json
    body: Dict[str, object] = {"input_ids": list(prompt), "stream": True, "sampling_params": {
        "max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
    if rid is not None:
        body["rid"] = rid
    started = threading.Event()

    def run() -> None:
        with httpx.stream("POST", f"{url}/generate", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    started.set()
    worker = threading.Thread(target=run)
    worker.start()
    assert started.wait(60), "no first chunk within 60 s"
    return worker
