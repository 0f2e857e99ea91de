"""Context-parallel prefill (``mixers/layers/cp_prefill.py``): a prompt split over gloo ranks
leaves the decoding rank's cache exactly as a one-process prefill does, and decoding goes on
from it identically.

    P = ranks, T = tokens of the whole row, N = documents (one slot each)

One spawn per world size (2 and 4 ranks) runs every case and saves what each rank holds; the
tests compare it, in this process, with a one-process prefill of the whole row into the same
slots (fp64, ``HybridLM`` with every registered mixer letter). Each case also keeps another
sequence in a slot of its own, prefilled on the decoding rank before the CP prefill (slots
shared), and continues after the CP prefill with a chunk of 4 tokens per slot, single-token
decode steps, and a continuous-batching step (a packed call of every slot's next token and a
new prompt in a fresh slot), teacher-forced: the logits of every step must match. The
negative control prefills the same shards without the exchange (each rank its shard alone),
which must leave a different cache.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

import pytest
import torch
import torch.distributed as dist

from ssm_pack import PackedSeqParams, balanced_bounds, shard_for_context_parallel

VOCAB, HIDDEN, SLOTS, MAX_SEQLEN, CHUNK, STEPS = 64, 16, 8, 72, 4, 3
OTHER_SLOT, OTHER = 7, (11, 3, 60, 5, 9)          # a sequence of its own, in a slot the prefill does not name
NEW_SLOT, NEW = 6, (8, 41, 2)                     # a prompt admitted after the CP prefill
TOL = 1e-12
SEED = 3


@dataclass(frozen=True)
class Case:
    lengths: tuple            # document lengths (0 = empty)
    total: int                # T (tokens after the documents: the padding tail)
    slots: tuple              # one per document
    bounds: str               # "even", "balanced" or "uneven" (a one-token shard at 4 ranks)
    holders: str              # which ranks pass cache=: "last", "first" or "all"


CASES = {
    # a document across the boundary / across all 4 ranks, an empty document, a padding tail
    "spanning_last": Case((3, 40, 0, 6), 52, (5, 0, 2, 3), "even", "last"),
    "spanning_all": Case((3, 40, 0, 6), 52, (5, 0, 2, 3), "even", "all"),
    # one long prompt on balanced bounds, decoded on rank 0 (which does not hold its end)
    "long_first": Case((45,), 45, (4,), "balanced", "first"),
    # documents shorter than the conv window crossing boundaries, an empty one, uneven shards
    "short_last": Case((2, 1, 9, 1, 0, 14), 27, (0, 2, 3, 5, 1, 4), "uneven", "last"),
}


def model():
    from mixers import HybridLM
    from mixers.layers import registry
    from tests.context_parallel.cases import SMALL
    torch.manual_seed(SEED)
    overrides = {x: dict(SMALL.get(x, registry.MIXERS[x].small)) for x in registry.letters()}
    return HybridLM(VOCAB, HIDDEN, registry.letters(), mixer_overrides=overrides).double().eval()


def row(case: Case):
    """``(params, ids [1, T], continuation [N + 1, CHUNK + STEPS])`` from the seed."""
    g = torch.Generator().manual_seed(SEED + 1)
    ids = torch.randint(0, VOCAB, (1, case.total), generator=g)
    more = torch.randint(0, VOCAB, (len(case.slots) + 1, CHUNK + STEPS), generator=g)
    return PackedSeqParams.from_lengths(list(case.lengths), total_tokens=case.total), ids, more


def bounds(case: Case, world: int) -> tuple:
    params = row(case)[0]
    if case.bounds == "balanced":
        return tuple(balanced_bounds(params, world, total_tokens=case.total, linear=0.5, attention=1.0))
    if case.bounds == "uneven":
        return (0, 3, case.total) if world == 2 else (0, 1, 3, 10, case.total)
    return tuple(r * case.total // world for r in range(world + 1))


def holds(case: Case, rank: int, world: int) -> bool:
    return {"last": rank == world - 1, "first": rank == 0, "all": True}[case.holders]


def fresh_cache(m):
    """A cache whose ``OTHER_SLOT`` already holds another sequence (one-process prefill)."""
    cache = m.allocate_inference_cache(SLOTS, MAX_SEQLEN)
    m(torch.tensor([OTHER]), cache=cache, cache_slots=[OTHER_SLOT])
    return cache


def states(cache) -> dict:
    out = {"lengths": cache.table.lengths.clone()}
    for i, layer in enumerate(cache.layers):
        out.update({f"{i}.{layer.owner_name}.{k}": v.clone() for k, v in layer.states.items()})
    return out


def continue_decoding(m, cache, case: Case, more: torch.Tensor) -> list[torch.Tensor]:
    """A chunk of CHUNK tokens per slot (rows), then STEPS single-token decode steps, teacher-forced,
    then one step of continuous batching: a packed call with the next token of every slot and a
    new prompt in a fresh slot (``NEW_SLOT``); the logits of each call."""
    slots = list(case.slots) + [OTHER_SLOT]
    logits = [m(more[:, :CHUNK], cache=cache, cache_slots=slots)["logits"]]
    for t in range(CHUNK, CHUNK + STEPS):
        logits.append(m(more[:, t:t + 1], cache=cache, cache_slots=slots)["logits"])
    params = PackedSeqParams.from_lengths([1] * len(slots) + [len(NEW)])
    ids = torch.cat([more[:, -1], torch.tensor(NEW)]).unsqueeze(0)
    logits.append(m(ids, packed_seq_params=params, cache=cache, cache_slots=slots + [NEW_SLOT])["logits"])
    return logits


@lru_cache(maxsize=None)
def reference(case: Case) -> dict:
    """The one-process prefill of the whole row into the same slots, and the decoding after it
    (computed once per case: read only)."""
    m = model()
    params, ids, more = row(case)
    with torch.no_grad():
        slots = fresh_cache(m)
        logits = m(ids, packed_seq_params=params, cache=slots, cache_slots=list(case.slots))["logits"]
        snapshot = states(slots)
        return {"logits": logits, "states": snapshot, "decode": continue_decoding(m, slots, case, more)}


# ------------------------------------------------------------------ the spawned ranks


def _refusals(m, rank: int, world: int) -> dict:
    """Misuse on 2 ranks: every rank raises, nothing is written. ``{name: (error, message, unchanged)}``."""
    case = CASES["spanning_last"]
    params, ids, _ = row(case)
    start, end, local = shard_for_context_parallel(params, rank, world, cp_group=dist.group.WORLD)
    shard, last = ids[:, start:end], rank == world - 1
    busy = fresh_cache(m)
    m(torch.tensor([[1, 2]]), cache=busy, cache_slots=[case.slots[1]])
    tries = {
        "slots_differ": (fresh_cache(m) if last else None, list(case.slots) if last else [5, 0, 2, 6]),
        "no_cache": (None, list(case.slots)),
        "slot_busy": (busy if last else None, list(case.slots)),
        "slot_count": (fresh_cache(m) if last else None, list(case.slots[:3])),
        "too_short": (m.allocate_inference_cache(SLOTS, 16) if last else None, list(case.slots)),
    }
    seen = {}
    for name, (cache, slots) in tries.items():
        before = None if cache is None else states(cache)
        try:
            m(shard, packed_seq_params=local, cache=cache, cache_slots=slots)
            seen[name] = (None, "", True)
        except (TypeError, ValueError) as err:
            unchanged = cache is None or all(torch.equal(before[k], v) for k, v in states(cache).items())
            seen[name] = (type(err).__name__, str(err), unchanged)
    return seen


def _mixers(rank: int, world: int) -> dict:
    """Each registered mixer alone: a CP prefill of the spanning row into the last rank's cache."""
    from mixers.layers import registry
    from tests.context_parallel.cases import SMALL
    case = CASES["spanning_last"]
    params = row(case)[0]
    start, end, local = shard_for_context_parallel(params, rank, world, total_tokens=case.total,
                                                   cp_group=dist.group.WORLD)
    x = torch.randn(1, case.total, HIDDEN, generator=torch.Generator().manual_seed(SEED + 2), dtype=torch.float64)
    out = {}
    for letter, kind in registry.MIXERS.items():
        torch.manual_seed(SEED)
        layer = kind.mixer(HIDDEN, **dict(SMALL.get(letter, kind.small))).double().eval()
        cache = layer.allocate_inference_cache(SLOTS, MAX_SEQLEN) if rank == world - 1 else None
        y = layer(x[:, start:end], local, cache=cache, cache_slots=list(case.slots))
        out[letter] = {"out": y, "states": None if cache is None else {k: v.clone() for k, v in cache.states.items()},
                       "lengths": None if cache is None else cache.table.lengths.clone()}
    return out


