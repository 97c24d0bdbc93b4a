#!/usr/bin/env python3
"""All-reduce latency: NCCL against the one-shot symmetric-memory all-reduce, one GPU per rank.

For each size (default 1, 8, 64, 256 tokens x hidden 4096, bfloat16) every rank measures, with
CUDA events, the mean device time of one all-reduce:
  eager  back-to-back calls launched from Python (--iters of them);
  graph  one CUDA graph of --calls-per-graph calls on distinct inputs (64: a 32-layer model's two
         all-reduces per layer), replayed --replays times.
"nccl" is `dist.all_reduce` (in place); "symm" is minisgl's `SymmMemAllReduce` (the decode path
of `Communicator.all_reduce`). With symmetric memory, two more graph columns time what a decoder
layer does after o_proj / down_proj: "symm+norm" (the one-shot all-reduce, then
`kernels.rmsnorm.rmsnorm` with the residual: two kernels) and "fused" (`all_reduce_rmsnorm`, mode
symm-fused: one kernel); "fused wrong" counts outputs of the last replay that differ from the
two-kernel path's. Every input is a small multiple of 1/4, so every sum is exact in
bfloat16: each call's output is compared with the expected sum (eager, and after the graph's
timed replays, so a race between consecutive calls would show). A time is the slowest rank's.

Prints a table and one line of JSON (prefixed "RESULT "); exits non-zero when a check failed or
a rank died. Never hangs: collectives time out after --dist-timeout-s, and the whole run (every
rank killed) after --timeout-s. NVLink multicast is off throughout (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 are forced in the ranks).

    python3 scripts/bench_allreduce.py --tp 2
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, cast

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

METHODS = ("nccl", "symm")
_NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2, help="ranks, one GPU each (cuda:0..tp-1)")
    p.add_argument("--tokens", default="1,8,64,256", help="comma-separated token counts")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--iters", type=int, default=200, help="timed eager calls per size")
    p.add_argument("--calls-per-graph", type=int, default=64)
    p.add_argument("--replays", type=int, default=20, help="timed graph replays per size")
    p.add_argument("--timeout-s", type=float, default=110.0,
                   help="wall-clock limit of the whole run; the ranks are killed after it")
    p.add_argument("--dist-timeout-s", type=float, default=30.0,
                   help="a collective waiting longer than this fails instead of hanging")
    args = p.parse_args(argv)
    if args.tp < 2:
        p.error("--tp must be >= 2 (an all-reduce needs two ranks)")
    return args


def token_counts(args: argparse.Namespace) -> List[int]:
    return [int(t) for t in args.tokens.split(",")]


# --- inputs and expected sums ---------------------------------------------------------------------
def pattern(numel: int, call: int, device: torch.device) -> torch.Tensor:
    """Values in {-6, ..., 6} / 4, shifted per call so that every call's data differs."""
    i = torch.arange(numel, device=device, dtype=torch.int64)
    return (((i + 7 * call) % 13) - 6).to(torch.float32) / 4


