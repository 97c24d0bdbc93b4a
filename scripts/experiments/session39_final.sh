# One GPU command on the final tree of the thirty-ninth session: the FP8 batch-1 step (issue 22)
# and the LoRA decode steps beside the base model's (bench_latency, bf16, Llama-3.1-8B shape).
# run(command="bash scripts/experiments/session39_final.sh", carry=[".whl", ".gpucache/mcache"])
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MINISGL_CACHE_DIR=$PWD/.gpucache/mcache
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
L8=configs/models/llama-3.1-8b
timeout 150 python3 scripts/bench_latency.py --model $L8 --batch-sizes 1,16 --steps 100 \
  --cuda-graph-max-bs 16 --quantization fp8 --kv-cache-dtype fp8_e4m3 > "$OUT/fp8.log" 2>&1
echo "fp8 exit $?"; grep -A3 "^ *batch" "$OUT/fp8.log"
for lora in "" "--lora"; do
  timeout 120 python3 scripts/bench_latency.py --model $L8 --batch-sizes 1,16,64 --steps 50 \
    --cuda-graph-max-bs 64 --enable-lora --max-lora-rank 16 $lora > "$OUT/lat$lora.log" 2>&1
  echo "bf16 $lora exit $?"; grep -A4 "^ *batch" "$OUT/lat$lora.log"
done
