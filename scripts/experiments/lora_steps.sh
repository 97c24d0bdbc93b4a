# LoRA decode steps on one GPU, minisgl only (the vLLM side: lora_steps_vllm.sh): the GPU
# tests of the LoRA graphs, bench_latency with and without --lora (rank 16, bf16, Llama-3.1-8B
# shape), and fp8_lat_peer.py's method (the offline API, vLLM's way of timing) on this tree,
# without an adapter, and on the tree before the LoRA graphs (.gpucache/old: `git archive
# <commit> minisgl configs/models/llama-3.1-8b` plus this tree's fp8_lat_peer.py):
# run(command="bash scripts/experiments/lora_steps.sh", carry=[".whl", ".gpucache/mcache",
#     ".gpucache/old"])
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false MINISGL_CACHE_DIR=$PWD/.gpucache/mcache
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
timeout 200 python3 -m pytest -q -m gpu tests/test_gpu.py -k "lora or one_buffer" \
  > "$OUT/tests.log" 2>&1; echo "gpu tests exit $?"; tail -3 "$OUT/tests.log"
L8=configs/models/llama-3.1-8b
for lora in "" "--lora"; do
  timeout 150 python3 scripts/bench_latency.py --model $L8 --batch-sizes 1,16,64 --steps 50 \
    --cuda-graph-max-bs 64 --enable-lora --max-lora-rank 16 $lora > "$OUT/lat$lora.log" 2>&1
  echo "bench_latency $lora exit $?"; grep -A4 "^ *batch" "$OUT/lat$lora.log"
done
P="scripts/experiments/fp8_lat_peer.py --engine minisgl --quantization none --kv-cache-dtype auto --batches 1,16,64"
timeout 150 python3 $P --lora-rank 16 > "$OUT/peer_lora.log" 2>&1
echo "peer lora exit $?"; grep "^\[minisgl\]" "$OUT/peer_lora.log"
timeout 150 python3 $P > "$OUT/peer_base.log" 2>&1
echo "peer base exit $?"; grep "^\[minisgl\]" "$OUT/peer_base.log"
( cd .gpucache/old && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 $P --lora-rank 16 ) \
  > "$OUT/peer_old.log" 2>&1
echo "peer old lora exit $?"; grep "^\[minisgl\]" "$OUT/peer_old.log"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
