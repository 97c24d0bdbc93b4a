# Packed 4-bit weights at decode batches (thirty-seventh session): the offline workload with the
# tree as it is, without the tensor-core tiles' last-program sums, and with _PROGRAMS 2048; the
# kernels at 64-200 rows with and without counters.  run(command="bash scripts/experiments/int4_ab.sh")
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
timeout 120 python3 scripts/bench_kernels.py --what intlinear --model configs/models/llama-3.1-8b \
  --linear-rows 64,137,200 2>&1 | grep -v Warn | tee "$OUT/kernels.log" | grep -E "default|cublas"
offline() {
  timeout 150 python3 scripts/bench_offline.py --model configs/models/llama-3.1-8b-awq \
    --load-format dummy > "$OUT/offline_$1.log" 2>&1
  echo "$1: $(grep -E 'decode:|output [0-9]' "$OUT/offline_$1.log" | tr '\n' ' ')"
}
cp minisgl/kernels/int_mm.py /tmp/int_mm.py.tree
offline tree
patch -p1 < scripts/experiments/no_tc_counters.patch && offline no_tc_counters
cp /tmp/int_mm.py.tree minisgl/kernels/int_mm.py
sed -i 's/^_PROGRAMS = 1024$/_PROGRAMS = 2048/' minisgl/kernels/int_mm.py && offline programs2048
cp /tmp/int_mm.py.tree minisgl/kernels/int_mm.py
offline tree_again
