# Issue 22 experiment: L2 prefetch of the next weights during the batch-1 attention (one H200).
# run(command="bash scripts/experiments/l2_prefetch.sh")
export PYTHONPATH=$PWD
timeout 280 python3 scripts/experiments/l2_prefetch.py 2>&1 | tail -20 | tee $OUT/l2_prefetch.log