def generation_prompts(case: Case, ids: torch.Tensor) -> list[list[int]]:
    """The spanning row's documents 1 and 3 (both end on the last rank at 2 and 4 ranks), then two
    prompts of their own."""
    cu = [0, *torch.tensor(case.lengths).cumsum(0).tolist()]
    return [ids[0, cu[1]:cu[2]].tolist(), ids[0, cu[3]:cu[4]].tolist(), list(NEW), list(OTHER)]


def _generate(m, rank: int, world: int) -> dict:
    """A CP prefill of the spanning row into the last rank's cache, then continuous batching there
    (``prefilled=`` the two documents whose last logits that rank holds, plus two new prompts)."""
    from mixers.inference import ContinuousBatcher
    case = CASES["spanning_last"]
    params, ids, _ = row(case)
    start, end, local = shard_for_context_parallel(params, rank, world, total_tokens=case.total,
                                                   cp_group=dist.group.WORLD)
    cache = m.allocate_inference_cache(SLOTS, MAX_SEQLEN) if rank == world - 1 else None
    logits = m(ids[:, start:end], packed_seq_params=local, cache=cache, cache_slots=list(case.slots))["logits"]
    if cache is None:
        return {}
    cu = [0, *torch.tensor(case.lengths).cumsum(0).tolist()]
    prefilled = {0: (case.slots[1], logits[0, cu[2] - 1 - start]), 1: (case.slots[3], logits[0, cu[4] - 1 - start])}
    batcher = ContinuousBatcher(m, prefill_chunk=4, record_logits=True, cache=cache)
    outputs = batcher.run(generation_prompts(case, ids), 4, prefilled=prefilled)
    return {"outputs": outputs, "logits": batcher.logits}


