"""Autocast cases of the GPU check's correctness stage: every mixer layer and one ``HybridLM("MGKPA")``
training step under ``torch.autocast`` (bf16 on CUDA; on the CPU dry run, CPU autocast to fp16: the
Triton interpreter computes bf16 as garbage, numpy has no bf16), built
twice with the same weights, ``backend="kernel"`` against ``backend="reference"`` under the same
autocast.

Both sides see autocast's bf16 projections, so the figure is the kernels' difference from the
references in the dtype a mixed-precision user trains in: the layer's output, the gradient of its
input and of every parameter (relative RMS, bf16 / fp16 limits 5e-3 forward / 1e-2 gradients). A kernel
that refuses the inputs makes the case ``skipped`` with its reason; each case names the kernels of its
mixers' plans (``PLAN``), so a skip for a missing one counts against that kernel.

    T = packed tokens, D = hidden
"""

from __future__ import annotations

import torch

from .grading import LIMITS, as_skip, rel_rms
from .record import Case

BF16 = torch.bfloat16
SMALL = {"M": {"head_dim": 16, "state_size": 8, "chunk_size": 16}, "G": {"head_dim": 8, "chunk_size": 16},
         "K": {"head_dim": 8, "chunk_size": 16}, "P": {"head_dim": 8, "chunk_size": 16}, "A": {"head_dim": 8}}


def _sizes(setup):
    """``(hidden, mixer overrides, document lengths)``: tiny on the dry run, empty and 1-token documents."""
    if setup.dry:
        return 32, SMALL, [0, 5, 1, 0, 13]
    return 256, {}, [0, 1, 300, 0, 1000, 1, 77, 2]


def autocast_dtype(setup) -> torch.dtype:
    return torch.float16 if setup.dry else BF16


def _twins(build, kernels):
    """The same module built twice from one seed: ``{"kernel": ..., "reference": ...}``; a kernel
    the layer refuses at construction (package missing, no device) is :class:`Skip`."""
    twins = {}
    for backend in ("kernel", "reference"):
        torch.manual_seed(0)
        try:
            twins[backend] = build(backend)
        except (ValueError, RuntimeError) as err:
            skip = as_skip(err, kernels) if backend == "kernel" else None
            if skip is not None:
                raise skip from err
            raise
    return twins


def plan_kernels(*classes) -> tuple[str, ...]:
    """Every kernel the ``PLAN`` of the mixer ``classes`` names, in order, once."""
    names = [kernel for cls in classes for _, choices in getattr(cls, "PLAN", ()) for kernel, _ in choices]
    return tuple(dict.fromkeys(names))


def _grade(setup, kernel: dict, reference: dict):
    """``(detail, figures, ok)`` over matching named tensors, bf16 limits (``out*`` forward, the rest gradients)."""
    dtype = autocast_dtype(setup)
    fwd, bwd = LIMITS[dtype]
    figures = {}
    for name, want in reference.items():
        got = kernel.get(name)
        if want is not None:                                   # a gradient the kernel side lacks fails
            figures[name] = float("inf") if got is None else rel_rms(got, want)
    bad = [n for n, e in figures.items() if not e <= (fwd if n.startswith("out") else bwd)]
    bad += [f"{n} is {kernel[n].dtype}, the reference's {t.dtype}" for n, t in reference.items()
            if n.startswith("out") and kernel[n].dtype != t.dtype]              # autocast's dtype kept
    worst = max(figures, key=figures.get)
    detail = f"autocast {str(dtype)[6:]}: worst {worst} {figures[worst]:.2e} (limits {fwd:.0e} / {bwd:.0e})"
    return detail + (f"; over the limit: {bad}" if bad else ""), figures, not bad


def _run_side(setup, backend, step, kernels):
    """Run ``step()`` under autocast; a kernel refusal becomes :class:`Skip`."""
    try:
        with torch.autocast(setup.device, dtype=autocast_dtype(setup)):
            return step()
    except (ValueError, RuntimeError) as err:
        skip = as_skip(err, kernels) if backend == "kernel" else None
        if skip is not None:
            raise skip from err
        raise


def case_layer_autocast(setup, letter: str):
    """One mixer layer, packed: forward under autocast, backward of a fixed projection of its output."""
    from mixers.layers.registry import MIXERS
    from ssm_pack import PackedSeqParams
    hidden, overrides, lengths = _sizes(setup)
    kernels = plan_kernels(MIXERS[letter].mixer)
    layers = _twins(lambda b: MIXERS[letter].mixer(hidden, backend=b, **overrides.get(letter, {})).to(setup.device),
                    kernels)
    params = PackedSeqParams.from_lengths(lengths, device=setup.device)
    T = int(params.total_tokens)
    gen = torch.Generator().manual_seed(1)
    x0, g_out = torch.randn(1, T, hidden, generator=gen), torch.randn(1, T, hidden, generator=gen)
    results = {}
    for backend, layer in layers.items():
        x = x0.to(setup.device).requires_grad_()
        out = _run_side(setup, backend, lambda: layer(x, packed_seq_params=params), kernels)  # noqa: B023
        (out.float() * g_out.to(setup.device)).sum().backward()
        results[backend] = {"out": out, "dx": x.grad, **{f"d{n}": p.grad for n, p in layer.named_parameters()}}
    return _grade(setup, results["kernel"], results["reference"])


def case_model_autocast(setup):
    """One ``HybridLM("MGKPA")`` training step on a packed batch under autocast: loss, logits, every gradient."""
    from mixers import HybridLM
    from mixers.layers.registry import MIXERS
    from ssm_pack import PackedSeqParams
    hidden, overrides, lengths = _sizes(setup)
    vocab = 64 if setup.dry else 32000
    kernels = plan_kernels(*(kind.mixer for kind in MIXERS.values()))
    models = _twins(lambda b: HybridLM(vocab, hidden, "MGKPA", backend=b, mixer_overrides=overrides)
                    .to(setup.device), kernels)
    params = PackedSeqParams.from_lengths(lengths, device=setup.device)
    ids = torch.randint(0, vocab, (1, int(params.total_tokens)), generator=torch.Generator().manual_seed(2))
    ids = ids.to(setup.device)
    results = {}
    for backend, model in models.items():
        out = _run_side(setup, backend, lambda: model(ids, params, labels=ids), kernels)  # noqa: B023
        out["loss"].backward()
        results[backend] = {"out_loss": out["loss"].reshape(1), "out_logits": out["logits"],
                            **{f"d{n}": p.grad for n, p in model.named_parameters()}}
    return _grade(setup, results["kernel"], results["reference"])


def autocast_cases(setup) -> list[Case]:
    """One case per mixer layer, then the model step."""
    from mixers.layers.registry import MIXERS
    tag = "fp16" if setup.dry else "bf16"
    cases = [Case(f"{MIXERS[letter].mixer.__name__} under autocast [{tag}]", case_layer_autocast, (setup, letter),
                  plan_kernels(MIXERS[letter].mixer)) for letter in MIXERS]
    return cases + [Case(f"HybridLM MGKPA step under autocast [{tag}]", case_model_autocast, (setup,),
                         plan_kernels(*(kind.mixer for kind in MIXERS.values())))]
