"""Throwaway prototype (issue 22, batch-1 FP8): o_proj -> gate/up -> down (FP8 weights, one bf16
token) as ONE persistent Gluon launch whose weight tiles stream through a shared-memory ring by
TMA, filled by a producer warp that never waits for the grid barriers between the stages (the
weights do not depend on the activations), against the model's three PDL-chained GEMV launches
(51.14 us on one H200, RESULTS.md twenty-fourth session) and the Triton persistent kernel
without a ring (58.75 us at best).

Per program (one per SM): row blocks rb = pid, pid + P, ... of each stage, each row block's K
tiles in order; the producer partition (1 warp) issues tile after tile into a DEPTH-slot ring
(ready / empty mbarriers); the consumer partition (the kernel's warps) stages the stage's input
row in shared memory after the grid barrier, then multiplies tile by tile, float32 sums, and
stores each row block's rows (x scale, bf16). Grid barrier: a release add / acquire spin on a
global counter; the last program out zeroes the counters.

  python3 scripts/experiments/tma_chain.py --compile-only    # compile for sm_90a here (no GPU): regs, smem
  python3 scripts/experiments/tma_chain.py                   # on the H200: check against the chain, time
"""
import argparse
import itertools
import os
import sys

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import constexpr_function
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

N1: gl.constexpr = gl.constexpr(4096)
K1: gl.constexpr = gl.constexpr(4096)
N2: gl.constexpr = gl.constexpr(28672)
K2: gl.constexpr = gl.constexpr(4096)
N3: gl.constexpr = gl.constexpr(4096)
K3: gl.constexpr = gl.constexpr(14336)
KMAX: gl.constexpr = gl.constexpr(14336)
# TMA_CHAIN_MATH=0: the consumer only waits and frees each tile (wrong outputs; an upper bound)
MATH: gl.constexpr = gl.constexpr(os.environ.get("TMA_CHAIN_MATH", "1") == "1")


