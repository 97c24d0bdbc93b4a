"""Rank info, tensor-parallel communicators and the CPU control group.

The names below are loaded from their modules on first use (a module `__getattr__`, PEP 562),
so that `bind` (addresses and sockets), `info` (ranks, shards, the head split) and `modes` (the
allreduce setting) import without torch: the API server and the launcher use them and never
touch a tensor, and torch costs a process some 2 s and 300 MB to import."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Dict

if TYPE_CHECKING:
    from minisgl.distributed.comm import (Communicator, ProcessGroups, agreed_error,
                                          check_same_across_ranks, destroy_process_groups,
                                          every_ranks, init_process_groups, min_over_ranks,
                                          true_on_all_ranks)
    from minisgl.distributed.info import DistributedInfo, Shard, check_head_split
    from minisgl.distributed.modes import ALLREDUCE_MODES, SYMM_MODES, check_allreduce_mode
    from minisgl.distributed.symm_allreduce import DEFAULT_SYMM_MAX_BYTES, SymmMemAllReduce

_MODULE_OF: Dict[str, str] = {
    **dict.fromkeys(["Communicator", "ProcessGroups", "agreed_error", "check_same_across_ranks",
                     "destroy_process_groups", "every_ranks", "init_process_groups",
                     "min_over_ranks", "true_on_all_ranks"], "comm"),
    **dict.fromkeys(["DistributedInfo", "Shard", "check_head_split"], "info"),
    **dict.fromkeys(["ALLREDUCE_MODES", "SYMM_MODES", "check_allreduce_mode"], "modes"),
    **dict.fromkeys(["DEFAULT_SYMM_MAX_BYTES", "SymmMemAllReduce"], "symm_allreduce"),
}
__all__ = ["ALLREDUCE_MODES", "Communicator", "DEFAULT_SYMM_MAX_BYTES", "DistributedInfo",
           "ProcessGroups", "SYMM_MODES", "Shard", "SymmMemAllReduce", "agreed_error",
           "check_allreduce_mode",
           "check_head_split", "check_same_across_ranks", "destroy_process_groups",
           "every_ranks", "init_process_groups", "min_over_ranks", "true_on_all_ranks"]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
