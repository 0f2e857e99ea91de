"""A NaN or inf in one document stays in that document, in every op, forward and backward.

A seeded fuzz: random packed layouts (uneven lengths, empty documents, documents straddling
chunk boundaries, 1-3 token documents, padding tails), one NaN / +inf / -inf planted at a random
position of a random input of one document (or in its initial state), then the same call without
it. Every other document's outputs, final states and input gradients must be finite and bitwise
equal to the run without the planted value; the poisoned document must come out non-finite.
The same for a NaN or inf output gradient, and a loss that leaves the poisoned values out
(``torch.where``) gets finite gradients. The conv needs no guard (each output is overwritten from
its own document's window), but it is fuzzed all the same; with an activation its input gradient
is NaN wherever its pre-activation is, which autograd's ``0 * nan`` keeps, masked loss or not.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

from mixers.ops import (
    causal_conv1d_fn,
    chunk_gated_delta_product,
    chunk_gated_delta_rule,
    chunk_kda,
    device_policy,
    mamba_chunk_scan_combined,
    varlen_attention,
)
from mixers.ops.common import isolation
from ssm_pack import lengths_to_cu_seqlens
from ssm_pack.formats.seq_idx import seq_idx_from_cu_seqlens

CHUNK = 8
NH = 2          # Gated DeltaProduct sub-steps
POISONS = (float("nan"), float("inf"), float("-inf"))


@dataclass
class Layout:
    lengths: list[int]
    tail: int
    cu: torch.Tensor = field(init=False)
    total: int = field(init=False)
    unit: torch.Tensor = field(init=False)   # [T] document of each token; the tail is document N

    def __post_init__(self):
        self.cu = lengths_to_cu_seqlens(self.lengths)
        self.total = int(self.cu[-1]) + self.tail
        self.unit = torch.repeat_interleave(torch.arange(len(self.lengths) + 1),
                                            torch.tensor(self.lengths + [self.tail]))

    def span(self, doc: int) -> tuple[int, int]:
        bounds = self.cu.tolist() + [self.total]
        return bounds[doc], bounds[doc + 1]


def random_layout(rng: random.Random) -> Layout:
    pool = [0, 1, 2, 3, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 3]
    lengths = [rng.choice(pool + [rng.randint(1, 3 * CHUNK)]) for _ in range(rng.randint(2, 6))]
    if sum(lengths) == 0:
        lengths[0] = 1
    return Layout(lengths, rng.choice([0, 0, 1, 3]))


def row_layout(rng: random.Random) -> Layout:
    """Rows of one document each (no ``cu_seqlens``): every tensor's document axis is dim 0."""
    return Layout([rng.randint(1, 3 * CHUNK)] * rng.randint(2, 4), 0)


# Every leaf is described by where its documents are: ("token", dim, steps per token), ("doc",)
# for per-document (or per-row) tensors (dim 0), ("first",) / ("last",) for a row's initial /
# final state (the document of the row's first / last token), ("shared",) for parameters every
# document uses.
TOKEN1, DOC, SHARED, FIRST, LAST = ("token", 1, 1), ("doc",), ("shared",), ("first",), ("last",)


def _delta_leaves(kind, lay, gen, dtype, init):
    h, hv, kd, vd = 2, (2 if kind == "gdp" else 4), 4, 3
    steps = NH if kind == "gdp" else 1
    t = lay.total

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    gate_shape = (1, t, hv, kd) if kind == "kda" else (1, t, hv)
    leaves = {"q": (rnd(1, t, h, kd), TOKEN1), "k": (rnd(1, t * steps, h, kd), ("token", 1, steps)),
              "v": (rnd(1, t * steps, hv, vd), ("token", 1, steps)),
              "g": (F.logsigmoid(rnd(*gate_shape)), TOKEN1),
              "beta": (torch.rand(1, t * steps, hv, generator=gen, dtype=dtype), ("token", 1, steps))}
    if init:
        leaves["initial_state"] = (rnd(len(lay.lengths), hv, kd, vd), DOC)
    return leaves