def _rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    from mixers.ops.common.cp_exchange import record_traffic
    from tests.context_parallel.worker import gloo_rank
    with gloo_rank(rank, world, port, os.path.join(out_dir, f"{rank}.err")):
        m = model()
        with torch.no_grad():
            for name, case in CASES.items():
                params, ids, more = row(case)
                start, end, local = shard_for_context_parallel(params, rank, world, total_tokens=case.total,
                                                               bounds=bounds(case, world), cp_group=dist.group.WORLD)
                cache = fresh_cache(m) if holds(case, rank, world) else None
                before = None if cache is None else states(cache)
                with record_traffic() as traffic:
                    logits = m(ids[:, start:end], packed_seq_params=local, cache=cache,
                               cache_slots=list(case.slots))["logits"]
                result = {"span": (start, end), "logits": logits, "holds": cache is not None,
                          "sent": {label: traffic.total("forward", label) for label in ("prefill state", "prefill kv")}}
                if cache is not None:
                    result["states"], result["before"] = states(cache), before
                    result["decode"] = continue_decoding(m, cache, case, more)
                alone = local.replace(cp_layout=None, cp_group=None)        # negative control: no exchange
                control = fresh_cache(m)
                m(ids[:, start:end], packed_seq_params=alone, cache=control, cache_slots=list(case.slots))
                result["control"] = states(control)
                torch.save(result, os.path.join(out_dir, f"{name}.{rank}.pt"))
            torch.save(_generate(m, rank, world), os.path.join(out_dir, f"generate.{rank}.pt"))
            if world == 2:
                torch.save(_refusals(m, rank, world), os.path.join(out_dir, f"refusals.{rank}.pt"))
            torch.save(_mixers(rank, world), os.path.join(out_dir, f"mixers.{rank}.pt"))


@pytest.fixture(scope="module")
def prefill_runs(tmp_path_factory):
    from tests.context_parallel.worker import runs_per_world
    return runs_per_world(tmp_path_factory, _rank_main, "cp_prefill")


