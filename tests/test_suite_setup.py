"""The suite's own set-up (tests/conftest.py): how a pytest-xdist worker shares the cores."""

from __future__ import annotations

from typing import Dict

import torch

from conftest import share_cores
from minisgl.cpu_threads import available_cores


def test_xdist_workers_split_the_cores_and_leave_a_users_choice() -> None:
    before = torch.get_num_threads()
    cores = available_cores()
    try:
        env: Dict[str, str] = {"PYTEST_XDIST_WORKER_COUNT": "2"}
        assert share_cores(env) == max(1, cores // 2)
        assert env["OMP_NUM_THREADS"] == str(max(1, cores // 2))
        assert torch.get_num_threads() == max(1, cores // 2)
        many: Dict[str, str] = {"PYTEST_XDIST_WORKER_COUNT": str(4 * cores)}
        assert share_cores(many) == 1  # never below one thread
        mine = {"PYTEST_XDIST_WORKER_COUNT": "2", "OMP_NUM_THREADS": "3"}
        assert share_cores(mine) == 0 and mine["OMP_NUM_THREADS"] == "3"
        serial: Dict[str, str] = {}
        assert share_cores(serial) == 0 and serial == {}
    finally:
        torch.set_num_threads(before)
