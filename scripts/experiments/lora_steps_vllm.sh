# vLLM 0.26's decode steps with a rank-16 LoRA adapter on every request and without one (bf16,
# Llama-3.1-8B shape, dummy weights), by fp8_lat_peer.py's method, to set beside
# lora_steps.sh's minisgl numbers. Needs /tmp/vllm_parts/part01 stored by the call before (as
# for .peer/peer.sh):
# run(command="bash scripts/experiments/lora_steps_vllm.sh", carry=[".peer/part02",
#     ".peer/extra-ct.tar.xz", ".peer/SHA256SUMS", ".peer/run_vllm_peer.py"])
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; V=$PWD/.peer
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
cp -f "$V"/part[0-9][0-9] /tmp/vllm_parts/ 2>/dev/null
if ! [ -f /tmp/vsite/.complete ]; then
  ( cd /tmp/vllm_parts && sha256sum -c "$V/SHA256SUMS" ) || { echo "vLLM parts missing"; exit 2; }
  cat $(awk '{print "/tmp/vllm_parts/"$2}' "$V/SHA256SUMS") | tar -xJf - -C /tmp && touch /tmp/vsite/.complete
fi
tar -xJf "$V/extra-ct.tar.xz" -C /tmp/vsite
gpu_free() { for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader); do kill -9 "$p"; done; sleep 3; }
for rank in ${RANKS:-16 0}; do
  env PYTHONPATH=/tmp/vsite HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_USE_DEEP_GEMM=0 \
    VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_CACHE_ROOT=/tmp/vllm_cache \
    timeout -k 10 270 python3 scripts/experiments/fp8_lat_peer.py --engine vllm \
    --quantization none --kv-cache-dtype auto --batches 1,16,64 --lora-rank $rank \
    > "$OUT/vllm_r$rank.log" 2>&1
  echo "vllm rank $rank exit $?"; grep -E '^\[vllm\]' "$OUT/vllm_r$rank.log"; tail -3 "$OUT/vllm_r$rank.log"; gpu_free
done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
