"""The launcher (`serve`, `python -m minisgl`): starts this node's processes and supervises them.

Start-up, in order: parse the config; resolve the model directory and check its shape against tp;
on node 0, bind the HTTP socket (a port in use fails here, before anything is spawned); make a
private runtime directory for the ipc:// sockets; over several nodes, meet the other launchers
(`cluster.py`: any start order within --dist-timeout, configs compared); spawn one scheduler
process per local rank of every replica, plus, on node 0, the tokenizer, the detokenizer and the
API server (which inherits the bound socket), all loading in parallel (`service.py`); once every
rank has loaded its weights and connected its sockets, hand the tokenizer the context length and
KV capacity they report; when every child is ready, print the one ready line (node 0: the URL;
another node: which ranks joined).

Then it watches: if a child dies, or another node reports a failure or goes silent, node 0's
API server answers the requests in flight with an error, every child is stopped and the launcher
exits 1 with a line naming the process (and node) that failed; a child that is stopped or
hung past `--watchdog-timeout` counts as failed. SIGINT/SIGTERM on node 0 drains: /health
answers 503, new requests get 503, those in flight get `--shutdown-timeout` seconds to finish
and the rest an error reply; then every replica's rank 0 gets a ShutdownMsg (all ranks stop at
the same step, on every node), the other children are terminated, stragglers killed; exit 0
(other nodes then exit 0 too). A second signal ends the requests in flight and stops at once.
Every exit path
removes the runtime directory. Start-up failures print one `serve: error: ...` line and exit 1;
bad settings exit 2. With --shell (a chat in the terminal) or --batch-input (an OpenAI batch
file, batch_file.py) node 0 runs that over its own API once ready, then stops the service.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Dict, NamedTuple, NoReturn, Optional, Sequence

from minisgl.devices import dtype_name
from minisgl.log import exit_now, setup_logging
from minisgl.models.config import ModelConfig
from minisgl.models.lora_config import read_adapter
from minisgl.models.generation import sampling_defaults
from minisgl.models.path import resolve_model_path
from minisgl.models.pooling import check_pooler_dimensions
from minisgl.server.args import ServerConfig, describe, parse_args
from minisgl.server.batch_file import check_paths
from minisgl.server.cluster import Cluster, fingerprint
from minisgl.server.proc import StartupError
from minisgl.server.service import Service
from minisgl.settings import values as setting_values
from minisgl.tokenizer.text import has_tokenizer, read_chat_template, resolve_tokenizer_path

logger = logging.getLogger("minisgl.launcher")


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


def node_fingerprint(cfg: ServerConfig, model: ModelConfig) -> Dict[str, str]:
    """What this node must share with the others (`cluster.fingerprint`): the scheduler's
    settings with the device and dtype resolved, the cluster's shape, the model's shape."""
    device = cfg.resolved_device
    settings: Dict[str, Any] = dict(setting_values(cfg.scheduler))
    settings["device"] = device
    settings["dtype"] = dtype_name(cfg.engine.dtype, device)
    cl = cfg.cluster
    settings.update(dp=cl.dp, nnodes=cl.nnodes, dist_broadcast_port=cl.dist_broadcast_port)
    return fingerprint(settings, model)


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


class Prepared(NamedTuple):
    model_path: Path
    tokenizer_path: Path  # the model's, or --tokenizer's
    model: ModelConfig
    sock: Optional[socket.socket]  # node 0's HTTP socket; None on the other nodes


def _prepare(cfg: ServerConfig) -> Prepared:
    try:
        cfg.resolved_device  # noqa: B018  (raises for cuda without a GPU)
        model_path = resolve_model_path(cfg.model, cfg.engine.revision,
                                        cfg.engine.download_dir, cfg.hf_token)
        # a readable config.json, before anything starts
        shape = ModelConfig.from_dir(model_path, cfg.engine.hf_override_dict)
        shape.check_tp(cfg.engine.tp, cfg.engine.enable_expert_parallel)
        shape.check_quantization(cfg.engine.quantization)
        check_pooler_dimensions(cfg.engine.pooler_config, shape.matryoshka_dimensions,
                                shape.hidden_size)
        for name, path in cfg.engine.lora_adapters:  # each rank reads them again, and loads
            read_adapter(name, path, cfg.engine.max_lora_rank)
        tokenizer_path = resolve_tokenizer_path(cfg.tokenizer, model_path,
                                                cfg.engine.download_dir, cfg.hf_token,
                                                cfg.engine.tokenizer_revision)
        if not has_tokenizer(tokenizer_path):
            logger.warning("%s has no tokenizer files: only token-id prompts can be served "
                           "(text and chat requests get a 400; --tokenizer names another)",
                           model_path)
        if cfg.cluster.multi_node:
            cfg.cluster.broadcast_tcp_addr(0)  # noqa: B018  (node 0's host resolves)
        cfg.engine.context_length(shape.max_context)
        if cfg.chat_template is not None:
            read_chat_template(cfg.chat_template)
        if cfg.batch_input is not None:
            check_paths(Path(cfg.batch_input), Path(cfg.batch_output or ""))
        changed = sampling_defaults(cfg.generation_config, model_path,
                                    cfg.override_generation_config).changed
        if changed:
            logger.info("sampling defaults from the model's generation config%s: %s "
                        "(--generation-config none for OpenAI's)",
                        " and --override-generation-config"
                        if cfg.override_generation_config else "",
                        ", ".join(f"{k}={v}" for k, v in changed.items()))
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise StartupError(str(e)) from None
    sock = bind_http(cfg.host, cfg.port) if cfg.cluster.is_head else None
    return Prepared(model_path, tokenizer_path, shape, sock)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run this node's part of the service until a signal or node 0's stop (exit 0), a failure
    here or on another node, or a start-up failure (exit 1), or a bad setting (exit 2)."""
    try:
        cfg = parse_args(argv)
        if cfg.batch_input is not None:  # the batch's own API: private, on a free port
            cfg = replace(cfg, host="127.0.0.1", port=0)
        cfg.check_combination()
    except ValueError as e:
        return _fail(str(e)) + 1  # 2, like argparse's own usage errors
    setup_logging("launcher", cfg.effective_log_level)
    _quiet_resource_tracker()
    for line in describe(cfg):
        logger.debug("config: %s", line)
    try:
        prep = _prepare(cfg)
    except StartupError as e:
        return _fail(str(e))
    link = (Cluster(cfg.cluster, node_fingerprint(cfg, prep.model))
            if cfg.cluster.multi_node else None)
    signals = Signals(threading.Event(), threading.Event())
    service = Service(cfg, prep.model_path, prep.sock, link, prep.tokenizer_path)
    _install_signal_handlers(signals, shell=cfg.shell and cfg.cluster.is_head)
    try:
        return _run(cfg, service, signals)
    except _Terminated:
        return 0
    finally:
        service.stop(graceful=not signals.hurry.is_set())


