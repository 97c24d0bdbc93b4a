"""The product by packed integer weights (AWQ, GPTQ, compressed-tensors W4A16 / W8A16,
repacked at load by layers/packed.py): out = x W^T + b. Up to `DENSE_ROWS` rows W is
dequantized tile by tile in registers, never whole in memory (one row: without tensor cores,
K split over programs); from there (prefill chunks, the largest decode batches) the product is
compute-bound and cuBLAS's on W dequantized once into a scratch [K, N] beats any dequantizing
tile (vLLM's AWQ path chooses the same at 256 rows).

The weight of N outputs and K inputs is held as
- `qweight` [ceil(K / P), N] int32: P = 32 / bits values a word along the inputs, input k of
  output n at bits (k % P) * bits of word [k // P, n] (GPTQ's own layout, whatever the
  checkpoint's);
- `scales` [G, N] float32 and `zeros` [G, N] float16 (whole numbers): group g's factor and zero
  point for each output;
- `g_idx` [K] int32: each input's group (act-order checkpoints permute them; else k // size).
W[n, k] = (q[k, n] - zeros[g_idx[k], n]) * scales[g_idx[k], n], in float32, then rounded to x's
dtype for the tensor-core product (as a dense checkpoint dequantized to that dtype is), which
accumulates in float32. The one-row path multiplies x by (q - zero) unrounded and scales each
group's sum once, as the batch-1 FP8 GEMV does (groups in order: each value read as
1 + q / 2^bits, `_one_row_kernel`). Where K is split over programs, the partial sums add up
in split order, by a second launch or, given the layer's counters (`arrivals`), by the last
program of each output tile: the same bits either way.

Nothing reads a value back to the host, so decode CUDA graphs capture it. This module imports
triton: only GPU paths (and the CPU interpreter tests) import it.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from minisgl.kernels.dot import dot, f32_dot, swizzled_tile


class IntTiles(NamedTuple):
    """The packed product's tiling. `block_m` < 16: the one-row path (no tensor cores: a
    decode step of one token is pure weight streaming); `split_k` > 1: programs split K too,
    each writing a float32 partial that a second kernel sums in a fixed order (deterministic),
    for products whose outputs alone give too few programs to stream the weight."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    swap: bool = False  # with tensor cores: out^T = W x^T (the kernel's SWAP)


# Rows from which the product is cuBLAS's on W dequantized into a scratch (module doc).
DENSE_ROWS = 256
# Programs a tensor-core product wants in flight, K split (at most 4 ways) to reach them:
# Llama-3.1-8B's projections at 4 bits, groups of 128, 137 rows on an H100: QKV, o and down
# best at 4 splits (192 to 384 programs), gate/up at 2 (896: 203.4 us against 227.1 at 4);
# at 16 rows gate/up's 2 splits cost 2% (RESULTS.md, thirty-sixth session).
_PROGRAMS = 1024


