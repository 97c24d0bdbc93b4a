"""The tensor-parallel all-reduce switch: config and CLI plumbing, the CPU fallback to gloo, a
clear error for "symm" off CUDA, and (on two GPUs) the symmetric-memory one-shot all-reduce
against NCCL, eagerly and inside a CUDA graph."""

from __future__ import annotations

import os
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist

from minisgl.distributed import (Communicator, DistributedInfo, SymmMemAllReduce,
                                 destroy_process_groups, init_process_groups)
from minisgl.distributed.symm_allreduce import symm_mem_problem
from minisgl.engine import EngineConfig
from minisgl.kernels.policy import KernelPolicy
from minisgl.server.args import parse_args
from minisgl.distributed.bind import free_port
from script_loader import load_script
from spawn_ranks import spawn_ranks
from tiny_models import build_tiny

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}


# --- spawning ranks -------------------------------------------------------------------------------
def _spawn(target: Callable[..., None], world: int, timeout_s: float) -> Dict[int, str]:
    """Run target(rank, port, queue) in `world` spawned processes; each puts (rank, "ok" or a
    traceback). Returns every rank's message."""
    msgs: Dict[int, str] = {}
    with spawn_ranks(target, world, free_port()) as ranks:
        for _ in range(world):
            rank, msg = ranks.out.get(timeout=timeout_s)
            msgs[rank] = msg
    return msgs


def _assert_ranks_ok(target: Callable[..., None], timeout_s: float, world: int = 2) -> None:
    """Spawn `world` ranks of target and require every one to report "ok" (else show their
    tracebacks)."""
    msgs = _spawn(target, world, timeout_s)
    assert msgs == {r: "ok" for r in range(world)}, "\n".join(msgs.values())


def _report(rank: int, out: Any, body: Callable[[], None]) -> None:
    try:
        body()
        out.put((rank, "ok"))
    except BaseException:  # noqa: BLE001 - the parent asserts on the message
        out.put((rank, traceback.format_exc()))
    finally:
        destroy_process_groups()


# --- configuration --------------------------------------------------------------------------------
def test_engine_config_allreduce_modes() -> None:
    info = DistributedInfo(0, 2)
    assert EngineConfig("m", info).allreduce == "auto"
    for mode in ("auto", "nccl"):
        assert EngineConfig("m", info, device="cpu", allreduce=mode).allreduce == mode
    assert EngineConfig("m", info, device="cuda", allreduce="symm").allreduce == "symm"
    with pytest.raises(ValueError, match="allreduce must be one of auto, nccl, symm"):
        EngineConfig("m", info, allreduce="mpi")
    with pytest.raises(ValueError, match="'symm' needs CUDA"):
        EngineConfig("m", info, device="cpu", allreduce="symm")
    assert EngineConfig("m", info, device="cuda", allreduce="symm-fused").allreduce == "symm-fused"
    with pytest.raises(ValueError, match="'symm-fused' needs CUDA"):
        EngineConfig("m", info, device="cpu", allreduce="symm-fused")
    with pytest.raises(ValueError, match="'symm-fused' .* needs fused_ops"):
        EngineConfig("m", info, device="cuda", allreduce="symm-fused", fused_ops=False)
    assert EngineConfig("m", info, device="cpu", allreduce="ordered").allreduce_mode == "ordered"
    assert EngineConfig("m", info, device="cpu").allreduce_mode == "auto"
    assert EngineConfig("m", info, device="cpu",
                        enable_deterministic_inference=True).allreduce_mode == "ordered"


def test_communicator_fuses_only_when_asked() -> None:
    """all_reduce_rmsnorm is None (no communication; the caller reduces and norms) for one
    rank, without symmetric memory, or without the fused mode."""
    x = torch.ones(2, 8)
    assert Communicator(DistributedInfo(0, 1)).all_reduce_rmsnorm(x, x, x[0], 1e-5) is None
    assert Communicator(DistributedInfo(0, 2), fuse_norm=True).all_reduce_rmsnorm(
        x, x, x[0], 1e-5) is None


