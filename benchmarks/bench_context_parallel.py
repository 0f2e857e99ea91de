"""What does state-passing context parallelism send, and what does it cost? Bytes and wall time.

    P = ranks, T = tokens of the row, J = conv width - 1, S = a layer's recurrent state,
    b = bytes per element

1. Bytes sent per rank per layer (forward + backward), **measured** from the collectives
   (``mixers.ops.common.cp_exchange.record_traffic``) on P = 2 spawned gloo ranks, checked against the
   plan the layout implies (``chain_plan`` / ``key_plan``, no communication), next to the
   all-to-all design's volume (Megatron-core's CP for Mamba, Ulysses for the others: the scan's
   inputs go sequence -> head sharded and its output back), **computed**:
   ``a2a = 2 (fwd+bwd) * (P-1)/P * T/P * (W_in + W_out) * b``.
2. The same two quantities projected to P = 8 / 64 / 256 for a 1M-token row (the plan of that
   layout, no run), for three document mixes.
3. Wall time of one fwd+bwd of each layer: 2-rank CP vs one process on the same row (one thread
   per process; the two ranks share this machine's cores, alternating with the single run).

    python -m benchmarks.bench_context_parallel [--tokens 4096] [--hidden 256] [--repeat 3]
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.bench_layers import LAYERS, document_lengths
from benchmarks.common import table
from mixers.layers import AttentionConfig, GatedDeltaNetConfig, GatedDeltaProductConfig, KDAConfig, Mamba2Config
from mixers.ops.attention.cp import key_plan
from mixers.ops.common.cp_exchange import chain_plan, record_traffic
from ssm_pack import PackedSeqParams, shard_for_context_parallel
from ssm_pack.parallel.layout import ContextParallelLayout

MIB = 2 ** 20


# ------------------------------------------------------------------------------- layer geometry
def geometry(name: str, cfg) -> dict:
    """Per layer: the exchanged pieces (``convs``: channels of each short conv call, each exchanging
    its own window: Mamba2's x, B and C apart; ``state``/``m``: elements of S and M; ``kv``: elements
    of one key+value row), the a2a widths and ``proj``: the multiply-adds of the layer's projections
    per token, forward (every ``nn.Linear``); ``dispatch``
    (Mamba2, GatedDeltaNet, KDA, Gated DeltaProduct, attention): the backend and sizes
    ``cost_model.dispatched_parts`` needs."""
    if name == "Attention":
        hq, hk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        left = -1 if cfg.window_size is None else cfg.window_size[0]
        return dict(convs=[], kv=2 * hk * d, w_in=(hq + 2 * hk) * d, w_out=hq * d,
                    left=left, heads=hk, width=1, proj=cfg.hidden_size * (2 * hq + 2 * hk) * d,
                    dispatch=dict(kind="attention", q_heads=hq, head_dim=d, left=left))
    if name == "Mamba2":
        conv = cfg.d_inner + 2 * cfg.num_groups * cfg.state_size
        # x, B and C go through the short conv as three calls, each exchanging its own window
        gn = cfg.num_groups * cfg.state_size
        return dict(convs=[cfg.d_inner, gn, gn], state=cfg.num_heads * cfg.head_dim * cfg.state_size, m=cfg.num_heads,
                    w_in=cfg.d_inner + conv + cfg.num_heads, w_out=cfg.d_inner, width=cfg.conv_size,
                    heads=cfg.num_heads, proj=cfg.hidden_size * (2 * cfg.d_inner + conv + cfg.num_heads),
                    dispatch=dict(kind="ssd", heads=cfg.num_heads, head_dim=cfg.head_dim, state_size=cfg.state_size,
                                  groups=cfg.num_groups, chunk=cfg.chunk_size))
    nh = getattr(cfg, "num_householder", 1)
    hv, k, v = cfg.num_v_heads, cfg.head_dim, cfg.head_v_dim
    convs = [cfg.key_dim, cfg.key_dim * nh, cfg.value_dim * nh]
    gate = hv * k if name == "KDA" else hv
    # q, k, v, beta, the output projection; the gates: a (hidden -> HV) and g (hidden -> value_dim), or
    # KDA's low-rank f (hidden -> V -> HV K) and g (hidden -> V -> value_dim)
    gates = (cfg.hidden_size * v + v * gate + cfg.hidden_size * v + v * cfg.value_dim if name == "KDA"
             else cfg.hidden_size * (gate + cfg.value_dim))
    geo = dict(convs=convs, state=hv * k * v, m=hv * k * k, w_in=sum(convs) + hv * nh + gate, w_out=cfg.value_dim,
               width=cfg.conv_size, heads=cfg.num_heads,
               proj=cfg.hidden_size * (sum(convs) + hv * nh + cfg.value_dim) + gates)
    sizes = dict(heads=hv, key_dim=k, value_dim=v, chunk=cfg.chunk_size)
    if name == "GatedDeltaNet":
        geo["dispatch"] = dict(kind="delta", **sizes)
    elif name == "KDA":
        geo["dispatch"] = dict(kind="kda", **sizes)
    elif name == "GatedDeltaProduct":
        geo["dispatch"] = dict(kind="delta_product", num_householder=nh, **sizes)
        geo["updates"] = nh                     # Householder steps: nh state updates per token
    return geo


def planned_bytes(lay: ContextParallelLayout, geo: dict, act_bytes: int, state_bytes: int) -> list[tuple[int, int]]:
    """``[(forward, backward)]`` bytes each rank sends for one layer, from the layout alone."""
    fwd, bwd = [0] * lay.size, [0] * lay.size

    def chain(closed, s, m, b):
        rounds, shift = chain_plan(lay, closed)
        for i, j, with_m in [p for rnd in rounds for p in rnd] + [(i, j, False) for i, j in shift]:
            n = (s + (m if with_m else 0)) * b
            fwd[i] += n
            bwd[j] += n
    j = geo["width"] - 1
    for channels in geo["convs"]:
        closed = [lay.last_starts_here[r] or lay.last_len[r] >= j for r in range(lay.size)]
        chain(closed, channels * j, j * j, act_bytes)
    if "state" in geo:
        chain(lay.last_starts_here, geo["state"], geo["m"], state_bytes)
    if "kv" in geo:
        for (i, r), (a, b) in key_plan(lay, geo["left"]).items():
            fwd[i] += (b - a) * geo["kv"] * act_bytes
            bwd[r] += (b - a) * geo["kv"] * act_bytes
    return list(zip(fwd, bwd))


def a2a_bytes(geo: dict, tokens: int, ranks: int, b: int) -> float:
    """The all-to-all design's bytes per rank for one layer, forward + backward."""
    return 2 * (ranks - 1) / ranks * (tokens / ranks) * (geo["w_in"] + geo["w_out"]) * b


