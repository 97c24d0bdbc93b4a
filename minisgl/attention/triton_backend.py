"""Attention over the paged KV with Triton kernels (the fast path on GPUs).

`prepare` turns the batch's lengths into int32 device tensors with one host-to-device copy per
batch (shared by every layer); `forward` stores the new K/V with `index_copy_` and launches the
decode kernels (flash-decoding, GQA-grouped) for a DECODE batch or the causal extend kernel for a
PREFILL batch. The kernels read K/V slot by slot through the page table, so any page size works.
An FP8 pool's layer scales are host constants handed to every launch (graph capture records
them: no device reads, no host syncs).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from minisgl.attention.base import AttentionBackend
from minisgl.core import Batch, Phase
from minisgl.kernels.attention import (decode_attention, extend_attention, extend_tiles,
                                      store_kv)
from minisgl.kernels.policy import KernelPolicy
from minisgl.kernels.types import KVTarget
from minisgl.kvcache import KVPool
from minisgl.utils import rows_to_device


@dataclass(frozen=True)
class TritonMeta:
    """Per-batch kernel inputs; the int32 tensors are [batch] and live on the pool's device."""

    decode: bool
    rows: torch.Tensor  # page-table row of each request
    prefix_lens: torch.Tensor  # tokens already in the pool before this batch
    extend_lens: torch.Tensor  # new tokens of this batch
    seq_lens: torch.Tensor  # prefix + new
    q_starts: torch.Tensor  # first row of each request's tokens in q
    max_extend: int
    o_part: Optional[torch.Tensor]  # decode scratch [batch, heads, splits, d] float32
    lse_part: Optional[torch.Tensor]  # decode scratch [batch, heads, splits] float32
    # Keyword-only from here: a field added above them once shifted `dense` into `arrivals`
    # positionally, which silently turned the dense prefill off (twenty-fifth session).
    _: KW_ONLY
    # The split merge's counters, int32 [batch, kv_heads], zero between launches (split only)
    arrivals: Optional[torch.Tensor] = None
    dense: bool = False  # one fresh prompt: torch's fused attention (TritonBackend.dense_prefill)
    # A mixed step (Batch.num_decode): this metadata is the prefill requests', whose tokens are
    # q's first `decode_from` rows; the decode rows after them run the decode kernel over
    # `decode_part` (the extend kernel would read K/V once per query head, not per KV head).
    decode_part: Optional["TritonMeta"] = None
    decode_from: int = 0


