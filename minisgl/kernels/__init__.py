"""Every Triton kernel of minisgl, one kind per module, and the small types their callers share.

- `rmsnorm`: RMSNorm (with the residual add), and the row arithmetic every norm kernel shares;
- `activation`: SiLU-and-mul; `rotary`: rotary embedding of q and k (optionally with the K/V
  store); `argmax`: the sampler's greedy pick;
- `gemv`: the batch-1 projections, with the norm before them and the rotary / SiLU after them
  fused in;
- `attention`: paged decode and extend attention, and the K/V store;
- `fp8`: FP8 activation quantization (per token, per group) and the scaled W8A8 GEMMs;
- `moe`: mixture-of-experts routing, the sort of (token, expert) pairs by expert and the
  grouped expert GEMMs; `dot`: the matrix product the tiled kernels (attention, moe) share;
- `allreduce`: all-reduce, residual add and RMSNorm in one kernel over symmetric memory;
- `pdl`: programmatic dependent launch, which the decode path's kernels use;
- `types`: what the kernels share with their callers (KVTarget, Normed, MoETiles, ...).

At batch 1 a decode step is some 400 small kernels, each costing a few microseconds even inside
a CUDA graph; the norm, SiLU and rotary kernels (one launch each instead of 5 to 15 torch
kernels) halved the count. They compute in float32 and round once, so results can differ from
the torch path in the last bit of bfloat16; the CPU path (exact against the reference in
float32) never calls them.

Importing this package imports nothing: the kernel modules import triton, and only GPU paths (or
tests under TRITON_INTERPRET=1) import them, so CPU installs without triton work. `types`
imports torch only, so callers import it at the top. Imports from here go to torch, triton and
these modules only.
"""
