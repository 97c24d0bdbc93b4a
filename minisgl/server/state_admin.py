"""The served state changed over HTTP: the weights reloaded from a checkpoint, running requests
aborted by id, and the prefix cache flushed.

The weights, as SGLang's endpoint does it (RL loops push each training step's checkpoint to
the server this way):
POST /update_weights_from_disk {"model_path", "load_format", "abort_all_requests"} is answered
{"success", "message", "num_paused_requests"}: 200, or 400 with success false and why (a
checkpoint of another architecture or shape, files that do not load). The reload goes to every
data-parallel replica (message.ReplicaChange of a WeightsMsg, a uid each); each replica lets
its running requests finish (or, with abort_all_requests, they end with finish_reason
"abort"), holds new ones, reloads on all of its ranks or none, drops its prefix cache and
answers. Where some replica failed and others reloaded, those go back to the checkpoint served
before, so every replica serves the same weights. Reloads run one at a time (a lock).

Requests: SGLang's POST /abort_request {"rid"} ends the running request of that id (its
`rid`, or the X-Request-Id it came with), {"abort_all": true} every one; the clients get
finish_reason "abort" (what RL loops do with the rollouts of a step they cut short).

Weights pushed by a trainer over a process group (SGLang's, as RL loops with a separate trainer
use them; distributed/weight_group.py): POST /init_weights_update_group {"master_address",
"master_port", "rank_offset", "world_size", "group_name", "backend"} has every rank of every
replica join the trainer's group (replica d's rank r as rank_offset + d * tp + r); POST
/update_weights_from_distributed {"names", "dtypes", "shapes", "group_name",
"abort_all_requests"} waits as a disk reload does, then every rank receives the tensors the
trainer broadcasts and loads its shard (the trainer may send the weights in several such
buckets); POST /destroy_weights_update_group {"group_name"} leaves it. Each is answered
{"success", "message"}: 200, or 400 with success false and why (a group that cannot hold the
ranks, a rank that could not join, a tensor that is not a weight of the model: after which
every rank serves the checkpoint it loaded last from disk).
POST /update_weights_from_tensor {"serialized_named_tensors", "load_format", "weight_version"}
(SGLang's, for a trainer on this machine: distributed/tensor_payload.py) takes one base64
payload per rank of every replica (rank r of replica d: d * tp + r), each opened by its rank
alone (TensorWeightsMsg), and is answered the same way.

The weights' version (SGLang's): `--weight-version` at start-up (default "default"), the
`weight_version` of a successful update's body, or POST /update_weight_version
{"new_version"}; GET /get_weight_version {"weight_version"}, /get_model_info and each
/generate reply's meta_info name it (RL loops tag each rollout with it).

The prefix cache: SGLang's /flush_cache (GET or POST; 200 with a line of text) and vLLM's
POST /reset_prefix_cache (200, empty) drop every cached page no running request holds, on
every replica (message.FlushCacheMsg): what a benchmark does between runs, or an operator
after a change the cache cannot see.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from typing import Awaitable, Callable, List, Mapping, Optional

from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.requests import Request

from minisgl.distributed.load_formats import DISK_FORMATS, TENSOR_FORMATS, check_load_format
from minisgl.distributed.weight_group import GroupSpec, check_update
from minisgl.message.types import (FlushCacheMsg, GroupMsg, GroupWeightsMsg, TensorWeightsMsg,
                                   WeightsMsg)
from minisgl.server.openapi import App, body as body_schema
from minisgl.server.protocol import ApiError, Body, parse_body
from minisgl.server.streams import RequestStreams


class UpdateWeightsBody(Body):
    model_path: str
    load_format: Optional[str] = None  # SGLang's: "auto" (the directory's safetensors) only
    abort_all_requests: bool = False  # SGLang's: end the running requests instead of waiting
    weight_version: Optional[str] = None  # SGLang's: the new weights' version, once loaded


class WeightVersionBody(Body):
    new_version: str
    abort_all_requests: bool = False


class InitGroupBody(Body):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class GroupWeightsBody(Body):
    names: List[str]
    dtypes: List[str]
    shapes: List[List[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True  # SGLang's: the prefix cache is dropped either way
    abort_all_requests: bool = False
    weight_version: Optional[str] = None  # SGLang's: the version once every bucket loaded


class TensorWeightsBody(Body):
    serialized_named_tensors: List[str]  # base64, one per tp rank (of each replica, in order)
    load_format: Optional[str] = None  # SGLang's: direct (pairs) or flattened_bucket
    flush_cache: bool = True  # SGLang's: the prefix cache is dropped either way
    abort_all_requests: bool = False
    weight_version: Optional[str] = None


class GroupBody(Body):
    group_name: str = "weight_update_group"


class AbortBody(Body):
    rid: str = ""
    abort_all: bool = False


def _check_format(load_format: Optional[str], formats: Mapping[str, str]) -> None:
    try:
        check_load_format(load_format, formats)
    except ValueError as e:
        raise ApiError(400, str(e), "load_format") from None


class Weights:
    """The checkpoint every replica serves (`path`; None: dummy weights), the weights'
    version (SGLang's weight_version) and their updates."""

    def __init__(self, streams: RequestStreams, replicas: int, path: Optional[str],
                 version: str = "default") -> None:
        self.streams, self.replicas, self.path, self.version = streams, replicas, path, version
        self._lock = asyncio.Lock()

    async def update(self, body: UpdateWeightsBody) -> None:
        """Reload every replica from `body.model_path`; ApiError (400) why not, after which
        every replica serves the weights it did (500 where one that reloaded cannot go back:
        then the message names what each serves)."""
        _check_format(body.load_format, DISK_FORMATS)
        path = body.model_path
        async with self._lock:
            if body.abort_all_requests:
                self.streams.abort_all()
            errors = await self._change(path, list(range(self.replicas)))
            if not any(errors):
                self.path = path
                self.version = body.weight_version or self.version
                return
            error = next(e for e in errors if e)
            done = [r for r, e in enumerate(errors) if e is None]
            if done and (self.path is None or any(await self._change(self.path, done))):
                raise ApiError(500, f"replicas {done} serve the weights of {path}, the others "
                                    f"those served before ({self.path or 'dummy weights'}): "
                                    f"{error}", "model_path")
            raise ApiError(400, error, "model_path")

    async def _change(self, path: str, replicas: List[int]) -> List[Optional[str]]:
        return await self.streams.apply_change(lambda uid: WeightsMsg(uid, path), replicas)

    async def join_group(self, body: InitGroupBody, tp: int) -> None:
        """Every replica's ranks join the trainer's group; ApiError (400) why not, no rank
        joined then (those of replicas that had, leave)."""
        spec = GroupSpec(body.master_address, body.master_port, body.rank_offset,
                         body.world_size, body.group_name, body.backend)
        try:
            spec.check(self.replicas * tp)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        async with self._lock:
            errors = await self.streams.apply_change(lambda uid: GroupMsg(
                uid, body.group_name, body.master_address, body.master_port, body.rank_offset,
                body.world_size, body.backend), list(range(self.replicas)))
            if any(errors):
                joined = [r for r, e in enumerate(errors) if e is None]
                if joined:
                    await self.streams.apply_change(
                        lambda uid: GroupMsg(uid, body.group_name, leave=True), joined)
                raise ApiError(400, next(e for e in errors if e), "master_address")

    async def from_group(self, body: GroupWeightsBody) -> None:
        """Every replica receives the tensors the trainer broadcasts; ApiError (400) why not."""
        try:
            dtypes = check_update(body.names, body.dtypes, body.shapes)
        except ValueError as e:
            raise ApiError(400, str(e), "dtypes") from None
        async with self._lock:
            if body.abort_all_requests:
                self.streams.abort_all()
            errors = await self.streams.apply_change(lambda uid: GroupWeightsMsg(
                uid, body.group_name, tuple(body.names), dtypes,
                tuple(tuple(s) for s in body.shapes)), list(range(self.replicas)))
        if any(errors):
            raise ApiError(400, next(e for e in errors if e), "names")
        self.version = body.weight_version or self.version

    async def from_tensors(self, body: TensorWeightsBody, tp: int) -> None:
        """Every replica loads the tensors a trainer on this machine handed over by reference
        (`tensor_payload.py`); ApiError (400) why not."""
        _check_format(body.load_format, TENSOR_FORMATS)
        count, ranks = len(body.serialized_named_tensors), tp * self.replicas
        if count != ranks:  # each rank's reference counts: a payload opened twice breaks them
            raise ApiError(400, f"serialized_named_tensors holds {count} payloads: give one per "
                                f"rank, {ranks} ({tp} tensor-parallel ranks x {self.replicas} "
                                f"replicas)", "serialized_named_tensors")
        try:
            payloads = tuple(base64.b64decode(p, validate=True)
                             for p in body.serialized_named_tensors)
        except (binascii.Error, ValueError) as e:
            raise ApiError(400, f"serialized_named_tensors must be base64: {e}",
                           "serialized_named_tensors") from None
        per_replica = iter([payloads[d * tp:(d + 1) * tp] for d in range(self.replicas)])
        async with self._lock:
            if body.abort_all_requests:
                self.streams.abort_all()
            errors = await self.streams.apply_change(lambda uid: TensorWeightsMsg(
                uid, next(per_replica)), list(range(self.replicas)))  # (in replica order)
        if any(errors):
            raise ApiError(400, next(e for e in errors if e), "serialized_named_tensors")
        self.version = body.weight_version or self.version

    async def leave_group(self, body: GroupBody) -> None:
        async with self._lock:
            errors = await self.streams.apply_change(
                lambda uid: GroupMsg(uid, body.group_name, leave=True),
                list(range(self.replicas)))
        if any(errors):
            raise ApiError(400, next(e for e in errors if e), "group_name")


def install_state_routes(app: App, streams: RequestStreams, weights: Weights, tp: int,
                         read_body: Callable[[Request], Awaitable[bytes]]) -> None:
    """SGLang's POST /update_weights_from_disk, /init_weights_update_group,
    /update_weights_from_distributed, /destroy_weights_update_group, /abort_request and
    /flush_cache, vLLM's /reset_prefix_cache (see the module's docstring); `tp`: each
    replica's ranks; `read_body`: a JSON body's bytes (api.json_body: 415 for another content
    type)."""
    app.body_models += [UpdateWeightsBody, AbortBody, InitGroupBody, GroupWeightsBody, GroupBody,
                        WeightVersionBody, TensorWeightsBody]

    async def answer(done: str, change: Awaitable[None]) -> Response:
        """SGLang's answer to a change: {"success", "message"}."""
        try:
            await change
        except ApiError as e:
            return JSONResponse({"success": False, "message": e.message}, status_code=e.status)
        return JSONResponse({"success": True, "message": done})

    @app.post("/update_weight_version", openapi_extra=body_schema(WeightVersionBody))
    async def update_weight_version(request: Request) -> Response:
        body = parse_body(await read_body(request), WeightVersionBody)
        if body.abort_all_requests:
            streams.abort_all()
        weights.version = body.new_version
        return JSONResponse({"success": True, "message": f"Weight version updated to "
                                                         f"{body.new_version}."})

    @app.get("/get_weight_version")
    async def get_weight_version() -> Response:
        return JSONResponse({"weight_version": weights.version})

    @app.post("/init_weights_update_group", openapi_extra=body_schema(InitGroupBody))
    async def init_weights_update_group(request: Request) -> Response:
        body = parse_body(await read_body(request), InitGroupBody)
        return await answer("Succeeded to initialize the weight update group.",
                            weights.join_group(body, tp))

    @app.post("/update_weights_from_distributed", openapi_extra=body_schema(GroupWeightsBody))
    async def update_weights_from_distributed(request: Request) -> Response:
        body = parse_body(await read_body(request), GroupWeightsBody)
        return await answer("Succeeded to update the parameters from distributed.",
                            weights.from_group(body))

    @app.post("/update_weights_from_tensor", openapi_extra=body_schema(TensorWeightsBody))
    async def update_weights_from_tensor(request: Request) -> Response:
        body = parse_body(await read_body(request), TensorWeightsBody)
        return await answer("Succeeded to update the parameters from tensors.",
                            weights.from_tensors(body, tp))

    @app.post("/destroy_weights_update_group", openapi_extra=body_schema(GroupBody))
    async def destroy_weights_update_group(request: Request) -> Response:
        body = parse_body(await read_body(request), GroupBody)
        return await answer("Succeeded to destroy the weight update group.",
                            weights.leave_group(body))

    @app.post("/abort_request", openapi_extra=body_schema(AbortBody))
    async def abort_request(request: Request) -> Response:
        body = parse_body(await read_body(request), AbortBody)
        if not body.abort_all and not body.rid:
            raise ApiError(400, "abort_request needs a rid, or abort_all", "rid")
        streams.abort_all(None if body.abort_all else body.rid)
        return Response(status_code=200)

    async def flush() -> None:
        await streams.apply_change(FlushCacheMsg, list(range(weights.replicas)))

    @app.each_method("/flush_cache", ["GET", "POST"])
    async def flush_cache() -> Response:
        await flush()
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        await flush()
        return Response(status_code=200)

    @app.post("/update_weights_from_disk", openapi_extra=body_schema(UpdateWeightsBody))
    async def update_weights_from_disk(request: Request) -> Response:
        body = parse_body(await read_body(request), UpdateWeightsBody)
        try:
            await weights.update(body)
        except ApiError as e:
            return JSONResponse({"success": False, "message": e.message,
                                 "num_paused_requests": 0}, status_code=e.status)
        return JSONResponse({"success": True, "message": f"Succeeded to update model weights "
                                                         f"from {body.model_path}.",
                             "num_paused_requests": 0})
