"""Rank info, tensor-parallel communicators and the CPU control group."""

from minisgl.distributed.comm import (Communicator, ProcessGroups, check_same_across_ranks,
                                      destroy_process_groups, init_process_groups,
                                      min_over_ranks, true_on_all_ranks)
from minisgl.distributed.info import DistributedInfo, Shard
from minisgl.distributed.symm_allreduce import (ALLREDUCE_MODES, DEFAULT_SYMM_MAX_BYTES,
                                                SYMM_MODES, SymmMemAllReduce,
                                                check_allreduce_mode)

__all__ = ["ALLREDUCE_MODES", "Communicator", "DEFAULT_SYMM_MAX_BYTES", "DistributedInfo",
           "ProcessGroups", "SYMM_MODES", "Shard", "SymmMemAllReduce", "check_allreduce_mode",
           "check_same_across_ranks", "destroy_process_groups", "init_process_groups",
           "min_over_ranks", "true_on_all_ranks"]
