# One GPU command (issue 22 and the LoRA graphs): the LoRA GPU tests, the FP8 batch-1 step,
# and a profile of the LoRA decode steps. run(command="bash scripts/experiments/lora_profile.sh",
#     carry=[".whl", ".gpucache/mcache"])
export PYTHONUNBUFFERED=1 MINISGL_CACHE_DIR=$PWD/.gpucache/mcache; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 -m pytest -q -m gpu tests/test_gpu.py -k "lora" 2>&1 | tail -2
L8=configs/models/llama-3.1-8b
timeout 150 python3 scripts/bench_latency.py --model $L8 --batch-sizes 1,16 --steps 100 --cuda-graph-max-bs 16 --quantization fp8 --kv-cache-dtype fp8_e4m3 > $OUT/fp8.log 2>&1; echo fp8 $?; grep -A3 "^ *batch" $OUT/fp8.log
timeout 200 python3 scripts/bench_latency.py --model $L8 --batch-sizes 1,16 --steps 20 --cuda-graph-max-bs 16 --enable-lora --max-lora-rank 16 --lora --profile > $OUT/prof_lora.log 2>&1; echo lora $?; grep -A3 "^ *batch" $OUT/prof_lora.log
