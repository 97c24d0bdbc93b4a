"""Rank info, tensor-parallel communicators and the CPU control group."""

from minisgl.distributed.comm import (Communicator, ProcessGroups, check_same_across_ranks,
                                      destroy_process_groups, init_process_groups,
                                      min_over_ranks)
from minisgl.distributed.info import DistributedInfo, Shard

__all__ = ["Communicator", "DistributedInfo", "ProcessGroups", "Shard", "check_same_across_ranks",
           "destroy_process_groups", "init_process_groups", "min_over_ranks"]
