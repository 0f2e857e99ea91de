#!/usr/bin/env bash
# GPU check of the kernel paths: one offline script, no compiler, sized for one H200 in under 10 minutes.
#
#   benchmarks/gpu_check.sh [--dry-run] [WHEELS_DIR] OUT_DIR
#
# WHEELS_DIR (optional: without it the installed packages are used) holds what the machine lacks:
# the flash-linear-attention and fla-core wheels (pure Python), einops, packaging, the mamba-ssm
# source archive (mamba_ssm-2.3.2.post1.tar.gz: only its Triton kernels are used, loaded from the
# Python sources without the CUDA extension) and, only if one is prebuilt for this machine's torch,
# a causal-conv1d wheel (fla's Triton conv runs otherwise). Wheels are unzipped into OUT_DIR/site;
# nothing is compiled and nothing is installed into the machine's Python.
#
# Stages, in order, each with its own time budget (GPU_CHECK_BUDGET_<STAGE> seconds overrides it);
# a stage that fails or runs out of time does not stop the next:
#   setup        unzip WHEELS_DIR into OUT_DIR/site
#   support      python -m ssm_pack (the machine as ssm-pack's support checks see it)
#   kernels      which kernel of the table runs here once the sources are loaded
#   correctness  every kernel vs the reference (benchmarks/gpu_correctness.py)
#   speed        packed vs padded, wrapper overhead, a HybridLM training step (benchmarks/bench_gpu.py)
# then OUT_DIR/gpu_check.json and OUT_DIR/summary.md (benchmarks/gpu_results.py); per stage
# OUT_DIR/<stage>.log and <stage>.json. Exit code 0 only when every stage passed.
#
# --dry-run: every stage on the CPU, tiny sizes, the Triton kernels under TRITON_INTERPRET=1 (cases
# whose package is missing are recorded as skipped, with the reason). GPU_CHECK_CASES=REGEX runs only
# the matching cases. PYTHON picks the interpreter (default python3).
set -uo pipefail

usage() { echo "usage: gpu_check.sh [--dry-run] [WHEELS_DIR] OUT_DIR" >&2; exit 2; }
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
case $# in
    1) WHEELS=""; OUT=$1 ;;
    2) WHEELS=$(cd "$1" && pwd) || usage; OUT=$2 ;;
    *) usage ;;
esac
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null || { echo "gpu_check: no Python interpreter '$PY' (set PYTHON)" >&2; exit 2; }
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT" || usage
OUT=$(cd "$OUT" && pwd) || usage
rm -f "$OUT"/stages.tsv "$OUT"/*.json "$OUT"/*.log "$OUT"/summary.md
LOG="$OUT/gpu_check.log"
SITE="$OUT/site"
cd "$ROOT" || exit 2

export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export TRITON_F32_DEFAULT=ieee        # fp32 kernels are compared at 1e-5: IEEE fp32 dots, not TF32
export FLA_FLASH_QLA=0 FLA_FLASH_KDA=0 FLA_TILELANG=0 FLA_INTRACARD_CP=0   # fla's Triton kernels only
CASES=${GPU_CHECK_CASES:-}
FLAGS=()
if [ "$DRY" -eq 1 ]; then
    export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=""
    FLAGS=(--dry-run)
fi

say() { echo "[${SECONDS}s] $*" | tee -a "$LOG"; }

budget() {  # budget STAGE GPU_SECONDS DRY_SECONDS
    local var="GPU_CHECK_BUDGET_${1^^}"
    if [ -n "${!var:-}" ]; then echo "${!var}"; elif [ "$DRY" -eq 1 ]; then echo "$3"; else echo "$2"; fi
}

stage() {  # stage NAME BUDGET COMMAND...: run it under its budget, record its exit code and seconds
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    say "stage $name (budget ${limit}s): $*"
    timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" "$limit" >>"$OUT/stages.tsv"
    tail -n 40 "$OUT/$name.log" >>"$LOG"
    say "stage $name: exit code $rc after $((SECONDS - start))s"
}

say "gpu_check: $("$PY" --version 2>&1), dry run $DRY, wheels ${WHEELS:-none (installed packages)}, output $OUT"
if [ -n "$WHEELS" ]; then
    stage setup "$(budget setup 30 60)" "$PY" -m benchmarks.gpu_loading unpack "$WHEELS" "$SITE"
fi
stage support "$(budget support 45 120)" "$PY" -m ssm_pack
stage kernels "$(budget kernels 45 120)" "$PY" -m benchmarks.gpu_loading report "$OUT" ${FLAGS[@]+"${FLAGS[@]}"}
stage correctness "$(budget correctness 300 900)" \
    "$PY" -m benchmarks.gpu_correctness --out "$OUT" --cases "$CASES" ${FLAGS[@]+"${FLAGS[@]}"}
stage speed "$(budget speed 150 1200)" "$PY" -m benchmarks.bench_gpu --out "$OUT" --cases "$CASES" ${FLAGS[@]+"${FLAGS[@]}"}

"$PY" -m benchmarks.gpu_results "$OUT"
RESULT=$?
tee -a "$LOG" <"$OUT/summary.md"
say "gpu_check: exit code $RESULT"
exit "$RESULT"
