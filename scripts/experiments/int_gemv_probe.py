"""Throwaway probe (thirty-sixth session): one-row packed 4-bit products at Llama-3.1-8B's
shapes. v2 (a 3-D tile, each value placed at the top of the mantissa by one shift, zero points
out of the loop) won and is now the tree's `int_mm._one_row_kernel`, timed here through
`int_mm` at each of VARIANTS' tiles, with the split-sum kernel and with the layer's counters
(`arrivals`: the last program sums); v3, kept below, is the same value by value with one FFMA
each, which lost. Prints us per product (weights rotated through > 256 MB, CUDA graph)."""
import torch, triton, triton.language as tl
from minisgl.kernels import int_mm as im


@triton.jit
def _v3(x_ptr, q_ptr, s_ptr, z_ptr, out_ptr, n, k, k_split, stride_qk, stride_sg, stride_os,
        BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    PER_WORD: tl.constexpr = 32 // BITS
    BLOCK_W: tl.constexpr = BLOCK_K // PER_WORD
    TOP: tl.constexpr = 23 - BITS
    MASK: tl.constexpr = ((1 << BITS) - 1) << TOP
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    k_lo = tl.program_id(1) * k_split
    k_hi = tl.minimum(k, k_lo + k_split)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        at = k0 // PER_WORD + tl.arange(0, BLOCK_W)
        w = tl.load(q_ptr + at.to(tl.int64)[:, None] * stride_qk + cols[None, :],
                    mask=col_ok[None, :], other=0,
                    eviction_policy="evict_first").to(tl.uint32, bitcast=True)
        part = tl.zeros([BLOCK_W, BLOCK_N], dtype=tl.float32)
        sx = tl.zeros([BLOCK_W], dtype=tl.float32)
        for j in tl.static_range(PER_WORD):
            xj = tl.load(x_ptr + k0 + tl.arange(0, BLOCK_W) * PER_WORD + j).to(tl.float32)
            if TOP >= BITS * j:
                placed = w << (TOP - BITS * j)
            else:
                placed = w >> (BITS * j - TOP)
            f = ((placed & MASK) | 0x3F800000).to(tl.float32, bitcast=True)
            part += xj[:, None] * f
            sx += xj
        t = tl.sum(part, axis=0)
        sxs = tl.sum(sx, axis=0)
        g = k0 // GROUP
        s = tl.load(s_ptr + g * stride_sg + cols, mask=col_ok, other=0.0)
        z = tl.load(z_ptr + g * stride_sg + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc += s * ((1 << BITS) * t - ((1 << BITS) + z) * sxs)
    tl.store(out_ptr + tl.program_id(1) * stride_os + cols, acc, mask=col_ok)


def run_v3(x, w, split, bn, bk, warps, stages, parts, out):
    """_v3 over K split `split` ways, its partials summed by int_mm's second kernel."""
    q, s, z = w
    k, n = x.shape[1], q.shape[1]
    k_split = triton.cdiv(triton.cdiv(k, split), bk) * bk
    splits = triton.cdiv(k, k_split)
    _v3[(triton.cdiv(n, bn), splits)](x, q, s, z, parts, n, k, k_split, q.stride(0),
                                      s.stride(0), n, BITS=4, BLOCK_N=bn, BLOCK_K=bk,
                                      GROUP=128, num_warps=warps, num_stages=stages)
    im._sum_splits_kernel[(triton.cdiv(n, 1024),)](parts, parts, out, n, n, splits,
                                                   HAS_BIAS=False, BLOCK=1024)
    return out


def timed(fn, copies, reps=3):
    g = torch.cuda.CUDAGraph()
    fn(0)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        for i in range(copies):
            fn(i)
    g.replay(); torch.cuda.synchronize()
    best = None
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); torch.cuda.synchronize()
        us = a.elapsed_time(b) * 1000 / copies
        best = us if best is None else min(best, us)
    return best


VARIANTS = [(32, 128, 1, 8, 2), (32, 128, 1, 16, 2), (32, 128, 1, 4, 2), (32, 64, 1, 8, 2),
            (32, 64, 1, 16, 3), (32, 128, 1, 12, 2), (32, 128, 1, 8, 3), (32, 128, 1, 8, 4),
            (16, 128, 1, 8, 2), (32, 128, 2, 8, 2), (64, 128, 1, 8, 2), (32, 64, 2, 16, 2)]


def main():
    torch.manual_seed(0)
    dev = "cuda"
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    for name, (n, k) in shapes.items():
        nbytes = n * k // 2
        copies = max(2, (256 << 20) // nbytes)
        ws = [(torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32, device=dev),
               torch.rand(k // 128, n, device=dev) * 0.01,
               torch.randint(0, 16, (k // 128, n), device=dev).half()) for _ in range(copies)]
        g_idx = torch.arange(k, device=dev, dtype=torch.int32) // 128
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        ref = im.int_mm(x, *ws[0], g_idx, 4, group_size=128).float()
        res = {"int_mm": timed(lambda i: im.int_mm(x, *ws[i], g_idx, 4, group_size=128), copies)}
        arrivals = torch.zeros(im.arrival_slots(n), dtype=torch.int32, device=dev)
        for bn, bk, warps, split, stages in VARIANTS:
            tiles = im.IntTiles(1, bn, bk, warps, stages, split)
            tag = f"n{bn}k{bk}w{warps}x{split}s{stages}"
            for counted, label in ((None, "v2_"), (arrivals, "v2_last_")):
                fn = lambda i, t=tiles, c=counted: im.int_mm(x, *ws[i], g_idx, 4, tiles=t,
                                                             group_size=128, arrivals=c)
                res[label + tag] = timed(fn, copies)
        out = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
        bn, bk, warps, split, stages = VARIANTS[0]
        parts = torch.empty(split, n, device=dev, dtype=torch.float32)
        got = run_v3(x, ws[0], split, bn, bk, warps, stages, parts, out).float()
        if (got - ref).abs().max().item() > 2e-2 * ref.abs().max().item():
            print(f"  {name} v3: wrong")
        res["v3_" + f"n{bn}k{bk}w{warps}x{split}s{stages}"] = timed(
            lambda i: run_v3(x, ws[i], split, bn, bk, warps, stages, parts, out), copies)
        base = res["int_mm"]
        print(f"{name} ({n}x{k}, {nbytes / 1e6:.1f} MB): " + ", ".join(
            f"{k_}={v:.2f}" for k_, v in sorted(res.items(), key=lambda kv: kv[1]))
              + f" | int_mm {base:.2f} us, roofline-ish {nbytes / 3.0e6:.2f}", flush=True)


if __name__ == "__main__":
    main()
