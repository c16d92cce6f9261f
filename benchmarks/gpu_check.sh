#!/usr/bin/env bash
# The GPU checks of issue 18, in the issue's order, as one bounded run on a machine with a GPU (TOTAL_S: 6.5 minutes,
# the wheel install included; a task's device time is 15 minutes in all, the machine's start included, so one call
# of ~8 minutes leaves room for a rerun of the stages that failed, with STAGES and a smaller TOTAL_S):
#   1. a tiny Llama with Llama 3 rope loaded on CUDA, checked against the CPU engine (benchmarks/gpu_smoke.py);
#   2. the service, speech and Whisper service tests with OMNIVOX_TEST_DEVICE=cuda (Whisper: the default speech
#      recognition model, with its encoder worker thread and cross-attention on the GPU);
#   3. decoder parity, the static-decode twin, the in-place (flex) decode attention and the codec's CUDA graphs
#      (tests/codecs/test_codec_graphs.py: graph replay == eager, bucket passes == dynamic decode, the decode worker's own
#      thread on the codec's device and stream) on CUDA in float32, the
#      sampler's one host copy per step under torch's sync debug mode (tests/engine/test_sampler_transfer.py) and the
#      Whisper encoder-decoder engine (tests/engine/test_whisper_engine.py), a model capturing its graphs at load while
#      another serves (tests/services/test_load_while_serving.py), the dynamic path's one staged copy per step under the sync
#      debug mode (tests/engine/test_runner_staging.py) and speculative decoding's one host read per step, plain rows and
#      drafts together (tests/engine/test_speculative.py);
#   4. bash benchmarks/gpu.sh with what is left of the budget, on a trimmed workload that fits it (omnivox against
#      transformers' continuous batching at concurrency 1 and 16, 15-s levels; the full workload is
#      `bash benchmarks/gpu.sh` alone, ~8 minutes), then the server log searched for failed steps.
# Not checked here: tensor parallelism (one GPU; CUDA graphs are off under TP anyway).
# Every stage appends its line to summary.txt as it ends, so a run cut short keeps what it saw. The script exits 1,
# naming them on its last line ("FAILED: ..."), when the environment does not import or any stage fails, runs out of
# budget, or the server log shows failed steps.
#
# On the device machine (its image lacks a few of our packages; their wheels travel in .whl, see below):
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=420)
# Here, first: `bash benchmarks/gpu_check.sh --dry-run` (CPU, ~1 min): the same environment set-up and stage plumbing,
# each stage only collecting its tests / importing its modules (tests/benchmarks/test_gpu_script.py runs it).
# The files come back from $OUT (8 at most): summary.txt, smoke.json, smoke.log, tests-service.log, tests-cuda.log,
# gpu.log, results.json, server.log.
#
# .whl (gitignored, ~27 MiB of the 64 MiB a call carries) is filled here once, for the image's Python 3.12 on x86-64,
# with what the image (/work/.library/device/KINDS.md lists it) lacks or holds too old, in the repo root:
#   rm -rf .whl && .venv/bin/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     grpcio==1.85.3 protobuf==7.36.2 googleapis-common-protos==1.76.0 grpcio-health-checking==1.85.1 \
#     grpcio-reflection==1.85.1 grpcio-status==1.85.3 gguf==0.19.0 snac==1.2.1 soundfile==0.14.0 cffi==2.1.1 \
#     pycparser==3.12 num2words==0.5.14 transformers==5.24.0 regex==2026.11.19 llguidance==1.9.1
#   ls .whl | wc -l   # 15 wheels (llguidance's is manylinux_2_31: engine/structured.py imports it, so without it
#                     # nothing of the engine imports). The image's huggingface_hub 1.33, tokenizers 0.23, torch 2.11,
#                     # numpy, safetensors, prometheus-client, pytest, pytest-timeout and hypothesis serve as they are.
#
# Environment: OUT (default gpu-check), PYTHON (default python3), TOTAL_S (default 390), STAGES (default "1 2 3 4":
# a rerun may pick some, e.g. STAGES="3" TOTAL_S=200 with timeout_s=230).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT="${OUT:-gpu-check}"
PY="${PYTHON:-python3}"
TOTAL_S="${TOTAL_S:-390}"
STAGES="${STAGES:-1 2 3 4}"
mkdir -p "$OUT"
START=$(date +%s)
export PYTHONUNBUFFERED=1

FAILED=()
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }
left() { echo $(( START + TOTAL_S - $(date +%s) )); }
wanted() { [[ " $STAGES " == *" $1 "* ]]; }
# stage NAME CAP_S LOG COMMAND...: run under min(CAP_S, time left), output to LOG, one summary line.
stage() {
  local name=$1 cap=$2 log=$3; shift 3
  local limit; limit=$(left); [ "$limit" -gt "$cap" ] && limit=$cap
  if [ "$limit" -lt 20 ]; then
    summary "$(printf '%-34s skipped: budget spent' "$name")"; FAILED+=("$name (budget spent)"); return 1
  fi
  local t0; t0=$(date +%s)
  timeout "$limit" "$@" > "$log" 2>&1
  local rc=$?
  summary "$(printf '%-34s rc=%-3s %4ss (limit %ss)  %s' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$limit" \
    "$(grep -E '(passed|failed|error|collected).* in [0-9.]+s|^gpu_smoke:' "$log" | tail -n 1)")"
  [ "$rc" -ne 0 ] && FAILED+=("$name (rc=$rc)")
  return $rc
}