def run() -> NoReturn:
    """The command's entry (`serve`, `python -m minisgl`, `minisgl-serve`): `main`, then exit
    at once with its status (everything is stopped and removed by then)."""
    exit_now(main())


def _ready_line(cfg: ServerConfig, service: Service) -> str:
    cl = cfg.cluster
    shape = f"tp {cfg.engine.tp}" + (f" over {cl.nnodes} nodes" if cl.multi_node else "") + \
        (f", dp {cl.dp}" if cl.dp > 1 else "")
    if cl.is_head:
        return (f"minisgl ready: {service.url} (model {service.model_name}, {shape}, "
                f"{cfg.resolved_device}, pid {os.getpid()})")
    return (f"minisgl node {cl.node_rank} ready: {service.describe_ranks()} joined "
            f"{cl.dist_init_addr} (model {service.model_name}, {shape}, "
            f"{cfg.resolved_device}, pid {os.getpid()})")


def _run(cfg: ServerConfig, service: Service, signals: "Signals") -> int:
    stop = signals.stop
    try:
        service.start(stop.is_set)
    except StartupError as e:
        message = service.fail_start(e)
        if stop.is_set():  # a signal asked to stop (a scale-down while loading): not a failure
            logger.info("stopped during start-up")
            return 0
        return _fail(message)
    print(_ready_line(cfg, service), flush=True)
    if cfg.shell and cfg.cluster.is_head:
        return _run_shell(service, stop)
    if cfg.batch_input is not None and cfg.cluster.is_head:
        return _run_batch(cfg, service, stop)
    failure = service.watch(stop)
    if failure is None and stop.is_set() and cfg.cluster.is_head:
        logger.info("shutting down: draining the requests in flight (up to %g s; a second "
                    "signal stops at once)", cfg.shutdown_timeout)
        failure = service.drain(cfg.shutdown_timeout, signals.hurry)
    if failure is None:
        logger.info("shutting down" if stop.is_set() else "node 0 stopped the service")
        return 0
    return _fail(f"{service.fail(failure)}; stopped the service")


def _run_shell(service: Service, stop: threading.Event) -> int:
    from minisgl.server.shell import run_shell

    def shell() -> int:
        run_shell(service.url, service.model_name)
        return 0

    return _supervised(service, stop, shell)


def _run_batch(cfg: ServerConfig, service: Service, stop: threading.Event) -> int:
    """--batch-input: the batch through the service's API, then stop (exit 0 once the output
    is written, whatever its requests' answers; 1 if a file fails)."""
    from minisgl.server.batch_file import run_batch, summary_line

    def batch() -> int:
        src, dst = check_paths(Path(cfg.batch_input or ""), Path(cfg.batch_output or ""))
        try:
            summary = run_batch(service.url, src, dst, cfg.resolved_api_key,
                                cfg.batch_concurrency)
        except OSError as e:
            return _fail(f"batch: {e}")
        print(summary_line(summary, dst), flush=True)
        return 0

    return _supervised(service, stop, batch)


def _supervised(service: Service, stop: threading.Event, work: Callable[[], int]) -> int:
    """`work`'s status while a thread watches the service (a failure ends the process with
    status 1); then the service is asked to stop."""
    def watch() -> None:
        failure = service.watch(stop)
        if failure is not None:
            _fail(f"{service.fail(failure)}; stopped the service")
            os._exit(1)

    watcher = threading.Thread(target=watch, daemon=True, name="supervisor")
    watcher.start()
    try:
        return work()
    finally:
        stop.set()
        watcher.join()


class _Terminated(Exception):
    pass


class Signals(NamedTuple):
    stop: threading.Event  # the first SIGTERM / SIGINT: drain, then stop
    hurry: threading.Event  # a second one: stop at once


def _install_signal_handlers(signals: Signals, shell: bool) -> None:
    def on_signal(signum: int, frame: Any) -> None:
        (signals.hurry if signals.stop.is_set() else signals.stop).set()
        if shell:  # the shell blocks in input(): leave it
            raise _Terminated()

    signal.signal(signal.SIGTERM, on_signal)
    if not shell:  # in the shell, Ctrl-C interrupts the current reply (KeyboardInterrupt)
        signal.signal(signal.SIGINT, on_signal)
