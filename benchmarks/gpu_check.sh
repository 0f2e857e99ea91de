#!/usr/bin/env bash
# The GPU check of the kernel paths (docs/gpu.md): one offline run on a CUDA machine, sized for one
# H200 in about 8 minutes including the causal-conv1d compile.
#
#   benchmarks/gpu_check.sh [--dry-run] [--stages S,...] [--allow-skip KERNEL ...] [--cases REGEX]
#                           [--results DIR] [WHEELS_DIR] OUT_DIR
#
# WHEELS_DIR: the wheelhouse `python -m benchmarks.gpu_check wheelhouse DIR` prepared on a machine
# with a package registry (fla wheels, mamba-ssm and causal-conv1d source archives, a manifest with
# sha256). Without it the installed packages are used. Everything lands under OUT_DIR/site;
# nothing is installed into the machine's Python.
#
# Stages, each in its own process under its budget (GPU_CHECK_BUDGET_<STAGE> seconds; the total
# GPU_CHECK_BUDGET_TOTAL caps the run): setup, support, kernels, correctness, speed
# (benchmarks/gpu_check/plan.py). A kernel of ssm_pack.kernels.KERNELS that should run here and did
# not fails the check unless --allow-skip names it. OUT_DIR/summary.md and gpu_check.json say which
# stages and kernels ran, which were skipped and why; the exit code is 0 only when the check passed.
#
# --dry-run: every stage on the CPU, tiny sizes, the Triton kernels under TRITON_INTERPRET=1 (the CUDA
# C++ kernels are not applicable there; the causal-conv1d build is planned, not compiled).
# PYTHON picks the interpreter (default python3).
set -uo pipefail

PY=${PYTHON:-python3}
command -v "$PY" >/dev/null || { echo "gpu_check: no Python interpreter '$PY' (set PYTHON)" >&2; exit 2; }
ROOT=$(cd "$(dirname "$0")/.." && pwd) || exit 2
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "$PY" -m benchmarks.gpu_check run "$@"
