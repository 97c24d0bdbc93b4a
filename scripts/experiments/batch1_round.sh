# Issue 22, one GPU command (one H200): the model's batch-1 / 16 FP8 steps with and without
# the L2 prefetch (the tree's prefetch turned off by experiments/noprefetch's sitecustomize),
# the L2-prefetch micro chain, then the TMA-ring chain.
# run(command="bash scripts/experiments/batch1_round.sh", carry=[".gpucache/gguf/part0"])
bash benchmarks/run_h200.sh gguf-stage > /dev/null 2>&1
export PYTHONPATH=$PWD
L8=configs/models/llama-3.1-8b
LAT="scripts/bench_latency.py --model $L8 --batch-sizes 1,16 --steps 100 --cuda-graph-max-bs 16 --quantization fp8 --kv-cache-dtype fp8_e4m3"
timeout 150 python3 $LAT > $OUT/lat_on.log 2>&1; tail -6 $OUT/lat_on.log
PYTHONPATH=$PWD/scripts/experiments/noprefetch:$PWD timeout 150 python3 $LAT > $OUT/lat_off.log 2>&1; tail -6 $OUT/lat_off.log
bash scripts/experiments/l2_prefetch.sh
bash scripts/experiments/tma_chain.sh