def test_cli_and_file_set_allreduce(tmp_path: Path) -> None:
    assert parse_args([]).engine.allreduce == "auto"
    cfg = parse_args(["--allreduce", "nccl", "--tp", "2", "--device", "cpu"])
    sc = cfg.scheduler_config(Path("/m"), 1, "tcp://127.0.0.1:1", "ipc://b", "ipc://d", "ipc://x")
    assert (cfg.engine.allreduce, sc.engine.allreduce) == ("nccl", "nccl")
    f = tmp_path / "c.toml"
    f.write_text('allreduce = "symm"\n')
    assert parse_args(["--config", str(f)]).engine.allreduce == "symm"
    f.write_text('allreduce = "mpi"\n')
    with pytest.raises(ValueError, match="allreduce must be one of"):
        parse_args(["--config", str(f)])
    with pytest.raises(SystemExit):
        parse_args(["--allreduce", "mpi"])
    with pytest.raises(ValueError, match="'symm' needs CUDA"):  # a known device: at parse time
        parse_args(["--allreduce", "symm", "--device", "cpu"])


@pytest.mark.parametrize("script", ["bench_latency", "bench_offline", "bench_allreduce"])
def test_bench_scripts_take_allreduce(script: str) -> None:
    module = load_script(script)
    if script == "bench_allreduce":
        args = module.parse_args(["--tp", "2", "--tokens", "1,8"])
        assert (args.tp, module.token_counts(args)) == (2, [1, 8])
        if _gpus() < 2:  # says what it needs and exits 2 instead of failing somewhere inside
            assert module.main(["--tp", "2"]) == 2
        return
    assert module.parse_args([]).allreduce == "auto"
    assert module.parse_args(["--allreduce", "symm"]).allreduce == "symm"
    with pytest.raises(SystemExit):
        module.parse_args(["--allreduce", "mpi"])


def test_llm_symm_on_cpu_fails_before_spawning(tmp_path: Path) -> None:
    from minisgl import LLM
    path = build_tiny("qwen3", tmp_path, None)
    with pytest.raises(ValueError, match="'symm' needs CUDA"):
        LLM(str(path), device="cpu", tp=2, allreduce="symm", show_progress=False)


# --- CPU: gloo, and the symmetric-memory path never taken ----------------------------------------
def test_symm_on_cpu_raises_before_joining() -> None:
    with pytest.raises(ValueError, match="'symm' needs CUDA"):
        init_process_groups(DistributedInfo(0, 2), torch.device("cpu"), "tcp://127.0.0.1:1",
                            5.0, allreduce="symm")
    assert not dist.is_initialized()
    assert "not cuda" in (symm_mem_problem(torch.device("cpu")) or "")


def _gloo_rank(rank: int, port: int, out: Any) -> None:
    def body() -> None:
        groups = init_process_groups(DistributedInfo(rank, 2), torch.device("cpu"),
                                     f"tcp://127.0.0.1:{port}", 30.0, allreduce="auto")
        assert groups.comm.symm is None, "auto on CPU must not set up symmetric memory"
        x = torch.arange(8, dtype=torch.float32).view(2, 4) * (rank + 1)
        y = groups.comm.all_reduce(x)
        assert torch.equal(y, torch.arange(8, dtype=torch.float32).view(2, 4) * 3), y
        # the LM head's gather into a row slice of a graph's logits buffer
        x = torch.arange(8, dtype=torch.float32).view(2, 4) * (rank + 1)  # reduced in place
        buffer = torch.zeros(5, 8)
        got = groups.comm.all_gather_last_dim(x, out=buffer[:2])
        want = torch.cat([torch.arange(8.0).view(2, 4), torch.arange(8.0).view(2, 4) * 2], -1)
        assert got.data_ptr() == buffer.data_ptr() and torch.equal(got, want), got
        assert torch.equal(groups.comm.all_gather_last_dim(x), want)
        assert not buffer[2:].any()
    _report(rank, out, body)


