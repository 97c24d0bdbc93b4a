# Issue 22, one GPU command (one H200): vLLM 0.26's and minisgl's FP8 decode steps at batch 1
# and 16 by the same method (fp8_lat_peer.py), then minisgl's bench_latency numbers (the
# overlapped step the roofline criterion is judged on). Needs part01's first piece in
# /tmp/vllm_parts, stored by the call before (`run_h200.sh vllm-stage`; its vLLM comment):
# run(command="bash scripts/experiments/fp8_lat_peer.sh", carry=[".peer/split/p1_ab",
#     ".peer/part02", ".peer/extra-ct.tar.xz", ".peer/SHA256SUMS", ".peer/run_vllm_peer.py",
#     ".whl", ".gpucache/mcache"])
set -u
. scripts/experiments/vllm_site.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
env $VLLM_ENV timeout -k 10 300 python3 scripts/experiments/fp8_lat_peer.py --engine vllm > "$OUT/vllm.log" 2>&1
echo "vllm exit $?"; grep -E '^\[vllm\]' "$OUT/vllm.log"; gpu_free
export PYTHONPATH=/tmp/site:$PWD MINISGL_CACHE_DIR=$PWD/.gpucache/mcache
timeout -k 10 200 python3 scripts/experiments/fp8_lat_peer.py --engine minisgl > "$OUT/minisgl.log" 2>&1
echo "minisgl exit $?"; grep -E '^\[minisgl\]' "$OUT/minisgl.log"
L8=configs/models/llama-3.1-8b
timeout 150 python3 scripts/bench_latency.py --model $L8 --batch-sizes 1,16 --steps 100 \
  --cuda-graph-max-bs 16 --quantization fp8 --kv-cache-dtype fp8_e4m3 > "$OUT/lat.log" 2>&1
echo "bench_latency exit $?"; tail -8 "$OUT/lat.log"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
