# Issue 22 experiment: the TMA-ring persistent chain against the PDL chain (one H200).
# run(command="bash scripts/experiments/tma_chain.sh")
export PYTHONPATH=$PWD
python3 -c "import triton; print('triton', triton.__version__)" | tee $OUT/tma.log
timeout 240 python3 scripts/experiments/tma_chain.py 2>&1 | tail -20 | tee -a $OUT/tma.log
TMA_CHAIN_MATH=0 timeout 200 python3 scripts/experiments/tma_chain.py 2>&1 | tail -12 | tee -a $OUT/tma.log
cp $OUT/tma_chain.txt $OUT/tma_chain_all.txt 2>/dev/null