def int_tiles(m: int, n: int, k: int, group_size: int = 0) -> IntTiles:
    """Tiles by the batch's rows: one row takes the no-tensor-core path (32 columns, 128
    inputs, one warp, K split into runs of at least 512 inputs, at most 16: an H100's best at
    every projection of Llama-3.1-8B's shape; RESULTS.md, thirty-sixth session); a decode
    batch of a few rows wastes little of a 16-row tile; K tiles no wider than a run of
    `group_size` inputs a group (int_mm's), so that each reads one row of scales; with
    tensor cores K is split where the outputs give fewer than `_PROGRAMS` programs."""
    if m == 1:
        tiles = IntTiles(1, 32, 128, 1, 2)
        if group_size >= 16 and not group_size & (group_size - 1):
            tiles = tiles._replace(block_k=min(tiles.block_k, group_size))
        return tiles._replace(split_k=max(1, min(16, triton.cdiv(k, 512))))
    else:
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
        tiles = IntTiles(block_m, 64 if m <= 64 else 128, 64, 4 if block_m <= 64 else 8, 3)
        most = 4
    if group_size >= 16 and not group_size & (group_size - 1):
        tiles = tiles._replace(block_k=min(tiles.block_k, group_size))
    programs = triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n)
    split = min(most, _PROGRAMS // programs, triton.cdiv(k, 2 * tiles.block_k))
    return tiles._replace(split_k=max(1, split))


@triton.jit
def packed_values(q_ptr, k0, word_rows, cols, col_ok, stride_qk, BITS: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Inputs [k0, k0 + BLOCK_K) of columns `cols` as [BLOCK_K, BLOCK_N] integers, from the
    BLOCK_K / P words that hold them (k0 and BLOCK_K multiples of P = 32 / BITS; words past
    `word_rows` read as zeros): each word is loaded once and shifted P ways."""
    PER_WORD: tl.constexpr = 32 // BITS
    at = k0 // PER_WORD + tl.arange(0, BLOCK_K // PER_WORD)
    words = tl.load(q_ptr + at.to(tl.int64)[:, None] * stride_qk + cols[None, :],
                    mask=(at < word_rows)[:, None] & col_ok[None, :], other=0,
                    eviction_policy="evict_first")
    shifts = tl.arange(0, PER_WORD) * BITS
    q = (words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)
    return tl.reshape(q, (BLOCK_K, BLOCK_N))


@triton.jit
def centred(q, z):
    """q - z in float32 (exact: both whole numbers below 2^8) for integers q and float32 zero
    points z: q's bits put in the mantissa of 2^23 (an OR, where an int-to-float conversion
    runs at a quarter of the ALU's rate on Hopper) and 2^23 + z subtracted."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - (z + 8388608.0)


@triton.jit
def group_params(s_ptr, z_ptr, g_ptr, k0, k, cols, col_ok, stride_sg, BLOCK_K: tl.constexpr,
                 GROUP: tl.constexpr):
    """Scales and zero points (float32) of inputs [k0, k0 + BLOCK_K): GROUP > 0 (inputs in
    runs of GROUP a group, GROUP a multiple of BLOCK_K): the tile's one group, [1, BLOCK_N];
    GROUP 0: each input's group read from g_idx, [BLOCK_K, BLOCK_N] (zero past k)."""
    if GROUP > 0:
        at = (k0 // GROUP) * stride_sg + cols[None, :]
        mask = col_ok[None, :]
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        groups = tl.load(g_ptr + kk, mask=kk < k, other=0).to(tl.int64)
        at = groups[:, None] * stride_sg + cols[None, :]
        mask = (kk < k)[:, None] & col_ok[None, :]
    s = tl.load(s_ptr + at, mask=mask, other=0.0)
    z = tl.load(z_ptr + at, mask=mask, other=0.0).to(tl.float32)
    return s, z


@triton.jit
def _rows_product(a, q, s, z, GROUP: tl.constexpr):
    """a [BLOCK_M, BLOCK_K] (float32) times the tile's dequantized weights, without tensor
    cores. One group a tile: s * (a (q - z)), the products scaled once per column (as the
    batch-1 FP8 GEMV scales its sums), not each weight."""
    if GROUP > 0:
        return s * tl.sum(a[:, :, None] * centred(q, z)[None, :, :], axis=1)
    else:
        return tl.sum(a[:, :, None] * (centred(q, z) * s)[None, :, :], axis=1)


@triton.jit
def _top_placed(words, BITS: tl.constexpr):
    """Words [BLOCK_W, 1, BLOCK_N] (uint32) -> [BLOCK_W, P, BLOCK_N] float32 1 + q / 2^BITS
    for each of their P values q: the value rotated into the top of the mantissa and 1.0's
    exponent put beside it (one shift and one LOP3 a value, where extracting q and converting
    it takes four)."""
    PER_WORD: tl.constexpr = 32 // BITS
    TOP: tl.constexpr = 23 - BITS
    MASK: tl.constexpr = ((1 << BITS) - 1) << TOP
    j = tl.arange(0, PER_WORD)
    left = ((TOP - BITS * j + 32) % 32).to(tl.uint32)[None, :, None]
    right = ((32 - left) % 32).to(tl.uint32)
    placed = (words << left) | (words >> right)
    return ((placed & MASK) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _bias_row(bias_ptr, cols, col_ok, HAS_BIAS: tl.constexpr):
    """The bias of columns `cols` in float32 (zeros without HAS_BIAS)."""
    bias = tl.zeros_like(cols).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    return bias


@triton.jit
def _last_sums(parts_ptr, offs, mask, split_size, counter_ptr, bias, out_ptrs):
    """For every program of a product with K split over program_id(1), once it has stored
    its float32 partial at parts_ptr + split * split_size + offs: the program that counts
    itself last at `counter_ptr` (and resets it to 0 for the next launch) sums the partials
    in split order, so that the result does not depend on which finished last, adds `bias`
    (float32, broadcast) and stores at `out_ptrs`."""
    # Every thread's partial is stored before the count is published (release); the last
    # program's reads follow its count (acquire).
    tl.debug_barrier()
    splits = tl.num_programs(1)
    if tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == splits - 1:
        tl.store(counter_ptr, 0)
        total = tl.load(parts_ptr + offs, mask=mask, other=0.0)
        for sp in range(1, splits):
            total += tl.load(parts_ptr + sp * split_size + offs, mask=mask, other=0.0)
        total += bias
        tl.store(out_ptrs, total.to(out_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _one_row_kernel(x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, parts_ptr, out_ptr, arrivals_ptr,
                    n, k, k_split, stride_xm, stride_qk, stride_sg, stride_om,
                    BITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP: tl.constexpr, LAST_SUMS: tl.constexpr):
    """Row r, columns [c BLOCK_N, (c + 1) BLOCK_N) of x W^T over inputs [s k_split, (s + 1)
    k_split), for program_id(0) = r * column blocks + c and split s = program_id(1); groups
    in runs of GROUP (a multiple of BLOCK_K: each K tile one group). Each value is read as
    f = 1 + q / 2^BITS (`_top_placed`), so that a tile's sum is
    sum x (q - z) = 2^BITS sum x f - (2^BITS + z) sum x, the zero point out of the loop
    (float32 keeps 2^-24 of sum |x| f: ~4 bits fewer than multiplying by q - z, far below
    a 16-bit output's rounding). One split: out, plus the bias. Several: the split's float32
    partial at parts[s, r]; with LAST_SUMS the last program of the row's column block to
    count itself in `arrivals` (which it resets to 0) sums the partials in split order, so
    that the result does not depend on which finished last; without, `_sum_splits_kernel`
    does, a launch later."""
    PER_WORD: tl.constexpr = 32 // BITS
    BLOCK_W: tl.constexpr = BLOCK_K // PER_WORD
    blocks = tl.cdiv(n, BLOCK_N)
    row = tl.program_id(0) // blocks
    cols = (tl.program_id(0) % blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    k_lo = tl.program_id(1) * k_split
    k_hi = tl.minimum(k, k_lo + k_split)
    word_rows = tl.cdiv(k, PER_WORD)
    j = tl.arange(0, PER_WORD)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        at = k0 // PER_WORD + tl.arange(0, BLOCK_W)
        # A 3-D load, so that each thread holds adjacent columns' words (one vector load)
        # and reuses each input of x across them.
        words = tl.load(q_ptr + at.to(tl.int64)[:, None, None] * stride_qk
                        + cols[None, None, :],
                        mask=(at < word_rows)[:, None, None] & col_ok[None, None, :], other=0,
                        eviction_policy="evict_first").to(tl.uint32, bitcast=True)
        kk = k0 + tl.arange(0, BLOCK_W)[:, None] * PER_WORD + j[None, :]
        x = tl.load(x_ptr + row * stride_xm + kk, mask=kk < k, other=0.0).to(tl.float32)
        t = tl.sum(tl.sum(x[:, :, None] * _top_placed(words, BITS), axis=1), axis=0)
        sx = tl.sum(tl.sum(x, axis=1), axis=0)
        g = k0 // GROUP
        s = tl.load(s_ptr + g * stride_sg + cols, mask=col_ok, other=0.0)
        z = tl.load(z_ptr + g * stride_sg + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc += s * ((1 << BITS) * t - ((1 << BITS) + z) * sx)
    bias = _bias_row(bias_ptr, cols, col_ok, HAS_BIAS)
    if tl.num_programs(1) == 1:
        tl.store(out_ptr + row * stride_om + cols, (acc + bias).to(out_ptr.dtype.element_ty),
                 mask=col_ok)
    else:
        split_size = tl.num_programs(0) // blocks * n
        offs = row * n + cols
        tl.store(parts_ptr + tl.program_id(1) * split_size + offs, acc, mask=col_ok)
        if LAST_SUMS:
            _last_sums(parts_ptr, offs, col_ok, split_size, arrivals_ptr + tl.program_id(0),
                       bias, out_ptr + row * stride_om + cols)


@triton.jit
def _operands(x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, rows, row_ok, cols, col_ok, k0, k, stride_xm,
              stride_qk, stride_sg, BITS: tl.constexpr, BLOCK_K: tl.constexpr,
              BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    """K tile k0's operands: x's [BLOCK_M, BLOCK_K], the weights' integers [BLOCK_K, BLOCK_N]
    and their scales and zero points (group_params)."""
    kk = k0 + tl.arange(0, BLOCK_K)
    a = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + kk[None, :],
                mask=row_ok[:, None] & (kk < k)[None, :], other=0.0)
    q = packed_values(q_ptr, k0, tl.cdiv(k, 32 // BITS), cols, col_ok, stride_qk, BITS,
                      BLOCK_K, BLOCK_N)
    s, z = group_params(s_ptr, z_ptr, g_ptr, k0, k, cols, col_ok, stride_sg, BLOCK_K, GROUP)
    return a, q, s, z


@triton.jit
def _int_mm_kernel(x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, bias_ptr, out_ptr, final_ptr,
                   arrivals_ptr, m, n, k, k_split, stride_xm, stride_qk, stride_sg, stride_om,
                   stride_os, BITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                   F32_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP: tl.constexpr, SWAP: tl.constexpr,
                   SWIZZLE: tl.constexpr, LAST_SUMS: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of out over inputs [s k_split, (s + 1) k_split) for split
    s = program_id(1) (into out + s stride_os; several splits: float32 partials, which with
    LAST_SUMS the tile's last program sums into final_ptr): each K tile's weights unpacked
    from their words, dequantized by their group's scale and zero point (rounded to x's dtype
    for the tensor cores), and multiplied. SWAP (tensor cores): out^T = W x^T, the dequantized tile
    the product's first operand, which Hopper's MMA may take from registers (the second
    comes through shared memory), x's the second."""
    pid_m, pid_n = swizzled_tile(tl.program_id(0), m, n, BLOCK_M, BLOCK_N, SWIZZLE)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < m
    col_ok = cols < n
    k_lo = tl.program_id(1) * k_split
    k_hi = tl.minimum(k, k_lo + k_split)
    if SWAP:
        acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            a, q, s, z = _operands(x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, rows, row_ok, cols,
                                   col_ok, k0, k, stride_xm, stride_qk, stride_sg, BITS,
                                   BLOCK_K, BLOCK_N, GROUP)
            w = (centred(q, z) * s).to(a.dtype)
            acc_t += dot(tl.trans(w), tl.trans(a), F32_DOT)
        acc = tl.trans(acc_t)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            a, q, s, z = _operands(x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, rows, row_ok, cols,
                                   col_ok, k0, k, stride_xm, stride_qk, stride_sg, BITS,
                                   BLOCK_K, BLOCK_N, GROUP)
            if BLOCK_M >= 16:
                acc += dot(a, (centred(q, z) * s).to(a.dtype), F32_DOT)
            else:
                acc += _rows_product(a.to(tl.float32), q, s, z, GROUP)
    bias = _bias_row(bias_ptr, cols, col_ok, HAS_BIAS)[None, :]
    if tl.num_programs(1) == 1:
        acc += bias
    offs = rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    tl.store(out_ptr + tl.program_id(1) * stride_os + offs,
             acc.to(out_ptr.dtype.element_ty), mask=mask)
    if LAST_SUMS:  # out_ptr holds the partials, final_ptr the result (dense [m, n])
        _last_sums(out_ptr, offs, mask, stride_os, arrivals_ptr + tl.program_id(0), bias,
                   final_ptr + offs)


@triton.jit
def _dequantize_kernel(q_ptr, s_ptr, z_ptr, g_ptr, w_ptr, n, k, stride_qk, stride_sg,
                       BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP: tl.constexpr):
    """Inputs [k0, k0 + BLOCK_K) x columns [n0, n0 + BLOCK_N) of W^T [K, N] (row-major, in
    w's dtype), for k0 = program_id(0) BLOCK_K, n0 = program_id(1) BLOCK_N."""
    k0 = tl.program_id(0) * BLOCK_K
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    kk = k0 + tl.arange(0, BLOCK_K)
    q = packed_values(q_ptr, k0, tl.cdiv(k, 32 // BITS), cols, col_ok, stride_qk, BITS, BLOCK_K,
                      BLOCK_N)
    s, z = group_params(s_ptr, z_ptr, g_ptr, k0, k, cols, col_ok, stride_sg, BLOCK_K, GROUP)
    w = (centred(q, z) * s).to(w_ptr.dtype.element_ty)
    tl.store(w_ptr + kk.to(tl.int64)[:, None] * n + cols[None, :], w,
             mask=(kk < k)[:, None] & col_ok[None, :])


@triton.jit
def _sum_splits_kernel(parts_ptr, bias_ptr, out_ptr, size, n, splits, HAS_BIAS: tl.constexpr,
                       BLOCK: tl.constexpr):
    """out = the sum of the `splits` float32 partials [splits, size] in order, + bias."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < size
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(splits):
        acc += tl.load(parts_ptr + s * size + i, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + i % n, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=ok)


def check_packed(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor, g_idx: torch.Tensor, bits: int,
                 experts: Optional[int] = None) -> None:
    """ValueError naming the shapes unless x [M, K] (dense rows) and the packed operands fit
    together (see the module's docstring; `experts`: each with a leading [E] of them)."""
    k = x.shape[1]
    lead = () if experts is None else (experts,)
    n, groups = qweight.shape[-1], scales.shape[-2]
    words = -(-k // (32 // bits)) if bits in (4, 8) else -1
    shapes = [tuple(t.shape) for t in (qweight, scales, zeros, g_idx)]
    want = [(*lead, words, n), (*lead, groups, n), (*lead, groups, n), (*lead, k)]
    dense = all(t.is_contiguous() for t in (qweight, scales, zeros, g_idx))
    if shapes != want or qweight.dtype != torch.int32 or x.stride(1) != 1 or not dense:
        raise ValueError(f"x {tuple(x.shape)} (strides {x.stride()}) by {bits}-bit packed "
                         f"weights wants dense qweight (int32), scales, zeros, g_idx of shapes "
                         f"{want}; got {qweight.dtype} {shapes}")


def kernel_group(group_size: int, block_k: int) -> int:
    """The kernels' GROUP (group_params) for a caller's `group_size` (g_idx[i] == i //
    group_size for every input; 0: unknown) and K tile: the run itself where whole tiles fit
    in it, else 0 (each input's group read from g_idx)."""
    return group_size if group_size and group_size % block_k == 0 else 0


def dequantized(x_dtype: torch.dtype, qweight: torch.Tensor, scales: torch.Tensor,
                zeros: torch.Tensor, g_idx: torch.Tensor, bits: int, group_size: int = 0
                ) -> torch.Tensor:
    """W^T [K, N] in `x_dtype`, dequantized as the tensor-core path does (operands as
    `int_mm`'s, not checked here)."""
    k, n = g_idx.shape[0], qweight.shape[1]
    w = torch.empty((k, n), dtype=x_dtype, device=qweight.device)
    block_k = 64
    _dequantize_kernel[(triton.cdiv(k, block_k), triton.cdiv(n, 128))](
        qweight, scales, zeros, g_idx, w, n, k, qweight.stride(0), scales.stride(0), BITS=bits,
        BLOCK_N=128, BLOCK_K=block_k, GROUP=kernel_group(group_size, block_k), num_warps=4)
    return w


def _dense_product(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                   zeros: torch.Tensor, g_idx: torch.Tensor, bits: int,
                   bias: Optional[torch.Tensor], group_size: int) -> torch.Tensor:
    """x W^T + b by cuBLAS on W dequantized into a scratch (freed on return)."""
    w = dequantized(x.dtype, qweight, scales, zeros, g_idx, bits, group_size)
    if bias is None:
        return x @ w
    return torch.addmm(bias.to(x.dtype), x, w)


def arrival_slots(n: int) -> int:
    """The counters a layer of N outputs gives `int_mm` (`arrivals`): one a 16-column block,
    which covers the tiles of every split product `int_tiles` chooses (at one row 32 columns a
    program; with tensor cores at most two row tiles of 128 columns below DENSE_ROWS)."""
    return triton.cdiv(n, 16)


def sums_in_last_program(tiles: IntTiles, splits: int, counters: int, output_tiles: int
                         ) -> bool:
    """Whether the last program of each output tile sums the K splits (else a second launch
    does): where K is split, there is a counter for each output tile, and the tiles have at
    most 64 rows. At 128-row tiles the sum in the product's kernel costs 25-35% a projection
    (Llama-3.1-8B's shape at 137 and 200 rows, H100: gate/up 278.7 us against 206.7; offline
    AWQ 7,255 output tok/s without it, 6,688 with; at 64 rows it saves 1-4%; RESULTS.md,
    thirty-seventh session)."""
    return splits > 1 and counters >= output_tiles and tiles.block_m <= 64


def check_arrivals(arrivals: torch.Tensor) -> None:
    """ValueError unless `arrivals` is a dense int32 tensor (int_mm's counters)."""
    if arrivals.dtype != torch.int32 or not arrivals.is_contiguous():
        raise ValueError(f"int_mm's arrivals are dense int32 counters; got {arrivals.dtype} "
                         f"{tuple(arrivals.shape)} (strides {arrivals.stride()})")


def int_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
           g_idx: torch.Tensor, bits: int, bias: Optional[torch.Tensor] = None,
           tiles: Optional[IntTiles] = None, group_size: int = 0,
           arrivals: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] times the packed weight (see the module's docstring) transposed, plus bias:
    [M, N] in x's dtype; from DENSE_ROWS rows (unless `tiles` are given) cuBLAS's product on
    the dequantized W (module doc). `group_size`: the caller's word that g_idx[i] == i //
    group_size for every input (layers/packed.group_run; 0: not known, g_idx is read per
    input). `arrivals`: int32 zeros (`arrival_slots(N)` of them), the caller's own while the
    product runs (a layer's: no other launch uses them at the same time): where K is split
    and there is a counter for each output tile, the last program of each tile sums the
    splits, with no second launch (~3 us a product on an H100), and leaves them zeros; the
    sum is in split order either way, so the bits do not change. ValueError naming the
    shapes where the parts do not fit."""
    m, k = x.shape
    n = qweight.shape[1]
    check_packed(x, qweight, scales, zeros, g_idx, bits)
    if tiles is None and m >= DENSE_ROWS:
        return _dense_product(x, qweight, scales, zeros, g_idx, bits, bias, group_size)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    tiles = tiles or int_tiles(m, n, k, group_size)
    per_word = 32 // bits
    if tiles.block_k % per_word:
        raise ValueError(f"{bits}-bit words hold {per_word} inputs: a K tile of "
                         f"{tiles.block_k} is not a whole number of words")
    k_split = triton.cdiv(triton.cdiv(k, tiles.split_k), tiles.block_k) * tiles.block_k
    splits = triton.cdiv(k, k_split)
    parts = out if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32,
                                                device=x.device)
    grid = (triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n), splits)
    group = kernel_group(group_size, tiles.block_k)
    if arrivals is not None:
        check_arrivals(arrivals)
    last_sums = arrivals is not None and sums_in_last_program(tiles, splits, arrivals.numel(),
                                                              grid[0])
    counters = arrivals if last_sums else None
    bias_arg = bias if bias is not None else scales
    counters_arg = counters if counters is not None else scales
    if tiles.block_m == 1 and group > 0:
        _one_row_kernel[grid](
            x, qweight, scales, zeros, bias_arg, parts, out, counters_arg, n, k, k_split,
            x.stride(0), qweight.stride(0), scales.stride(0), n, BITS=bits,
            HAS_BIAS=bias is not None, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
            GROUP=group, LAST_SUMS=last_sums, num_warps=tiles.num_warps,
            num_stages=tiles.num_stages)
    else:
        _int_mm_kernel[grid](
            x, qweight, scales, zeros, g_idx, bias_arg, parts, out, counters_arg, m, n, k,
            k_split, x.stride(0), qweight.stride(0), scales.stride(0), n, m * n, BITS=bits,
            HAS_BIAS=bias is not None, F32_DOT=f32_dot(x), BLOCK_M=tiles.block_m,
            BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP=group,
            SWAP=tiles.swap and tiles.block_m >= 16, SWIZZLE=8, LAST_SUMS=last_sums,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    if splits > 1 and not last_sums:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](
            parts, bias if bias is not None else parts, out, m * n, n, splits,
            HAS_BIAS=bias is not None, BLOCK=block)
    return out
