"""Context-parallel test cases: packed-row layouts and the subjects run on them.

    P = ranks, T = tokens of the whole physical row, N = documents

A case is a subject (an op with initial and final states, a mixer, or ``HybridLM``), a layout
(document lengths, the row length T, shard bounds, per-document padding) and a seed. The same
function :func:`run_subject` runs it on the whole row (one process, the reference) and on one
rank's shard (CP, or CP without the exchange: the negative control), so both sides build their
inputs identically: full-row tensors from the seed, sliced to the shard.
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ssm_pack import PackedSeqParams, VarlenBatch

SMALL = {"M": {"head_dim": 4, "state_size": 4, "chunk_size": 8, "expand": 1},
         "G": {"head_dim": 4, "chunk_size": 8, "num_heads": 2, "num_v_heads": 4},
         "K": {"head_dim": 4, "chunk_size": 8, "num_heads": 2}, "P": {"head_dim": 4, "chunk_size": 8, "num_heads": 2},
         "A": {"head_dim": 4, "num_heads": 4, "num_kv_heads": 2}, "C": {"conv_size": 4, "conv_bias": True},
         "S": {"state_size": 4, "chunk_size": 8, "expand": 1, "dt_bc_norm": "weighted"},
         "R": {"conv_size": 4, "num_heads": 2},
         "L": {"head_dim": 4, "chunk_size": 8}}
OPS = ("conv", "ssd", "selective_scan", "gdn", "kda", "gdp", "rg_lru", "attention", "attention_window",
       "attention_varlen_attn", "attention_flash_window")
# ops run on one layout only: selective_scan_fn with its default arguments (no D, z, delta_bias, states)
PLAIN_OPS = ("selective_scan_plain",)
# attention under the CUDA device policy on fakes (tests/support/fakes.py), fp16: (the installed kernel, window)
KERNEL_ATTENTION = {"attention_varlen_attn": ("torch_varlen", None), "attention_flash_window": ("flash_attn", (5, 0))}
MIXERS = ("M", "G", "K", "P", "A", "C", "S", "R", "L")
HIDDEN, CONV_DIM, WIDTH = 16, 6, 4


@dataclass(frozen=True)
class Layout:
    lengths: tuple          # document lengths (0 = empty document)
    total: int              # T (tokens after the documents: the padding tail)
    bounds: tuple | None    # shard offsets (None: even split)
    pad_to: int = 1         # per-document padding of the physical layout

    def params(self) -> PackedSeqParams:
        return PackedSeqParams.from_lengths(list(self.lengths), pad_to_multiple_of=self.pad_to, total_tokens=self.total)

    def shard_bounds(self, world: int) -> tuple:
        return self.bounds or tuple(r * self.total // world for r in range(world + 1))


def _from_cuts(cuts, total, bounds=None, pad_to=1) -> Layout:
    cuts = sorted(cuts)
    return Layout(tuple(b - a for a, b in zip([0] + cuts[:-1], cuts)), total, bounds, pad_to)


def layout(kind: str, world: int, seed: int = 0) -> Layout:
    """Layouts that together cover: a document across several ranks, one ending exactly at a
    rank boundary, ranks without a document start, empty documents (at the row start, inside a
    shard, at a boundary, after a crossing document, at T, owned by a rank holding only a
    continuation),
    documents shorter than the conv window crossing a boundary, a padding tail crossing a
    boundary, uneven shards with a one-token shard, per-document padding, middle ranks holding
    fewer tokens of a document than the conv window, a rank's continuing segment longer than
    one 256-query block of CP attention."""
    rng = random.Random(seed * 7919 + world)
    if kind == "spanning":       # one document from rank 0 into the last rank; the middle ranks start nothing
        total = 12 * world
        end = 12 * (world - 1) + 3
        return _from_cuts([2, 2, end, end + 1, end + 1, end + 4], total)
    if kind == "boundary":       # documents ending exactly at rank boundaries (an empty one there), 2-token
        total = 10 * world + 3   # ones crossing them (shorter than the conv window)
        bounds = [r * total // world for r in range(world + 1)]
        cuts = [3]
        for i, b in enumerate(bounds[1:-1]):
            cuts += [b - 1, b + 1] if i % 2 else [b, b]
        if world == 2:
            cuts += [bounds[1] + 4, bounds[1] + 6]
        return _from_cuts(cuts, total, tuple(bounds))
    if kind == "tail":           # a padding tail across every rank boundary
        return _from_cuts([3, 3, 7], 9 * world)
    if kind == "random":         # uneven shards (one of a single token), random cuts, empties, a tail
        for _ in range(50):      # redrawn until some segment crosses a rank boundary
            lay = _random_layout(rng, world)
            if crosses(lay, world):
                return lay
        raise AssertionError("no crossing layout drawn")
    if kind == "empty_cont":     # ranks holding only a continuation, owning the empty document at their end
        total = 5 * world        # (at a rank boundary and at T), an empty one inside rank 0's shard
        return Layout((3, 0, 7, 0) + (10, 0) * ((world - 2) // 2), total, None)
    if kind == "empties":        # empty documents at the row start, inside a shard, at a rank boundary, right
        total = 10 * world       # after a crossing document ends inside a shard, and at T
        cuts = [0, 3, 3]
        for i in range(1, world):
            cuts += [10 * i + 2] * 2 if i % 2 else [10 * i] * 2
        return _from_cuts(cuts + [total, total], total)
    if kind == "thin":           # one document from rank 0 into the last rank; the middle ranks hold 2 of its
        bounds = [0, 7] + [7 + 2 * i for i in range(1, world - 1)]     # tokens each (fewer than WIDTH - 1)
        total = bounds[-1] + 8
        return _from_cuts([3, total - 2], total, tuple(bounds + [total]))
    if kind == "long":           # one document over every rank, 260 of its tokens on the last one (more than the
        bounds = [0] + [3 + 2 * i for i in range(world - 1)]           # 256 queries of one block of CP attention)
        total = bounds[-1] + 262
        return _from_cuts([1, total - 2], total, tuple(bounds + [total]))
    if kind == "padded":         # per-document padding to a multiple of 4 (the physical layout is padded)
        lengths = [rng.randint(0, 9) for _ in range(2 * world)]
        physical = sum(-(-n // 4) * 4 for n in lengths)
        return Layout(tuple(lengths), physical + 2, None, 4)
    raise ValueError(kind)


def _random_layout(rng, world) -> Layout:
    sizes = [rng.randint(3, 14) for _ in range(world)]
    sizes[rng.randrange(1, world)] = 1
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + s)
    total = bounds[-1]
    cuts = [t for t in range(1, total) if rng.random() < 0.15]
    cuts += [rng.choice(cuts)] if cuts else []
    tail = rng.randint(0, 4)
    return _from_cuts([c for c in cuts if c <= total - tail] + [total - tail], total, tuple(bounds))


def crosses(lay: Layout, world: int) -> bool:
    """Some segment (document or tail) continues across a rank boundary."""
    from ssm_pack import shard_for_context_parallel
    return any(shard_for_context_parallel(lay.params(), 0, world, bounds=lay.shard_bounds(world))[2]
               .cp_layout.continues_in)


# ----------------------------------------------------------------------------------- subjects
def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _rand(g, *shape):
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def op_inputs(subject: str, total: int, docs: int, seed: int) -> dict:
    """Full-row inputs (fp64): ``row`` tensors are sliced per shard (on their token dim), the
    others are shared by every rank (their gradients sum over ranks)."""
    g = _gen(seed)
    row, shared = {}, {}
    if subject == "conv":
        row["x"] = _rand(g, 1, CONV_DIM, total)
        shared.update(weight=_rand(g, CONV_DIM, WIDTH) * 0.5, bias=_rand(g, CONV_DIM),
                      h0=_rand(g, docs, CONV_DIM, WIDTH - 1))
        row["w_out"] = _rand(g, 1, CONV_DIM, total)
        shared["w_final"] = _rand(g, docs, CONV_DIM, WIDTH - 1)
    elif subject == "ssd":
        h, p, n, grp = 4, 3, 4, 2
        row.update(x=_rand(g, 1, total, h, p), dt=_rand(g, 1, total, h), B=_rand(g, 1, total, grp, n),
                   C=_rand(g, 1, total, grp, n), z=_rand(g, 1, total, h, p), w_out=_rand(g, 1, total, h, p))
        shared.update(A=-torch.rand(h, generator=g, dtype=torch.float64) - 0.2, D=_rand(g, h),
                      dt_bias=_rand(g, h) * 0.3, h0=_rand(g, docs, h, p, n), w_final=_rand(g, docs, h, p, n),
                      w_row=_rand(g, 1, h, p, n))
    elif subject == "selective_scan_plain":
        e, n = 3, 4
        row.update(u=_rand(g, 1, e, total), delta=F.softplus(_rand(g, 1, e, total)), B=_rand(g, 1, n, total),
                   C=_rand(g, 1, n, total), w_out=_rand(g, 1, e, total))
        shared["A"] = -torch.rand(e, n, generator=g, dtype=torch.float64) - 0.2
    elif subject == "selective_scan":
        e, n = 3, 4
        row.update(u=_rand(g, 1, e, total), delta=_rand(g, 1, e, total), B=_rand(g, 1, n, total),
                   C=_rand(g, 1, n, total), z=_rand(g, 1, e, total), w_out=_rand(g, 1, e, total))
        shared.update(A=-torch.rand(e, n, generator=g, dtype=torch.float64) - 0.2, D=_rand(g, e),
                      delta_bias=_rand(g, e) * 0.3, h0=_rand(g, docs, e, n), w_final=_rand(g, docs, e, n),
                      w_row=_rand(g, 1, e, n))
    elif subject in ("gdn", "kda", "gdp"):
        h, hv, kd, vd = 2, (4 if subject == "gdn" else 2), 4, 3
        nh = 2 if subject == "gdp" else 1
        row.update(q=_rand(g, 1, total, h, kd), k=_rand(g, 1, total * nh, h, kd), v=_rand(g, 1, total * nh, hv, vd),
                   beta=torch.rand(1, total * nh, hv, generator=g, dtype=torch.float64),
                   w_out=_rand(g, 1, total, hv, vd))
        gate = (1, total, hv, kd) if subject == "kda" else (1, total, hv)
        if subject != "gdp":     # Gated DeltaProduct without a gate (the mixer case runs one)
            row["g"] = -F.softplus(_rand(g, *gate)) * 0.5
        shared.update(h0=_rand(g, docs, hv, kd, vd) * 0.5, w_final=_rand(g, docs, hv, kd, vd))
    elif subject == "rg_lru":
        row.update(x=_rand(g, 1, total, CONV_DIM), gate_x=_rand(g, 1, total, CONV_DIM),
                   gate_a=_rand(g, 1, total, CONV_DIM), w_out=_rand(g, 1, total, CONV_DIM))
        shared.update(recurrent_param=_rand(g, CONV_DIM), h0=_rand(g, docs, CONV_DIM), w_final=_rand(g, docs, CONV_DIM))
    else:
        d = 8 if subject in KERNEL_ATTENTION else 4         # varlen_attn: head dims a multiple of 8
        row.update(q=_rand(g, total, 4, d), k=_rand(g, total, 2, d), v=_rand(g, total, 2, d),
                   w_out=_rand(g, total, 4, d))
        if subject in KERNEL_ATTENTION:         # what the kernels take
            row.update({name: row[name].half() for name in ("q", "k", "v")})
    return {"row": row, "shared": shared}


@contextmanager
def cuda_policy(subject: str, varlen):
    """Under CP, the kernel subjects run on a pretend CUDA device with only their kernel installed (the
    strict fakes); yields the list of kernel calls (``None`` for every other run: no kernel)."""
    if subject not in KERNEL_ATTENTION or varlen.cp is None:
        yield None
        return
    import pytest

    from mixers.ops import dispatch
    from mixers.ops.attention import kernel_torch
    from tests.support import fakes
    kernel, calls = KERNEL_ATTENTION[subject][0], []
    with pytest.MonkeyPatch.context() as mp:
        fakes.install(mp, calls=calls)
        mp.setattr(dispatch, "cached_support", lambda name, features=(): (
            (True, None) if name == kernel else (False, f"{name} is not installed")))
        mp.setattr(kernel_torch, "on_cuda", lambda t: True)
        mp.setattr(kernel_torch, "load_upstream", lambda: fakes.fake_torch_varlen(calls))
        yield calls


def _slice(subject, name, t, lo, hi):
    """Tokens ``lo:hi`` of a row tensor (Gated DeltaProduct's k, v, beta hold 2 steps per token)."""
    dim = 2 if subject.startswith(("conv", "selective_scan")) else (0 if subject.startswith("attention") else 1)
    per = 2 if subject == "gdp" and name in ("k", "v", "beta") else 1
    return t.narrow(dim, lo * per, (hi - lo) * per)


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def run_op(subject, inputs, varlen, lo, hi) -> dict:
    """Run op ``subject`` on tokens ``lo:hi`` with metadata ``varlen``; backward of
    ``sum(out * w_out) + sum(states * w_final)``. Returns outputs, states and gradients."""
    from mixers.ops import (
        causal_conv1d_fn,
        chunk_gated_delta_product,
        chunk_gated_delta_rule,
        chunk_kda,
        mamba_chunk_scan_combined,
        rg_lru,
        selective_scan_fn,
        varlen_attention,
    )
    row = {k: _slice(subject, k, t, lo, hi) if k.startswith("w_") else _leaf(_slice(subject, k, t, lo, hi))
           for k, t in inputs["row"].items()}
    shared = {k: t if k.startswith("w_") else _leaf(t) for k, t in inputs["shared"].items()}
    states, row_state = None, None
    if subject == "conv":
        out, states = causal_conv1d_fn(row["x"], shared["weight"], shared["bias"], initial_states=shared["h0"],
                                       return_final_states=True, activation="silu", cu_seqlens=varlen)
    elif subject == "ssd":
        out, row_state, states = mamba_chunk_scan_combined(
            row["x"], row["dt"], shared["A"], row["B"], row["C"], 8, D=shared["D"], z=row["z"],
            dt_bias=shared["dt_bias"], initial_states=shared["h0"], cu_seqlens=varlen, dt_softplus=True,
            return_final_states=True, return_varlen_states=True)
    elif subject == "selective_scan":
        out, row_state, states = selective_scan_fn(
            row["u"], row["delta"], shared["A"], row["B"], row["C"], shared["D"], row["z"], shared["delta_bias"],
            True, True, initial_states=shared["h0"], cu_seqlens=varlen, return_varlen_states=True, chunk_size=4)
    elif subject == "selective_scan_plain":
        out = selective_scan_fn(row["u"], row["delta"], shared["A"], row["B"], row["C"], cu_seqlens=varlen)
    elif subject in ("gdn", "kda", "gdp"):
        args = (row["q"], row["k"], row["v"], row.get("g"), row["beta"])
        kw = dict(initial_state=shared["h0"], output_final_state=True, use_qk_l2norm_in_kernel=True,
                  cu_seqlens=varlen, chunk_size=8)
        if subject == "gdp":
            out, states = chunk_gated_delta_product(*args, 2, **kw)
        else:
            out, states = (chunk_gated_delta_rule if subject == "gdn" else chunk_kda)(*args, **kw)
    elif subject == "rg_lru":     # documents 1, 4, ... start fresh, the others continue their initial state
        continues = torch.arange(shared["h0"].shape[0]) % 3 != 1
        out, states = rg_lru(row["x"], row["gate_x"], row["gate_a"], shared["recurrent_param"],
                             initial_state=shared["h0"], continues=continues, output_final_state=True,
                             cu_seqlens=varlen)
    else:
        window = (5, 0) if subject == "attention_window" else KERNEL_ATTENTION.get(subject, (None, None))[1]
        with cuda_policy(subject, varlen) as calls:
            out = varlen_attention(row["q"], row["k"], row["v"], varlen, causal=True, window_size=window)
    loss = (out * row["w_out"]).sum()
    if states is not None:
        loss = loss + (states * shared["w_final"]).sum()
    if row_state is not None:
        loss = loss + (row_state * shared["w_row"]).sum()
    loss.backward()
    result = {"out": out.detach(), "states": None if states is None else states.detach(),
              "row_state": None if row_state is None else row_state.detach()}
    if subject == "rg_lru":     # output_final_state left at its default: (out, None), as on one process
        with torch.no_grad():
            result["unasked_states"] = rg_lru(row["x"], row["gate_x"], row["gate_a"], shared["recurrent_param"],
                                              initial_state=shared["h0"], continues=continues, cu_seqlens=varlen)[1]
    if subject in KERNEL_ATTENTION and calls is not None:
        result["kernels"] = [(kind, [b.tolist() for b in given] if isinstance(given, tuple) else [given.tolist()])
                             for kind, given in calls]
    result.update({f"grad_{k}": t.grad for k, t in row.items() if t.requires_grad})
    result.update({f"grad_{k}": t.grad for k, t in shared.items() if t.requires_grad})
    return result


def build_module(subject: str, seed: int):
    from mixers import HybridLM
    from mixers.layers.registry import MIXERS as REGISTERED
    torch.manual_seed(seed)
    if subject.startswith("model"):          # model32: the same model in float32
        model = HybridLM(64, HIDDEN, "MGKPA", mixer_overrides=SMALL)
        return model if subject == "model32" else model.double()
    return REGISTERED[subject].mixer(HIDDEN, **SMALL[subject]).double()


def module_inputs(subject: str, total: int, seed: int) -> dict:
    g = _gen(seed + 1)
    if subject.startswith("model"):
        ids = torch.randint(0, 64, (1, total), generator=g)
        labels = torch.where(torch.rand(1, total, generator=g) < 0.2, -100, torch.randint(0, 64, (1, total),
                                                                                          generator=g))
        return {"ids": ids, "labels": labels}
    return {"x": _rand(g, 1, total, HIDDEN), "w_out": _rand(g, 1, total, HIDDEN)}


def run_module(subject, module, inputs, params, lo, hi) -> dict:
    """A mixer (``sum(out * w_out)``) or ``HybridLM`` (its loss) on tokens ``lo:hi``."""
    module.zero_grad(set_to_none=True)
    if subject.startswith("model"):
        captured = {}

        def keep(_, __, out):
            out.retain_grad()
            captured["embedded"] = out
        hook = module.embed.register_forward_hook(keep)
        try:
            res = module(inputs["ids"][:, lo:hi], packed_seq_params=params, labels=inputs["labels"][:, lo:hi])
        finally:
            hook.remove()
        res["loss"].backward()
        out, extra = res["logits"].detach(), {"loss": res["loss"].detach(), "grad_x": captured["embedded"].grad}
    else:
        x = _leaf(inputs["x"][:, lo:hi])
        res = module(x, packed_seq_params=params)
        (res * inputs["w_out"][:, lo:hi]).sum().backward()
        out, extra = res.detach(), {"grad_x": x.grad}
    params_grads = {name: p.grad.detach().clone() for name, p in module.named_parameters() if p.grad is not None}
    return {"out": out, "param_grads": params_grads, **extra}


def poison(subject: str, inputs: dict, token: int) -> dict:
    """A NaN in one input of one token (x for the conv and SSD, k for the delta rule, q for attention)."""
    key = {"conv": "x", "ssd": "x", "selective_scan": "u", "rg_lru": "x"}.get(subject) or (
        "q" if subject.startswith("attention") else "k")
    t = inputs["row"][key].clone()
    if subject in ("conv", "selective_scan"):
        t[0, :, token] = float("nan")
    elif subject.startswith("attention"):
        t[token] = float("nan")
    else:
        t[0, token * (2 if subject == "gdp" else 1)] = float("nan")
    return {"row": {**inputs["row"], key: t}, "shared": inputs["shared"]}


def run_subject(subject, lay: Layout, params, lo, hi, seed, nan_at: int | None = None) -> dict:
    """Run a case's subject on tokens ``lo:hi`` of the row with metadata ``params`` (an op with a
    NaN at global token ``nan_at``, if given)."""
    docs = len(lay.lengths)
    if subject in OPS + PLAIN_OPS:
        varlen = VarlenBatch.build(params, hi - lo)
        inputs = op_inputs(subject, lay.total, docs, seed)
        return run_op(subject, inputs if nan_at is None else poison(subject, inputs, nan_at), varlen, lo, hi)
    module = build_module(subject, seed)
    return run_module(subject, module, module_inputs(subject, lay.total, seed), params, lo, hi)


def cases(world: int) -> list[tuple[str, str, str, int]]:
    """``(case id, subject, layout kind, seed)`` for one world size."""
    out = []
    for kind in ("spanning", "boundary", "random", "padded", "tail", "empty_cont", "empties"):
        for subject in OPS:
            out.append((f"{subject}-{kind}-p{world}", subject, kind, 11 * world))
    for kind in ("spanning", "random"):
        for subject in MIXERS + ("model",):
            out.append((f"{subject}-{kind}-p{world}", subject, kind, 13 * world))
    out.append((f"model-boundary-p{world}", "model", "boundary", 13 * world))   # a target must not cross there
    out.append((f"model32-spanning-p{world}", "model32", "spanning", 13 * world))
    out.append((f"conv-thin-p{world}", "conv", "thin", 11 * world))
    out.append((f"attention-long-p{world}", "attention", "long", 11 * world))
    out.append((f"selective_scan_plain-spanning-p{world}", "selective_scan_plain", "spanning", 11 * world))
    return out
