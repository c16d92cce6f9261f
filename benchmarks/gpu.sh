#!/usr/bin/env bash
# The benchmark workload on CUDA: omnivox (bf16; CUDA graphs for decode when the engine has them, its default on CUDA)
# against transformers generate and generate_batch, on a randomly initialised Llama-3.2-1B-shaped checkpoint.
# Budget: under 8 minutes on one GPU. Prints a short table last.
#
#   bash benchmarks/gpu.sh            # on a machine with a GPU
#   bash benchmarks/gpu.sh --dry-run  # the same steps on CPU with a tiny model and a tiny workload (what the tests run)
#   bash benchmarks/gpu.sh [--dry-run] -- ARGS...  # ARGS go to the benchmark last (they win over the defaults)
#
# Exit status: nonzero when the omnivox server cannot start, a request fails, or the budget runs out. results.json is
# written after every level, so a run cut short keeps what it measured.
# Environment: PYTHON (default: .venv/bin/python, else python3), OUT (default: bench-results/gpu),
# BUDGET_S (default 470: seconds for building the checkpoint and the benchmark together).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
OUT="${OUT:-bench-results/gpu}"
BUDGET_S="${BUDGET_S:-470}"
DRY=0
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "gpu.sh: unknown argument $1 (only --dry-run, then -- ARGS for the benchmark)" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$OUT"
CKPT="$OUT/checkpoint"

if [ "$DRY" = 1 ]; then
  SHAPE=tiny DTYPE=float32 DEVICE=cpu
  BENCH=(--concurrency 1,2 --min-requests 2 --requests-per-slot 1 --prompt-words 4,12 --output-tokens 4,8
         --shared-prefix-words 4 --bandwidth-mib 16 --systems omnivox,hf)
else
  SHAPE=llama-3.2-1b DTYPE=bfloat16 DEVICE=cuda
  "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu.sh: no CUDA device (use --dry-run)')"
  BENCH=(--concurrency 1,4,16,64 --min-requests 8 --requests-per-slot 2 --prompt-words 64,512 --output-tokens 64,256
         --shared-prefix-words 64 --bandwidth-mib 2048 --level-seconds 25 --systems omnivox,hf,hf-cb)
fi

start=$(date +%s)
# One deadline for everything: building the checkpoint counts against the same budget as the benchmark.
left() {
  local n=$(( start + BUDGET_S - $(date +%s) ))
  if [ "$n" -le 0 ]; then echo "gpu.sh: budget of $BUDGET_S s spent" >&2; exit 1; fi
  echo "$n"
}
if [ ! -f "$CKPT/config.json" ] || ! grep -q "\"$SHAPE\"" "$CKPT/RANDOM_WEIGHTS.json" 2>/dev/null; then
  rm -rf "$CKPT"
  timeout "$(left)" "$PYTHON" -m omnivox.benchmarks.make_random_checkpoint --shape "$SHAPE" --dtype "$DTYPE" \
    --device "$DEVICE" --out "$CKPT" || { echo "gpu.sh: building the checkpoint failed or timed out" >&2; exit 1; }
fi
# A bounded run: `timeout` keeps a hung server from eating the GPU budget. The benchmark exits nonzero when an
# omnivox system was skipped (its server did not start) or any request failed.
timeout "$(left)" "$PYTHON" -m omnivox.benchmarks --model "$CKPT" --dtype "$DTYPE" --device "$DEVICE" --out "$OUT" \
  --no-progress "${BENCH[@]}" "${EXTRA[@]}" > "$OUT/bench.log" 2>&1 || {
  code=$?
  tail -n 40 "$OUT/bench.log" >&2
  [ "$code" = 124 ] && echo "gpu.sh: benchmark timed out; partial results in $OUT/results.json" >&2
  [ -f "$OUT/omnivox-server.log" ] && { echo "--- omnivox server log (tail)" >&2; tail -n 20 "$OUT/omnivox-server.log" >&2; }
  exit 1
}

"$PYTHON" - "$OUT/results.json" "$(( $(date +%s) - start ))" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"{r['machine']} | {r['model']} ({r['dtype']}) | {sys.argv[2]} s")
if r.get("floor"):
    print(f"batch-1 ITL floor {r['floor']['itl_floor_ms']:.2f} ms at {r['floor']['bandwidth_gb_s']:.0f} GB/s")
print(f"{'system':<40} {'conc':>4} {'total TPS':>10} {'TTFT p50 ms':>12} {'ITL p50 ms':>11} {'ITL p99 ms':>11}")
for x in r["levels"]:
    print(f"{x['system']:<40} {x['concurrency']:>4} {x['total_tps']:>10.1f} {x['ttft_p50_ms']:>12.1f}"
          f" {x['itl_p50_ms']:>11.2f} {x['itl_p99_ms']:>11.2f}")
for name, why in r.get("skipped", {}).items():
    print(f"skipped {name}: {why}")
PY