def layout_of(lengths, tokens: int, ranks: int, rank: int = 0) -> ContextParallelLayout:
    params = PackedSeqParams.from_lengths(lengths, total_tokens=tokens)
    return shard_for_context_parallel(params, rank, ranks)[2].cp_layout


def row_lengths(tokens: int, median: float, seed: int = 0) -> list[int]:
    """Log-normal documents filling ``tokens`` (the last one cut to fit)."""
    lengths, total, k = [], 0, 0
    while total < tokens:
        n = document_lengths(64, seed=seed + k, median=median, cap=8 * int(median) + 1)
        for x in n:
            x = min(x, tokens - total)
            lengths.append(x)
            total += x
            if total == tokens:
                break
        k += 1
    return lengths


# ------------------------------------------------------------------------------- the 2-rank run
def _rank(rank, world, port, tokens, hidden, repeat, out):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    lengths = row_lengths(tokens, 300.0)
    params = PackedSeqParams.from_lengths(lengths, total_tokens=tokens)
    start, end, local = shard_for_context_parallel(params, rank, world, cp_group=dist.group.WORLD)
    x_full = torch.randn(1, tokens, hidden, generator=torch.Generator().manual_seed(1))
    result = {}
    for name, cls in LAYERS.items():
        torch.manual_seed(0)
        layer = cls(hidden)

        def cp_step():
            x = x_full[:, start:end].clone().requires_grad_()
            layer(x, packed_seq_params=local).square().sum().backward()

        def single_step():
            x = x_full.clone().requires_grad_()
            layer(x, packed_seq_params=params).square().sum().backward()
        with record_traffic() as traffic:       # also the CP step's warm-up
            cp_step()
        if rank == 0:
            single_step()                       # the single run's warm-up
        best_cp, best_single = [float("inf")] * 2, [float("inf")] * 2      # (wall, busiest rank's CPU time)
        for _ in range(repeat):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            cp_step()
            spent = torch.tensor([time.perf_counter() - t0, time.process_time() - c0])
            dist.all_reduce(spent, op=dist.ReduceOp.MAX)          # the CP step ends with its slowest rank
            best_cp = [min(a, float(b)) for a, b in zip(best_cp, spent)]
            if rank == 0:
                t0, c0 = time.perf_counter(), time.process_time()
                single_step()
                best_single = [min(best_single[0], time.perf_counter() - t0),
                               min(best_single[1], time.process_time() - c0)]
            dist.barrier()
        result[name] = dict(forward=traffic.total("forward"), backward=traffic.total("backward"),
                            calls=traffic.calls(), cp=best_cp, single=best_single,
                            config=layer.config)
    torch.save({"rank": rank, "layers": result, "lengths": lengths}, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def measure(tokens: int, hidden: int, repeat: int, world: int = 2) -> list[dict]:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(world, port, tokens, hidden, repeat, out), nprocs=world,
                           start_method="spawn")
        return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(world)]