def _delta_call(kind, lay, x, opts):
    fn = {"gdn": chunk_gated_delta_rule, "kda": chunk_kda}.get(kind)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    kw = dict(initial_state=x.get("initial_state"), output_final_state=opts["final"], cu_seqlens=lay.cu,
              use_qk_l2norm_in_kernel=opts["l2norm"], chunk_size=CHUNK, backend="reference")
    o, final = fn(*args, **kw) if fn is not None else chunk_gated_delta_product(*args, NH, **kw)
    return {"o": (o, TOKEN1)} | ({"final": (final, DOC)} if final is not None else {})


def _ssd_leaves(lay, gen, dtype, init):
    h, p, g, n, t = 4, 3, 2, 5, lay.total

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    leaves = {"x": (rnd(1, t, h, p), TOKEN1), "dt": (rnd(1, t, h), TOKEN1), "B": (rnd(1, t, g, n), TOKEN1),
              "C": (rnd(1, t, g, n), TOKEN1), "z": (rnd(1, t, h, p), TOKEN1),
              "A": (-torch.rand(h, generator=gen, dtype=dtype) - 0.2, SHARED), "D": (rnd(h), SHARED),
              "dt_bias": (rnd(h) * 0.5, SHARED)}
    if init:
        leaves["initial_states"] = (rnd(len(lay.lengths), h, p, n), DOC)
    return leaves


def _rows_leaves(lay, gen, dtype, init):
    rows, n, h, hv, kd, vd = len(lay.lengths), lay.lengths[0], 2, 4, 4, 3

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    leaves = {"q": rnd(rows, n, h, kd), "k": rnd(rows, n, h, kd), "v": rnd(rows, n, hv, vd),
              "g": F.logsigmoid(rnd(rows, n, hv)), "beta": torch.rand(rows, n, hv, generator=gen, dtype=dtype)}
    if init:
        leaves["initial_state"] = rnd(rows, hv, kd, vd)
    return {name: (t, DOC) for name, t in leaves.items()}


def _rows_call(lay, x, opts):
    o, final = chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x.get("initial_state"),
                                      output_final_state=opts["final"], use_qk_l2norm_in_kernel=opts["l2norm"],
                                      chunk_size=CHUNK, backend="reference")
    return {"o": (o, DOC)} | ({"final": (final, DOC)} if final is not None else {})


def _ssd_seq_idx_leaves(lay, gen, dtype, init):
    leaves = _ssd_leaves(lay, gen, dtype, False)
    if init:
        leaves["initial_states"] = (torch.randn(1, 4, 3, 5, generator=gen, dtype=dtype), FIRST)
    return leaves


def _ssd_seq_idx_call(lay, x, opts):
    """Upstream's own packing: ``seq_idx`` (no ``cu_seqlens``), a row's initial and final state."""
    seq_idx = seq_idx_from_cu_seqlens(lay.cu, lay.total)
    y, final = mamba_chunk_scan_combined(x["x"], x["dt"], x["A"], x["B"], x["C"], CHUNK, D=x["D"], z=x["z"],
                                         dt_bias=x["dt_bias"], initial_states=x.get("initial_states"),
                                         seq_idx=seq_idx, dt_softplus=opts["softplus"], return_final_states=True,
                                         backend="reference")
    return {"y": (y, TOKEN1), "final": (final, LAST)}


def _ssd_call(lay, x, opts):
    res = mamba_chunk_scan_combined(x["x"], x["dt"], x["A"], x["B"], x["C"], CHUNK, D=x["D"], z=x["z"],
                                    dt_bias=x["dt_bias"], initial_states=x.get("initial_states"), cu_seqlens=lay.cu,
                                    dt_softplus=opts["softplus"], return_varlen_states=opts["final"],
                                    backend="reference")
    return {"y": (res[0], TOKEN1), "states": (res[1], DOC)} if opts["final"] else {"y": (res, TOKEN1)}


def _attn_leaves(lay, gen, dtype, init):
    t = lay.total
    return {name: (torch.randn(t, hq, 4, generator=gen, dtype=dtype), ("token", 0, 1))
            for name, hq in (("q", 4), ("k", 2), ("v", 2))}


def _attn_call(lay, x, opts):
    longest = max(lay.lengths + [lay.tail])
    o = varlen_attention(x["q"], x["k"], x["v"], lay.cu, longest, causal=opts["causal"],
                         window_size=opts["window"], backend="reference")
    return {"o": (o, ("token", 0, 1))}


