"""Rank info, tensor-parallel communicators and the CPU control group."""

from minisgl.distributed.comm import (Communicator, ProcessGroups, destroy_process_groups,
                                      init_process_groups, min_over_ranks)
from minisgl.distributed.info import DistributedInfo, Shard

__all__ = ["Communicator", "DistributedInfo", "ProcessGroups", "Shard", "destroy_process_groups",
           "init_process_groups", "min_over_ranks"]