def test_gather_at_tp1_takes_no_out() -> None:
    """At tp = 1 the gather is the identity: an `out` there would be left unwritten, so it is
    refused (the LM head writes its product into `out` itself)."""
    comm = Communicator(DistributedInfo(0, 1))
    x = torch.ones(2, 3)
    assert comm.all_gather_last_dim(x) is x
    with pytest.raises(ValueError, match="tp = 1"):
        comm.all_gather_last_dim(x, out=torch.empty(2, 3))


def test_auto_on_cpu_is_gloo() -> None:
    _assert_ranks_ok(_gloo_rank, timeout_s=90)


def _ordered_rank(rank: int, port: int, out: Any) -> None:
    def body() -> None:
        groups = init_process_groups(DistributedInfo(rank, 3), torch.device("cpu"),
                                     f"tcp://127.0.0.1:{port}", 30.0, allreduce="ordered")
        assert groups.comm.ordered and groups.comm.symm is None
        partials = [torch.randn(40, 24, generator=torch.Generator().manual_seed(r)
                                ).to(torch.bfloat16) for r in range(3)]
        want = (partials[0].float() + partials[1] + partials[2]).to(torch.bfloat16)
        whole = groups.comm.all_reduce(partials[rank].clone())
        assert torch.equal(whole, want)
        for rows in (slice(0, 1), slice(7, 12), slice(39, 40)):  # its rows alone: the same bits
            assert torch.equal(groups.comm.all_reduce(partials[rank][rows].clone()), want[rows])
    _report(rank, out, body)


def test_ordered_adds_partials_in_rank_order() -> None:
    """allreduce "ordered" (deterministic inference past two ranks): three ranks' bf16
    partials added in rank order in float32 and rounded once, a row's bits the same reduced
    alone as among 40."""
    _assert_ranks_ok(_ordered_rank, timeout_s=90, world=3)


def test_fits_is_decided_by_shape_dtype_and_layout() -> None:
    """`fits` alone decides the path (so every rank decides the same); checked without a GPU by
    giving an unallocated instance a CPU device."""
    symm = SymmMemAllReduce.__new__(SymmMemAllReduce)
    symm.device, symm.max_bytes = torch.device("cpu"), 2 << 20
    bf16 = torch.bfloat16
    assert symm.fits(torch.empty(256, 4096, dtype=bf16))  # exactly 2 MiB
    assert symm.fits(torch.empty(3, 64, dtype=torch.float32))
    assert not symm.fits(torch.empty(257, 4096, dtype=bf16))  # too big: NCCL
    assert not symm.fits(torch.empty(4, 4096, dtype=torch.float16))  # no fp16 kernel
    assert not symm.fits(torch.empty(4096, 4, dtype=bf16).t())  # not contiguous
    assert not symm.fits(torch.empty(2, 4096, dtype=bf16)[:, 1:])  # not contiguous
    assert symm.fits(torch.empty(9, 4096, dtype=bf16)[1:])  # offset of 8 KiB: aligned
    assert not symm.fits(torch.empty(4097, dtype=bf16)[1:].view(16, 256))  # offset of 2 bytes
    assert not symm.fits(torch.empty(3, dtype=bf16))  # 6 bytes: below the 16-byte granule
    assert not symm.fits(torch.empty(0, 4096, dtype=bf16))


# --- CPU: the fused kernel in Triton's interpreter, ranks sharing one memory region --------------
_STAGING = 4096  # bytes of staging per rank in the CPU tests; flags follow
_CPU_CALLS = [(1, 64), (3, 100), (5, 64), (7, 48), (2, 100)]  # (rows, hidden): grids change


def _cpu_rank_input(call: int, rank: int, rows: int, hidden: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * call + rank)
    return torch.randn(rows, hidden, generator=gen)