def _conv_leaves(lay, gen, dtype, init):
    d, w = 3, 4
    leaves = {"x": (torch.randn(1, d, lay.total, generator=gen, dtype=dtype), ("token", 2, 1)),
              "weight": (torch.randn(d, w, generator=gen, dtype=dtype), SHARED),
              "bias": (torch.randn(d, generator=gen, dtype=dtype), SHARED)}
    if init:
        leaves["initial_states"] = (torch.randn(len(lay.lengths), d, w - 1, generator=gen, dtype=dtype), DOC)
    return leaves


def _conv_call(lay, x, opts):
    res = causal_conv1d_fn(x["x"], x["weight"], x["bias"], initial_states=x.get("initial_states"),
                           return_final_states=opts["final"], activation=opts["activation"], cu_seqlens=lay.cu,
                           backend="reference")
    return {"out": (res[0], ("token", 2, 1)), "final": (res[1], DOC)} if opts["final"] else \
        {"out": (res, ("token", 2, 1))}


def _options(op, rng):
    if op == "attention":
        return {"causal": rng.random() < 0.7, "window": rng.choice([None, None, (3, -1), (2, 4)])}
    opts = {"final": rng.random() < 0.7}
    if op.startswith("ssd"):
        opts["softplus"] = rng.random() < 0.5
    elif op == "conv":
        opts["activation"] = rng.choice([None, "silu"])
    else:
        opts["l2norm"] = rng.random() < 0.5
    return opts


OPS = {
    "gdn": (lambda lay, gen, dt, init: _delta_leaves("gdn", lay, gen, dt, init), lambda *a: _delta_call("gdn", *a)),
    "kda": (lambda lay, gen, dt, init: _delta_leaves("kda", lay, gen, dt, init), lambda *a: _delta_call("kda", *a)),
    "gdp": (lambda lay, gen, dt, init: _delta_leaves("gdp", lay, gen, dt, init), lambda *a: _delta_call("gdp", *a)),
    "gdn_rows": (_rows_leaves, _rows_call),
    "ssd": (_ssd_leaves, _ssd_call),
    "ssd_seq_idx": (_ssd_seq_idx_leaves, _ssd_seq_idx_call),
    "attention": (_attn_leaves, _attn_call),
    "conv": (_conv_leaves, _conv_call),
}


def _units(lay: Layout, where, length: int) -> torch.Tensor:
    """Document of each index along a leaf's / result's document axis."""
    if where[0] == "doc":
        return torch.arange(length)
    if where[0] in ("first", "last"):
        return lay.unit[:1] if where[0] == "first" else lay.unit[-1:]
    return torch.repeat_interleave(lay.unit, where[2])


def _slices(t: torch.Tensor, lay: Layout, where):
    """``t`` moved so that dim 0 is its document axis, and the document of each index."""
    moved = t.movedim(_dim(where), 0)
    return moved, _units(lay, where, moved.shape[0])


def _plant(op, name, x, where, lay, rng, opts):
    """A planted poison: (leaf name, flat index, value, document), or None if this leaf cannot hold one."""
    moved, units = _slices(x[name], lay, where)
    docs = sorted(set(units.tolist()))
    if not docs:
        return None
    doc = rng.choice(docs)
    rows = torch.nonzero(units == doc).reshape(-1).tolist()
    row = rng.choice(rows)
    inner = rng.randrange(moved[0].numel())
    values = list(POISONS)
    if name == "g":            # -inf is a legal log-decay (a reset); KDA refuses +inf by name
        values = [float("nan")] + ([float("inf")] if op != "kda" else [])
    if name == "dt" and opts.get("softplus"):
        values = [float("nan"), float("inf")]    # softplus(-inf) = 0: a legal dt
    return name, row, inner, rng.choice(values), doc


def _with_poison(x, lay, where_of, plant):
    name, row, inner, value, _ = plant
    out = {k: v.clone() for k, v in x.items()}
    moved, _ = _slices(out[name], lay, where_of[name])
    cell = moved[row]                                # a view of out[name]
    cell[torch.unravel_index(torch.tensor(inner), cell.shape)] = value
    return out


