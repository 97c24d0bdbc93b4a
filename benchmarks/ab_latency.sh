#!/usr/bin/env bash
# Batch-1 decode step of several source trees, one after another on one GPU, in one command:
# the only comparison this project trusts for changes of a few percent (two GPUs, or two
# commands, differed by up to 4% on the same code; benchmarks/RESULTS.md, sixth session).
#
#   bash benchmarks/ab_latency.sh DIR_OR_REV [DIR_OR_REV ...]
#
# Each argument is a directory holding minisgl/, scripts/ and configs/ (e.g. a `git archive`
# of a commit, unpacked before the command is sent: the GPU machine has the working tree but no
# git history), or "." for the checkout itself. Extra bench_latency.py flags: AB_FLAGS.
# Logs go to ${OUT:-/tmp/out}/ab_<n>.log; one summary line per tree to stdout.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
MODEL=${AB_MODEL:-configs/models/llama-3.1-8b}; n=0
for tree in "$@"; do
  n=$((n + 1)); log="$OUT/ab_$n.log"; src=$(cd "$tree" && pwd)
  (cd "$src" && PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}" timeout "${AB_LIMIT:-120}" \
     python3 scripts/bench_latency.py --model "$MODEL" --batch-sizes 1 --steps 200 ${AB_FLAGS:-} \
     > "$log" 2>&1; echo "exit $?" >> "$log")
  printf '%s: ' "$tree"
  if grep -q '^RESULT' "$log"; then
    grep '^RESULT' "$log" | python3 -c "import json, sys
r = json.loads(sys.stdin.read()[7:])['rows'][0]
ms = lambda k: '-' if r[k] is None else f'{r[k]:.3f}'
print(f'step {ms(\"step_ms\")} ms, overlapped {ms(\"overlap_ms\")} ms, graph {ms(\"graph_ms\")} ms, roofline {ms(\"roofline_ms\")} ms')"
  else
    echo "no result (see $log)"
  fi
done