def _fused_cpu_rank(rank: int, world: int, shm: torch.Tensor, region: int, spin_limit: int,
                    out: Any) -> None:
    """Rank `rank` of `world` processes, each mapping `shm` (one region per rank) at its own
    address, as symmetric memory maps peers. Puts (rank, "errors N" or a traceback) once; with a
    real spin_limit every call is checked against the two-step path first."""
    os.environ["TRITON_INTERPRET"] = "1"  # before this process imports triton
    try:
        from minisgl.kernels import rmsnorm
        from minisgl.kernels.allreduce import all_reduce_rmsnorm
        from minisgl.kernels.types import PeerBuffers
        ptrs = torch.tensor([shm.data_ptr() + q * region for q in range(world)])
        peers = PeerBuffers(shm[rank * region:(rank + 1) * region], ptrs, rank, world, _STAGING,
                            torch.zeros(1, dtype=torch.int32), spin_limit, trap=False)
        for call, (rows, hidden) in enumerate(_CPU_CALLS):
            xs = [_cpu_rank_input(call, q, rows, hidden) for q in range(world)]
            res = _cpu_rank_input(call, 99, rows, hidden)  # replicated: the same on every rank
            w = _cpu_rank_input(call, 98, 1, hidden)[0]
            got, got_res = all_reduce_rmsnorm(xs[rank], res, w, 1e-5, peers, max_programs=2)
            if peers.errors.item():
                break  # a barrier gave up: the sums are garbage, say so instead
            total = xs[0]
            for x in xs[1:]:
                total = total + x  # float32, rank order: what the kernel must do
            want, want_res = rmsnorm.rmsnorm(total, w, 1e-5, res)
            assert torch.equal(got_res, want_res), f"call {call}: new residual"
            assert torch.equal(got, want), f"call {call}: normed output"
        out.put((rank, f"errors {int(peers.errors.item())}"))
    except BaseException:  # noqa: BLE001 - the parent asserts on the message
        out.put((rank, traceback.format_exc()))


def _run_fused_cpu(world: int, ranks: int, spin_limit: int) -> Tuple[Dict[int, str], bytes]:
    """Spawn `ranks` of a `world`-rank group; (each rank's message, flag bytes afterwards)."""
    from minisgl.kernels.allreduce import flag_bytes
    region = _STAGING + flag_bytes(world) + 4096  # + slack: regions page apart, like real ones
    region -= region % 4096
    shm = torch.zeros(world * region, dtype=torch.uint8).share_memory_()
    msgs: Dict[int, str] = {}
    with spawn_ranks(_fused_cpu_rank, ranks, world, shm, region, spin_limit) as procs:
        for _ in range(ranks):
            rank, msg = procs.out.get(timeout=180)
            msgs[rank] = msg
    flags = b"".join(bytes(shm[q * region + _STAGING:q * region + _STAGING + flag_bytes(world)]
                           .tolist()) for q in range(world))
    return msgs, flags


@pytest.mark.parametrize("world", [2, 3])
def test_fused_all_reduce_rmsnorm_in_interpreter(world: int) -> None:
    """Every call equals all-reduce + rmsnorm.rmsnorm bit for bit, on every rank; rows
    outnumber programs and the grid changes between calls; no barrier gives up; every flag is
    back at zero afterwards (the next call, or graph replay, starts clean)."""
    pytest.importorskip("triton")
    msgs, flags = _run_fused_cpu(world, world, spin_limit=1 << 22)
    assert msgs == {r: "errors 0" for r in range(world)}, "\n".join(msgs.values())
    assert not any(flags), "a barrier flag was left set"


def test_fused_barrier_gives_up_instead_of_hanging() -> None:
    """With its peer missing, a rank's barriers give up after spin_limit tries and set both
    error bits (on a GPU it would also trap)."""
    pytest.importorskip("triton")
    msgs, _ = _run_fused_cpu(world=2, ranks=1, spin_limit=50)
    assert msgs == {0: "errors 3"}, msgs


