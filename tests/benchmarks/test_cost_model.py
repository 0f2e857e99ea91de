"""The cost model (``benchmarks/cost_model.py``) against measurement, exactly.

Bytes: 3 spawned gloo ranks run each mixer (Mamba2, GatedDeltaNet, KDA, GatedDeltaProduct,
attention, windowed attention) forward + backward on uneven shards of one packed row (a document
crossing every rank boundary, a shard shorter than the conv window, short documents, a padding
tail); what ``record_traffic`` counts per exchange kind equals the model's bytes per rank and
kind; the multiply-adds of the projections that ``benchmarks.op_counts`` counts per rank in the
same runs (forward + backward: every matmul with a projection weight, and the weight gradients)
equal the model's ``projections`` part. Attention work: the model's query-key pairs per rank
equal those counted from the attention spec's own mask. Dispatched work: on one process, every
part of ``dispatched_parts`` (the scans' and attention's products too) equals the counted
multiply-adds on packed rows (a 1-token document, one longer than a chunk and not a multiple of
it, a padding tail), and the ideal figures do not; per CP rank, ``dispatched_rank_parts`` equals
the counted multiply-adds on every rank of the gloo runs for every subject, and, for the delta
rule (whose CP pass depends on where the shard's documents end inside the chunks), on every rank
of more layouts, each rank counted in one process with the exchange answering random numbers.
The plan's arithmetic also equals ``bench_context_parallel``'s plan (built on the real layout) on
many rows without any run.
"""

from __future__ import annotations

import datetime
import os
import random

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks import cost_model as cm

LENGTHS, TOTAL = [3, 17, 2, 1, 9], 36          # document 1 holds tokens 3..19; tokens 32..35: the tail
BOUNDS = (0, 8, 10, 36)                        # rank 1 holds 2 tokens, all inside document 1
WORLD = 3
SUBJECTS = ("M", "G", "K", "P", "A", "Aw")
KIND = {"conv": "conv", "ssd": "state", "gdn": "state", "kda": "state", "gdp": "state", "attention": "kv"}


