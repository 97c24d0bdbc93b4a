"""Page-table rows: one per running request, handed out lowest-first (deterministic)."""

from __future__ import annotations

import heapq
from typing import List


class TableRows:
    """Free rows of the engine's page table. Rows are owned by a request from admission until
    the scheduler frees it (exactly once, on finish or abort)."""

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self._free: List[int] = list(range(num_rows))

    @property
    def available(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free page-table row (admission should have checked)")
        return heapq.heappop(self._free)

    def free(self, row: int) -> None:
        heapq.heappush(self._free, row)