# --- GPU: symmetric memory against NCCL -----------------------------------------------------------
def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _exact(shape: Tuple[int, ...], call: int, rank: int, dtype: torch.dtype,
           device: torch.device) -> torch.Tensor:
    """Small multiples of 1/4 times (rank + 1): every sum over ranks is exact in bfloat16."""
    n = 1
    for d in shape:
        n *= d
    i = torch.arange(n, device=device)
    return (((i + 7 * call) % 13 - 6).float() / 4 * (rank + 1)).to(dtype).view(shape)


def _nccl_sum(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    dist.all_reduce(y)
    return y


def _check_eager(comm: Any, rank: int, device: torch.device,
                 shapes: List[Tuple[Tuple[int, int], torch.dtype]]) -> None:
    gen = torch.Generator(device=device).manual_seed(1000 + rank)
    for call, (shape, dtype) in enumerate(shapes):
        exact = _exact(shape, call, rank, dtype, device)
        got = comm.all_reduce(exact.clone())
        assert torch.equal(got, _nccl_sum(exact)), f"exact {shape} {dtype}"
        rand = torch.randn(shape, generator=gen, device=device).to(dtype)
        torch.testing.assert_close(comm.all_reduce(rand.clone()), _nccl_sum(rand),
                                   rtol=1e-2, atol=1e-2)


def _check_graph(comm: Any, rank: int, device: torch.device,
                 shapes: List[Tuple[Tuple[int, int], torch.dtype]]) -> None:
    """One graph of every shape's all-reduce (symm and NCCL paths mixed), replayed on new data:
    each replay equals NCCL's eager sum of the same inputs."""
    xs = [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in shapes]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [comm.all_reduce(x) for x in xs]
    for replay in range(3):
        inputs = [_exact(x.shape, 10 * replay + k, rank, x.dtype, device)
                  for k, x in enumerate(xs)]
        for x, v in zip(xs, inputs):
            x.copy_(v)  # NCCL reduces in place, so refill before every replay
        graph.replay()
        for k, (o, v) in enumerate(zip(outs, inputs)):
            assert torch.equal(o, _nccl_sum(v)), f"replay {replay}, call {k}: {tuple(v.shape)}"


def _symm_rank_comm(rank: int, port: int, allreduce: str) -> Tuple[torch.device, Any]:
    """Rank `rank` of two on GPU `rank`, multicast off, process groups with `allreduce`:
    (its device, its communicator)."""
    os.environ.update(NO_MULTICAST)
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    groups = init_process_groups(DistributedInfo(rank, 2), device, f"tcp://127.0.0.1:{port}",
                                 60.0, allreduce=allreduce)
    return device, groups.comm


def _symm_rank(rank: int, port: int, out: Any) -> None:
    def body() -> None:
        device, comm = _symm_rank_comm(rank, port, "symm")
        assert comm.symm is not None
        bf16 = torch.bfloat16
        shapes = [((1, 4096), bf16), ((8, 4096), bf16), ((256, 4096), bf16),
                  ((3, 64), torch.float32), ((300, 4096), bf16)]  # the last is > 2 MiB: NCCL
        assert [comm.symm.fits(torch.empty(s, dtype=d, device=device)) for s, d in shapes] == \
            [True, True, True, True, False]
        _check_eager(comm, rank, device, shapes)
        _check_graph(comm, rank, device, shapes)
        torch.cuda.synchronize(device)
        comm.symm = None  # free the symmetric buffer before the process group goes
    _report(rank, out, body)


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 2, reason="needs two GPUs")
def test_symm_allreduce_matches_nccl_tp2() -> None:
    _assert_ranks_ok(_symm_rank, timeout_s=240)


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 2, reason="needs two GPUs")
def test_llm_tp2_symm_matches_nccl(tmp_path: Path) -> None:
    """The whole engine (decode CUDA graphs included) gives the same greedy tokens with either
    all-reduce: float32, two ranks, so every sum is the same a + b."""
    path = str(build_tiny("qwen3", tmp_path, None))
    assert _llm_tp2_tokens(path, "symm", "float32") == _llm_tp2_tokens(path, "nccl", "float32")


