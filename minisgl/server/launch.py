"""The launcher (`serve`, `python -m minisgl`): starts the process tree and supervises it.

Start-up, in order: parse the config; resolve the model directory and check its shape against tp;
bind the HTTP socket (a port in use fails here, before anything is spawned); make a private
runtime directory for the ipc:// sockets; spawn one scheduler process per rank plus the tokenizer,
the detokenizer and the API server (which inherits the bound socket), all loading in parallel; once
every rank has loaded its weights and connected its sockets, hand the tokenizer the context length
and KV capacity they report; when every child is ready, print the one ready line with the URL.

Then it watches the children: if one dies, the others are stopped and the launcher exits 1 with a
line naming the dead one. SIGINT/SIGTERM: rank 0 gets a ShutdownMsg (all ranks stop at the same
step), the other children are terminated, stragglers killed; exit 0. Every exit path removes the
runtime directory. Start-up failures print one `serve: error: ...` line and exit 1; bad settings
exit 2.
"""

from __future__ import annotations

import logging
import multiprocessing.connection as mpc
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import zmq

from minisgl.core import Limits
from minisgl.layers.linear import check_head_split
from minisgl.message.codec import encode
from minisgl.message.types import ShutdownMsg
from minisgl.models.config import ModelConfig
from minisgl.models.path import resolve_model_path
from minisgl.scheduler.config import SchedulerConfig
from minisgl.server.api import ApiConfig, run_api
from minisgl.server.args import ServerConfig, describe, parse_args
from minisgl.log import setup_logging
from minisgl.server.proc import (Child, StartupError, first_dead, spawn, stop_children,
                                 wait_ready)
from minisgl.tokenizer.detokenize_worker import DetokenizerConfig, run_detokenizer
from minisgl.tokenizer.text import read_chat_template
from minisgl.tokenizer.tokenize_worker import TokenizerConfig, run_tokenizer
from minisgl.utils import free_port

logger = logging.getLogger("minisgl.launcher")
_GRACEFUL_STOP_S = 4.0  # ranks get this long to act on ShutdownMsg, then SIGTERM, 2 s, SIGKILL


class Addresses(NamedTuple):
    backend: str  # tokenizer / detokenizer / launcher -> rank 0
    detokenizer: str  # rank 0 / tokenizer -> detokenizer
    broadcast: str  # rank 0 -> other ranks
    tokenizer: str  # API server -> tokenizer
    api: str  # detokenizer / tokenizer -> API server

    @classmethod
    def in_dir(cls, run_dir: str) -> "Addresses":
        return cls(*(f"ipc://{run_dir}/{name}" for name in cls._fields))


def _rank_entry(cfg: SchedulerConfig, conn: Any) -> None:
    from minisgl.scheduler.main import run_rank
    run_rank(cfg, conn)


