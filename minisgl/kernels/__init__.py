"""Every Triton kernel of minisgl, and the small types and policy their callers share.

Importing this package imports nothing else: the kernel modules import triton, and only GPU paths
(or tests under TRITON_INTERPRET=1) import them, so CPU installs without triton work. `policy`
and `types` import torch only; layers, attention, distributed and the engine import them freely.
"""