def _llm_tp2_tokens(path: str, mode: str, dtype: str) -> List[List[int]]:
    """Greedy tokens of 8 mixed prompts from a tp=2 CUDA engine with all-reduce `mode`."""
    from hf_reference import mixed_prompts
    from minisgl import LLM, SamplingParams
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with LLM(path, tp=2, device="cuda", dtype=dtype, allreduce=mode, show_progress=False) as llm:
        return [o.token_ids for o in llm.generate(mixed_prompts(8, seed=6), greedy)]


# --- GPU: the fused all-reduce + RMSNorm against the two-step path --------------------------------
def _fused_rows(dtype: torch.dtype) -> Tuple[int, ...]:
    """Row counts that fit the default 2 MiB staging buffer at hidden 4096 (bf16: up to 256
    rows, the largest decode graph; float32: up to 128)."""
    return (1, 7, 64, 256) if dtype == torch.bfloat16 else (1, 7, 64, 128)


def _mismatch(got: torch.Tensor, want: torch.Tensor) -> str:
    diff = (got.float() - want.float()).abs()
    return f"{int((got != want).sum())} of {got.numel()} differ, max {float(diff.max()):.3g}"


def _two_step(comm: Any, x: torch.Tensor, res: torch.Tensor, w: torch.Tensor
              ) -> Tuple[torch.Tensor, torch.Tensor]:
    from minisgl.kernels import rmsnorm
    out, new_res = rmsnorm.rmsnorm(comm.symm.all_reduce(x), w, 1e-5, res)
    assert new_res is not None
    return out, new_res


def _check_fused(comm: Any, xs: List[torch.Tensor], ress: List[torch.Tensor], w: torch.Tensor,
                 outs: List[Tuple[torch.Tensor, torch.Tensor]], what: str) -> None:
    """Each fused output equals the two-step path's and rank 0's, bit for bit."""
    for x, res, (out, new_res) in zip(xs, ress, outs):
        want, want_res = _two_step(comm, x, res, w)
        assert torch.equal(new_res, want_res), f"{what} {tuple(x.shape)} residual: " + \
            _mismatch(new_res, want_res)
        assert torch.equal(out, want), f"{what} {tuple(x.shape)} out: " + _mismatch(out, want)
        theirs = out.clone()
        dist.broadcast(theirs, src=0)
        assert torch.equal(out, theirs), f"{what} {tuple(x.shape)}: ranks differ"


def _fused_inputs(gen: torch.Generator, rank: int, dtype: torch.dtype, device: torch.device
                  ) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """Partial sums and residuals; all the same on every rank for the same generator state
    (the callers scale the partial sums by rank + 1 so that they differ)."""
    seed = torch.randint(1 << 30, (1,), device=device, generator=gen)
    shared = torch.Generator(device=device).manual_seed(int(seed))
    rows = _fused_rows(dtype)
    xs = [torch.randn(r, 4096, device=device, generator=gen).to(dtype) for r in rows]
    ress = [torch.randn(r, 4096, device=device, generator=shared).to(dtype) for r in rows]
    return xs, ress


def _fused_rank(rank: int, port: int, out: Any) -> None:
    def body() -> None:
        device, comm = _symm_rank_comm(rank, port, "symm-fused")
        assert comm.symm is not None and comm.fuse_norm
        for dtype in (torch.bfloat16, torch.float32):
            # The generators' first draws are the same on both ranks (seed 7 for the shared
            # seed), then differ per rank for the partial sums.
            gen = torch.Generator(device=device).manual_seed(7)
            w = torch.randn(4096, device=device, generator=gen).to(dtype)
            gen.manual_seed(7)
            xs, ress = _fused_inputs(gen, rank, dtype, device)
            xs = [(x * (rank + 1)).contiguous() for x in xs]
            fused = [comm.all_reduce_rmsnorm(x, r, w, 1e-5) for x, r in zip(xs, ress)]
            assert all(f is not None for f in fused), "every size must fit"
            too_big = torch.zeros(2 * _fused_rows(dtype)[-1], 4096, dtype=dtype, device=device)
            assert comm.all_reduce_rmsnorm(too_big, too_big, w, 1e-5) is None  # caller falls back
            _check_fused(comm, xs, ress, w, fused, f"eager {dtype}")
            _check_fused_graph(comm, rank, device, dtype, w)
        torch.cuda.synchronize(device)
        comm.symm = None  # free the symmetric buffer before the process group goes
    _report(rank, out, body)