def _worst(got: dict, want: dict) -> dict:
    assert got.keys() == want.keys()
    return {k: float((got[k].double() - want[k].double()).abs().max()) if got[k].numel() else 0.0 for k in want}


WORLDS = [pytest.param(w, id=f"p{w}") for w in (2, 4)]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", [pytest.param(n, id=n) for n in CASES])
def test_cp_prefill_leaves_the_one_process_cache(prefill_runs, name, world):
    """Every state tensor of every mixer and every key / value, on each rank with a cache, equals the
    one-process prefill's (fp64, within 1e-12; slot lengths exactly); the other sequence's slot is
    bitwise untouched; the ranks' logits are the one-process logits slice for slice."""
    case = CASES[name]
    path = prefill_runs(world)
    per_rank = [torch.load(path / f"{name}.{r}.pt") for r in range(world)]
    ref = reference(case)
    assert [r["span"] for r in per_rank] == list(zip(bounds(case, world)[:-1], bounds(case, world)[1:]))
    assert [r["holds"] for r in per_rank] == [holds(case, r, world) for r in range(world)]
    for rank, result in enumerate(per_rank):
        if not result["holds"]:
            continue
        assert torch.equal(result["states"]["lengths"], ref["states"]["lengths"])
        bad = {k: v for k, v in _worst(result["states"], ref["states"]).items() if not v <= TOL}
        assert not bad, f"rank {rank}'s cache differs from the one-process prefill: {bad}"
        for key, value in result["before"].items():      # the other sequence's slot: as before the prefill
            assert torch.equal(result["states"][key][OTHER_SLOT], value[OTHER_SLOT]), key
    logits = torch.cat([r["logits"] for r in per_rank], dim=1)
    assert float((logits - ref["logits"]).abs().max()) <= 1e-10


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", [pytest.param(n, id=n) for n in CASES])
def test_decoding_after_cp_prefill_matches_one_process(prefill_runs, name, world):
    """A chunk of 4 tokens per slot, then 3 decode steps (every slot of the prefill and the other
    sequence's, in one row call each), then a packed call mixing a token for each slot with a new
    prompt in a fresh slot: the logits equal those after the one-process prefill."""
    case = CASES[name]
    path = prefill_runs(world)
    ref = reference(case)["decode"]
    for rank in range(world):
        result = torch.load(path / f"{name}.{rank}.pt")
        if result["holds"]:
            errors = [float((got - want).abs().max()) for got, want in zip(result["decode"], ref)]
            assert len(errors) == 2 + STEPS and max(errors) <= TOL, errors


@pytest.mark.parametrize("world", WORLDS)
def test_continuous_batching_resumes_cp_prefilled_slots(prefill_runs, world):
    """``ContinuousBatcher.run(..., prefilled=)`` on the last rank after a CP prefill: the two
    prefilled documents and two new prompts (chunks of 4, 8 slots) generate the tokens, and from
    the logits, that generating all four from scratch on one process gives."""
    from mixers.inference import ContinuousBatcher
    case = CASES["spanning_last"]
    path = prefill_runs(world)
    got = torch.load(path / f"generate.{world - 1}.pt")
    m = model()
    batcher = ContinuousBatcher(m, prefill_chunk=4, record_logits=True)
    want = batcher.run(generation_prompts(case, row(case)[1]), 4)
    assert got["outputs"] == want and all(len(o) == 4 for o in want)
    errors = [float((a - b).abs().max()) for a, b in zip(got["logits"], batcher.logits)]
    assert max(errors) <= TOL, errors


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", [pytest.param(n, id=n) for n in CASES if CASES[n].holders == "last"])
def test_without_the_exchange_the_cache_differs(prefill_runs, name, world):
    """Negative control: each rank prefilling its shard alone leaves the last rank a different cache
    (a document crosses into it), so the equality above is the exchange's doing."""
    case = CASES[name]
    path = prefill_runs(world)
    control = torch.load(path / f"{name}.{world - 1}.pt")["control"]
    ref = reference(case)["states"]
    worst = _worst({k: v for k, v in control.items() if k != "lengths"},
                   {k: v for k, v in ref.items() if k != "lengths"})
    assert max(worst.values()) > 1e-3, worst
    assert not torch.equal(control["lengths"], ref["lengths"])


