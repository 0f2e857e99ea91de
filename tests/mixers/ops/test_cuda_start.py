"""The cuda-marked tests can start on a GPU: run on CPU with the device faked (``tests/support/fake_device.py``),
every one is collected and reaches its first kernel call (the strict fakes check upstream's contract
there), or skips for a reason that holds on any GPU."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[3]
CUDA_TESTS = "tests/mixers/ops/test_cuda_kernels.py"
# skips that hold on every GPU: what the kernels take, not what is installed
ALLOWED_SKIPS = ("flash-attn takes fp16 / bf16 only", "fla's Gated DeltaProduct kernel takes fp16 / bf16 only")


def test_every_cuda_test_reaches_its_first_kernel_call():
    env = {**os.environ, "SSM_PACK_FAKE_CUDA": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "cuda",
                          CUDA_TESTS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    passed = int(re.search(r"(\d+) passed", out).group(1))
    skips = re.findall(r"SKIPPED \[\d+\] \S+ (.*)", out)
    assert passed >= 20 and not re.search(r"\d+ (failed|error)", out), out[-2000:]
    assert all(reason.startswith(ALLOWED_SKIPS) for reason in skips), skips