def _check_fused_graph(comm: Any, rank: int, device: torch.device, dtype: torch.dtype,
                       w: torch.Tensor, replays: int = 1000) -> None:
    """One graph of a fused call per size (with PDL), replayed on new inputs every time; every
    replay checked (a barrier that let a rank overwrite a buffer early would show here)."""
    xs = [torch.zeros(r, 4096, dtype=dtype, device=device) for r in _fused_rows(dtype)]
    ress = [torch.zeros_like(x) for x in xs]
    policy = KernelPolicy(fused=True, pdl=True)
    for x, r in zip(xs, ress):  # warm up (compile) outside the capture
        comm.all_reduce_rmsnorm(x, r, w, 1e-5, policy)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [comm.all_reduce_rmsnorm(x, r, w, 1e-5, policy) for x, r in zip(xs, ress)]
    gen = torch.Generator(device=device).manual_seed(11)
    for replay in range(replays):
        gen.manual_seed(11 + replay)  # the shared seed: the same on both ranks
        new_xs, new_ress = _fused_inputs(gen, rank, dtype, device)
        for x, r, nx, nr in zip(xs, ress, new_xs, new_ress):
            x.copy_(nx * (rank + 1))
            r.copy_(nr)
        graph.replay()
        _check_fused(comm, xs, ress, w, outs, f"graph replay {replay} {dtype}")


def _ordered_cuda_rank(rank: int, port: int, out: Any) -> None:
    def body() -> None:
        device, comm = _symm_rank_comm(rank, port, "ordered")
        assert comm.ordered and comm.symm is None
        x = torch.zeros(64, 4096, dtype=torch.bfloat16, device=device)
        comm.all_reduce(x)  # warm up (NCCL's communicator) outside the capture
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            summed = comm.all_reduce(x)
        for step in range(20):  # each rank's partials from the shared seed, then replayed
            gen = torch.Generator(device=device).manual_seed(step)
            parts = [torch.randn(64, 4096, device=device, generator=gen).to(torch.bfloat16)
                     for _ in range(2)]
            x.copy_(parts[rank])
            graph.replay()
            want = (parts[0].float() + parts[1]).to(torch.bfloat16)
            assert torch.equal(summed, want), step
            assert torch.equal(comm.all_reduce(parts[rank][3:5].clone()), want[3:5]), step
        torch.cuda.synchronize(device)
    _report(rank, out, body)


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 2, reason="needs two GPUs")
def test_ordered_over_nccl_in_a_cuda_graph() -> None:
    """allreduce "ordered" on two GPUs: NCCL's all-gather and the rank-order sum captured in a
    CUDA graph give the float32 sum rounded once, each replay on new partials, and rows
    reduced alone the same bits."""
    _assert_ranks_ok(_ordered_cuda_rank, timeout_s=240)


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 2, reason="needs two GPUs")
def test_symm_fused_matches_two_step_tp2() -> None:
    _assert_ranks_ok(_fused_rank, timeout_s=540)


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_llm_tp2_symm_fused_matches_symm(tmp_path: Path, dtype: str) -> None:
    """The whole engine (decode CUDA graphs included) gives the same greedy tokens with the
    fused all-reduce + RMSNorm as with the two-step path: the kernel gives the same bits."""
    path = str(build_tiny("qwen3", tmp_path, None))
    assert _llm_tp2_tokens(path, "symm-fused", dtype) == _llm_tp2_tokens(path, "symm", dtype)
