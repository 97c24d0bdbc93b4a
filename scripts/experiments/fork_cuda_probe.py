"""Whether a rank forked from minisgl's fork server (server/proc.py, MINISGL_START_METHOD=
forkserver) can use CUDA: the fork server imports torch and minisgl.scheduler.main, which must
not initialize CUDA, or every forked child's first CUDA call fails. Prints one line; exit 1 on
failure. GPU machines only (run_h200.sh s44-fork)."""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

from minisgl.server.proc import prestart, spawn, stop_children, wait_ready


def _cuda_matmul(conn: Any) -> None:
    import torch
    a = torch.randn(256, 256, device="cuda")
    conn.send(("ready", "probe", {"sum": float((a @ a).sum().item()),
                                  "device": torch.cuda.get_device_name()}))


def main() -> int:
    # the child finds the entry by this module's name (a script's __main__ is not importable)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from fork_cuda_probe import _cuda_matmul as entry
    os.environ["MINISGL_START_METHOD"] = "forkserver"
    if not prestart(os.environ):
        return 1
    child = spawn("probe", entry, (), "warning", tempfile.mkdtemp(), forkserver=True)
    try:
        wait_ready([child], should_stop=lambda: False)
        print(f"forked rank used CUDA: {child.info}")
        return 0
    except Exception as e:  # the child's CUDA error, as its death or report
        print(f"forked rank could not use CUDA: {e}")
        return 1
    finally:
        stop_children([child], 2.0, 2.0)


if __name__ == "__main__":
    sys.exit(main())