@pytest.mark.parametrize("world", WORLDS)
def test_only_the_ranks_without_the_cache_send(prefill_runs, world):
    """Gather to the last rank: it sends nothing; every other rank sends its real tokens' keys and
    values (two [R_r, Hk, Dh] fp64 tensors per attention mixer) and the states of the documents it
    owns."""
    from mixers.layers import registry
    from tests.context_parallel.cases import SMALL
    case = CASES["spanning_last"]
    path = prefill_runs(world)
    attention = [x for x in registry.letters() if registry.MIXERS[x].cache == "kv"]
    kv_row = sum(SMALL["A"]["num_kv_heads"] * SMALL["A"]["head_dim"] for _ in attention) * 2 * 8
    b = bounds(case, world)
    for rank in range(world):
        sent = torch.load(path / f"spanning_last.{rank}.pt")["sent"]
        if rank == world - 1:
            assert sent == {"prefill state": 0, "prefill kv": 0}
        else:
            real = max(0, min(b[rank + 1], sum(case.lengths)) - b[rank])
            assert sent["prefill kv"] == real * kv_row
    owns_docs = [torch.load(path / f"spanning_last.{r}.pt")["sent"]["prefill state"] > 0 for r in range(world - 1)]
    assert any(owns_docs)          # rank 0 holds the end of the first document


@pytest.mark.parametrize("world", WORLDS)
def test_each_mixer_alone(prefill_runs, world):
    """Every registered mixer called on its own with a CP prefill: the last rank's cache equals the
    one-process prefill's, outputs slice for slice."""
    from mixers.layers import registry
    from tests.context_parallel.cases import SMALL
    case = CASES["spanning_last"]
    path = prefill_runs(world)
    per_rank = [torch.load(path / f"mixers.{r}.pt") for r in range(world)]
    params = row(case)[0]
    x = torch.randn(1, case.total, HIDDEN, generator=torch.Generator().manual_seed(SEED + 2), dtype=torch.float64)
    for letter, kind in registry.MIXERS.items():
        torch.manual_seed(SEED)
        layer = kind.mixer(HIDDEN, **dict(SMALL.get(letter, kind.small))).double().eval()
        cache = layer.allocate_inference_cache(SLOTS, MAX_SEQLEN)
        with torch.no_grad():
            y = layer(x, params, cache=cache, cache_slots=list(case.slots))
        got = per_rank[-1][letter]
        assert torch.equal(got["lengths"], cache.table.lengths), letter
        bad = {k: v for k, v in _worst(got["states"], cache.states).items() if not v <= TOL}
        assert not bad, f"{kind.mixer.__name__}: {bad}"
        out = torch.cat([r[letter]["out"] for r in per_rank], dim=1)
        assert float((out - y).abs().max()) <= 1e-10, letter
        assert all(r[letter]["states"] is None for r in per_rank[:-1])


REFUSALS = {
    "slots_differ": "every rank of a context-parallel prefill must pass the same cache_slots",
    "no_cache": "no rank of the context-parallel prefill passed cache=",
    "slot_busy": "already holds 2 tokens",
    "slot_count": "cache_slots names 3 slots but the call has 4 documents",
    "too_short": "max_seqlen=16",
}


@pytest.mark.parametrize("name", [pytest.param(n, id=n) for n in REFUSALS])
def test_misuse_raises_on_every_rank_and_writes_nothing(prefill_runs, name):
    """Slots that differ between ranks, no rank with a cache, a slot already in use, a slot count that
    is not the row's documents, a cache too short for the whole prompt: a ValueError on every rank
    (the rank that found it names the problem, the others name that rank), no cache touched."""
    path = prefill_runs(2)
    seen = [torch.load(path / f"refusals.{r}.pt")[name] for r in range(2)]
    for rank, (error, message, unchanged) in enumerate(seen):
        assert error == "ValueError", (rank, error, message)
        assert unchanged, rank
    messages = " | ".join(message for _, message, _ in seen)
    assert REFUSALS[name] in messages, messages
    if name in ("slot_busy", "slot_count", "too_short"):         # found on rank 1 (the cache's), named on rank 0
        assert "rank 1 of the context-parallel prefill refused its input" in seen[0][1], seen[0][1]