def bind_http(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so that a port in use fails before anything starts."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as e:
        raise StartupError(f"cannot resolve host {host!r}: {e.strerror}") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise StartupError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


class Service:
    """The children of one launch and what they share. `stop` releases everything (children,
    socket, runtime directory); it is idempotent and safe to call after a failed `start`."""

    def __init__(self, cfg: ServerConfig, model_path: Path, sock: socket.socket) -> None:
        self.cfg = cfg
        self.model_path = model_path
        self.model_name = cfg.model_name(model_path)
        self.sock: Optional[socket.socket] = sock
        self.run_dir = tempfile.mkdtemp(prefix="minisgl-")
        self.addrs = Addresses.in_dir(self.run_dir)
        self.health_file = os.path.join(self.run_dir, "up")  # exists while all are up
        self.ranks: List[Child] = []
        self.workers: List[Child] = []
        self.port: int = sock.getsockname()[1]

    @property
    def children(self) -> List[Child]:
        return self.ranks + self.workers

    @property
    def url(self) -> str:
        host, port = self.cfg.host, self.port
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def start(self, should_stop: Callable[[], bool]) -> None:
        """Spawn every child and wait until all are ready. Ranks and workers load in parallel;
        the tokenizer gets the ranks' context length and KV capacity once they are known."""
        assert self.sock is not None, "start() runs once"
        level, a, path = self.cfg.effective_log_level, self.addrs, str(self.model_path)
        init = f"tcp://127.0.0.1:{free_port()}"
        for r in range(self.cfg.engine.tp):
            rank_cfg = self.cfg.scheduler_config(self.model_path, r, init, a.backend,
                                                 a.detokenizer, a.broadcast)
            self.ranks.append(spawn(f"rank{r}", _rank_entry, (rank_cfg,), level, self.run_dir))
        shape = ModelConfig.from_dir(self.model_path)
        context = self.cfg.engine.context_length(shape.max_context)
        api_cfg = ApiConfig(self.model_name, context, self.cfg.max_n, a.tokenizer, a.api,
                            self.health_file, self.cfg.model_aliases)
        template = (None if self.cfg.chat_template is None
                    else read_chat_template(self.cfg.chat_template))
        self.workers = [
            spawn("tokenizer", run_tokenizer,
                  (TokenizerConfig(path, a.tokenizer, a.backend, a.detokenizer, a.api, template),),
                  level, self.run_dir),
            spawn("detokenizer", run_detokenizer,
                  (DetokenizerConfig(path, a.detokenizer, a.backend, a.api),), level,
                  self.run_dir),
            spawn("api", run_api, (api_cfg, self.sock, level), level, self.run_dir),
        ]
        sent = []

        def send_limits() -> None:
            if sent or any(c.info is None for c in self.ranks):
                return
            limits: Limits = (self.ranks[0].info or {})["limits"]
            show_step(f"all {self.cfg.engine.tp} ranks ready: context {limits.max_context} "
                      f"tokens, KV pool {limits.kv_capacity} tokens")
            self.workers[0].conn.send(("limits", limits))
            sent.append(True)

        show_step(f"loading {self.model_name} on {self.cfg.engine.tp} rank(s)")
        wait_ready(self.children, should_stop, send_limits,
                   lambda child, text: show_step(f"{child.name}: {text}"))
        self.sock.close()  # the API server holds its own copy now
        self.sock = None
        Path(self.health_file).touch()

    def first_dead(self) -> Optional[Child]:
        return first_dead(self.children)

    def wait(self, timeout_s: float) -> None:
        """Sleep until a child exits or `timeout_s` passes."""
        mpc.wait([c.process.sentinel for c in self.children], timeout=timeout_s)

    def stop(self, graceful: bool) -> None:
        Path(self.health_file).unlink(missing_ok=True)
        if graceful and self.ranks and self.ranks[0].alive:
            _send_shutdown(self.addrs.backend)
        for c in self.workers:
            if c.alive:
                c.process.terminate()
        if graceful:
            stop_children(self.children, _GRACEFUL_STOP_S, 2.0)
        else:  # a child died: the others may be stuck in a collective with it
            stop_children(self.children, 0.0, 1.0)
        self.ranks, self.workers = [], []
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        shutil.rmtree(self.run_dir, ignore_errors=True)


def show_step(text: str) -> None:
    """A start-up step on the launcher's output (in the shell too: it is not a log line), so
    that the wait before the ready line is not silent."""
    print(f"minisgl starting: {text}", flush=True)


def _send_shutdown(backend_addr: str) -> None:
    ctx = zmq.Context()
    try:
        push = ctx.socket(zmq.PUSH)
        push.connect(backend_addr)
        push.send(encode(ShutdownMsg()))
        push.close(linger=1000)
    finally:
        ctx.term()


def supervise(service: Service, stop: threading.Event) -> Optional[Child]:
    """Watch the children until `stop` is set (None) or one of them dies (returned)."""
    while not stop.is_set():
        dead = service.first_dead()
        if dead is not None:
            Path(service.health_file).unlink(missing_ok=True)  # /health answers 503 from now
            return dead
        service.wait(0.2)
    return None


def _quiet_resource_tracker() -> None:
    """A child killed by a signal leaves its semaphores (tqdm's lock) to multiprocessing's
    resource tracker, which frees them and warns after the launcher's last line; keep the
    launcher's error line the last one."""
    quiet = "ignore:resource_tracker:UserWarning"
    old = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = f"{old},{quiet}" if old else quiet


def _fail(message: str) -> int:
    print(f"serve: error: {message}", file=sys.stderr, flush=True)
    return 1


def _prepare(cfg: ServerConfig) -> Tuple[Path, socket.socket]:
    try:
        cfg.resolved_device  # noqa: B018  (raises for cuda without a GPU)
        model_path = resolve_model_path(cfg.model, cfg.engine.revision,
                                                cfg.engine.download_dir)
        shape = ModelConfig.from_dir(model_path)  # a readable config.json, before anything starts
        check_head_split(shape.num_heads, shape.num_kv_heads, cfg.engine.tp)
        cfg.engine.context_length(shape.max_context)
        if cfg.chat_template is not None:
            read_chat_template(cfg.chat_template)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise StartupError(str(e)) from None
    return model_path, bind_http(cfg.host, cfg.port)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the service until a signal (exit 0), a dead child or a start-up failure (exit 1),
    or a bad setting (exit 2)."""
    try:
        cfg = parse_args(argv)
        cfg.check_combination()
    except ValueError as e:
        return _fail(str(e)) + 1  # 2, like argparse's own usage errors
    setup_logging("launcher", cfg.effective_log_level)
    _quiet_resource_tracker()
    for line in describe(cfg):
        logger.debug("config: %s", line)
    try:
        model_path, sock = _prepare(cfg)
    except StartupError as e:
        return _fail(str(e))
    stop = threading.Event()
    service = Service(cfg, model_path, sock)
    _install_signal_handlers(stop, shell=cfg.shell)
    try:
        return _run(cfg, service, stop)
    except _Terminated:
        return 0
    finally:
        service.stop(graceful=True)


def _run(cfg: ServerConfig, service: Service, stop: threading.Event) -> int:
    try:
        service.start(stop.is_set)
    except StartupError as e:
        service.stop(graceful=False)
        return _fail(str(e))
    print(f"minisgl ready: {service.url} (model {service.model_name}, tp {cfg.engine.tp}, "
          f"{cfg.resolved_device}, pid {os.getpid()})", flush=True)
    if cfg.shell:
        return _run_shell(service, stop)
    dead = supervise(service, stop)
    if dead is None:
        logger.info("shutting down")
        return 0
    service.stop(graceful=False)
    return _fail(f"{dead.describe_death()}; stopped the service")


def _run_shell(service: Service, stop: threading.Event) -> int:
    from minisgl.server.shell import run_shell

    def watch() -> None:
        dead = supervise(service, stop)
        if dead is not None:
            service.stop(graceful=False)
            _fail(f"{dead.describe_death()}; stopped the service")
            os._exit(1)

    watcher = threading.Thread(target=watch, daemon=True, name="supervisor")
    watcher.start()
    try:
        run_shell(service.url, service.model_name)
    finally:
        stop.set()
        watcher.join()
    return 0


class _Terminated(Exception):
    pass


def _install_signal_handlers(stop: threading.Event, shell: bool) -> None:
    def on_signal(signum: int, frame: Any) -> None:
        stop.set()
        if shell:  # the shell blocks in input(): leave it
            raise _Terminated()

    signal.signal(signal.SIGTERM, on_signal)
    if not shell:  # in the shell, Ctrl-C interrupts the current reply (KeyboardInterrupt)
        signal.signal(signal.SIGINT, on_signal)
