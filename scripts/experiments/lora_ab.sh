# LoRA decode steps A/B in one lease (one GPU): this tree against .gpucache/old (`git archive
# <commit> minisgl configs/models/llama-3.1-8b scripts/bench_latency.py`), bench_latency with
# every request on a rank-16 adapter (bf16, Llama-3.1-8B shape), twice each, interleaved; the
# LoRA kernel tests on CUDA first.
# run(command="bash scripts/experiments/lora_ab.sh", carry=[".whl", ".gpucache/mcache",
#     ".gpucache/old"])
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MINISGL_CACHE_DIR=$PWD/.gpucache/mcache
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader
PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pytest -q tests/test_triton_ops.py -k lora \
  > "$OUT/kt.log" 2>&1; echo "kernel tests $?"; tail -1 "$OUT/kt.log"
PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m pytest -q -m gpu tests/test_gpu.py -k lora \
  > "$OUT/gt.log" 2>&1; echo "gpu tests $?"; tail -1 "$OUT/gt.log"
A="--model configs/models/llama-3.1-8b --batch-sizes 1,16,64 --steps 50 --cuda-graph-max-bs 64 --enable-lora --max-lora-rank 16 --lora"
for round in 1 2; do
  for tree in new old; do
    dir=$PWD; [ $tree = old ] && dir=$PWD/.gpucache/old
    ( cd $dir && PYTHONPATH=/tmp/site:$dir timeout 120 python3 scripts/bench_latency.py $A ) \
      > "$OUT/$tree$round.log" 2>&1
    echo "$tree round $round exit $?"; grep -A3 "^ *batch" "$OUT/$tree$round.log"
  done
done