def rank_input(shape: Tuple[int, int], call: int, rank: int, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    """This rank's input: pattern x (rank + 1). Exact in bfloat16, and so is any sum of them."""
    numel = shape[0] * shape[1]
    return (pattern(numel, call, device) * (rank + 1)).to(dtype).view(shape)


def expected_sum(shape: Tuple[int, int], call: int, world: int, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
    numel = shape[0] * shape[1]
    return (pattern(numel, call, device) * (world * (world + 1) // 2)).to(dtype).view(shape)


# --- timing ---------------------------------------------------------------------------------------
def align_ranks(cpu_group: Any, warm: Callable[[], Any]) -> None:
    """Line the ranks up before a timed region: host barrier, then a few collectives, which
    finish together on every device."""
    torch.cuda.synchronize()
    dist.barrier(group=cpu_group)
    for _ in range(3):
        warm()


def device_ms(fn: Callable[[], Any], reps: int) -> float:
    """Mean device milliseconds of `fn` over `reps` back-to-back runs (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


class Methods:
    """The two all-reduces under test, as out-of-place functions x -> sum."""

    def __init__(self, symm: Any) -> None:
        self.symm = symm

    def nccl(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)  # in place: the output is x itself
        return x

    def symm_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        out = self.symm.all_reduce(x)
        if out is None:
            raise RuntimeError(f"{tuple(x.shape)} {x.dtype} does not fit the symmetric buffer")
        return out

    def get(self, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        return self.nccl if name == "nccl" else self.symm_all_reduce


@dataclass(frozen=True)
class Case:
    """One size on one rank, and what a measurement needs to check and align with its peers."""
    shape: Tuple[int, int]
    rank: int
    world: int
    dtype: torch.dtype
    device: torch.device
    cpu_group: Any

    def inputs(self, calls: int) -> List[torch.Tensor]:
        return [rank_input(self.shape, k, self.rank, self.dtype, self.device)
                for k in range(calls)]

    def wrong(self, outs: List[torch.Tensor]) -> int:
        """How many of the calls' outputs (call k at index k) differ from their exact sums."""
        return sum(not torch.equal(o, expected_sum(self.shape, k, self.world, self.dtype,
                                                   self.device))
                   for k, o in enumerate(outs))


def measure_eager(fn: Callable[[torch.Tensor], torch.Tensor], case: Case,
                  args: argparse.Namespace) -> Tuple[float, int]:
    """(microseconds per call, wrong outputs) of back-to-back eager calls."""
    bad = case.wrong([fn(x) for x in case.inputs(8)])
    # NCCL reduces in place, so this input grows with every call (up to inf): timing only.
    work = case.inputs(1)[0]
    align_ranks(case.cpu_group, lambda: fn(work))
    return device_ms(lambda: fn(work), args.iters) * 1e3, bad


def measure_graph(fn: Callable[[torch.Tensor], torch.Tensor], case: Case,
                  args: argparse.Namespace, in_place: bool) -> Tuple[float, int]:
    """(microseconds per call, wrong outputs) of `calls_per_graph` calls on distinct inputs,
    captured in one CUDA graph and replayed."""
    calls = args.calls_per_graph
    xs = case.inputs(calls)
    fresh = [x.clone() for x in xs]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fn(x) for x in xs]
    align_ranks(case.cpu_group, graph.replay)
    if in_place:  # check one replay from fresh inputs, then time (the values keep growing)
        for x, f in zip(xs, fresh):
            x.copy_(f)
        graph.replay()
        bad = case.wrong(outs)
        ms = device_ms(graph.replay, args.replays)
    else:  # the outputs of the last timed replay must still be exact
        ms = device_ms(graph.replay, args.replays)
        bad = case.wrong(outs)
    return ms / calls * 1e3, bad


def measure_norm_graph(symm: Any, case: Case, args: argparse.Namespace) -> Dict[str, Any]:
    """Graph times (microseconds per call) of all-reduce + residual add + RMSNorm: two kernels
    ("symm+norm") and the fused one ("fused"), and how many fused outputs of the last replay
    differ from the two-kernel outputs of the same inputs ("fused_wrong")."""
    from minisgl.kernels import rmsnorm
    calls = args.calls_per_graph
    xs = case.inputs(calls)
    ress = [x.flip(-1).contiguous() for x in xs]  # replicated, like a residual: same per rank
    weight = torch.linspace(0.5, 1.5, case.shape[1], device=case.device).to(case.dtype)

    def two_step(x: torch.Tensor, res: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        out, new_res = rmsnorm.rmsnorm(symm.all_reduce(x), weight, 1e-5, res)
        return out, new_res  # type: ignore[return-value]

    def fused(x: torch.Tensor, res: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return symm.all_reduce_rmsnorm(x, res, weight, 1e-5)

    times: Dict[str, Any] = {}
    outs: Dict[str, List[Tuple[torch.Tensor, torch.Tensor]]] = {}
    for name, fn in (("symm+norm", two_step), ("fused", fused)):
        fn(xs[0], ress[0])  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs[name] = [fn(x, r) for x, r in zip(xs, ress)]
        align_ranks(case.cpu_group, graph.replay)
        times[f"{name}_graph_us"] = device_ms(graph.replay, args.replays) / calls * 1e3
    wrong = sum(not (torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))
                for a, b in zip(outs["fused"], outs["symm+norm"]))
    return {**times, "fused_wrong": wrong}


# --- one rank -------------------------------------------------------------------------------------
def run_rank(rank: int, args: argparse.Namespace, init_method: str, out: Any) -> None:
    """Measure every size and method; send ("ok", rank, rows | why) or ("error", rank, text)."""
    os.environ.update(_NO_MULTICAST)  # before any CUDA / NCCL initialization in this process
    try:
        out.put(("ok", rank, measure_rank(rank, args, init_method)))
    except BaseException:  # noqa: BLE001 - report every failure to the parent, then exit
        out.put(("error", rank, traceback.format_exc()))
        raise SystemExit(1) from None


def measure_rank(rank: int, args: argparse.Namespace, init_method: str) -> Dict[str, Any]:
    from minisgl.distributed import (DEFAULT_SYMM_MAX_BYTES, DistributedInfo, SymmMemAllReduce,
                                     destroy_process_groups, init_process_groups)
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dtype = getattr(torch, args.dtype)
    world = args.tp
    largest = max(token_counts(args)) * args.hidden * dtype.itemsize
    max_bytes = max(DEFAULT_SYMM_MAX_BYTES, -(-largest // 16) * 16)
    groups = init_process_groups(DistributedInfo(rank, world), device, init_method,
                                 args.dist_timeout_s, allreduce="nccl")
    methods: Optional[Methods] = Methods(None)  # None in the finally
    try:
        # Neither group is None: --tp >= 2 (parse_args), so init_process_groups made both.
        symm, why = SymmMemAllReduce.create(cast(dist.ProcessGroup, dist.group.WORLD),
                                            cast(dist.ProcessGroup, groups.cpu_group), device,
                                            max_bytes, fused=True)
        methods = Methods(symm)
        names = [m for m in METHODS if m != "symm" or symm is not None]
        rows = []
        for tokens in token_counts(args):
            case = Case((tokens, args.hidden), rank, world, dtype, device, groups.cpu_group)
            row: Dict[str, Any] = {"tokens": tokens, "bytes": tokens * args.hidden * dtype.itemsize}
            for name in names:
                fn = methods.get(name)
                row[f"{name}_eager_us"], bad_eager = measure_eager(fn, case, args)
                row[f"{name}_graph_us"], bad_graph = measure_graph(fn, case, args,
                                                                   in_place=name == "nccl")
                row[f"{name}_wrong"] = bad_eager + bad_graph
            if symm is not None:
                row.update(measure_norm_graph(symm, case, args))
            rows.append(row)
        gathered: List[Any] = [None] * world
        dist.all_gather_object(gathered, rows, group=groups.cpu_group)
        return {"rows": slowest_rank(gathered), "symm_unavailable": why,
                "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                "symm_max_bytes": max_bytes}
    finally:
        methods = symm = None  # free the symmetric buffer before its process group goes
        torch.cuda.synchronize(device)
        destroy_process_groups()


def slowest_rank(per_rank: List[List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    """Each row with every time the largest over ranks and every wrong count summed."""
    merged = []
    for rows in zip(*per_rank):
        row = dict(rows[0])
        for key in row:
            if key.endswith("_us"):
                row[key] = round(max(r[key] for r in rows), 2)
            elif key.endswith("_wrong"):
                row[key] = sum(r[key] for r in rows)
        merged.append(row)
    return merged


# --- the parent -----------------------------------------------------------------------------------
def collect(procs: List[Any], results: Any, deadline: float) -> Tuple[Dict[int, Any], List[str]]:
    """Each rank's report, until all arrived, or the deadline passed. A failure or a dead rank
    shortens the deadline to a few seconds (its peers' reports, or its own, may be in flight)."""
    got: Dict[int, Any] = {}
    failed: Dict[int, str] = {}
    while len(got) + len(failed) < len(procs) and time.monotonic() < deadline:
        try:
            status, rank, payload = results.get(timeout=0.5)
        except queue.Empty:
            if any(not p.is_alive() for r, p in enumerate(procs) if r not in got):
                deadline = min(deadline, time.monotonic() + 3)
            continue
        if status == "ok":
            got[rank] = payload
        else:
            failed[rank] = payload
            deadline = min(deadline, time.monotonic() + 5)
    errors = [f"rank {r} failed:\n{text}" for r, text in sorted(failed.items())]
    for r, p in enumerate(procs):
        if r not in got and r not in failed:
            errors.append(f"rank {r}: no report (" + (
                f"exit code {p.exitcode})" if not p.is_alive() else "timed out, see --timeout-s)"))
    return got, errors


def stop(procs: List[Any]) -> None:
    """Join every rank briefly, then kill what is left (a rank stuck in teardown must not hang
    the script)."""
    for p in procs:
        p.join(timeout=10)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def print_table(args: argparse.Namespace, report: Dict[str, Any]) -> None:
    print(f"all-reduce, tp {args.tp}, {report['device']}, torch {report['torch']}, "
          f"hidden {args.hidden} {args.dtype}; microseconds per call (slowest rank)")
    if report["symm_unavailable"]:
        print(f"symmetric memory unavailable: {report['symm_unavailable']}")
    names = [m for m in METHODS if f"{m}_eager_us" in report["rows"][0]]
    norm = [n for n in ("symm+norm", "fused") if f"{n}_graph_us" in report["rows"][0]]
    head = "".join(f"{n + ' eager':>12}{n + ' graph':>12}" for n in names)
    head += "".join(f"{n + ' graph':>17}" for n in norm)
    print(f"{'tokens':>7}{'bytes':>10}{head}{'graph speedup':>15}{'wrong':>7}")
    for r in report["rows"]:
        cells = "".join(f"{r[n + '_eager_us']:>12.2f}{r[n + '_graph_us']:>12.2f}" for n in names)
        cells += "".join(f"{r[n + '_graph_us']:>17.2f}" for n in norm)
        speedup = (f"{r['nccl_graph_us'] / r['symm_graph_us']:>14.2f}x" if "symm" in names
                   else f"{'-':>15}")
        wrong = sum(v for k, v in r.items() if k.endswith("_wrong"))
        print(f"{r['tokens']:>7}{r['bytes']:>10}{cells}{speedup}{wrong:>7}")


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.device_count() < args.tp:
        print(f"needs {args.tp} CUDA GPUs, found "
              f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}")
        return 2
    from minisgl.distributed.bind import free_port
    deadline = time.monotonic() + args.timeout_s
    init_method = f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    procs = [ctx.Process(target=run_rank, args=(r, args, init_method, results), daemon=True,
                         name=f"bench-allreduce-rank{r}") for r in range(args.tp)]
    for p in procs:
        p.start()
    try:
        got, errors = collect(procs, results, deadline)
    finally:
        stop(procs)
    report: Dict[str, Any] = {"tp": args.tp, "hidden": args.hidden, "dtype": args.dtype,
                              "calls_per_graph": args.calls_per_graph, "errors": errors}
    if 0 in got:
        report.update(got[0])
        print_table(args, report)
    wrong = sum(v for r in report.get("rows", []) for k, v in r.items() if k.endswith("_wrong"))
    report["ok"] = not errors and 0 in got and wrong == 0
    for e in errors:
        print(e, file=sys.stderr)
    print("RESULT " + json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