@gluon.jit
def _produce_stage(desc, ring, ready, empty, i, pid, nprog, N: gl.constexpr, K: gl.constexpr,
                   BN: gl.constexpr, BK: gl.constexpr, DEPTH: gl.constexpr):
    for rb in range(pid, N // BN, nprog):
        for kt in range(K // BK):
            slot = i % DEPTH
            phase = (i // DEPTH) & 1
            # a fresh mbarrier counts as having completed the phase before phase 0
            mbarrier.wait(empty.index(slot), phase ^ 1)
            mbarrier.expect(ready.index(slot), BN * BK)
            tma.async_copy_global_to_shared(desc, [rb * BN, kt * BK], ready.index(slot),
                                            ring.index(slot))
            i += 1
    return i


@gluon.jit
def _producer(d1, d2, d3, ring, ready, empty, pid, nprog, BN: gl.constexpr, BK: gl.constexpr,
              DEPTH: gl.constexpr):
    i = 0
    i = _produce_stage(d1, ring, ready, empty, i, pid, nprog, N1, K1, BN, BK, DEPTH)
    i = _produce_stage(d2, ring, ready, empty, i, pid, nprog, N2, K2, BN, BK, DEPTH)
    i = _produce_stage(d3, ring, ready, empty, i, pid, nprog, N3, K3, BN, BK, DEPTH)


@gluon.jit
def _grid_barrier(bar_ptr, target):
    gl.thread_barrier()  # every consumer warp's stores before the release
    gl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    spins = 0
    # capped, so that a grid that is not all resident fails (counters left nonzero) not hangs
    while (gl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu") < target) & (spins < 4000000):
        spins += 1
    gl.thread_barrier()


@constexpr_function
def _pow2(n):
    return triton.next_power_of_2(n)


@gluon.jit
def _stage_input(x_ptr, xs, K: gl.constexpr, BK: gl.constexpr, num_warps: gl.constexpr):
    """The stage's input row (written by other programs before the barrier) into shared
    memory as [K / BK, BK], in one load past L1 (one round trip) and one store."""
    R: gl.constexpr = _pow2(K // BK)
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    r = gl.arange(0, R, layout=gl.SliceLayout(1, lay))
    c = gl.arange(0, BK, layout=gl.SliceLayout(0, lay))
    offs = r[:, None] * BK + c[None, :]
    x = gl.load(x_ptr + offs, mask=offs < K, other=0.0, cache_modifier=".cg")
    xs.slice(0, R).store(x)
    gl.thread_barrier()


@gluon.jit
def _consume_stage(x_ptr, s_ptr, y_ptr, ring, ready, empty, xs, i, pid, nprog,
                   N: gl.constexpr, K: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                   DEPTH: gl.constexpr, num_warps: gl.constexpr):
    w_lay: gl.constexpr = gl.BlockedLayout([1, 16], [2, 16], [num_warps, 1], [1, 0])
    r_lay: gl.constexpr = gl.SliceLayout(1, w_lay)
    _stage_input(x_ptr, xs, K, BK, num_warps)
    for rb in range(pid, N // BN, nprog):
        rows = rb * BN + gl.arange(0, BN, layout=r_lay)
        scale = gl.load(s_ptr + rows)  # issued now, used after the K loop: no stall there
        acc = gl.zeros([BN, BK], gl.float32, layout=w_lay)
        for kt in gl.static_range(K // BK):  # static: a row of xs by a constant slice
            slot = i % DEPTH
            mbarrier.wait(ready.index(slot), (i // DEPTH) & 1)
            if MATH:
                w = ring.index(slot).load(w_lay)
                fence_async_shared()
                mbarrier.arrive(empty.index(slot))
                x = xs.slice(kt, 1).load(w_lay)  # [1, BK]
                acc += w.to(gl.float32) * x.to(gl.float32)
            else:  # the streaming alone: what the ring and the barriers allow
                mbarrier.arrive(empty.index(slot))
            i += 1
        out = gl.sum(acc, axis=1) * scale
        gl.store(y_ptr + rows, out.to(gl.bfloat16))
    return i


@gluon.jit
def _consumer(x0, s1, y1, s2, y2, s3, y3, bar_ptr, ring, ready, empty, xs, pid, nprog,
              BN: gl.constexpr, BK: gl.constexpr, DEPTH: gl.constexpr,
              num_warps: gl.constexpr):
    i = 0
    i = _consume_stage(x0, s1, y1, ring, ready, empty, xs, i, pid, nprog, N1, K1, BN, BK,
                       DEPTH, num_warps)
    _grid_barrier(bar_ptr, nprog)
    i = _consume_stage(y1, s2, y2, ring, ready, empty, xs, i, pid, nprog, N2, K2, BN, BK,
                       DEPTH, num_warps)
    _grid_barrier(bar_ptr, 2 * nprog)
    i = _consume_stage(y2, s3, y3, ring, ready, empty, xs, i, pid, nprog, N3, K3, BN, BK,
                       DEPTH, num_warps)
    gl.thread_barrier()
    if gl.atomic_add(bar_ptr + 1, 1, sem="acq_rel", scope="gpu") == nprog - 1:
        gl.store(bar_ptr, 0)
        gl.store(bar_ptr + 1, 0)


@gluon.jit
def tma_chain_kernel(x0, d1, s1, y1, d2, s2, y2, d3, s3, y3, bar_ptr,
                     BN: gl.constexpr, BK: gl.constexpr, DEPTH: gl.constexpr,
                     num_warps: gl.constexpr):
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    ring = gl.allocate_shared_memory(gl.float8e4nv, [DEPTH, BN, BK], d1.layout)
    ready = gl.allocate_shared_memory(gl.int64, [DEPTH, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [DEPTH, 1], mbarrier.MBarrierLayout())
    xs = gl.allocate_shared_memory(gl.bfloat16, [_pow2(KMAX // BK), BK],
                                   gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    for s in gl.static_range(DEPTH):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    gl.warp_specialize([
        (_consumer, (x0, s1, y1, s2, y2, s3, y3, bar_ptr, ring, ready, empty, xs, pid, nprog,
                     BN, BK, DEPTH, num_warps)),
        (_producer, (d1, d2, d3, ring, ready, empty, pid, nprog, BN, BK, DEPTH)),
    ], [1], [24])


def smem_layout(bn: int, bk: int) -> gl.NVMMASharedLayout:
    """Unswizzled: the consumer reads 16-byte vectors along rows, which no swizzle helps, and
    an unswizzled TMA box may be 256 bytes wide."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)


def compile_only(bn: int, bk: int, depth: int, warps: int, xch: int) -> None:
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    lay = smem_layout(bn, bk)
    desc = f"tensordesc<fp8e4nv[{bn}, {bk}],{lay!r}>"
    sig = {"x0": "*bf16", "d1": desc, "s1": "*fp32", "y1": "*bf16", "d2": desc, "s2": "*fp32",
           "y2": "*bf16", "d3": desc, "s3": "*fp32", "y3": "*bf16", "bar_ptr": "*i32",
           "BN": "constexpr", "BK": "constexpr", "DEPTH": "constexpr",
           "num_warps": "constexpr"}
    consts = {"BN": bn, "BK": bk, "DEPTH": depth, "num_warps": warps}
    names = list(sig)
    # what the JIT infers of torch tensors: 16-byte-aligned pointers
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
             if t.startswith("*")}
    src = GluonASTSource(tma_chain_kernel, sig, consts, attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "maxnreg": 168})
    import subprocess
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                               text=True).stdout
    res = [ln.strip() for ln in usage.splitlines() if "REG" in ln]
    print(f"BN {bn} BK {bk} DEPTH {depth} warps {warps}: shared {k.metadata.shared} B; "
          f"{res[0] if res else usage[-300:]}")
    out = os.environ.get("TMA_CHAIN_DUMP")
    if out:
        for ext in ("ttgir", "ptx"):
            with open(f"{out}.{ext}", "w") as f:
                f.write(k.asm[ext])


def run_on_gpu(variants: list) -> None:
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    sys.path.insert(0, "scripts")
    sys.path.insert(0, ".")
    from bench_kernels import time_graph
    from minisgl.kernels import gemv as G
    out_dir = os.environ.get("OUT", "/tmp/out")
    log = open(f"{out_dir}/tma_chain.txt", "a")

    def say(*a: object) -> None:
        s = " ".join(str(v) for v in a)
        print(s, flush=True)
        log.write(s + "\n")
        log.flush()

    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = tuple((int(n.value), int(k.value)) for n, k in ((N1, K1), (N2, K2), (N3, K3)))
    copies = 3
    mats = [[((torch.randn(n, k, device="cuda") * 0.05).to(torch.float8_e4m3fn),
              torch.rand(n, device="cuda") + 0.5) for (n, k) in shapes] for _ in range(copies)]
    x0 = torch.randn(K1.value, device="cuda", dtype=torch.bfloat16) * 0.1
    ys = [torch.empty(n, device="cuda", dtype=torch.bfloat16) for (n, _) in shapes]
    bar = torch.zeros(2, device="cuda", dtype=torch.int32)
    nbytes = sum(n * k for n, k in shapes)

    def chain(i: int) -> torch.Tensor:
        m = mats[i]
        a = G.gemv(x0, m[0][0], pdl=True, weight_scale=m[0][1])
        b = G.gemv(a, m[1][0], pdl=True, weight_scale=m[1][1])
        return G.gemv(b[:K3.value], m[2][0], pdl=True, weight_scale=m[2][1])

    ref = chain(0).float()
    torch.cuda.synchronize()
    st = itertools.cycle(range(copies))
    us = time_graph(lambda: chain(next(st)), copies, 20)
    say(f"PDL chain (the model's GEMV)      {us:7.2f} us  {nbytes / us / 1e6:5.2f} TB/s")
    for bn, bk, depth, warps in variants:
        lay = smem_layout(bn, bk)
        descs = [[TensorDescriptor.from_tensor(w, [bn, bk], lay) for w, _ in m] for m in mats]

        def run(i: int, bn: int = bn, bk: int = bk, depth: int = depth, warps: int = warps
                ) -> None:
            d, m = descs[i], mats[i]
            tma_chain_kernel[(sms,)](x0, d[0], m[0][1], ys[0], d[1], m[1][1], ys[1], d[2],
                                     m[2][1], ys[2], bar, BN=bn, BK=bk, DEPTH=depth,
                                     num_warps=warps, maxnreg=168,
                                     launch_cooperative_grid=True)
        try:
            run(0)
            torch.cuda.synchronize()
            # ys[1][:K3] is the down input: the chain's b[:K3.value] (gate half, no SiLU: a benchmark)
            diff = (ys[2].float() - ref).abs().max().item()
            scale = ref.abs().max().item()
            st = itertools.cycle(range(copies))
            us = time_graph(lambda: run(next(st)), copies, 20)
            say(f"TMA ring{'' if MATH.value else ' (streaming only)'} BN {bn} BK {bk} DEPTH {depth} "
                f"warps {warps}: {us:7.2f} us  "
                f"{nbytes / us / 1e6:5.2f} TB/s  max |diff| {diff:.3g} of {scale:.3g}  "
                f"counters {bar.tolist()}")
        except Exception as e:  # a variant that does not compile or launch: say so, go on
            say(f"TMA ring BN {bn} BK {bk} DEPTH {depth} warps {warps}: FAIL "
                f"{type(e).__name__}: {str(e)[:400]}")


VARIANTS = [(16, 256, 40, 4), (16, 256, 40, 8), (16, 256, 24, 4), (8, 256, 48, 4),
            (16, 128, 64, 4)]

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args()
    if args.compile_only:
        for bn, bk, depth, warps in VARIANTS:
            try:
                compile_only(bn, bk, depth, warps, 1024)
            except Exception as e:
                import traceback; traceback.print_exc(); print(f"BN {bn} BK {bk} DEPTH {depth} warps {warps}: FAIL "
                      f"{type(e).__name__}: {str(e)[:2000]}")
    else:
        run_on_gpu(VARIANTS)