def _run(op, lay, x, opts, seed, *, masked=False, bad_weight=None):
    """Results and input gradients of ``loss = sum(result * w)`` (random ``w``; ``masked``: the
    non-finite results left out with ``torch.where``; ``bad_weight = (result, index, value)``:
    one entry of ``w`` replaced, i.e. a non-finite output gradient)."""
    leaves = {k: v.detach().clone().requires_grad_() for k, v in x.items()}
    results = OPS[op][1](lay, leaves, opts)
    gen = torch.Generator().manual_seed(seed)
    loss = 0
    for name, (r, _) in results.items():
        w = torch.randn(r.shape, generator=gen, dtype=r.dtype)
        if bad_weight is not None and bad_weight[0] == name:
            w.view(-1)[bad_weight[1]] = bad_weight[2]
        loss = loss + ((torch.where(torch.isfinite(r), r, 0.0) if masked else r) * w).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True, materialize_grads=True)
    return {k: r.detach() for k, (r, _) in results.items()}, dict(zip(leaves, grads)), \
        {k: w for k, (_, w) in results.items()}


def _check_others(what, clean, dirty, lay, where, doc):
    a, units = _slices(clean, lay, where)
    b, _ = _slices(dirty, lay, where)
    others = units != doc
    assert torch.isfinite(b[others]).all(), f"{what}: a non-finite value reached another document"
    assert torch.equal(a[others], b[others]), f"{what}: another document changed"
    return b[~others]


def _setup(op, seed):
    rng = random.Random(seed)
    lay = row_layout(rng) if op.endswith("_rows") else random_layout(rng)
    dtype = rng.choice([torch.float32, torch.float64])
    opts = _options(op, rng)
    init = op != "attention" and rng.random() < 0.6
    spec = OPS[op][0](lay, torch.Generator().manual_seed(seed), dtype, init)
    return rng, lay, opts, {k: v for k, (v, _) in spec.items()}, {k: w for k, (_, w) in spec.items()}


def _poisoned_input(op, rng, lay, opts, x, where_of):
    names = [k for k, w in where_of.items() if w != SHARED]
    plant = None
    while plant is None:
        name = rng.choice(names)
        plant = _plant(op, name, x, where_of[name], lay, rng, opts)
    doc = plant[4]
    if where_of[plant[0]] in (DOC, FIRST) and lay.span(doc)[0] == lay.span(doc)[1] and not opts.get("final"):
        opts["final"] = True                       # an empty document's only result is its final state
    return plant, doc


def _check_other_grads(context, grad_c, grad_d, lay, where_of, doc):
    """Other documents' input gradients bitwise equal and finite; returns the poisoned document's."""
    return [_check_others(f"{context}: grad {k}", grad_c[k], grad_d[k], lay, where_of[k], doc)
            for k in grad_c if where_of[k] != SHARED]


def check_isolation(op: str, seed: int) -> None:
    rng, lay, opts, x, where_of = _setup(op, seed)
    plant, doc = _poisoned_input(op, rng, lay, opts, x, where_of)
    context = f"{op} seed={seed} lengths={lay.lengths} tail={lay.tail} {opts} plant={plant[:4]} doc={doc}"
    out_c, grad_c, where_r = _run(op, lay, x, opts, seed)
    out_d, grad_d, _ = _run(op, lay, _with_poison(x, lay, where_of, plant), opts, seed)
    own_values = [_check_others(f"{context}: {k}", out_c[k], out_d[k], lay, where_r[k], doc) for k in out_c]
    assert any((~torch.isfinite(v)).any() for v in own_values), \
        f"{context}: the poisoned document came out finite"
    own_grads = _check_other_grads(context, grad_c, grad_d, lay, where_of, doc)
    start, end = lay.span(doc)
    # (a linear conv's input gradient is exact and finite even with a NaN input; an empty
    # document's final state is its initial state, whose gradient is the final state's)
    if op != "conv" and end > start:
        assert any((~torch.isfinite(v)).any() for v in own_grads), \
            f"{context}: the poisoned document's gradients came out finite"