# ------------------------------------------------------------------------------- report
def report(tokens: int, hidden: int, repeat: int) -> str:
    ranks = measure(tokens, hidden, repeat)
    world = len(ranks)
    lengths = ranks[0]["lengths"]
    layouts = [layout_of(lengths, tokens, world, r) for r in range(world)]
    rows, time_rows, geos = [], [], {}
    for name in LAYERS:
        geo = geos[name] = geometry(name, ranks[0]["layers"][name]["config"])
        plan = planned_bytes(layouts[0], geo, 4, 4)
        measured = [(r["layers"][name]["forward"], r["layers"][name]["backward"]) for r in ranks]
        assert measured == plan, f"{name}: measured {measured} != planned {plan}"
        worst = max(f + b for f, b in measured)
        a2a = a2a_bytes(geo, tokens, world, 4)
        rows.append([name, f"{worst / 1024:,.1f} KiB", f"{ranks[0]['layers'][name]['calls']}",
                     f"{a2a / 1024:,.1f} KiB", f"{a2a / max(worst, 1):,.0f}x"])
        (cp, cp_cpu), (single, single_cpu) = ranks[0]["layers"][name]["cp"], ranks[0]["layers"][name]["single"]
        time_rows.append([name, f"{cp * 1e3:,.1f} ms", f"{single * 1e3:,.1f} ms", f"{single / cp:.2f}x",
                          f"{cp_cpu * 1e3:,.1f} ms", f"{single_cpu * 1e3:,.1f} ms", f"{single_cpu / cp_cpu:.2f}x"])
    text = [f"## measured: P = {world} gloo ranks, T = {tokens}, hidden {hidden}, fp32, {len(lengths)} documents "
            f"(log-normal, median 300); bytes = fwd + bwd sent by the busiest rank; plan == measured for every layer",
            "", table(["layer", "ours (measured)", "collectives on rank 0", "all-to-all (computed)", "a2a / ours"],
                      rows),
            "", f"## one fwd+bwd, 2-rank CP vs one process on the same row ({tokens} tokens, 1 thread per process, "
            f"best of {repeat}; CPU time: the busiest rank's, what a core per rank would take)", "",
            table(["layer", "CP wall", "one process wall", "wall speed-up", "CP CPU", "one process CPU",
                   "CPU-time speed-up"], time_rows), ""]
    text += projection(geos, f"hidden {hidden} (the layers measured above)", MIXES)
    big = {name: geometry(name, cfg) for name, cfg in production_configs(PRODUCTION_HIDDEN).items()}
    text += projection(big, f"hidden {PRODUCTION_HIDDEN} (default head sizes)", MIXES[1:])
    return "\n".join(text)


PRODUCTION_HIDDEN = 4096
MIXES = ("short docs (median 300)", "long docs (median 32K)", "one 1M-token document")


def production_configs(hidden: int) -> dict:
    return {"Mamba2": Mamba2Config(hidden), "GatedDeltaNet": GatedDeltaNetConfig(hidden), "KDA": KDAConfig(hidden),
            "GatedDeltaProduct": GatedDeltaProductConfig(hidden), "Attention": AttentionConfig(hidden)}


def projection(geos: dict, sizes: str, mixes, tokens: int = 2 ** 20) -> list[str]:
    """Bytes per rank per layer for a 1M-token row (bf16 activations, fp32 states), from the plan."""
    rows_of = {MIXES[0]: lambda: row_lengths(tokens, 300.0), MIXES[1]: lambda: row_lengths(tokens, 32768.0),
               MIXES[2]: lambda: [tokens]}
    out = []
    for mix in mixes:
        lengths = rows_of[mix]()
        rows = []
        for name, geo in geos.items():
            cells = [name]
            for ranks in (8, 64, 256):
                lay = layout_of(lengths, tokens, ranks)
                ours = max(f + b for f, b in planned_bytes(lay, geo, 2, 4))
                a2a = a2a_bytes(geo, tokens, ranks, 2)
                note = "" if ranks <= geo["heads"] else f" (P > {geo['heads']} heads)"
                cells.append(f"{ours / MIB:,.2f} / {a2a / MIB:,.1f}{note}")
            rows.append(cells)
        out += [f"## projected: 1M-token row, {mix}, {sizes}: MiB per rank per layer (the busiest rank), "
                "ours / all-to-all (fwd+bwd, bf16 activations, fp32 states)", "",
                table(["layer", "P = 8", "P = 64", "P = 256"], rows), ""]
    return out


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    text = report(args.tokens, args.hidden, args.repeat)
    print(text)
    return text


if __name__ == "__main__":
    main()