class TritonBackend(AttentionBackend):
    """Paged attention with Triton kernels; also implements the decode CUDA-graph protocol of
    engine/cuda_graph.py (metadata viewing the graph's static input buffers)."""

    # Flash-decoding split policy, from kernel times under graph replay (scripts/bench_kernels.py
    # --what decode): a small batch leaves most SMs idle unless each request's context is split
    # into chunks of at least 64 tokens; from batch 64 up the batch alone fills the device, and
    # unsplit is fastest.
    min_split_tokens: int = 64
    max_splits: int = 32
    # A prefill of one fresh prompt (no cached prefix) of at least this many tokens, the
    # time-to-first-token case, runs torch's fused causal attention (FlashAttention / cuDNN) on
    # its K/V gathered from the pool: on an H200 that beats the paged extend kernel from about
    # 1,024 tokens (bench_kernels.py --what extend --extend-prompts; benchmarks/RESULTS.md).
    dense_prefill_tokens: int = 1024

    def __init__(self, pool: KVPool, page_table: torch.Tensor, num_heads: int,
                 num_kv_heads: int, head_dim: int, scale: float,
                 policy: KernelPolicy = KernelPolicy(), windows: Sequence[int] = (),
                 softcap: float = 0.0) -> None:
        """`policy.pdl`: the decode kernels (K/V store, attention) use programmatic dependent
        launch (kernels/pdl.py); the caller checks the device supports it. `windows`,
        `softcap`: as for AttentionBackend."""
        super().__init__(pool, page_table, num_heads, num_kv_heads, head_dim, scale, windows,
                         softcap)
        self.policy = policy
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads "
                             f"{num_kv_heads}")
        self.device = page_table.device
        # Read once: the decode split count aims to fill the GPU's multiprocessors.
        self.num_sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                        if self.device.type == "cuda" else 8)
        # Batch-invariant steps may size the extend kernel's query blocks by the chunk where a
        # token's bits were measured not to depend on them: sm_90 (see _invariant).
        self._sm90 = (self.device.type == "cuda"
                      and torch.cuda.get_device_capability(self.device)[0] == 9)

    def num_splits(self, batch_size: int, max_seq_len: int) -> int:
        """KV splits per (request, KV head): about two waves of programs, none too short."""
        programs = max(1, batch_size * self.num_kv_heads)
        want = -(-2 * self.num_sms // programs)
        by_len = -(-max_seq_len // self.min_split_tokens)
        return max(1, min(want, by_len, self.max_splits))

    def prepare(self, batch: Batch) -> None:
        rows = [r.table_row for r in batch.reqs]
        starts: List[int] = []
        start = 0
        for ext in batch.extend_lens:
            starts.append(start)
            start += ext
        seq_lens = batch.seq_lens
        first = batch.first_decode
        decode = batch.phase is Phase.DECODE
        if batch.phase is Phase.VERIFY:
            batch.attn_meta = self.verify_meta(batch)
            return
        invariant = self.policy.batch_invariant
        if not decode and batch.num_decode and not invariant:  # a mixed step: its two parts
            n, d = max(first, batch.num_decode), batch.num_decode
            pad = lambda xs: [*xs, *[0] * (n - len(xs))]  # noqa: E731 (one copy: equal rows)
            dev = rows_to_device([pad(rows[:first]), pad(batch.prefix_lens[:first]),
                                  pad(batch.extend_lens[:first]), pad(seq_lens[:first]),
                                  pad(starts[:first]), pad(rows[first:]), pad(seq_lens[first:])],
                                 torch.int32, self.device)
            # Unsplit, as large decode graphs run: the kernel variants the capture compiled (an
            # eager split count per step made new ones compile mid-serving; RESULTS.md,
            # fourteenth session, command 8).
            part = self._decode_meta(dev[5, :d], dev[6, :d], max(seq_lens[first:]), splits=1)
            batch.attn_meta = TritonMeta(False, dev[0, :first], dev[1, :first], dev[2, :first],
                                         dev[3, :first], dev[4, :first],
                                         max(batch.extend_lens[:first]), None, None,
                                         decode_part=part, decode_from=starts[first])
            return
        # One copy for the whole batch, each row 16-byte aligned (see utils.rows_to_device).
        dev = rows_to_device([rows, batch.prefix_lens, batch.extend_lens, seq_lens, starts],
                             torch.int32, self.device)
        if decode:
            batch.attn_meta = self._decode_meta(dev[0], dev[3], max(seq_lens, default=1),
                                                dev[1], dev[2], dev[4])
            return
        # Torch's causal kernel has no window and no softcap: a prompt longer than some
        # layer's window, or any of a softcapped model, runs paged.
        dense = (not invariant and batch.size == 1 and batch.prefix_lens[0] == 0
                 and not self.softcap
                 and self.dense_prefill_tokens <= batch.extend_lens[0]
                 <= min((w for w in self.windows if w), default=batch.extend_lens[0])
                 and self.device.type == "cuda")
        batch.attn_meta = TritonMeta(False, dev[0], dev[1], dev[2], dev[3], dev[4],
                                     max(batch.extend_lens, default=0), None, None, dense=dense)

    def verify_meta(self, batch: Batch) -> TritonMeta:
        """A verify batch as decode rows: request i's j-th new token is one row over its
        page-table row whose sequence ends at that token (prefix + j + 1 keys, the new tokens'
        K/V stored first), so the decode kernels attend it causally, one K/V read per KV head
        (the extend kernel reads K/V once per query head) and split over the context as a
        decode step's (a batch-1 verify otherwise leaves most multiprocessors idle)."""
        rows = [r.table_row for r, n in zip(batch.reqs, batch.extend_lens) for _ in range(n)]
        ends = [p + j + 1 for p, n in zip(batch.prefix_lens, batch.extend_lens)
                for j in range(n)]
        if not self.policy.batch_invariant:
            dev = rows_to_device([rows, ends], torch.int32, self.device)
            return self._decode_meta(dev[0], dev[1], max(ends))
        # as one-token extends (the batch-invariant path reads these fields too)
        dev = rows_to_device([rows, ends, [e - 1 for e in ends], [1] * len(rows),
                              list(range(len(rows)))], torch.int32, self.device)
        return self._decode_meta(dev[0], dev[1], max(ends), dev[2], dev[3], dev[4])

    def _decode_meta(self, rows: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                     prefix_lens: Optional[torch.Tensor] = None,
                     extend_lens: Optional[torch.Tensor] = None,
                     q_starts: Optional[torch.Tensor] = None,
                     splits: Optional[int] = None) -> TritonMeta:
        """Decode metadata for requests at these page-table rows (one new token each), with
        the flash-decoding split scratch sized for them (`splits`, else `num_splits`'s). The
        decode kernels read only the rows and sequence lengths (and the scratch); the other
        fields describe the batch."""
        bs = rows.shape[0]
        splits = splits or self.num_splits(bs, max_seq_len)
        o_part = torch.empty((bs, self.num_heads, splits, self.head_dim), dtype=torch.float32,
                             device=self.device)
        lse_part = torch.empty((bs, self.num_heads, splits), dtype=torch.float32,
                               device=self.device)
        arrivals = (torch.zeros((bs, self.num_kv_heads), dtype=torch.int32, device=self.device)
                    if splits > 1 else None)
        return TritonMeta(True, rows, rows if prefix_lens is None else prefix_lens,
                          rows if extend_lens is None else extend_lens, seq_lens,
                          rows if q_starts is None else q_starts, 1, o_part, lse_part,
                          arrivals=arrivals)

    # --- CUDA graphs (engine/cuda_graph.py): metadata over the graph's static inputs ---------
    def init_graph_buffers(self, max_bs: int) -> None:
        """Allocate what decode graphs of up to `max_bs` requests share: the split scratch (one
        flat buffer serves every size: graphs never run at the same time), the split merge's
        counters (zeros, which every launch leaves zero) and the constant per-request extend
        lengths (1) and query starts (0, 1, 2, ...)."""
        most = max(bs * self._graph_splits(bs) for bs in range(1, max_bs + 1))
        self._graph_o = torch.empty(most * self.num_heads * self.head_dim, dtype=torch.float32,
                                    device=self.device)
        self._graph_lse = torch.empty(most * self.num_heads, dtype=torch.float32,
                                      device=self.device)
        self._graph_arrivals = torch.zeros(max_bs * self.num_kv_heads, dtype=torch.int32,
                                           device=self.device)
        self._graph_ones = torch.ones(max_bs, dtype=torch.int32, device=self.device)
        self._graph_starts = torch.arange(max_bs, dtype=torch.int32, device=self.device)

    def _graph_splits(self, bs: int) -> int:
        """Splits for a graph of `bs` requests: sized for the longest context; the kernels'
        minimum split length keeps short sequences from being over-split at replay."""
        return self.num_splits(bs, self.page_table.shape[1])

    def graph_meta(self, rows: torch.Tensor, positions: torch.Tensor,
                   seq_lens: torch.Tensor) -> TritonMeta:
        """Metadata for capturing a decode graph whose per-request page-table rows, positions
        (= cached lengths) and sequence lengths live in these static int32 tensors."""
        bs = rows.shape[0]
        splits = self._graph_splits(bs)
        h, d = self.num_heads, self.head_dim
        o_part = self._graph_o[:bs * h * splits * d].view(bs, h, splits, d)
        lse_part = self._graph_lse[:bs * h * splits].view(bs, h, splits)
        arrivals = self._graph_arrivals[:bs * self.num_kv_heads].view(bs, self.num_kv_heads)
        return TritonMeta(True, rows, positions, self._graph_ones[:bs], seq_lens,
                          self._graph_starts[:bs], 1, o_part, lse_part, arrivals=arrivals)

    def prefill_graph_meta(self, meta: torch.Tensor, max_extend: int,
                           decode: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
                           ) -> TritonMeta:
        """Metadata for a prefill CUDA graph (engine/prefill_graph.py) over the static int32
        block `meta` [5, 4]: rows, prefix lens, extend lens, seq lens and query starts in
        column 0, one request, at most `max_extend` new tokens (it sizes the grid). `decode`:
        the page-table rows and sequence lengths of decode rows after q's first `max_extend`
        rows (a mixed step), attended unsplit as an eager mixed step's are."""
        part = None if decode is None else self._decode_meta(*decode, 1, splits=1)
        return TritonMeta(False, meta[0, :1], meta[1, :1], meta[2, :1], meta[3, :1],
                          meta[4, :1], max_extend, None, None, decode_part=part,
                          decode_from=max_extend)

    def kv_target(self, layer: int, batch: Batch) -> Optional[KVTarget]:
        """The pool's layer caches, the batch's slots and the layer's scales (an FP8 pool):
        the kernels read every token's K/V, new ones included, from the pool, so whoever
        writes them there (the rotary kernel, the QKV GEMV; both quantize as `store_kv` does)
        may skip `store_kv`."""
        return KVTarget(self.pool.k[layer], self.pool.v[layer],
                        batch.out_slots,  # type: ignore[arg-type]
                        self.pool.scales.k[layer], self.pool.scales.v[layer])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                batch: Batch, kv_stored: bool = False) -> torch.Tensor:
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
        meta: TritonMeta = batch.attn_meta  # type: ignore[assignment]
        pdl = self.policy.pdl and meta.decode  # prefill kernels are long: nothing to overlap
        k_scale, v_scale = self.pool.scales.k[layer], self.pool.scales.v[layer]
        if not kv_stored:
            store_kv(k, v, batch.out_slots, k_cache, v_cache, pdl,  # type: ignore[arg-type]
                     k_scale, v_scale)
        if q.stride(-1) != 1:
            q = q.contiguous()  # the kernels index the head dimension densely
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if self.policy.batch_invariant:
            self._invariant(q, k_cache, v_cache, meta, out, k_scale, v_scale, layer)
        elif meta.decode:
            self._decode(q, k_cache, v_cache, meta, out, pdl, k_scale, v_scale, layer)
        elif meta.dense and k_cache.dtype == q.dtype:
            return self.dense_prefill(q, k_cache, v_cache, batch)
        else:
            n = meta.decode_from if meta.decode_part is not None else q.shape[0]
            extend_attention(q[:n], k_cache, v_cache, self.page_table, meta.rows,
                             meta.prefix_lens, meta.extend_lens, meta.q_starts, meta.max_extend,
                             out[:n], self.scale, k_scale=k_scale, v_scale=v_scale,
                             window=self.window(layer), softcap=self.softcap)
            if meta.decode_part is not None:  # PDL as in the graphs: the same variant
                self._decode(q[n:], k_cache, v_cache, meta.decode_part, out[n:],
                             self.policy.pdl, k_scale, v_scale, layer)
        return out.reshape(q.shape[0], -1)

    def _invariant(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   meta: TritonMeta, out: torch.Tensor, k_scale: float, v_scale: float,
                   layer: int) -> None:
        """Every phase's tokens (a decode or verify row as a one-token extend after its
        prefix) through the extend kernel, its keys in tiles of one width (BLOCK_N) aligned at
        position 0 and folded in one order; the tiles past a token that its block reads are
        wholly masked for it (they change none of its bits), so its output is the same in any
        batch, chunk or step (policy.batch_invariant; no split of the context). On sm_90 the
        query blocks follow the chunk (extend_tiles: 128 rows from 1,024 new tokens): a
        token's bits were measured the same at 32, 64 and 128 rows and 4 or 8 warps
        (RESULTS.md, forty-sixth session); elsewhere one tiling serves every step."""
        tiles = extend_tiles(q.dtype, q.shape[2], meta.max_extend if self._sm90 else 0)
        extend_attention(q, k_cache, v_cache, self.page_table, meta.rows, meta.prefix_lens,
                         meta.extend_lens, meta.q_starts, meta.max_extend, out, self.scale,
                         tiles=tiles, k_scale=k_scale, v_scale=v_scale,
                         window=self.window(layer), softcap=self.softcap)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: TritonMeta, out: torch.Tensor, pdl: bool, k_scale: float,
                v_scale: float, layer: int) -> None:
        assert meta.o_part is not None and meta.lse_part is not None
        decode_attention(q, k_cache, v_cache, self.page_table, meta.rows, meta.seq_lens,
                         meta.o_part, meta.lse_part, out, self.scale, self.min_split_tokens,
                         pdl=pdl, k_scale=k_scale, v_scale=v_scale, arrivals=meta.arrivals,
                         window=self.window(layer), softcap=self.softcap)

    def dense_prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      batch: Batch) -> torch.Tensor:
        """Causal attention of one fresh prompt, q [T, heads, d], whose K/V (just stored, at the
        batch's slots) are gathered into dense [T, kv_heads, d] copies, a small fraction of the
        attention's own reads."""
        slots = batch.out_slots
        assert slots is not None
        k = k_cache.index_select(0, slots).transpose(0, 1).unsqueeze(0)
        v = v_cache.index_select(0, slots).transpose(0, 1).unsqueeze(0)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k, v, is_causal=True, scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads)
        return out.squeeze(0).transpose(0, 1).reshape(q.shape[0], -1)