def _module(subject):
    from mixers.layers.registry import MIXERS as REGISTERED
    from tests.context_parallel.cases import HIDDEN, SMALL
    torch.manual_seed(0)
    extra = {"window_size": (4, 0)} if subject == "Aw" else {}
    return REGISTERED[subject[0]].mixer(HIDDEN, **SMALL[subject[0]], **extra).double()


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    from benchmarks.op_counts import MatmulCounter
    from mixers.ops.common.cp_exchange import record_traffic
    from ssm_pack import PackedSeqParams, shard_for_context_parallel
    from tests.context_parallel.cases import HIDDEN
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    results = {}
    try:
        params = PackedSeqParams.from_lengths(LENGTHS, total_tokens=TOTAL)
        start, end, local = shard_for_context_parallel(params, rank, WORLD, bounds=BOUNDS, cp_group=dist.group.WORLD)
        x = torch.randn(1, TOTAL, HIDDEN, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        for subject in SUBJECTS:
            module = _module(subject)
            with record_traffic() as traffic, MatmulCounter(module) as counter:
                module(x[:, start:end].clone().requires_grad_(), packed_seq_params=local).square().sum().backward()
            results[subject] = {"events": traffic.events, "config": module.config, "macs": counter.macs,
                                "by_op": dict(counter.by_op), "unknown": counter.unknown}
    finally:
        torch.save(results, os.path.join(out_dir, f"{rank}.pt"))
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    from tests.context_parallel.worker import free_port
    path = tmp_path_factory.mktemp("cost")
    mp.start_processes(_rank_main, args=(free_port(), str(path)), nprocs=WORLD, join=True, start_method="spawn")
    return [torch.load(path / f"{r}.pt", weights_only=False) for r in range(WORLD)]


def _geometry(subject, config):
    from benchmarks.bench_context_parallel import geometry
    names = {"M": "Mamba2", "G": "GatedDeltaNet", "K": "KDA", "P": "GatedDeltaProduct", "A": "Attention"}
    return geometry(names[subject[0]], config)


def _by_kind(events) -> dict:
    out = {kind: [0, 0] for kind in ("conv", "state", "kv")}
    for label, direction, nbytes in events:
        out[KIND[label]][0 if direction == "forward" else 1] += nbytes
    return {kind: tuple(v) for kind, v in out.items()}


@pytest.mark.parametrize("subject", [pytest.param(s, id=s) for s in SUBJECTS])
def test_model_bytes_equal_the_measured_bytes(measured, subject):
    geo = _geometry(subject, measured[0][subject]["config"])
    model = cm.ours_bytes(cm.cover_of([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], TOTAL), BOUNDS, geo, 8, 8)
    got = [_by_kind(result[subject]["events"]) for result in measured]
    assert got == model
    assert any(f for rank in got for f, _ in rank.values())          # something was sent


def _model_parts(subject, config):
    boundaries = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    window = config.window_size[0] + 1 if subject == "Aw" else None
    return cm.work_parts(_geometry(subject, config), config.hidden_size, boundaries, LENGTHS, BOUNDS, window)


@pytest.mark.parametrize("subject", [pytest.param(s, id=s) for s in SUBJECTS])
def test_model_projection_work_equals_the_counted_matmuls(measured, subject):
    """Per rank, the model's ``projections`` == the counting mode's, on the real CP run. Negative
    controls: a geometry one hidden size off, or shards one token off, no longer match."""
    from tests.context_parallel.cases import SMALL
    config = measured[0][subject]["config"]
    counted = [result[subject]["macs"]["projections"] for result in measured]
    assert all(not result[subject]["unknown"] for result in measured)      # no product went uncounted
    assert [p["projections"] for p in _model_parts(subject, config)] == counted
    assert all(counted)
    extra = {"window_size": config.window_size} if subject == "Aw" else {}
    wider = type(config)(config.hidden_size + 4, **SMALL[subject[0]], **extra)
    assert [p["projections"] for p in _model_parts(subject, wider)] != counted
    shifted = cm.work_parts(_geometry(subject, config), config.hidden_size, [0, TOTAL], [TOTAL], (0, 9, 10, 36))
    assert [p["projections"] for p in shifted] != counted


@pytest.mark.parametrize("subject", [pytest.param(s, id=s) for s in SUBJECTS])
def test_the_scan_and_attention_parts_are_lower_bounds(measured, subject):
    """The ideal parts on CP ranks: the counted matmuls outside the projections (the chunked scans'
    products, the blocked attention kernel's scores) are at least the model's ideal ``scan`` +
    ``attention`` on every rank holding tokens, never fewer (the ideal is a lower bound)."""
    model = _model_parts(subject, measured[0][subject]["config"])
    counted = [result[subject]["macs"]["other"] for result in measured]
    assert all(c >= m["scan"] + m["attention"] > 0 for c, m in zip(counted, model))


RANK_EXACT = SUBJECTS               # ``dispatched_rank_parts`` is exact per rank for these


@pytest.mark.parametrize("subject", [pytest.param(s, id=s) for s in RANK_EXACT])
def test_dispatched_rank_model_equals_the_counted_matmuls(measured, subject):
    """Per CP rank, every part of ``dispatched_rank_parts`` == the counted matmuls on the gloo run
    (``attention + scan`` is the count's ``other``): the local chunked pass on the shard plus the
    exchange's products (the SSD's entering-state correction and conv windows; the delta rule's
    keep-intermediates calls, state chain and correction; attention's continuing segment over the
    received keys). Negative controls: the one-process model of the shard alone (no exchange
    products; for the delta rule, the fast path) misses the continuing ranks (every rank for the
    delta rule), and the model of the same row on shards one token off differs."""
    config = measured[0][subject]["config"]
    geo = _geometry(subject, config)
    boundaries = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    model = cm.dispatched_rank_parts(geo, config.hidden_size, boundaries, LENGTHS, BOUNDS)
    counted = [result[subject]["macs"] for result in measured]
    rest = "attention" if subject.startswith("A") else "scan"
    assert model == [{"projections": c["projections"], "attention": 0, "scan": 0, rest: c["other"]} for c in counted]
    alone = [cm.dispatched_parts(geo, config.hidden_size, [0, hi - a], hi - a) for a, hi in zip(BOUNDS, BOUNDS[1:])]
    fast_path_alone = subject[0] in "MA"          # the delta rule's CP calls never take the fast path
    assert [a[rest] == c["other"] for a, c in zip(alone, counted)] == [fast_path_alone, False, False]
    shifted = cm.dispatched_rank_parts(geo, config.hidden_size, boundaries, LENGTHS, (0, 9, 10, 36))
    assert [p[rest] for p in shifted] != [c["other"] for c in counted]


def test_dispatched_rank_model_refuses_what_it_does_not_model():
    with pytest.raises(ValueError, match="no per-rank dispatched model for None"):       # no dispatch at all
        cm.dispatched_rank_parts(GEO, 16, [0, 8], [8], (0, 4, 8))
    with pytest.raises(ValueError, match="no per-rank dispatched model for 'rg_lru'"):
        cm.dispatched_rank_parts({**GEO, "dispatch": {"kind": "rg_lru"}}, 16, [0, 8], [8], (0, 4, 8))


# ------------------------------------------------------------------ per CP rank, one process: the delta rule
def _fake_all_to_all(out, buffer, recv_splits, send_splits, group=None):
    """The exchange of a single rank: what arrives is random (the products do not depend on it)."""
    with torch.no_grad():
        out.copy_(torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(out.numel())))


