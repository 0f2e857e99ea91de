#!/usr/bin/env bash
# GPU check of the kernel paths, offline, in under 9 minutes on one H200.
#
#   benchmarks/gpu_check.sh WHEELS_DIR OUT_DIR
#
# WHEELS_DIR holds wheels or source archives of whatever the machine lacks (torch if missing,
# flash-linear-attention + triton, causal-conv1d and mamba-ssm sources, pytest, hypothesis,
# packaging, matplotlib). causal-conv1d is built for sm_90 only; mamba-ssm is built when time
# allows. Writes OUT_DIR/gpu_check.log, support.txt, cuda_tests.txt, gpu_bench.md and summary.md.
set -uo pipefail
WHEELS=$(cd "${1:?usage: gpu_check.sh WHEELS_DIR OUT_DIR}" && pwd)
OUT=${2:?usage: gpu_check.sh WHEELS_DIR OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/gpu_check.log"
START=$(date +%s)
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
python() { "$PY" "$@"; }
say() { echo "[$(($(date +%s) - START))s] $*" | tee -a "$LOG"; }
left() { echo $((540 - ($(date +%s) - START))); }           # seconds left of the 9-minute budget
pip_offline() { python -m pip install --no-index --find-links "$WHEELS" "$@" >>"$LOG" 2>&1; }

say "gpu_check: wheels from $WHEELS, output to $OUT"
python -c "import torch" 2>/dev/null || { say "installing torch from the wheels"; pip_offline torch; }
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
    say "FAIL: torch sees no CUDA device"; exit 2; }
python -c "import torch; print('torch', torch.__version__, 'on', torch.cuda.get_device_name(0))" | tee -a "$LOG"

say "installing ssm-pack and the test tools"
pip_offline --no-deps -e . && pip_offline packaging pytest hypothesis matplotlib || say "WARN: some test tools missing"
say "installing flash-linear-attention (pure Python) and triton"
pip_offline flash-linear-attention triton || say "WARN: fla not installed; GDN/KDA/GDP kernels will be skipped"
say "building causal-conv1d for sm_90 only"
TORCH_CUDA_ARCH_LIST="9.0" CAUSAL_CONV1D_FORCE_BUILD=TRUE timeout 200 \
    python -m pip install --no-index --find-links "$WHEELS" --no-build-isolation causal-conv1d >>"$LOG" 2>&1 \
    || say "WARN: causal-conv1d did not build in time; conv kernels will be skipped"
if [ "$(left)" -gt 330 ]; then
    say "building mamba-ssm for sm_90 (time allows)"
    TORCH_CUDA_ARCH_LIST="9.0" MAMBA_FORCE_BUILD=TRUE timeout $(( $(left) - 300 )) \
        python -m pip install --no-index --find-links "$WHEELS" --no-build-isolation mamba-ssm >>"$LOG" 2>&1 \
        || say "WARN: mamba-ssm did not build in time; SSD kernels will be skipped"
else
    say "skipping mamba-ssm: $(left)s left"
fi

python -m ssm_pack > "$OUT/support.txt" 2>&1; cat "$OUT/support.txt" >> "$LOG"

say "cuda-marked tests (kernel vs reference, every op and layer, packed and unpacked, bf16 and fp32)"
timeout $(( $(left) > 150 ? 150 : $(left) )) python -m pytest -q -m cuda tests -rs > "$OUT/cuda_tests.txt" 2>&1
TESTS=$?
tail -n 25 "$OUT/cuda_tests.txt" | tee -a "$LOG"

say "GPU benchmarks"
timeout $(( $(left) > 20 ? $(left) - 10 : 10 )) python -m benchmarks.bench_gpu --out "$OUT" >>"$LOG" 2>&1
BENCH=$?

{
    echo "# gpu_check summary"
    echo
    echo "- cuda tests exit code: $TESTS ($(tail -n 1 "$OUT/cuda_tests.txt"))"
    echo "- gpu benchmarks exit code: $BENCH"
    echo "- seconds: $(($(date +%s) - START))"
    echo
    [ -f "$OUT/gpu_bench.md" ] && cat "$OUT/gpu_bench.md"
} > "$OUT/summary.md"
cat "$OUT/summary.md" | tee -a "$LOG"
[ "$TESTS" -eq 0 ] && [ "$BENCH" -eq 0 ]