def check_output_gradient(op: str, seed: int) -> None:
    """A NaN or inf output gradient in one document stays in that document's input gradients."""
    rng, lay, opts, x, where_of = _setup(op, seed)
    results, _, where_r = _run(op, lay, x, opts, seed)
    name = next(k for k, w in where_r.items() if w[0] == "token" or k == "o" and w == DOC)
    moved, units = _slices(results[name], lay, where_r[name])
    row = rng.randrange(moved.shape[0])
    doc = int(units[row])
    index = torch.zeros(moved.shape, dtype=torch.bool)
    index[row].view(-1)[rng.randrange(moved[row].numel())] = True
    flat = int(torch.nonzero(index.movedim(0, _dim(where_r[name])).reshape(-1))[0])
    value = rng.choice(POISONS)
    context = f"{op} seed={seed} lengths={lay.lengths} tail={lay.tail} {opts} output gradient {value} doc={doc}"
    _, grad_c, _ = _run(op, lay, x, opts, seed)
    _, grad_d, _ = _run(op, lay, x, opts, seed, bad_weight=(name, flat, value))
    own = _check_other_grads(context, grad_c, grad_d, lay, where_of, doc)
    assert any((~torch.isfinite(v)).any() for v in own), f"{context}: the document's gradients came out finite"


