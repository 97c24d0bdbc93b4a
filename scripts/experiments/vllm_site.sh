# Sourced by the experiments that run vLLM 0.26 beside minisgl on the GPU machine: unpacks the
# peer bundle (.peer/, as .peer/peer.sh does; part01, or its first piece, stored in
# /tmp/vllm_parts by the call before) into /tmp/vsite once a machine, and defines gpu_free
# (kill what holds the GPU).
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; V=$PWD/.peer
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
cp -f "$V"/part[0-9][0-9] "$V"/split/p1_* /tmp/vllm_parts/ 2>/dev/null
# part01 may come in two pieces (benchmarks/run_h200.sh's vLLM comment says why and how)
[ -f /tmp/vllm_parts/part01 ] || cat /tmp/vllm_parts/p1_* > /tmp/vllm_parts/part01 2>/dev/null
if ! [ -f /tmp/vsite/.complete ]; then
  ( cd /tmp/vllm_parts && sha256sum -c "$V/SHA256SUMS" ) || { echo "vLLM parts missing"; exit 2; }
  cat $(awk '{print "/tmp/vllm_parts/"$2}' "$V/SHA256SUMS") | tar -xJf - -C /tmp && touch /tmp/vsite/.complete
fi
tar -xJf "$V/extra-ct.tar.xz" -C /tmp/vsite
gpu_free() { for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader); do kill -9 "$p"; done; sleep 3; }
VLLM_ENV="PYTHONPATH=/tmp/vsite HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_USE_DEEP_GEMM=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_CACHE_ROOT=/tmp/vllm_cache"
