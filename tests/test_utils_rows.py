"""utils.rows_to_device: one copy, every row 16-byte aligned (Triton specializes kernels on
pointer alignment, so unaligned rows built new kernel variants while serving)."""

from __future__ import annotations

import pytest
import torch

from minisgl.utils import rows_to_device


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 7, 8, 13])
def test_rows_are_aligned_and_exact(dtype: torch.dtype, n: int) -> None:
    rows = [[r * 100 + i for i in range(n)] for r in range(5)]
    t = rows_to_device(rows, dtype, torch.device("cpu"))
    assert t.shape == (5, n) and t.dtype == dtype
    assert t.tolist() == [[float(v) if dtype.is_floating_point else v for v in r] for r in rows]
    for r in range(5):
        assert t[r].data_ptr() % 16 == 0 and t[r].is_contiguous()


def test_rows_must_be_given_and_equal_in_length() -> None:
    with pytest.raises(ValueError, match="equal-length"):
        rows_to_device([[1, 2], [3]], torch.int32, torch.device("cpu"))
    with pytest.raises(ValueError, match="at least one row"):
        rows_to_device([], torch.int32, torch.device("cpu"))
