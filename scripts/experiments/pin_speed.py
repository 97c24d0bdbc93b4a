#!/usr/bin/env python3
"""How fast this machine pins host memory (sleep mode's first level-1 sleep pins the weights'
size: engine/sleep.py): one buffer of `--gib` GiB through torch's pinned allocator, as the
engine allocates it. Compare the allocator's settings from the environment, e.g.

    python3 scripts/experiments/pin_speed.py --gib 15
    PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:8 \\
        python3 scripts/experiments/pin_speed.py --gib 15
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=15.0)
    args = parser.parse_args()
    nbytes = int(args.gib * 2**30)
    torch.cuda.init()
    start = time.perf_counter()
    buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pinned = time.perf_counter() - start
    source = torch.empty(min(nbytes, 2**31), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    buffer[:source.numel()].copy_(source, non_blocking=True)
    torch.cuda.synchronize()
    copied = time.perf_counter() - start
    print(f"{os.environ.get('PYTORCH_CUDA_ALLOC_CONF', 'default')}: pinned {args.gib:.1f} GiB "
          f"in {pinned:.2f} s ({pinned / args.gib:.2f} s a GiB); device-to-host "
          f"{source.numel() / copied / 1e9:.1f} GB/s into it")


if __name__ == "__main__":
    main()