def check_masked_loss(op: str, seed: int) -> None:
    """Leaving the poisoned values out of the loss (``torch.where``) gives finite input gradients
    everywhere but at the poisoned entry's own token, the other documents' bitwise those of the
    call without the poison."""
    rng, lay, opts, x, where_of = _setup(op, seed)
    plant, doc = _poisoned_input(op, rng, lay, opts, x, where_of)
    context = f"{op} seed={seed} lengths={lay.lengths} tail={lay.tail} {opts} plant={plant[:4]} doc={doc}"
    _, grad_c, _ = _run(op, lay, x, opts, seed, masked=True)
    _, grad_d, _ = _run(op, lay, _with_poison(x, lay, where_of, plant), opts, seed, masked=True)
    _check_other_grads(context, grad_c, grad_d, lay, where_of, doc)
    if op == "ssd" and "initial_states" in x:
        return      # with per-document states, the z gate and D skip run outside the scan's guard
        # (mamba_chunk_scan_combined adds the states' reads first): autograd's 0 * nan there makes
        # the poisoned document's gradients NaN, in that document only (checked above)
    for k, g in grad_d.items():
        if where_of[k] == SHARED:
            continue
        moved, _ = _slices(g, lay, where_of[k])
        keep = torch.ones(moved.shape[0], dtype=torch.bool)
        if where_of[plant[0]][0] == "token" and where_of[k][0] == "token":
            # per-token work outside the guard (l2norm, softplus, the z gate) differentiates the NaN
            token = plant[1] // where_of[plant[0]][2]
            keep[torch.arange(moved.shape[0]) // where_of[k][2] == token] = False
        elif k == plant[0]:
            keep[plant[1]] = False
        assert torch.isfinite(moved[keep]).all(), f"{context}: grad {k} not finite under a masked loss"


def _dim(where) -> int:
    return where[1] if where[0] == "token" else 0


SEEDS = 24
GUARDED = [pytest.param(op, id=op) for op in OPS if op != "conv"]   # the conv needs no guard (see module doc)


@pytest.fixture(autouse=True, params=[pytest.param(False, id="host-read"), pytest.param(True, id="branch-free")])
def guard_form(request, monkeypatch):
    """Every test on both forms of the guard (the device policy picks one, see ``isolation``)."""
    monkeypatch.setattr(device_policy, "branch_free_isolation", lambda device: request.param)
    return request.param


def _same(a, b) -> bool:
    """Bitwise equal, NaN where NaN (and of the same sign of infinity)."""
    return a.shape == b.shape and torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(
        torch.where(torch.isnan(a), 0.0, a), torch.where(torch.isnan(b), 0.0, b))


@pytest.mark.parametrize("poisoned", [pytest.param(False, id="finite"), pytest.param(True, id="poisoned")])
@pytest.mark.parametrize("op", GUARDED)
def test_both_forms_of_the_guard_agree_bitwise(op, poisoned, guard_form, monkeypatch):
    if not guard_form:
        pytest.skip("compares the branch-free form with the host-read form once")
    for seed in range(4):
        rng, lay, opts, x, where_of = _setup(op, 300 + seed)
        if poisoned:
            x = _with_poison(x, lay, where_of, _poisoned_input(op, rng, lay, opts, x, where_of)[0])
        runs = []
        for branch_free in (True, False):
            monkeypatch.setattr(device_policy, "branch_free_isolation", lambda device, b=branch_free: b)
            runs.append(_run(op, lay, x, opts, 300 + seed))
        (out_a, grad_a, _), (out_b, grad_b, _) = runs
        assert all(_same(out_a[k], out_b[k]) for k in out_a), f"{op} seed={seed}: outputs differ"
        assert all(_same(grad_a[k], grad_b[k]) for k in grad_a), f"{op} seed={seed}: gradients differ"


@pytest.mark.parametrize("op", [pytest.param(op, id=op) for op in OPS])
def test_nonfinite_input_stays_in_its_document(op):
    for seed in range(SEEDS):
        check_isolation(op, seed)


@pytest.mark.parametrize("op", [pytest.param(op, id=op) for op in OPS])
def test_nonfinite_output_gradient_stays_in_its_document(op):
    for seed in range(SEEDS // 2):
        check_output_gradient(op, 100 + seed)


@pytest.mark.parametrize("op", GUARDED)
def test_masked_loss_gives_finite_gradients(op):
    for seed in range(SEEDS // 2):
        check_masked_loss(op, 200 + seed)


@pytest.mark.parametrize("poisoned", [pytest.param(False, id="finite"), pytest.param(True, id="poisoned")])
@pytest.mark.parametrize("op", GUARDED)
def test_outputs_stay_ordinary_tensors(op, poisoned):
    """The guard's outputs can be modified in place and differentiated, like the kernels' (no
    view of a custom autograd node reaches the caller)."""
    rng, lay, opts, x, where_of = _setup(op, 7)
    if poisoned:
        x = _with_poison(x, lay, where_of, _poisoned_input(op, rng, lay, opts, x, where_of)[0])
    leaves = {k: v.detach().clone().requires_grad_() for k, v in x.items()}
    results = OPS[op][1](lay, leaves, opts)
    loss = 0
    for r, _ in results.values():
        r.mul_(2.0)
        loss = loss + torch.where(torch.isfinite(r), r, 0.0).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    assert any(g is not None for g in grads)


def test_a_guard_without_tokens_leaves_unread_states_alone(guard_form):
    """No token (every document empty): non-finite initial states no token reads are sanitized and
    come back as given, on both forms (branch-free: the per-segment tables are empty)."""
    iso = isolation.Isolation(torch.zeros(1, 0, dtype=torch.int64))
    states, owner = torch.full((2, 3), float("nan")), torch.tensor([-1, -1])
    iso.scan_states(states, owner)
    assert torch.equal(iso.clean_states(torch.ones(2, 3), owner), torch.ones(2, 3))
    assert torch.equal(iso.poison_states(torch.ones(2, 3), owner), torch.ones(2, 3))


def test_the_guard_computes_its_masks_once_for_every_output(guard_form, monkeypatch):
    """The masks are computed once, at the first output, and reused by the others (the op's outputs and
    final states read the same masks; no second pass over the tokens)."""
    seg = torch.tensor([[0, 0, 1, 1, 1]])
    iso = isolation.Isolation(seg)
    computed = []
    slots = iso._segment_slots
    monkeypatch.setattr(iso, "_segment_slots", lambda: computed.append(1) or slots())
    x = torch.ones(1, 5, 2, dtype=torch.float64)
    x[0, 1, 0] = float("nan")                               # enters document 0's state at its second token
    iso.scan(x)
    y = iso.poison_tokens(torch.ones(1, 5, 2, dtype=torch.float64))
    states = iso.poison_states(torch.ones(2, 3, dtype=torch.float64), torch.tensor([0, 1]))
    after = iso.state_bad_after(torch.tensor([0, 1, 4, -1]), torch.tensor([0, 0, 1, 1]))
    assert torch.equal(torch.isnan(y[0, :, 0]), torch.tensor([False, True, False, False, False]))
    assert torch.equal(torch.isnan(y[0, :, 1]), torch.tensor([False, True, False, False, False]))
    assert torch.equal(torch.isnan(states).all(1), torch.tensor([True, False]))
    assert not torch.isnan(states[1]).any()
    assert torch.equal(after, torch.tensor([False, True, False, False]))
    assert computed == [1]
