"""Instruction counts of a Triton kernel for Hopper (sm_90a), on a machine without a GPU: the
kernel is compiled for that target, assembled by the ptxas that Triton bundles, disassembled
by its cuobjdump, and its SASS opcodes counted. A proxy for the GPU (it says nothing of memory
or latency) that showed, for instance, int_mm's old one-row loop at ~6.8 instructions a
packed value against ~4 for `_top_placed` (RESULTS.md, thirty-sixth session).

    python3 scripts/experiments/sass_count.py            # int_mm's one-row kernel, as run
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile
from typing import Any, Dict, Iterable

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def sass_counts(fn: Any, signature: Dict[str, str], constants: Dict[str, Any],
                divisible: Iterable[str] = (), num_warps: int = 4, num_stages: int = 2
                ) -> "collections.Counter[str]":
    """Opcode counts of `fn` compiled with `signature` (argument -> Triton type, e.g. "*bf16",
    "i32"), `constants` (the constexprs) and the arguments `divisible` by 16 (as Triton
    specializes them at run time, which decides vector loads); prints registers too."""
    names = list(signature)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in divisible}
    sig = {**signature, **{c: "constexpr" for c in constants}}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constants, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    with tempfile.TemporaryDirectory() as d:
        ptx, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        assembled = subprocess.run([f"{BIN}/ptxas-blackwell", "-arch=sm_90a", "-v", ptx, "-o",
                                    cubin], capture_output=True, text=True, check=True)
        sass = subprocess.run([f"{BIN}/cuobjdump", "-sass", cubin], capture_output=True,
                              text=True, check=True).stdout
    regs = re.search(r"Used (\d+) registers", assembled.stderr + assembled.stdout)
    ops = collections.Counter(re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)",
                                         sass))
    print(f"{getattr(fn, '__name__', fn)}: {regs.group(1) if regs else '?'} registers, "
          f"{sum(ops.values())} instructions: "
          + ", ".join(f"{op} {n}" for op, n in ops.most_common(14)))
    return ops


def main() -> None:
    from minisgl.kernels import int_mm
    sig = {"x_ptr": "*bf16", "q_ptr": "*i32", "s_ptr": "*fp32", "z_ptr": "*fp16",
           "bias_ptr": "*fp32", "parts_ptr": "*fp32", "out_ptr": "*bf16",
           "arrivals_ptr": "*i32", "n": "i32", "k": "i32", "k_split": "i32",
           "stride_xm": "i32", "stride_qk": "i32", "stride_sg": "i32", "stride_om": "i32"}
    tiles = int_mm.int_tiles(1, 6144, 4096, 128)
    sass_counts(int_mm._one_row_kernel, sig,
                {"BITS": 4, "HAS_BIAS": False, "BLOCK_N": tiles.block_n,
                 "BLOCK_K": tiles.block_k, "GROUP": 128, "LAST_SUMS": True},
                divisible=list(sig), num_warps=tiles.num_warps, num_stages=tiles.num_stages)


if __name__ == "__main__":
    main()