def _rank_counts(subject, lengths, total, bounds, monkeypatch, traffic=None) -> tuple[list[dict], object]:
    """Per rank, the multiply-adds one forward + backward of the subject's layer dispatches on that
    rank's shard, every rank run alone in this process (a stand-in group, the exchange answering
    random numbers: the same calls and products as on a gloo run); ``traffic``: a list that gets
    each rank's exchange events (``record_traffic``)."""
    from benchmarks.op_counts import MatmulCounter
    from mixers.ops.common import cp_exchange
    from ssm_pack import PackedSeqParams, shard_for_context_parallel
    from tests.context_parallel.cases import HIDDEN
    from tests.context_parallel.test_shard import FakeGroup
    monkeypatch.setattr(cp_exchange.dist, "all_to_all_single", _fake_all_to_all)
    module, world, counted = _module(subject), len(bounds) - 1, []
    for rank in range(world):
        params = PackedSeqParams.from_lengths(lengths, total_tokens=total)
        start, end, local = shard_for_context_parallel(params, rank, world, bounds=bounds)
        local.cp_group = FakeGroup(world)
        x = torch.randn(1, end - start, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
        with cp_exchange.record_traffic() as sent, MatmulCounter(module) as counter:
            module(x.requires_grad_(), packed_seq_params=local).square().sum().backward()
        assert not counter.unknown
        counted.append(dict(counter.macs))
        if traffic is not None:
            traffic.append(sent.events)
    return counted, module.config


# chunks of 8 steps (Gated DeltaProduct: 4 tokens of 2 sub-steps), conv window J = 3 (every shard
# holds at least 3 tokens: ``test_conv_windows_composed_over_ranks`` has the shorter ones)
RANK_ROWS = [
    pytest.param([1, 12, 1, 7], 24, (0, 5, 13, 24), id="short_docs_long_doc_tail"),   # 1-token documents,
    # a 12-token one from rank 0 into rank 1 (which starts mid-document), a 3-token tail
    pytest.param([20, 3], 26, (0, 4, 9, 15, 26), id="one_doc_over_four_ranks"),       # doubling rounds with maps
    pytest.param([6, 7, 9, 2], 30, (0, 11, 30), id="chunk_edges"),                    # documents across chunk edges
    pytest.param([5, 3], 20, (0, 6, 12, 20), id="tail_over_ranks"),                   # the padding tail continues
    pytest.param([8, 8, 16], 32, (0, 16, 32), id="whole_chunks"),                     # runs of exactly a chunk
    pytest.param([17, 5], 22, (0, 16, 22), id="one_doc_in_16"),                       # rank 0: one document,
    pytest.param([3, 5, 3, 7, 4], 22, (0, 16, 22), id="four_docs_in_16"),             # or four, going on
]


@pytest.mark.parametrize("lengths, total, bounds", RANK_ROWS)
@pytest.mark.parametrize("subject", [pytest.param(s, id=s) for s in ("G", "K", "P")])
def test_delta_rank_model_equals_the_counted_matmuls_per_layout(subject, lengths, total, bounds, monkeypatch):
    """Per rank of each layout, ``dispatched_rank_parts`` == the counted matmuls of the rank's
    forward + backward (the continuing segment's call with K more value columns, the call over the
    documents starting on the rank, per-document final states on runs padded to powers of two, the
    state chain's ``M @ S`` and ``M @ M``, the entering state's correction, the conv windows).
    Negative controls: the same shards read as one segment (the layout ignored) and the one-process
    fast-path model of each shard alone do not match."""
    counted, config = _rank_counts(subject, lengths, total, bounds, monkeypatch)
    geo, boundaries = _geometry(subject, config), [0, *torch.tensor(lengths).cumsum(0).tolist()]
    model = cm.dispatched_rank_parts(geo, config.hidden_size, boundaries, lengths, bounds)
    assert model == [{"projections": c["projections"], "attention": 0, "scan": c["other"]} for c in counted]
    blind = cm.dispatched_rank_parts(geo, config.hidden_size, [0], [], bounds)
    assert [p["scan"] for p in blind] != [c["other"] for c in counted]
    alone = [cm.dispatched_parts(geo, config.hidden_size, [0, hi - a], hi - a)["scan"]
             for a, hi in zip(bounds, bounds[1:])]
    assert all(a < c["other"] for a, c in zip(alone, counted))


def test_the_delta_rank_work_follows_the_documents(monkeypatch):
    """The figures of ``dispatched_rank_parts``' docstring: rank 0's 16 tokens, its last document going
    on, counted as one document and as four (3, 5, 3, 5 tokens); the model gives both."""
    got = []
    for lengths in ([17, 5], [3, 5, 3, 7, 4]):
        counted, config = _rank_counts("G", lengths, 22, (0, 16, 22), monkeypatch)
        boundaries = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        model = cm.dispatched_rank_parts(_geometry("G", config), config.hidden_size, boundaries, lengths, (0, 16, 22))
        assert model[0]["scan"] == counted[0]["other"]
        got.append(counted[0]["other"])
    assert (config.num_v_heads, config.head_dim, config.head_v_dim, config.chunk_size) == (4, 4, 8, 8)
    assert got == [74_752, 80_896]


@pytest.mark.parametrize("lengths, total, bounds", [
    pytest.param([4], 4, (0, 1, 2, 3, 4), id="one_token_shards"),
    pytest.param([2, 9], 14, (0, 3, 4, 5, 6, 7, 9, 14), id="short_shards_mid_document"),
])
@pytest.mark.parametrize("subject", [pytest.param(s, id=s) for s in ("M", "G", "K", "P")])
def test_conv_windows_composed_over_ranks(subject, lengths, total, bounds, monkeypatch):
    """Shards shorter than the conv window J = 3 inside one document: the conv's doubling rounds
    carry maps (``M_recv @ M``, and ``S_recv @ M`` with ``M``'s gradient once it carries one).
    Per rank, the dispatched model and the conv bytes equal the count, each short conv call (Mamba2's
    x, B and C apart) exchanging its own window. Negative control: Mamba2's conv as one call of all
    its channels sends and multiplies less than the run."""
    traffic = []
    counted, config = _rank_counts(subject, lengths, total, bounds, monkeypatch, traffic)
    geo, boundaries = _geometry(subject, config), [0, *torch.tensor(lengths).cumsum(0).tolist()]
    cover, facts = cm.cover_of(boundaries, total), cm.rank_facts(cm.cover_of(boundaries, total), bounds)
    assert any(m for rnd in cm.chain(facts, [f["last_starts_here"] or f["last_len"] >= 3 for f in facts])[0]
               for _, _, m in rnd)                                               # a round carries a map
    model = cm.dispatched_rank_parts(geo, config.hidden_size, boundaries, lengths, bounds)
    assert model == [{"projections": c["projections"], "attention": 0, "scan": c["other"]} for c in counted]
    sent = [_by_kind(events)["conv"] for events in traffic]
    assert [rank["conv"] for rank in cm.ours_bytes(cover, bounds, geo, 8, 8)] == sent
    if subject == "M":
        one = {**geo, "convs": [sum(geo["convs"])]}
        assert [p["scan"] for p in cm.dispatched_rank_parts(one, config.hidden_size, boundaries, lengths, bounds)
                ] != [c["other"] for c in counted]
        assert [rank["conv"] for rank in cm.ours_bytes(cover, bounds, one, 8, 8)] != sent


def test_the_layout_exercises_every_branch():
    """Negative control of the arithmetic above: the row has doubling rounds for the conv (a
    shard shorter than the window) and the scans (a document over 3 ranks), and a windowed
    attention that needs fewer keys than the plain one."""
    cover = cm.cover_of([0, 3, 20, 22, 23, 32], TOTAL)
    facts = cm.rank_facts(cover, BOUNDS)
    assert cm.chain(facts, [f["last_starts_here"] for f in facts])[0]
    assert cm.chain(facts, [f["last_starts_here"] or f["last_len"] >= 3 for f in facts])[0]
    assert cm.received_keys(cover, BOUNDS, 4) != cm.received_keys(cover, BOUNDS, -1)


def _random_rows(count: int):
    rng = random.Random(7)
    for _ in range(count):
        lengths = [rng.choice([0, 1, 2, 3, 5, 9, 17, 40]) for _ in range(rng.randint(1, 8))]
        total = sum(lengths) + rng.choice([0, 0, 3])
        world = rng.randint(2, min(8, max(2, total)))
        if total < world:
            continue
        cuts = sorted(rng.sample(range(1, total), world - 1))
        yield lengths, total, [0, *cuts, total]


@pytest.mark.parametrize("name", [pytest.param(n, id=n) for n in ("Mamba2", "GatedDeltaNet", "Attention")])
def test_model_bytes_equal_the_plan_of_the_real_layout(name):
    from benchmarks.bench_context_parallel import geometry, planned_bytes
    from mixers.layers import AttentionConfig, GatedDeltaNetConfig, Mamba2Config
    from ssm_pack import PackedSeqParams, shard_for_context_parallel
    config = {"Mamba2": Mamba2Config(16, head_dim=4, state_size=4, expand=1),
              "GatedDeltaNet": GatedDeltaNetConfig(16, head_dim=4, num_heads=2),
              "Attention": AttentionConfig(16, head_dim=4, num_heads=4, num_kv_heads=2, window_size=(6, 0))}[name]
    geo = geometry(name, config)
    for geo_case in (geo, {**geo, "left": -1} if "kv" in geo else geo):
        for lengths, total, bounds in _random_rows(60):
            params = PackedSeqParams.from_lengths(lengths, total_tokens=total)
            lay = shard_for_context_parallel(params, 0, len(bounds) - 1, bounds=bounds)[2].cp_layout
            plan = planned_bytes(lay, geo_case, 2, 4)
            cover = cm.cover_of(lay.cover.tolist()[:-1], total)
            model = [tuple(map(sum, zip(*rank.values()))) for rank in cm.ours_bytes(cover, bounds, geo_case, 2, 4)]
            assert model == plan, (lengths, total, bounds)


def _counted_pairs(boundaries, lengths, total, window) -> torch.Tensor:
    """``[T]`` query-key pairs per query from the attention spec's own mask (``mixers.ops.attention.naive``)."""
    from mixers.ops.attention.naive import _visible
    pairs = torch.zeros(total, dtype=torch.int64)
    for s, n in zip(boundaries, lengths):
        if n:
            pairs[s:s + n] = _visible(n, True, None if window is None else (window - 1, 0), "cpu").sum(1)
    return pairs


@pytest.mark.parametrize("lengths, slots, total, window", [
    pytest.param([5, 1, 0, 17, 3], [5, 1, 0, 17, 3], 26, None, id="plain"),
    pytest.param([9, 2, 11], [9, 2, 11], 30, None, id="tail"),
    pytest.param([5, 0, 13, 2, 7], [8, 0, 16, 4, 8], 44, None, id="padded"),
    pytest.param([21, 4, 0, 15], [21, 4, 0, 15], 44, 6, id="window"),
    pytest.param([21, 3, 9], [24, 8, 16], 48, 4, id="window_padded"),
])
def test_model_attention_pairs_equal_the_mask(lengths, slots, total, window):
    boundaries = [0, *torch.tensor(slots).cumsum(0).tolist()]
    counted = _counted_pairs(boundaries, lengths, total, window)
    for world in (1, 2, 3, 5):
        for bounds in (cm.even_bounds(total, world), [0, *sorted(random.Random(world).sample(range(1, total),
                                                                                             world - 1)), total]):
            model = cm.attention_pairs(boundaries, lengths, bounds, window)
            assert model == [int(counted[a:b].sum()) for a, b in zip(bounds[:-1], bounds[1:])]
    assert sum(cm.attention_pairs(boundaries, lengths, [0, total], window)) == int(counted.sum()) > 0


# ------------------------------------------------------------------ the dispatched work, exactly, one process
def _dispatch_layer(kind):
    from mixers import AttentionMixer, GatedDeltaNetMixer, GatedDeltaProductMixer, KDAMixer, Mamba2Mixer
    from mixers.layers import AttentionConfig, GatedDeltaNetConfig, GatedDeltaProductConfig, KDAConfig, Mamba2Config
    return {"Mamba2": (Mamba2Mixer, Mamba2Config(64, head_dim=16, state_size=8, num_groups=2, chunk_size=16)),
            "GatedDeltaNet": (GatedDeltaNetMixer, GatedDeltaNetConfig(64, head_dim=16, num_heads=1, num_v_heads=2,
                                                                      chunk_size=16)),
            "KDA": (KDAMixer, KDAConfig(64, head_dim=16, num_heads=1, num_v_heads=2, expand_v=2.0, chunk_size=16)),
            "GatedDeltaProduct": (GatedDeltaProductMixer, GatedDeltaProductConfig(64, head_dim=16, num_heads=2,
                                                                                  num_householder=2, chunk_size=16)),
            "GatedDeltaProduct_nh3": (GatedDeltaProductMixer, GatedDeltaProductConfig(
                64, head_dim=16, num_heads=2, expand_v=1.0, num_householder=3, chunk_size=16)),
            "Attention": (AttentionMixer, AttentionConfig(64, head_dim=16, num_heads=4, num_kv_heads=2)),
            "Attention_window": (AttentionMixer, AttentionConfig(64, head_dim=16, num_heads=4, num_kv_heads=1,
                                                                 window_size=(20, 0)))}[kind]


def _counted_run(kind, lengths, total):
    """``(geometry, boundaries, counted macs)`` of one forward + backward of a small layer on one row."""
    from benchmarks.bench_context_parallel import geometry
    from benchmarks.op_counts import count_training_step
    from ssm_pack import PackedSeqParams
    cls, config = _dispatch_layer(kind)
    torch.manual_seed(0)
    macs = count_training_step(cls(config=config), PackedSeqParams.from_lengths(lengths, total_tokens=total), total)
    return geometry(kind.split("_")[0], config), [0, *torch.tensor(lengths).cumsum(0).tolist()], macs


# chunks of 16 (Mamba2, GatedDeltaNet, KDA, Gated DeltaProduct: of sub-steps) and query blocks of 128
# (attention): every row has a 1-token document, one longer than a chunk and not a multiple of it,
# and a padding tail
ROWS = [
    pytest.param([1, 37, 5, 1], 50, id="short"),            # 37 = 2 chunks + 5; tail of 6
    pytest.param([150, 1, 9], 170, id="over_a_block"),      # 150 > one attention block (reach 256)
    pytest.param([3, 1, 21], 64, id="tail_longest"),        # the 39-token tail is the longest segment
]
DISPATCH_KINDS = [pytest.param(k, id=k) for k in ("Mamba2", "GatedDeltaNet", "KDA", "GatedDeltaProduct",
                                                   "GatedDeltaProduct_nh3", "Attention", "Attention_window")]


@pytest.mark.parametrize("lengths, total", ROWS)
@pytest.mark.parametrize("kind", DISPATCH_KINDS)
def test_dispatched_model_equals_the_counted_matmuls(kind, lengths, total):
    """Every part of ``dispatched_parts`` == the counting mode's, exactly (``attention + scan`` is
    its ``other``), on packed rows with uneven documents and a padding tail."""
    geo, boundaries, counted = _counted_run(kind, lengths, total)
    model = cm.dispatched_parts(geo, 64, boundaries, total)
    rest = "attention" if kind.startswith("Attention") else "scan"
    assert model == {"projections": counted["projections"], "attention": 0, "scan": 0, rest: counted["other"]}
    assert counted["other"] > 0


@pytest.mark.parametrize("kind", DISPATCH_KINDS)
def test_the_ideal_work_is_not_the_dispatched_work(kind):
    """Negative controls: the ideal figures (``(u + 1) S`` per token, ``2 Hq D`` per causal pair) fall short
    of the count, as does the dispatched model one chunk (or attention block) size off."""
    lengths, total = [1, 37, 5, 1], 50
    geo, boundaries, counted = _counted_run(kind, lengths, total)
    window = geo["left"] + 1 if geo.get("left", -1) >= 0 else None
    (ideal,) = cm.work_parts(geo, 64, boundaries, lengths, [0, total], window)
    assert ideal["projections"] == counted["projections"]
    assert 0 < ideal["scan"] + ideal["attention"] < counted["other"]
    spec = dict(geo["dispatch"])
    size = "block" if spec["kind"] == "attention" else "chunk"
    spec[size] = spec.get(size, cm.ATTENTION_BLOCK) // 2
    off = cm.dispatched_parts({**geo, "dispatch": spec}, 64, boundaries, total)
    assert off["scan"] + off["attention"] != counted["other"]


@pytest.mark.parametrize("kind", [pytest.param(k, id=k) for k in ("KDA", "GatedDeltaProduct",
                                                                   "GatedDeltaProduct_nh3")])
def test_the_delta_variants_are_not_gated_deltanet(kind):
    """Negative controls of the two variants: KDA's count is not the scalar-gate model's (its Grams
    are built level by level, its gate's backward is K wide), and Gated DeltaProduct's is not
    GatedDeltaNet's on T tokens (one step per token) nor on (nh - 1) T, but exactly on nh T."""
    lengths, total = [1, 37, 5, 1], 50
    geo, boundaries, counted = _counted_run(kind, lengths, total)
    spec = dict(geo["dispatch"])
    spec.pop("kind")
    nh = spec.pop("num_householder", 1)
    assert cm.dispatched_parts(geo, 64, boundaries, total)["scan"] == counted["other"]
    if kind == "KDA":
        assert cm.dispatched_delta_macs(total, **spec) != counted["other"]
        assert cm.dispatched_kda_macs(total, **{**spec, "key_dim": spec["key_dim"] // 2}) != counted["other"]
    else:
        assert nh == (3 if kind.endswith("nh3") else 2)
        assert cm.dispatched_delta_macs(nh * total, **spec) == counted["other"]
        assert cm.dispatched_delta_macs(total, **spec) < counted["other"]
        assert cm.dispatched_delta_macs((nh - 1) * total, **spec) < counted["other"]


def test_dispatched_formulas_by_hand():
    """The stated per-chunk / per-block sums on round numbers (one chunk, one block)."""
    L, H, P, N, G = 128, 4, 64, 64, 1
    assert cm.dispatched_ssd_macs(80, heads=H, head_dim=P, state_size=N, groups=G, chunk=L) == (
        2 * L * L * H + 4 * G * L * L * N + 3 * H * L * L * P + 6 * H * P * L * N) == 29_491_200
    assert cm.dispatched_ssd_macs(129, heads=H, head_dim=P, state_size=N, groups=G, chunk=L) == 2 * 29_491_200
    L, K, V = 64, 64, 128                              # the WY inverse: 64 (16^2 + 32^2) = 81,920
    assert cm.dispatched_delta_macs(80, heads=1, key_dim=K, value_dim=V, chunk=L) == 2 * (
        7 * L * L * K + 6 * L * L * V + 9 * L * K * V + 2 * L * L + 81_920)
    for L, K, V in ((64, 64, 128), (16, 16, 32), (8, 16, 16)):   # KDA: Gc(L) in closed form
        gc = 2 * K * L * (L - 1) + (K * L * (5 * L - 16) if L >= 16 else K * L * L * 3)
        assert cm.dispatched_kda_macs(L + 1, heads=3, key_dim=K, value_dim=V, chunk=L) == 2 * 3 * (
            gc + 6 * L * L * V + 9 * L * K * V + 2 * L * L * K + cm._wy_inverse_macs(L))
    assert cm.dispatched_delta_product_macs(40, num_householder=3, heads=2, key_dim=K, value_dim=V, chunk=64) == (
        cm.dispatched_delta_macs(120, heads=2, key_dim=K, value_dim=V, chunk=64)) == 2 * cm.dispatched_delta_macs(
        64, heads=2, key_dim=K, value_dim=V, chunk=64)
    assert cm.attention_reach(70) == 128 and cm.attention_reach(1) == 0 and cm.attention_reach(300, 20) == 128
    assert cm.dispatched_attention_macs(80, 70, q_heads=2, head_dim=64) == 7 * 2 * 128 * 256 * 64 + 2 * 128 * 256
    with pytest.raises(ValueError, match="no dispatch model"):
        cm.dispatched_parts(GEO, 16, [0, 8], 8)


# ------------------------------------------------------------------ the scaling statements of docs/context-parallel.md
GEO = {"convs": [6], "state": 40, "m": 3, "kv": 10, "left": -1, "width": 4, "w_in": 30, "w_out": 12, "heads": 8}


@pytest.mark.parametrize("ranks", [pytest.param(p, id=f"P{p}") for p in (2, 3, 5, 8, 16)])
def test_one_document_bytes_follow_the_stated_formulas(ranks):
    """One document over equal shards of T/P >= J tokens: the conv sends 2 J C b per rank (one
    boundary each way; J C b at P = 2), the state at most 2 (ceil(log2 P) (S + M) + S) b and the
    same at every T, attention's keys exactly (P - 1)/P T kv b on every rank (P | T)."""
    j, (c,) = GEO["width"] - 1, GEO["convs"]
    states = set()
    for total in (ranks * 8, ranks * 64, ranks * 1000):
        per = cm.ours_bytes(cm.cover_of([0, total], total), cm.even_bounds(total, ranks), GEO, 2, 4)
        conv = max(sum(r["conv"]) for r in per)
        assert conv == (2 if ranks > 2 else 1) * j * c * 2
        states.add(max(sum(r["state"]) for r in per))
        assert [sum(r["kv"]) for r in per] == [(ranks - 1) * total // ranks * GEO["kv"] * 2] * ranks
    assert len(states) == 1 and states.pop() <= 2 * (cm.ceil_log2(ranks) * (GEO["state"] + GEO["m"]) + GEO["state"]) * 4


def test_all_to_all_formula_and_its_cap():
    assert cm.a2a_bytes(GEO, 64, 4, 2) == 2 * 3 / 4 * 16 * 42 * 2
    assert [p for p in (1, 2, 3, 4, 8, 16) if cm.a2a_fits(GEO, p)] == [1, 2, 4, 8]


def test_the_benchmark_prints_both_tables(tmp_path, capsys):
    from benchmarks.bench_cost_model import main
    text = main(["--tokens", "4096", "8192", "--ranks", "2", "64", "--count-tokens", "128", "--out", str(tmp_path)])
    assert text.count("| 4,096 ") == 4 and text.count("| 8,192 ") == 4        # 2 ranks x 2 tables
    counted = [[c.strip() for c in line.split("|")] for line in text.splitlines()
               if line.startswith(("| Mamba2 ", "| GatedDeltaNet ", "| KDA ", "| GatedDeltaProduct ",
                                   "| Attention "))]
    kinds = ("Mamba2", "GatedDeltaNet", "KDA", "GatedDeltaProduct", "Attention")
    assert [row[1:3] for row in counted] == [[n, p] for n in kinds
                                             for p in ("projections", "attention" if n == "Attention" else "scan")]
    assert all(row[4] == row[5] for row in counted)                             # dispatched model == counted
    assert [row[6] for row in counted[::2]] == ["1.00x"] * 5                   # projections: ideal == dispatched
    assert all(float(row[6][:-1]) > 1 for row in counted[1::2])                # the backends do more
    rows = [line.split("|") for line in text.splitlines() if line.startswith("| 8,192 ")]
    assert rows[0][9].strip() != "-" and rows[1][9].strip() == "-"      # a2a attention: P = 64 > 8 KV heads
    assert (tmp_path / "cost-model.md").read_text().strip() == text.strip()
    with pytest.raises(SystemExit):
        main(["--ranks", "1"])
    assert "--ranks must be integers >= 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--count-tokens", "-1"])
    assert "--count-tokens must be >= 0, got -1" in capsys.readouterr().err

