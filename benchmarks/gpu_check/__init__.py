"""The GPU check (``benchmarks/gpu_check.sh``, docs/gpu.md): one offline run on a CUDA machine that
says which kernel ran, which was skipped and why, and fails when a kernel that should run did not.

    python -m benchmarks.gpu_check wheelhouse DIR [--python-version 3.12]   # on a networked machine
    benchmarks/gpu_check.sh [--dry-run] [options] [WHEELS_DIR] OUT_DIR        # on the CUDA machine

Modules, lowest first (an import only ever points down; ``tests/benchmarks`` checks it):

* :mod:`.record`: one stage's cases (``passed`` / ``failed`` / ``skipped`` with the kind of skip).
* :mod:`.plan`: the stages, their budgets, ``--stages`` / ``--allow-skip`` and which kernel this run
  expects to run.
* :mod:`.wheelhouse`: what the CUDA machine lacks, downloaded with its manifest (names, versions,
  sha256), and the wheel-tag reading the setup stage shares.
* :mod:`.loading`: how a stage process gets its kernels (fla pinned to Triton, mamba-ssm's Triton
  kernels from sources, the interpreter on a dry run).
* :mod:`.build`: causal-conv1d: a prebuilt wheel for this Python and torch, else its source archive
  compiled with nvcc for this device only, within a budget, or a line saying why not.
* :mod:`.setup_stage`: the setup stage: the wheelhouse into ``OUT/site``, nothing installed.
* :mod:`.machine`: the support stage (``python -m ssm_pack``) and the kernels stage.
* :mod:`.grading`: a kernel against the reference (relative RMS, the project's limits), one kernel
  of a family pinned, refusals told apart from missing kernels.
* :mod:`.stage`: the command line every measuring stage shares.
* :mod:`.autocast`, :mod:`.correctness`, :mod:`.speed`: the measuring stages' cases.
* :mod:`.verdict`: the rules: which stage passed, which kernel ran, the result.
* :mod:`.report`: ``gpu_check.json`` and ``summary.md`` from the stage records.
* :mod:`.runner`: the whole check: each stage in its own process under its budget, then the report.
"""
