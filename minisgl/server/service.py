"""One node's share of a service: its child processes, how they start, how they are watched and
how they stop.

Node 0 (the only node with nnodes == 1) runs every replica's ranks that live on it plus the
tokenizer, the detokenizer and the API server; another node runs only its ranks. Over several
nodes a `Cluster` links the launchers (meeting, failure reports, heartbeats).

A failure ends the whole service. The launcher that sees it names the process that failed
first: a rank that exited with `PEER_EXIT` only followed another's failure, so its launcher
waits up to `_FOLLOWER_GRACE_S` for the one that caused it (here, or reported by another node);
over several nodes it then leaves the decision to node 0, which names a node that went
silent, and only with none the follower (`Cluster.report_secondary`). A child that is stopped
or frozen, or a rank's step that runs past `watchdog_timeout`, is a failure too
(`watchdog.py`). Node 0 then tells the API server (`ServiceDown`: every request in flight gets
an error reply), stops the other children at once, and gives the API server up to
`_API_EXIT_S` to send those replies and exit by itself.

A clean stop on node 0 (SIGTERM, SIGINT) drains first (`drain`): /health answers 503, the API
server refuses new requests and gives those in flight `shutdown_timeout` to finish, ends the
rest with an error reply and exits; then every rank stops at the same step (`ShutdownMsg`).
"""

from __future__ import annotations

import logging
import multiprocessing.connection as mpc
import os
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import zmq

from minisgl.core import Limits
from minisgl.distributed.bind import free_port
from minisgl.distributed.store import rank_beat_key
from minisgl.message.codec import encode
from minisgl.message.startup import PEER_EXIT
from minisgl.message.types import Drain, ServiceDown, ShutdownMsg
from minisgl.models.config import ModelConfig
from minisgl.models.generation import sampling_defaults
from minisgl.models.pooling import model_pooling
from minisgl.scheduler.config import SchedulerConfig
from minisgl.server.api_config import ApiConfig
from minisgl.server.args import ServerConfig
from minisgl.server.cluster import Cluster
from minisgl.server.health import HealthFile
from minisgl.server.proc import (Child, StartupError, first_dead, new_pulse, spawn, stop_children,
                                 wait_ready)
from minisgl.server.watchdog import Verdict, judge
from minisgl.server.tool_calls import default_tool_call_parser, mistral_variant
from minisgl.server.topology import Wiring, rank_name
from minisgl.server.tls import server_url
from minisgl.tokenizer.detokenize_worker import DetokenizerConfig, run_detokenizer
from minisgl.tokenizer.text import model_chat_template, read_chat_template
from minisgl.tokenizer.tokenize_worker import TokenizerConfig, run_tokenizer

logger = logging.getLogger("minisgl.launcher")
_GRACEFUL_STOP_S = 4.0  # ranks get this long to act on ShutdownMsg, then SIGTERM, 2 s, SIGKILL
_FOLLOWER_GRACE_S = 2.0
_API_EXIT_S = 2.0  # the API server sends its last replies and exits within this, else SIGTERM
_WATCH_TURN_S = 0.1



def show_step(text: str) -> None:
    """A start-up step on the launcher's output (in the shell too: it is not a log line), so
    that the wait before the ready line is not silent."""
    print(f"minisgl starting: {text}", flush=True)

class OtherNodeFailed(StartupError):
    """Another node reported a failure during start-up (the message is its report)."""


class Cause(NamedTuple):
    """What a launcher blames for a dead child, in words; `secondary`: only a rank that
    followed another's failure, whose cause was not seen here."""
    text: str
    secondary: bool = False


class Addresses(NamedTuple):
    backends: Tuple[str, ...]  # tokenizer / detokenizer / launcher -> each replica's rank 0
    detokenizer: str  # every rank 0 / tokenizer -> detokenizer
    broadcasts: Tuple[str, ...]  # each replica's rank 0 -> its other ranks on this host
    tokenizer: str  # API server (and detokenizer: replica stats) -> tokenizer
    api: str  # detokenizer / tokenizer / launcher -> API server

    @classmethod
    def in_dir(cls, run_dir: str, replicas: int) -> "Addresses":
        def ipc(name: str, replica: Optional[int] = None) -> str:
            return f"ipc://{run_dir}/{name}{'' if replica is None or replicas == 1 else replica}"
        return cls(tuple(ipc("backend", d) for d in range(replicas)), ipc("detokenizer"),
                   tuple(ipc("broadcast", d) for d in range(replicas)), ipc("tokenizer"),
                   ipc("api"))


