"""Mutation check of the inference tests: plant one small bug at a time in a scratch copy of the
repository, run the relevant inference tests there, and report which bugs no test caught.

    python -m tests.mixers.inference.mutations            # every mutation, a table per area
    python -m tests.mixers.inference.mutations --list      # the planted changes
    python -m tests.mixers.inference.mutations --only NAME [--only NAME ...]
    python -m tests.mixers.inference.mutations --tests PATH [PATH ...]   # other tests for every mutation

Not part of the default test run (the file name does not start with ``test_``): each mutation
runs pytest once (about 10-40 s on 2 cores). The working tree is never modified; the copy lives
in a temporary directory. A baseline run with no mutation must pass first.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
HERE = "tests/mixers/inference/"
API, CONT, SAMPLE, CACHE, MAMBA = (HERE + n for n in ("test_inference_api.py", "test_continuation.py",
                                                          "test_sampling.py", "test_cache_api.py",
                                                          "test_mamba2_decode.py"))
OLD = [HERE + "test_model_cache.py", HERE + "test_mixer_cache.py", HERE + "test_decode_ops.py"]


@dataclass(frozen=True)
class Mutation:
    area: str
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


M = Mutation
MUTATIONS = [
    M("slots", "spread-rows-off-by-one", "mixers/inference/slots.py",
      "return out.index_copy(0, self.state_rows, states)", "return out.index_copy(0, self.state_rows + 1, states)",
      (CONT, *OLD)),
    M("slots", "pick-rows-off-by-one", "mixers/inference/slots.py",
      "return states if self.state_rows is None else states.index_select(0, self.state_rows)",
      "return states if self.state_rows is None else states.index_select(0, self.state_rows + 1)", (CONT, *OLD)),
    M("slots", "positions-ignore-cached-length", "mixers/inference/slots.py",
      "offset = self.starts_device[doc.clamp(max=len(self.host) - 1)] * (doc < len(self.host))",
      "offset = 0 * (doc < len(self.host))", (CONT, *OLD)),
    M("slots", "bool-slots-accepted", "mixers/inference/slots.py",
      "or slots.is_complex() or slots.dtype == torch.bool:", "or slots.is_complex():", (CACHE, *OLD)),
    M("slots", "reset-skips-the-lengths", "mixers/inference/slots.py",
      "            self.lengths[host] = 0\n", "            pass\n", (CACHE, *OLD)),
    M("grad", "layer-cache-write-keeps-graph", "mixers/inference/layer_cache.py",
      "state.index_copy_(0, batch.slots, values.detach().to(state.dtype))",
      "state.index_copy_(0, batch.slots, values.to(state.dtype))", (CONT, *OLD)),
    M("grad", "kv-write-keeps-graph", "mixers/inference/layer_cache.py",
      "state[slots, positions] = values.detach().to(state.dtype)",
      "state[slots, positions] = values.to(state.dtype)", (CONT, *OLD)),
    M("grad", "ssd-update-keeps-graph", "mixers/ops/ssd/update.py",
      "new = h.detach().to(state.dtype)", "new = h.to(state.dtype)", (CONT, *OLD)),
    M("grad", "conv-update-keeps-graph", "mixers/ops/causal_conv1d/update.py",
      "new = full[:, :, full.shape[2] - state_len:].detach().to(conv_state.dtype)",
      "new = full[:, :, full.shape[2] - state_len:].to(conv_state.dtype)", (CONT, *OLD)),
    M("grad", "kvcache-append-keeps-graph", "mixers/ops/attention/kvcache.py",
      "_append(k_cache, v_cache, k.detach(), v.detach(), index, lens)",
      "_append(k_cache, v_cache, k, v, index, lens)", (CONT, *OLD)),
    M("sampling", "logits-times-temperature", "mixers/inference/generate.py",
      "probs = torch.softmax((logits - logits.max()) / self.temperature, dim=-1)",
      "probs = torch.softmax((logits - logits.max()) * self.temperature, dim=-1)", (SAMPLE, *OLD)),
    M("sampling", "no-max-shift", "mixers/inference/generate.py",
      "probs = torch.softmax((logits - logits.max()) / self.temperature, dim=-1)",
      "probs = torch.softmax(logits / self.temperature, dim=-1)", (SAMPLE, *OLD)),
    M("sampling", "greedy-takes-argmin", "mixers/inference/generate.py",
      "return int(torch.argmax(logits))", "return int(torch.argmin(logits))", (SAMPLE, *OLD)),
    M("generate", "cache-argument-ignored", "mixers/inference/generate.py",
      "        cache = self.cache\n        if not isinstance(cache, InferenceCache):",
      "        cache = self.model.allocate_inference_cache(self.cache.capacity, self.cache.max_seqlen)\n"
      "        if not isinstance(cache, InferenceCache):", (SAMPLE, API, *OLD)),
    M("generate", "cache-checked-after-reset", "mixers/inference/generate.py",
      "        cache.check(self.model, reference.dtype, reference.device, what=\"the model\")\n",
      "        cache.reset()\n        cache.check(self.model, reference.dtype, reference.device, what=\"the model\")\n",
      (API, SAMPLE, *OLD)),
    M("generate", "nan-temperature-accepted", "mixers/inference/generate.py",
      "if not math.isfinite(temperature) or temperature < 0:", "if temperature < 0:", (API, SAMPLE, *OLD)),
    M("generate", "max-batch-size-ignored", "mixers/inference/generate.py",
      "return cache, cache.capacity if self.max_batch_size is None else self.max_batch_size",
      "return cache, cache.capacity", (API, SAMPLE, *OLD)),
    M("model", "token-ids-unchecked", "mixers/model.py",
      "        check_token_ids(input_ids, self.embed.num_embeddings)\n", "", (API, *OLD)),
    M("model", "cache-under-cp-accepted", "mixers/layers/cached.py",
      "    if layout is None and group is None and run is None:\n        return\n",
      "    return\n", (API, *OLD)),
    M("model", "mixer-cache-under-cp-accepted", "mixers/layers/cached.py",
      "        refuse_context_parallel(packed_seq_params, name)\n", "", (API, *OLD)),
    M("generate", "prompt-vocabulary-unchecked", "mixers/inference/generate.py",
      "    if vocab is not None and not all(0 <= t < vocab for t in tokens):",
      "    if False:", (API, *OLD)),
    M("generate", "inf-temperature-accepted", "mixers/inference/generate.py",
      "if not math.isfinite(temperature) or temperature < 0:", "if math.isnan(temperature) or temperature < 0:",
      (API, SAMPLE, *OLD)),
    M("cache", "reset-skips-states", "mixers/inference/cache.py",
      "        for layer in self.layers:\n            layer.clear(host)\n", "", (CACHE, *OLD)),
    M("cache", "allocate-ignores-dtype", "mixers/layers/cached.py",
      "        dtype = reference.dtype if dtype is None else dtype\n", "        dtype = reference.dtype\n",
      (CACHE, *OLD)),
    M("decode", "mamba2-decode-drops-dt-limit", "mixers/layers/mamba2.py",
      "state_batch_indices=batch.slots, dt_limit=c.dt_limit, backend=self.backend)",
      "state_batch_indices=batch.slots, backend=self.backend)", (MAMBA, *OLD)),
    M("decode", "ssd-update-ignores-dt-limit", "mixers/ops/ssd/update.py",
      "dt = process_dt(dt, dt_bias, dt_softplus, dt_limit, compute)",
      "dt = process_dt(dt, dt_bias, dt_softplus, (0.0, float('inf')), compute)", (MAMBA, *OLD)),
    M("decode", "ssd-update-skips-D", "mixers/ops/ssd/update.py",
      "        out = out + xc * D.to(compute)\n", "        out = out + 0 * D.to(compute)\n", (MAMBA, *OLD)),
    M("decode", "delta-step-decays-after-update", "mixers/ops/delta_rule/recurrent.py",
      "state = _delta_update(_decay(state, g), k, v, beta)", "state = _decay(_delta_update(state, k, v, beta), g)",
      (CONT, *OLD)),
    M("decode", "gdp-step-first-householder-only", "mixers/ops/delta_rule/recurrent.py",
      "for j in range(k.shape[1]):", "for j in range(1):", (CONT, *OLD)),
    M("decode", "delta-decode-from-zero-state", "mixers/layers/delta_base.py",
      "o, state = _STEP[self.KIND](q, k, v, g, beta, *extra, initial_state=initial, **kwargs)",
      "o, state = _STEP[self.KIND](q, k, v, g, beta, *extra, initial_state=None, **kwargs)", (CONT, *OLD)),
    M("decode", "conv-update-state-shifted", "mixers/ops/causal_conv1d/update.py",
      "new = full[:, :, full.shape[2] - state_len:].detach()",
      "new = full[:, :, full.shape[2] - state_len - 1:-1].detach()", (CONT, *OLD)),
    M("decode", "kvcache-window-off-by-one", "mixers/ops/attention/kvcache.py",
      "keep = keep & (key_pos >= query_pos[..., None] - left)",
      "keep = keep & (key_pos > query_pos[..., None] - left)", (CONT, *OLD)),
    M("decode", "kvcache-chunk-not-causal", "mixers/ops/attention/kvcache.py",
      "keep = keep & (key_pos <= query_pos[..., None]) if causal else keep", "keep = keep", (CONT, *OLD)),
]


def scratch_copy() -> Path:
    dest = Path(tempfile.mkdtemp(prefix="ssm-pack-mutations-")) / "repo"
    shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(".git", "__pycache__", "*.pyc", ".pytest_cache",
                                                              ".hypothesis", "docs", "benchmarks"))
    return dest


def run_tests(repo: Path, tests) -> tuple[int, str]:
    env = dict(os.environ, PYTHONPATH=str(repo), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-rfE", "-p", "no:cacheprovider", *tests]
    done = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    failed = [line.split(" - ")[0] for line in lines if line.startswith(("FAILED ", "ERROR "))]
    tail = lines[-1] if lines else done.stderr.strip()[-200:]
    return done.returncode, f"{tail}  {failed[0] if failed else ''}".rstrip()


def apply(repo: Path, m: Mutation) -> str:
    path = repo / m.path
    text = path.read_text()
    if text.count(m.old) != 1:
        raise SystemExit(f"{m.name}: the text to change occurs {text.count(m.old)} times in {m.path}; "
                         "update the mutation list")
    path.write_text(text.replace(m.old, m.new))
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--only", action="append", default=[])
    parser.add_argument("--tests", nargs="+", help="run these tests for every mutation instead of its own list")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    if args.tests:
        chosen = [Mutation(m.area, m.name, m.path, m.old, m.new, tuple(args.tests)) for m in chosen]
    if args.list:
        for m in chosen:
            print(f"{m.area:9s} {m.name:34s} {m.path}")
        return 0
    repo = scratch_copy()
    probe = subprocess.run([sys.executable, "-c", "import mixers; print(mixers.__file__)"], cwd=repo,
                           env=dict(os.environ, PYTHONPATH=str(repo)), capture_output=True, text=True)
    if not probe.stdout.startswith(str(repo)):
        raise SystemExit(f"the scratch copy does not shadow the installed package: {probe.stdout or probe.stderr}")
    rc, tail = run_tests(repo, sorted({t for m in chosen for t in m.tests}))
    if rc != 0:
        raise SystemExit(f"baseline (no mutation) fails: {tail}")
    results = []
    for m in chosen:
        original, start = apply(repo, m), time.time()
        try:
            rc, tail = run_tests(repo, m.tests)
        finally:
            (repo / m.path).write_text(original)
        results.append((m, rc != 0))
        print(f"{'killed ' if rc else 'SURVIVED'} {m.area:9s} {m.name:34s} {time.time() - start:5.1f} s  {tail}",
              flush=True)
    print("\narea       killed / planted")
    for area in dict.fromkeys(m.area for m, _ in results):
        row = [k for m, k in results if m.area == area]
        print(f"{area:10s} {sum(row):3d} / {len(row)}")
    print(f"{'all':10s} {sum(k for _, k in results):3d} / {len(results)}")
    shutil.rmtree(repo.parent, ignore_errors=True)
    return 0 if all(k for _, k in results) else 1


if __name__ == "__main__":
    sys.exit(main())
