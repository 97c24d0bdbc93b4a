"""Rank info, tensor-parallel communicators and the CPU control group.

The names below are loaded from their modules on first use (a module `__getattr__`, PEP 562),
so that `bind` (addresses and sockets) imports without torch: the API server and the launcher
use it and never touch a tensor, and torch costs a process some 2 s and 300 MB to import."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Dict

if TYPE_CHECKING:
    from minisgl.distributed.comm import (Communicator, ProcessGroups, check_same_across_ranks,
                                          destroy_process_groups, init_process_groups,
                                          min_over_ranks, true_on_all_ranks)
    from minisgl.distributed.info import DistributedInfo, Shard
    from minisgl.distributed.symm_allreduce import (ALLREDUCE_MODES, DEFAULT_SYMM_MAX_BYTES,
                                                    SYMM_MODES, SymmMemAllReduce,
                                                    check_allreduce_mode)

_MODULE_OF: Dict[str, str] = {
    **dict.fromkeys(["Communicator", "ProcessGroups", "check_same_across_ranks",
                     "destroy_process_groups", "init_process_groups", "min_over_ranks",
                     "true_on_all_ranks"], "comm"),
    **dict.fromkeys(["DistributedInfo", "Shard"], "info"),
    **dict.fromkeys(["ALLREDUCE_MODES", "DEFAULT_SYMM_MAX_BYTES", "SYMM_MODES",
                     "SymmMemAllReduce", "check_allreduce_mode"], "symm_allreduce"),
}
__all__ = ["ALLREDUCE_MODES", "Communicator", "DEFAULT_SYMM_MAX_BYTES", "DistributedInfo",
           "ProcessGroups", "SYMM_MODES", "Shard", "SymmMemAllReduce", "check_allreduce_mode",
           "check_same_across_ranks", "destroy_process_groups", "init_process_groups",
           "min_over_ranks", "true_on_all_ranks"]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