def _rank_entry(cfg: SchedulerConfig, pulse: Any, conn: Any) -> None:
    from minisgl.scheduler.main import run_rank
    run_rank(cfg, conn, pulse)


def _api_entry(cfg: ApiConfig, sock: Any, log_level: str, conn: Any) -> None:
    """The API server process's entry: the HTTP stack is imported there, not in the launcher."""
    from minisgl.server.api import run_api
    run_api(cfg, sock, log_level, conn)


def _push_once(addr: str, msg: Any) -> None:
    ctx = zmq.Context()
    try:
        push = ctx.socket(zmq.PUSH)
        push.connect(addr)
        push.send(encode(msg))
        push.close(linger=1000)
    finally:
        ctx.term()


def min_limits(limits: List[Limits]) -> Limits:
    """What every replica can hold: the least of each."""
    return Limits(*(min(values) for values in zip(*limits)))


class Service:
    """The children of one launch on this node and what they share. `stop` releases everything
    (children, socket, runtime directory, the link to other nodes); it is idempotent and safe to
    call after a failed `start`. `sock` (the bound HTTP socket) is None on nodes other than 0."""

    def __init__(self, cfg: ServerConfig, model_path: Path, sock: Optional[socket.socket],
                 link: Optional[Cluster] = None, tokenizer_path: Optional[Path] = None) -> None:
        self.cfg = cfg
        self.model_path = model_path
        self.tokenizer_path = tokenizer_path or model_path  # --tokenizer's, resolved
        self.model_name = cfg.model_name(model_path)
        self.sock = sock
        self.link = link
        self.node = cfg.cluster.node_rank
        self.run_dir = tempfile.mkdtemp(prefix="minisgl-")
        self.addrs = Addresses.in_dir(self.run_dir, cfg.cluster.dp)
        self.health_file = os.path.join(self.run_dir, "up")  # touched while all are up
        self.health = HealthFile(self.health_file)
        self.places = cfg.cluster.local_ranks(cfg.engine.tp)
        self.ranks: List[Child] = []
        self.workers: List[Child] = []
        self.port: int = sock.getsockname()[1] if sock is not None else 0
        self.met = False  # the nodes met: failures from now on are reported to the others
        self.stopped = False
        self._limits_sent = False

    @property
    def children(self) -> List[Child]:
        return self.ranks + self.workers

    @property
    def url(self) -> str:
        return server_url(self.cfg.host, self.port, self.cfg.tls is not None)

    def _name(self, what: str) -> str:
        """A process or event as the error line names it: prefixed by its node over several."""
        return f"node {self.node}: {what}" if self.link is not None else what

    # --- start ---------------------------------------------------------------------------------
    def start(self, should_stop: Callable[[], bool]) -> None:
        """Meet the other nodes (if any), spawn every child of this node and wait until all are
        ready. Ranks and workers load in parallel; the tokenizer gets the ranks' context length
        and KV capacity once they are known."""
        if self.link is not None:
            self.link.meet(should_stop, show_step)
            self.met = True
            self.link.start_watch()
        level = self.cfg.effective_log_level
        for place, rank_cfg in zip(self.places, self._rank_configs()):
            pulse = new_pulse()  # the rank's scheduler times its steps on it too
            self.ranks.append(spawn(rank_name(place, self.cfg.cluster.dp), _rank_entry,
                                    (rank_cfg, pulse), level, self.run_dir, pulse))
        if self.cfg.cluster.is_head:
            self._spawn_workers(level)
        show_step(f"loading {self.model_name} on {len(self.ranks)} rank(s)")
        wait_ready(self.children, should_stop, self._send_limits, self._check_others,
                   lambda child, text: show_step(f"{child.name}: {text}"))
        if self.link is not None:
            self.link.watch_ranks({rank_beat_key(p.replica, p.rank): c.label
                                   for p, c in zip(self.places, self.ranks)})
        if self.sock is not None:
            self.sock.close()  # the API server holds its own copy now
            self.sock = None
            self.health.mark(True)

    def _rank_configs(self) -> List[SchedulerConfig]:
        """Every local rank's config. One machine: each replica's rank 0 hosts a rendezvous on a
        free local port. Several nodes: every replica meets in node 0's store under its own
        prefix, and its rank 0's broadcast also listens on tcp:// for the other nodes."""
        a, cl, n = self.addrs, self.cfg.cluster, len(self.places)
        if cl.multi_node:
            host, port = cl.store_addr
            inits = [f"tcp://{host}:{port}"] * cl.dp
        else:
            inits = [f"tcp://127.0.0.1:{free_port()}" for _ in range(cl.dp)]
        out = []
        for p in self.places:
            broadcast = a.broadcasts[p.replica]
            wiring = Wiring(p.replica, p.device_index, n)
            if cl.multi_node:
                remote = cl.broadcast_tcp_addr(p.replica)
                wiring = wiring._replace(store_prefix=f"replica{p.replica}/",
                                         broadcast_remote=remote if p.rank == 0 else None)
                broadcast = broadcast if cl.is_head else remote  # rank 0 is on node 0
            out.append(self.cfg.scheduler_config(self.model_path, p.rank, inits[p.replica],
                                                 a.backends[p.replica], a.detokenizer,
                                                 broadcast, wiring, self.tokenizer_path))
        return out

    def _spawn_workers(self, level: str) -> None:
        a, path, dp = self.addrs, str(self.model_path), self.cfg.cluster.dp
        shape = ModelConfig.from_dir(self.model_path, self.cfg.engine.hf_override_dict)
        context = self.cfg.engine.context_length(shape.max_context)
        c = self.cfg
        template = None if c.chat_template is None else read_chat_template(c.chat_template)
        chat_template = (template if template is not None
                         else model_chat_template(self.tokenizer_path))
        tool_parser = mistral_variant(c.tool_call_parser or default_tool_call_parser(
            chat_template), chat_template)
        pooling = model_pooling(Path(self.model_path), c.engine.pooler_config)
        api_cfg = ApiConfig(self.model_name, context, c.max_n, a.tokenizer, a.api,
                            self.health_file, dp, root=path, reasoning_parser=c.reasoning_parser,
                            constrain_in_reasoning=c.constrain_in_reasoning,
                            tool_call_parser=tool_parser, aliases=c.model_aliases,
                            api_key=c.resolved_api_key, loopback_only=c.on_loopback,
                            cors=c.cors, uvicorn_log_level=c.uvicorn_log_level,
                            root_path=c.root_path or "",
                            openapi=c.openapi, request_id_headers=c.request_id_headers,
                            prompt_tokens_details=c.prompt_tokens_details,
                            response_role=c.response_role,
                            max_queued_requests=c.max_queued_requests,
                            request_timeout=c.request_timeout,
                            max_request_bytes=c.max_request_bytes, body_timeout=c.body_timeout,
                            log_requests=c.log_requests, log_outputs=c.log_outputs,
                            max_log_len=c.max_log_len,
                            lora_adapters=c.engine.lora_adapters,
                            lora_runtime=c.engine.lora_runtime,
                            sleep_mode=c.engine.enable_sleep_mode, tp=c.engine.tp,
                            otlp_traces_endpoint=c.otlp_traces_endpoint,
                            weights_cpu_backup=c.engine.enable_weights_cpu_backup,
                            weights_path=None if c.engine.load_format == "dummy" else path,
                            weight_version=c.weight_version,
                            tokenizer_path=str(self.tokenizer_path),
                            max_lora_rank=c.engine.max_lora_rank,
                            incremental_streaming_output=c.incremental_streaming_output,
                            hidden_size=shape.hidden_size,
                            embedding_refusal=pooling.refusal, pooling=pooling,
                            matryoshka=shape.matryoshka_dimensions, tls=c.tls,
                            classifier=shape.classifier,
                            sampling_defaults=sampling_defaults(
                                c.generation_config, Path(self.model_path),
                                c.override_generation_config),
                            auto_tool_choice=c.auto_tool_choice,
                            return_tokens_as_token_ids=c.return_tokens_as_token_ids,
                            log_stats_interval=c.log_stats_interval if c.log_stats else None,
                            force_include_usage=c.enable_force_include_usage,
                            eos_token_ids=tuple(shape.eos_token_ids),
                            trust_request_chat_template=c.trust_request_chat_template,
                            uvicorn_access_log=c.uvicorn_access_log,
                            server_load_tracking=c.server_load_tracking,
                            stream_interval=c.stream_interval,
                            max_logprobs=c.scheduler.logprobs_cap(shape.vocab_size))
        tok_cfg = TokenizerConfig(str(self.tokenizer_path), a.tokenizer, a.backends, a.detokenizer,
                                  a.api, template,
                                  c.max_queued_tokens, c.tokenizer_threads,
                                  default_template_kwargs=c.default_chat_template_kwargs,
                                  content_format=c.chat_template_content_format)
        # The tokenizer needs the replicas' stats to route (several) or to count queued tokens.
        stats_to = a.tokenizer if dp > 1 or c.max_queued_tokens is not None else None
        self.workers = [
            spawn("tokenizer", run_tokenizer, (tok_cfg,), level, self.run_dir),
            spawn("detokenizer", run_detokenizer,
                  (DetokenizerConfig(str(self.tokenizer_path), a.detokenizer, a.backends,
                                     a.api, stats_to),),
                  level, self.run_dir),
            spawn("api", _api_entry, (api_cfg, self.sock, level), level, self.run_dir),
        ]
        self._limits_sent = False

    def _send_limits(self) -> None:
        """Once every local rank is ready, node 0 hands the tokenizer what the replicas hold."""
        if not self.workers or self._limits_sent or any(c.info is None for c in self.ranks):
            return
        firsts = [c for p, c in zip(self.places, self.ranks) if p.rank == 0]
        limits = min_limits([(c.info or {})["limits"] for c in firsts])
        show_step(f"all {self.cfg.engine.tp * self.cfg.cluster.dp} ranks ready: context "
                  f"{limits.max_context} tokens, KV pool {limits.kv_capacity} tokens")
        self.workers[0].conn.send(("limits", limits))
        self._limits_sent = True

    def _check_others(self) -> None:
        found = self.link.failure() if self.link is not None else None
        if found is not None:
            raise OtherNodeFailed(found)

    def fail_start(self, e: StartupError) -> str:
        """Stop after a start-up failure; the message for the error line (over several nodes,
        once they met: the first failure any node reported)."""
        message = str(e)
        if self.met and not isinstance(e, OtherNodeFailed):
            message = self._report(self._name(message))
        self.stop(graceful=False)
        return message

    # --- watch ---------------------------------------------------------------------------------
    def watch(self, stop: threading.Event) -> Optional[str]:
        """Watch until `stop` is set or node 0 stops the service (None), or something fails:
        then the failure, in words (the first one reported, over several nodes)."""
        while not stop.is_set():
            dead = first_dead(self.children)
            if dead is not None and dead.process.exitcode == 0 and not self.cfg.cluster.is_head:
                return None  # a rank ends cleanly only on node 0's ShutdownMsg
            verdict = self._judge(self.children)
            if verdict.failure is not None:
                return verdict.failure
            if self.link is not None and self.link.shutting_down:
                return None
            self.health.mark(verdict.healthy)
            mpc.wait([c.process.sentinel for c in self.children], timeout=_WATCH_TURN_S)
        return None

    def _judge(self, children: List[Child]) -> Verdict:
        """`children` and the other nodes: the first failure (reported to the other nodes, in
        words), else whether every child shows signs of life."""
        dead = first_dead(children)
        if dead is not None:
            return Verdict(self._blame(dead), False)
        found = self.link.failure() if self.link is not None else None
        if found is not None:
            return Verdict(found, False)
        verdict = judge(children, self.ranks, self.cfg.watchdog_timeout, time.monotonic())
        if verdict.failure is not None:
            return Verdict(self._report(self._name(verdict.failure)), False)
        return verdict

    def _blame(self, dead: Child) -> str:
        """The failure every node names for `dead` (`_cause`), reported to the other nodes; a
        follower's goes through node 0's decision, so that it never wins over the cause."""
        cause = self._cause(dead)
        if cause.secondary and self.link is not None:
            return self.link.report_secondary(cause.text)
        return self._report(cause.text)

    def _cause(self, dead: Child) -> Cause:
        """What to blame for `dead`: itself, or, if it only followed another's failure, that
        failure once it shows within `_FOLLOWER_GRACE_S` (here, or from another node), else
        the follower, as secondary."""
        if dead.process.exitcode != PEER_EXIT:
            return Cause(self._name(dead.describe_death()))
        deadline = time.monotonic() + _FOLLOWER_GRACE_S
        while time.monotonic() < deadline:
            first = next((c for c in self.children
                          if not c.alive and c.process.exitcode != PEER_EXIT), None)
            if first is not None:
                return Cause(self._name(first.describe_death()))
            found = self.link.failure() if self.link is not None else None
            if found is not None:
                return Cause(found)
            time.sleep(0.1)
        return Cause(self._name(f"{dead.describe_death()} after another rank failed"), True)

    def _report(self, message: str) -> str:
        return self.link.report(message) if self.link is not None else message

    def fail(self, message: str) -> str:
        """Stop after a failure: tell the other nodes (the first report wins: returned) and the
        API server, stop the other children at once, give the API server a moment to send its
        error replies and exit, then stop whatever is left."""
        self.health.mark(False)  # /health answers 503 from now
        message = self._report(message)
        api = self._api()
        if api is not None and api.alive:
            _push_once(self.addrs.api, ServiceDown(message))
        others = [c for c in self.children if c is not api]
        stop_children(others, 0.0, 0.5)  # they may be stuck in a collective, or stopped
        if api is not None:
            api.process.join(_API_EXIT_S)
        self.stop(graceful=False)
        return message

    def _api(self) -> Optional[Child]:
        return next((c for c in self.workers if c.name == "api"), None)

    def drain(self, timeout_s: float, hurry: threading.Event) -> Optional[str]:
        """Node 0's clean stop, before `stop`: /health answers 503, the API server refuses new
        requests, lets those in flight finish for up to `timeout_s`, ends the rest with an error
        reply and exits (`streams.py`). `hurry` set (a second signal) ends them at once. The
        children are watched meanwhile: a failure is returned, in words (None: drained)."""
        self.health.mark(False)
        api = self._api()
        if api is None or not api.alive:
            return None
        _push_once(self.addrs.api, Drain(timeout_s))
        deadline, hurried = time.monotonic() + timeout_s + _API_EXIT_S, False
        others = [c for c in self.children if c is not api]
        while api.alive and time.monotonic() < deadline:
            if hurry.is_set() and not hurried:
                logger.info("second signal: ending the requests in flight now")
                _push_once(self.addrs.api, ServiceDown("it was stopped before the request "
                                                       "finished"))
                deadline, hurried = min(deadline, time.monotonic() + _API_EXIT_S), True
            failure = self._judge(others).failure
            if failure is not None:
                return failure
            mpc.wait([api.process.sentinel], timeout=_WATCH_TURN_S)
        return None

    # --- stop ----------------------------------------------------------------------------------
    def stop(self, graceful: bool) -> None:
        if self.stopped:
            return
        self.stopped = True
        self.health.mark(False)
        if graceful and self.link is not None:
            if self.cfg.cluster.is_head:
                self.link.announce_shutdown()
            elif not self.link.shutting_down:  # this node leaving ends the service
                self.link.report(self._name("its launcher was stopped"))
        if graceful and self.workers:
            firsts = [c for p, c in zip(self.places, self.ranks) if p.rank == 0]
            for backend, rank0 in zip(self.addrs.backends, firsts):
                if rank0.alive:
                    _push_once(backend, ShutdownMsg())
        for c in self.workers:
            if c.alive:
                c.process.terminate()
        if graceful:
            stop_children(self.children, _GRACEFUL_STOP_S, 2.0)
            if self.link is not None and self.cfg.cluster.is_head:
                self.link.await_departures()
        else:  # a child died: the others may be stuck in a collective with it, or stopped
            stop_children(self.children, 0.0, 0.5)
        self.ranks, self.workers = [], []
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.link is not None:
            self.link.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def describe_ranks(self) -> str:
        """This node's ranks, for the ready line of a node other than 0."""
        by_replica: Dict[int, List[int]] = {}
        for p in self.places:
            by_replica.setdefault(p.replica, []).append(p.rank)
        parts = [f"ranks {r[0]}-{r[-1]}" if len(r) > 1 else f"rank {r[0]}"
                 for r in by_replica.values()]
        if self.cfg.cluster.dp > 1:
            parts = [f"{part} of replica {d}" for d, part in zip(by_replica, parts)]
        return ", ".join(parts)
