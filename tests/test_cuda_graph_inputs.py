"""The decode graphs' static inputs (engine/cuda_graph.py), checked on CPU: every row of every
size's block starts 16-byte aligned (Triton builds a kernel variant per pointer alignment, so
unaligned graph inputs built variants that eager decode never uses), blocks do not overlap, and
a replay's host values pad each block with (pad_row, 0, 1); a LoRA family's blocks carry each
request's adapter slot in a fourth row (-1: none, and for padding), and the mask a LoRA graph
builds from it marks each token's slot only."""

from __future__ import annotations

import pytest
import torch

from minisgl.engine.cuda_graph import graph_sizes, input_rows, static_input_blocks
from minisgl.engine.lora import graph_lora_rows
from minisgl.engine.prefill_graph import MIN_TOKENS as MIN_BUCKET, bucket_sizes
from minisgl.utils import aligned_width


def test_blocks_are_aligned_disjoint_and_start_as_padding() -> None:
    sizes = graph_sizes(256)
    blocks = static_input_blocks(sizes, pad_row=7, device=torch.device("cpu"))
    assert sorted(blocks) == sizes
    spans = []
    for bs, block in blocks.items():
        assert block.dtype == torch.int32 and block.is_contiguous()
        assert block.shape == (3, aligned_width(bs, torch.int32)) and block.shape[1] >= bs
        for row in block[:, :bs]:
            assert row.data_ptr() % 16 == 0, bs
        assert block.tolist() == [[7] * block.shape[1], [0] * block.shape[1],
                                  [1] * block.shape[1]]
        spans.append((block.data_ptr(), block.data_ptr() + block.numel() * 4))
    spans.sort()
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


def test_input_rows_pad_to_the_block_width() -> None:
    assert input_rows([3, 9], [10, 0], pad_row=5, width=4) == [
        [3, 9, 5, 5], [10, 0, 0, 0], [11, 1, 1, 1]]
    assert input_rows([], [], pad_row=5, width=1) == [[5], [0], [1]]


def test_input_rows_rejects_a_batch_wider_than_the_block() -> None:
    with pytest.raises(ValueError, match="3 rows, 3 positions and no adapter slots for a "
                                         "block of 2 columns"):
        input_rows([1, 2, 3], [0, 0, 0], pad_row=0, width=2)
    with pytest.raises(ValueError, match="2 rows, 1 positions"):
        input_rows([1, 2], [0], pad_row=0, width=4)
    with pytest.raises(ValueError, match="2 rows, 2 positions and 1 adapter slots"):
        input_rows([1, 2], [0, 0], pad_row=0, width=4, slots=[3])


def test_lora_blocks_carry_adapter_slots_and_their_mask() -> None:
    blocks = static_input_blocks([1, 8], pad_row=7, device=torch.device("cpu"), lora=True)
    block = blocks[8]
    assert block.shape == (4, aligned_width(8, torch.int32))
    assert block[3].tolist() == [-1] * block.shape[1]
    assert all(row.data_ptr() % 16 == 0 for row in block)
    values = input_rows([3, 9, 4], [10, 0, 2], pad_row=5, width=8, slots=[2, -1, 0])
    assert values[3] == [2, -1, 0] + [-1] * 5
    block.copy_(torch.tensor(values, dtype=torch.int32))
    rows = graph_lora_rows(block[3, :4], num_slots=3, dtype=torch.bfloat16)
    assert rows.picks is None and rows.mask.dtype == torch.bfloat16
    assert rows.mask.tolist() == [[0, 0, 1], [0] * 3, [1, 0, 0], [0] * 3]


def test_prefill_buckets_pad_by_less_than_half_and_stay_multiples_of_16() -> None:
    """Prefill graph buckets: 64, 96, 128, 192, 256, then steps of 64 (from 1,024 an eighth)
    up to the limit and the context length (a 1,024-token bucket over 512-token page-table
    rows indexed past them on a GPU); every prompt longer than the smallest bucket is padded
    by less than half its length, from 256 tokens on by at most 64 or an eighth, and every
    size is a multiple of 16 (one Triton variant per bucket)."""
    assert bucket_sizes(1024) == [64, 96, 128, 192, 256, *range(320, 1025, 64)]
    assert bucket_sizes(700) == [64, 96, 128, 192, 256, *range(320, 641, 64)]
    assert bucket_sizes(63) == [] and bucket_sizes(64) == [64]
    assert bucket_sizes(1024, context=512) == bucket_sizes(512)  # no bucket past a table row
    assert bucket_sizes(1024, context=700) == bucket_sizes(700)
    sizes = bucket_sizes(1 << 14)
    assert len(sizes) < 50 and sizes[-1] == 1 << 14
    assert all(n % 16 == 0 for n in sizes)
    for length in range(MIN_BUCKET + 1, sizes[-1] + 1):
        bucket = next(n for n in sizes if n >= length)
        assert bucket - length < length / 2, (length, bucket)
        if length > 256:
            assert bucket - length < max(64, length / 8), (length, bucket)
