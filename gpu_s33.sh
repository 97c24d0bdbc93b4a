#!/usr/bin/env bash
# Thirty-third session's GPU checks (temporary; the lasting modes are in benchmarks/run_h200.sh).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MINISGL_CACHE_DIR=/tmp/mcache
step() {
  local name=$1 limit=$2; shift 2
  echo "=== $name: $*" | tee -a "$OUT/summary.txt"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "exit $?" >> "$OUT/$name.log"
  tail -n 6 "$OUT/$name.log" | tee -a "$OUT/summary.txt"
}
T="python3 -m pytest -q -p no:cacheprovider"
if [ "$1" = A ]; then
  mkdir -p /tmp/gguf && cp .gpucache/gguf/part0 /tmp/gguf/ && echo "gguf part0 staged"
  nvidia-smi --query-gpu=name --format=csv,noheader | tee -a "$OUT/summary.txt"
  step fp8moe_kernels 120 $T tests/test_fp8_moe.py -k "fused or default_tiles or refuses"
  step int_kernels 90 $T tests/test_int_packed.py -k "int_mm or pack_places or dummy_awq"
  step moe_kernels 150 $T tests/test_moe.py -k "fused or route or align or tiles or dummy"
  step fp8_dummy_30b 150 $T -m gpu tests/test_fp8_moe.py -k dummy
fi
if [ "$1" = B ]; then  # a tokenizer-only copy of the default model (tiny models' tokenizer)
  export MINISGL_CACHE_DIR=$PWD/.gpucache/mcache
  step fp8_moe_all 200 $T tests/test_fp8_moe.py
  step int_packed_all 170 $T tests/test_int_packed.py
  step moe_gpu_tokens 80 $T tests/test_moe.py -k "gpu_float32"
  step fp8_kernels 140 $T tests/test_fp8_kernels.py
fi
if [ "$1" = C ]; then  # throughput: Qwen3-30B-A3B bf16 against FP8 blocks; 8B bf16 against AWQ
  step offline_30b_bf16 170 python3 scripts/bench_offline.py --model configs/models/qwen3-30b-a3b
  step offline_30b_fp8 170 python3 scripts/bench_offline.py --model configs/models/qwen3-30b-a3b-fp8
  step latency_8b_awq 110 python3 scripts/bench_latency.py --model configs/models/llama-3.1-8b-awq --steps 30
  step latency_8b_bf16 110 python3 scripts/bench_latency.py --model configs/models/llama-3.1-8b --steps 30
fi
