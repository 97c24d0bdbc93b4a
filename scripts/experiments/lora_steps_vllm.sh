# vLLM 0.26's decode steps with a rank-16 LoRA adapter on every request and without one (bf16,
# Llama-3.1-8B shape, dummy weights), by fp8_lat_peer.py's method, to set beside
# lora_steps.sh's minisgl numbers. Needs /tmp/vllm_parts/part01 stored by the call before (as
# for .peer/peer.sh):
# run(command="bash scripts/experiments/lora_steps_vllm.sh", carry=[".peer/part02",
#     ".peer/extra-ct.tar.xz", ".peer/SHA256SUMS", ".peer/run_vllm_peer.py"])
set -u
. scripts/experiments/vllm_site.sh
for rank in ${RANKS:-16 0}; do
  env $VLLM_ENV timeout -k 10 270 python3 scripts/experiments/fp8_lat_peer.py --engine vllm \
    --quantization none --kv-cache-dtype auto --batches 1,16,64 --lora-rank $rank \
    > "$OUT/vllm_r$rank.log" 2>&1
  echo "vllm rank $rank exit $?"; grep -E '^\[vllm\]' "$OUT/vllm_r$rank.log"; tail -3 "$OUT/vllm_r$rank.log"; gpu_free
done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