# 0. Environment: the image's python and torch, our missing packages from .whl, omnivox from this tree (a link
# farm with the layout pyproject's package-dir maps, so nothing is built).
summary "gpu_check $(date -u '+%F %T') UTC, commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
[ "$DRY" = 1 ] && summary "dry run: on this machine's python; each stage only collects its tests or imports"
[ "$DRY" = 0 ] && summary "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -n 1)"
if [ -d .whl ] && [ "$DRY" = 0 ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUT/smoke.log" 2>&1 || summary "wheel install failed: $(tail -n 3 "$OUT/smoke.log")"
fi
SHIM=/tmp/omnivox-shim-$$
rm -rf "$SHIM" && mkdir -p "$SHIM/omnivox"
trap 'rm -rf "$SHIM"' EXIT
cp -r protos/omnivox/. "$SHIM/omnivox/"
for pkg in services engine models codecs benchmarks; do ln -s "$PWD/$pkg" "$SHIM/omnivox/$pkg"; done
SITE=:/tmp/site
[ "$DRY" = 1 ] && SITE=""  # the wheels are for the image's Python 3.12: not here
export PYTHONPATH="$SHIM$SITE${PYTHONPATH:+:$PYTHONPATH}"
# Everything the stages import: a package missing from the image and from .whl stops the run here, named.
if ! env_line=$("$PY" -c 'import torch, transformers, grpc, llguidance, omnivox.engine, omnivox.services.grpc_api.server, omnivox.codecs.snac; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "transformers", transformers.__version__, "grpc", grpc.__version__)' 2>&1); then
  summary "environment broken: $(echo "$env_line" | tail -n 1)"
  summary "FAILED: environment (see the header for .whl)"
  exit 1
fi
summary "$(echo "$env_line" | tail -n 1)"

if wanted 1; then
  if [ "$DRY" = 1 ]; then
    stage "1 llama3-rope load on cuda" 100 "$OUT/smoke.log" "$PY" -c "import omnivox.benchmarks.gpu_smoke"
  else
    stage "1 llama3-rope load on cuda" 100 "$OUT/smoke.log" "$PY" -m omnivox.benchmarks.gpu_smoke --out "$OUT/smoke.json"
  fi
fi
PYTEST=("$PY" -m pytest -q -p no:cacheprovider --timeout 100 -o "addopts=" -W ignore::UserWarning)
[ "$DRY" = 1 ] && PYTEST+=(--collect-only)
if wanted 2; then
  OMNIVOX_TEST_DEVICE=cuda stage "2 service+speech tests (cuda)" 120 "$OUT/tests-service.log" \
    "${PYTEST[@]}" tests/services/generation/test_service_generate.py tests/services/speech/test_speech_service.py tests/services/transcription/test_whisper_service.py
fi
if wanted 3; then
  OMNIVOX_TEST_DEVICE=cuda stage "3 parity+twin+flex fp32 (cuda)" 150 "$OUT/tests-cuda.log" \
    "${PYTEST[@]}" tests/engine/test_static_decode.py tests/models/test_decoder_parity.py tests/models/test_paged_flex.py \
    tests/engine/test_engine.py tests/models/test_meta_build.py tests/codecs/test_codec_graphs.py tests/engine/test_sampler_transfer.py \
    tests/engine/test_whisper_engine.py tests/services/test_load_while_serving.py tests/engine/test_runner_staging.py \
    tests/engine/test_speculative.py
fi
if wanted 4; then
  budget=$(( $(left) - 15 ))
  if [ "$DRY" = 1 ]; then
    stage "4 gpu.sh" 30 "$OUT/gpu.log" bash -n benchmarks/gpu.sh
  elif [ "$budget" -lt 60 ]; then
    summary "4 gpu.sh                            skipped: ${budget}s left"
    FAILED+=("4 gpu.sh (budget spent)")
  else
    BENCH_OUT=/tmp/gpu-bench
    stage "4 gpu.sh" "$budget" "$OUT/gpu.log" env OUT="$BENCH_OUT" BUDGET_S="$budget" PYTHON="$PY" bash benchmarks/gpu.sh \
      -- --concurrency 1,16 --level-seconds 15 --systems omnivox,hf-cb
    cp "$BENCH_OUT/results.json" "$OUT/results.json" 2>/dev/null
    if [ -f "$BENCH_OUT/omnivox-server.log" ]; then
      {
        echo "# failed steps and errors in the omnivox server log"
        grep -n -E "step failed|failing the|sampling failed|stream is capturing|Traceback|Error|falling back" \
          "$BENCH_OUT/omnivox-server.log" | head -n 100
        echo "# the log's last 150 lines"
        tail -n 150 "$BENCH_OUT/omnivox-server.log"
      } > "$OUT/server.log"
      failed_steps=$(grep -c -E 'step failed|failing the|stream is capturing' "$BENCH_OUT/omnivox-server.log")
      summary "server log: $failed_steps failed steps; $(grep -m1 'decode attention' "$BENCH_OUT/omnivox-server.log" | cut -c1-160)"
      [ "$failed_steps" -gt 0 ] && FAILED+=("server log: $failed_steps failed steps")
    fi
  fi
fi
summary "total $(( $(date +%s) - START ))s"
if [ "${#FAILED[@]}" -gt 0 ]; then
  summary "FAILED: $(IFS=';'; echo "${FAILED[*]}")"
  exit 1
fi
summary "all stages passed"
