"""The context-parallel cost model: bytes, work and activation memory per rank, in plain arithmetic.

    P = ranks, T = tokens of the physical row, r = a rank, [b_r, b_{r+1}) its shard, J = conv width - 1,
    S / M = elements of a layer's recurrent state / of its transition map, kv = elements of one
    key + value row, b = bytes per element, p = a token's position in its document

For one layer of one packed row, one training step (forward + backward), per rank:

* bytes sent, ours (state passing, ``mixers.ops.common.cp_exchange``): per layer kind, what the
  layout's plan sends, worked out here from the boundaries and the bounds alone (no torch): a conv
  call (``geo["convs"]``: Mamba2's x, B and C are three) sends its last ``J`` inputs
  (``J * channels``) across each rank boundary a document crosses (recursive-doubling rounds where
  a shard is shorter than ``J``, ``+ J^2`` while the sender's map still depends on what enters it);
  a scan sends its state ``S`` per crossed boundary, plus ``ceil(log2 k)`` doubling rounds of
  ``S`` (``S + M`` while the sender's map still depends on what enters it) for a document crossing
  ``k`` boundaries; attention sends every earlier key and value of a continuing document (``kv``
  per key, within the window). The
  backward sends the same bytes back (receiver to sender).
* bytes sent, all-to-all (Megatron-core's CP for Mamba, Ulysses for the others): the layer's
  inputs go sequence -> head sharded and its output back, each all-to-all keeping ``1/P`` of a
  rank's ``T/P`` rows and sending the rest, forward and backward (4 all-to-alls per layer, 2 of
  width ``W_in`` and 2 of ``W_out``): ``2 * (P-1)/P * T/P * (W_in + W_out) * b``. It needs the
  heads divisible by P, so it stops at ``P = heads`` (KV heads for attention).
* work (multiply-adds), forward + backward = ``3 *`` forward (a product's backward is two of its
  size), in three parts (``work_parts``):
  ``projections = proj * tokens``, ``proj`` the multiply-adds of every ``nn.Linear`` per token
  (``hidden * (W_in + W_out)`` where the projections are exactly the a2a widths; the geometry's
  ``proj`` otherwise), every token of the shard: exact, equal to the matmuls a real run dispatches
  (``benchmarks.op_counts``, checked per rank on gloo runs);
  ``attention = 2 * Hq * D * pairs``, ``pairs`` the query-key pairs of the causal mask a rank's
  queries see (exact for the mask: ``sum min(p + 1, window)`` over its real tokens; the reference
  kernel multiplies whole blocks, masked pairs included, so it dispatches more);
  ``scan = (u + 1) * S * tokens`` (``u`` state updates, Gated DeltaProduct's ``nh`` else 1, and
  the readout, token by token): the algorithm's work, the chunked backends dispatch more
  (intra-chunk products).
  These are the "ideal" figures the tables project with. What our torch reference backends
  really dispatch outside the projections is modelled exactly by ``dispatched_ssd_macs``
  (Mamba2), ``dispatched_delta_macs`` (GatedDeltaNet), ``dispatched_kda_macs`` (KDA),
  ``dispatched_delta_product_macs`` (Gated DeltaProduct) and ``dispatched_attention_macs``, together
  ``dispatched_parts`` (one process, one packed row; equal to ``benchmarks.op_counts``'s count,
  checked in ``tests/benchmarks/test_cost_model.py`` and asserted by ``bench_cost_model``);
  ``dispatched_rank_parts`` gives the same per context-parallel rank, exact for every one of these
  kinds: the local pass on the shard (for the delta rule, the reference's keep-intermediates path,
  whose per-document products follow where the shard's documents end inside the chunks) plus the
  exchange's products (checked per rank on gloo runs and on single-rank layouts).
* activation memory: ``tokens * (hidden + W_in + W_out) * b`` kept for backward (an estimate of the
  layer's inputs and outputs, ``1/P`` of one process), plus, for ours, the keys and values received.
"""

from __future__ import annotations

import bisect
import math

from mixers.ops.attention.cp import BLOCK as CP_ATTENTION_BLOCK  # queries per block of a continuing segment
from mixers.ops.attention.reference import BLOCK as ATTENTION_BLOCK  # queries per block
from mixers.ops.delta_rule.gram import _DIRECT_HALF as _GRAM_DIRECT_HALF  # quadrants from this size: bmm
from mixers.ops.delta_rule.wy import _BASE as _WY_BASE  # diagonal blocks solved directly


def cover_of(boundaries, total: int) -> list[int]:
    """Physical document boundaries ``[0, ..., c_N]`` followed by T (segment N: the padding tail)."""
    boundaries = [int(c) for c in boundaries]
    if not boundaries or boundaries[0] != 0 or any(b < a for a, b in zip(boundaries, boundaries[1:])):
        raise ValueError(f"boundaries must be non-decreasing offsets starting at 0, got {boundaries[:8]}")
    if total < boundaries[-1]:
        raise ValueError(f"total={total} is smaller than the last boundary {boundaries[-1]}; pass the row length")
    return boundaries + [int(total)]


def even_bounds(total: int, ranks: int) -> list[int]:
    """Equal-token shards, as ``shard_for_context_parallel`` cuts them by default."""
    return [r * total // ranks for r in range(ranks + 1)]


def rank_facts(cover: list[int], bounds) -> list[dict]:
    """Per rank: ``continues_in`` / ``continues_out`` (its first / last segment started before /
    goes on after it), ``last_len``, ``last_starts_here`` and ``first_seg_start``."""
    facts = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        first = bisect.bisect_right(cover, start) - 1
        last = bisect.bisect_right(cover, end - 1) - 1
        last_start = max(cover[last], start)
        cont_in = cover[first] < start
        facts.append(dict(continues_in=cont_in, continues_out=cover[last + 1] > end, last_len=end - last_start,
                          last_starts_here=last_start > start or not cont_in, first_seg_start=cover[first]))
    return facts


def chain(facts: list[dict], closed: list[bool]) -> tuple[list, list]:
    """The recursive-doubling plan: ``(rounds of (sender, receiver, with_m), shift pairs)``."""
    size = len(facts)
    done = [closed[j] or j == 0 or not facts[j]["continues_out"] for j in range(size)]
    rounds, d = [], 1
    while not all(done):
        rounds.append([(j - d, j, not done[j - d]) for j in range(size) if not done[j]])
        done = [done[j] or done[j - d] for j in range(size)]
        d *= 2
    return rounds, [(j - 1, j) for j in range(1, size) if facts[j]["continues_in"]]


def _chain_bytes(facts, closed, s: int, m: int, b: int) -> list[list[int]]:
    sent = [[0, 0] for _ in facts]                       # per rank: [forward, backward]
    rounds, shift = chain(facts, closed)
    for i, j, with_m in [p for rnd in rounds for p in rnd] + [(i, j, False) for i, j in shift]:
        n = (s + (m if with_m else 0)) * b
        sent[i][0] += n
        sent[j][1] += n
    return sent


def key_ranges(facts: list[dict], bounds, left: int) -> dict:
    """``{(sender, receiver): (lo, hi)}``: keys the receiver's first segment needs (``left < 0``: no window)."""
    plan = {}
    for j, f in enumerate(facts):
        if not f["continues_in"]:
            continue
        lo = f["first_seg_start"] if left < 0 else max(f["first_seg_start"], bounds[j] - left)
        for s in range(bisect.bisect_right(bounds[1:], lo), j):
            a, hi = max(bounds[s], lo), min(bounds[s + 1], bounds[j])
            if hi > a:
                plan[(s, j)] = (a, hi)
    return plan


def ours_bytes(cover: list[int], bounds, geo: dict, act_bytes: int, state_bytes: int) -> list[dict]:
    """Per rank ``{"conv", "state", "kv": (forward, backward)}``: bytes state passing sends for one
    layer of geometry ``geo`` (``benchmarks.bench_context_parallel.geometry``)."""
    facts = rank_facts(cover, bounds)
    size = len(facts)
    parts = {"conv": [[0, 0] for _ in range(size)], "state": [[0, 0] for _ in range(size)],
             "kv": [[0, 0] for _ in range(size)]}
    j = geo["width"] - 1
    for channels in geo["convs"]:
        closed = [f["last_starts_here"] or f["last_len"] >= j for f in facts]
        for r, (fw, bw) in enumerate(_chain_bytes(facts, closed, channels * j, j * j, act_bytes)):
            parts["conv"][r][0] += fw
            parts["conv"][r][1] += bw
    if "state" in geo:
        parts["state"] = _chain_bytes(facts, [f["last_starts_here"] for f in facts], geo["state"], geo["m"],
                                      state_bytes)
    if "kv" in geo:
        for (i, r), (a, hi) in key_ranges(facts, bounds, geo["left"]).items():
            parts["kv"][i][0] += (hi - a) * geo["kv"] * act_bytes
            parts["kv"][r][1] += (hi - a) * geo["kv"] * act_bytes
    return [{k: tuple(v[r]) for k, v in parts.items()} for r in range(size)]


def ours_total(cover, bounds, geo, act_bytes: int, state_bytes: int) -> list[int]:
    """Per rank: forward + backward bytes of every part."""
    return [sum(f + b for f, b in rank.values()) for rank in ours_bytes(cover, bounds, geo, act_bytes, state_bytes)]


def a2a_bytes(geo: dict, tokens: int, ranks: int, b: int) -> float:
    """The all-to-all design's bytes per rank for one layer, forward + backward."""
    return 2 * (ranks - 1) / ranks * (tokens / ranks) * (geo["w_in"] + geo["w_out"]) * b


def a2a_fits(geo: dict, ranks: int) -> bool:
    """Whether head sharding works at P ranks: the (KV) heads divisible by P."""
    return geo["heads"] % ranks == 0


def _pairs_prefix(n: int, window: int | None) -> int:
    """Query-key pairs of the first ``n`` queries of a document: ``sum_{p < n} min(p + 1, window)``."""
    if window is None or n <= window:
        return n * (n + 1) // 2
    return window * (window + 1) // 2 + (n - window) * window


def attention_pairs(boundaries, lengths, bounds, window: int | None = None) -> list[int]:
    """Per rank: causal query-key pairs of its real tokens (document i's ``lengths[i]`` real tokens
    open its physical slot ``[boundaries[i], boundaries[i + 1])``; a query sees ``window`` keys at most)."""
    pairs = [0] * (len(bounds) - 1)
    for start, n in zip(boundaries[:-1], lengths):
        for r in range(len(pairs)):
            a, hi = max(start, bounds[r]), min(start + n, bounds[r + 1])
            if hi > a:
                pairs[r] += _pairs_prefix(hi - start, window) - _pairs_prefix(a - start, window)
    return pairs


def projection_macs(geo: dict, hidden: int) -> int:
    """Multiply-adds per token of the layer's projections (every ``nn.Linear``), forward: the
    geometry's ``proj`` where it has one (``bench_context_parallel.geometry``), else
    ``hidden * (W_in + W_out)``. Exact: equal to what ``benchmarks.op_counts`` counts."""
    return geo["proj"] if "proj" in geo else hidden * (geo["w_in"] + geo["w_out"])


def scan_macs(geo: dict) -> int:
    """Multiply-adds per token of the recurrence, forward: ``(u + 1) S``, ``u`` state updates
    (``geo["updates"]``: Gated DeltaProduct's ``num_householder``, else 1) and one readout, token
    by token: the algorithm's ("ideal"); what the chunked backends dispatch
    (intra-chunk products too) is ``dispatched_ssd_macs`` / ``dispatched_delta_macs`` /
    ``dispatched_kda_macs`` / ``dispatched_delta_product_macs``."""
    return (geo.get("updates", 1) + 1) * geo.get("state", 0)


def linear_macs(geo: dict, hidden: int) -> int:
    """Multiply-adds per token of one layer's forward outside attention's pairs (projections + scan)."""
    return projection_macs(geo, hidden) + scan_macs(geo)


def attention_macs(geo: dict) -> int:
    """Multiply-adds per query-key pair (``q . k`` and the weighted ``v`` over all query heads)."""
    return 2 * geo["w_out"] if "kv" in geo else 0


# ---------------------------------------------------------------- what the torch reference backends dispatch
#
# The figures above are the algorithm's ("ideal") work. The functions below give, exactly, the
# multiply-adds of the products that our CPU / reference backends dispatch for the part outside the
# projections, forward + backward, for one packed row of ``T`` physical tokens (documents and the
# padding tail), as :class:`benchmarks.op_counts.MatmulCounter` counts them under ``other``. Every
# product is data-independent: its shape follows from ``T``, the layer's geometry, the chunk (block)
# size and, for attention, the longest segment. Blocking (how many chunks run as one batch) does
# not change a total. Each term below is ``(products) x (size of one)``; a product ``[m, k] @ [k, n]``
# counts ``m k n``.


def _chunks(tokens: int, chunk: int) -> int:
    """Chunks of a row: the backends pad it to whole chunks (padding tokens are neutral, not skipped)."""
    return -(-int(tokens) // int(chunk))


def dispatched_ssd_macs(tokens: int, *, heads: int, head_dim: int, state_size: int, groups: int, chunk: int) -> int:
    """Multiply-adds of forward + backward the SSD chunked scan (``mixers.ops.ssd``: ``reference`` and
    ``chunk_scan`` / ``chunk_scan_backward``) dispatches on one row of ``tokens`` tokens.

        C = ceil(T / L) chunks, L = chunk, H = heads, P = head dim, Ns = state size, G = groups

    Per chunk, ``2 L^2 H + 4 G L^2 Ns + 3 H L^2 P + 6 H P L Ns``:

    * ``2 L^2 H``: the segmented cumulative decay ``keep [L, L] @ (dt A) [L, H]``, and its
      backward ``keep^T @ grad`` (the mask has no gradient);
    * ``4 G L^2 Ns``: ``C B^T`` per group (forward, recomputed in the backward) and its two
      gradients ``dCB @ B``, ``dCB^T @ C``;
    * ``3 H L^2 P``: the intra-chunk output ``scores [L, L] @ xdt [L, P]`` per head and its two
      gradients ``scores^T @ dy``, ``dy @ xdt^T``;
    * ``6 H P L Ns``: the chunk state ``(x w)^T [H P, L] @ B [L, Ns]`` and the entering-state
      read ``C [L, Ns] @ h^T [Ns, H P]``, each with two gradients (``B @ du^T``, ``(x w)^T @ du``;
      ``(dy w)^T @ C``, ``(dy w)^T @ h``).

    The ideal :func:`scan_macs` is ``3 * 2 H P Ns`` per token; this is ``O(L)`` more per token in the
    intra-chunk terms."""
    L, h, p, ns, g = int(chunk), int(heads), int(head_dim), int(state_size), int(groups)
    return _chunks(tokens, L) * (2 * L * L * h + 4 * g * L * L * ns + 3 * h * L * L * p + 6 * h * p * L * ns)


def _wy_inverse_macs(chunk: int) -> int:
    """Products of ``mixers.ops.delta_rule.wy.unit_lower_inverse`` for one ``[L, L]`` matrix: per
    doubling level ``b = 16, 32, .., L / 2`` (from ``min(16, L)``), ``L / (2 b)`` quadrants of two
    ``[b, b] @ [b, b]`` products each, ``L b^2``; the base blocks' triangular solve is no product."""
    b, total = min(_WY_BASE, chunk), 0
    while b < chunk:
        total += chunk * b * b
        b *= 2
    return total


def dispatched_delta_macs(tokens: int, *, heads: int, key_dim: int, value_dim: int, chunk: int) -> int:
    """Multiply-adds of forward + backward the chunked delta rule with a scalar gate (GatedDeltaNet;
    ``mixers.ops.delta_rule``: ``blocked``, ``prep``, ``gram``, ``wy``) dispatches on one row.

        N = C H chunk-heads, C = ceil(T / L), L = chunk, H = value heads, K / V = key / value head dims

    Per chunk-head, ``7 L^2 K + 6 L^2 V + 9 L K V + 2 L^2 + I(L)``:

    * ``7 L^2 K``: the Grams ``[q; beta k] [2L, K] @ k^T`` (2), recomputed in the backward for
      ``q`` only (1, the WY inverse is kept), and their backward ``dS [2L, L] @ k``,
      ``dS^T @ [q; beta k]`` (2 + 2);
    * ``6 L^2 V``: forward ``T (R_U - R_W S)`` and ``qk @ delta``; backward ``qk^T @ do``,
      ``T^T @ d delta``, ``do @ delta^T`` and ``dR_U @ delta^T`` (the WY system's ``dA``);
    * ``9 L K V``: forward ``R_W @ S``, ``k_out^T @ delta``, ``q_read @ S``; backward
      ``q_read^T @ do``, ``k_out @ dS'``, ``R_W^T @ dR_U``, ``do @ S^T``, ``delta @ dS'^T`` and
      ``dR_U @ S^T``;
    * ``2 L^2``: the gate's segmented sums' backward ``sums^T [L, 2L] @ [dG | dsuf] [2L, H]``, per
      chunk (``2 L^2 H``), i.e. ``2 L^2`` per chunk-head;
    * ``I(L) = L sum b^2``: the blocked WY inverse (:func:`_wy_inverse_macs`), forward only.

    The ideal :func:`scan_macs` is ``3 * 2 H K V`` per token."""
    L, k, v = int(chunk), int(key_dim), int(value_dim)
    per = 7 * L * L * k + 6 * L * L * v + 9 * L * k * v + 2 * L * L + _wy_inverse_macs(L)
    return _chunks(tokens, L) * int(heads) * per


def _channel_gram_macs(chunk: int, key_dim: int) -> int:
    """Products of ``mixers.ops.delta_rule.gram`` for one chunk-head with a per-channel gate, forward
    + backward. Per doubling level ``half = 1, 2, .., L / 2`` (blocks of ``2 half``, ``L / (2 half)``
    of them), forward: one ``[2 half, K] @ [K, half]`` per block (``q`` and ``beta k`` rows stacked),
    ``half K L``, so ``K L (L - 1)`` over the levels, taken twice (the forward and the backward's
    recomputed preparation: with a per-channel gate both Grams are formed again). Backward
    (``_level_grad``): ``half >= 8``, the two gradients ``grad [2 half, half] @ right`` and
    ``grad^T @ factors`` per block, ``2 half K L``; ``half < 8``, one block-diagonal
    ``[L, L / 2]`` matrix per chunk-head and its two products with ``[L / 2, K]`` and ``[L, K]``,
    ``L^2 K`` (zeros included)."""
    L, k = int(chunk), int(key_dim)
    total, half = 2 * k * L * (L - 1), 1
    while half < L:
        total += k * L * L if half < _GRAM_DIRECT_HALF else 2 * half * k * L
        half *= 2
    return total


def dispatched_kda_macs(tokens: int, *, heads: int, key_dim: int, value_dim: int, chunk: int) -> int:
    """Multiply-adds of forward + backward the chunked delta rule with a per-channel gate (KDA;
    ``mixers.ops.delta_rule``: ``blocked``, ``prep``, ``gram``, ``wy``) dispatches on one row.

        N = C H chunk-heads, C = ceil(T / L), L = chunk, H = value heads (key heads repeated for
        grouped values), K / V = key / value head dims

    Per chunk-head, ``Gc(L) + 6 L^2 V + 9 L K V + 2 L^2 K + I(L)``: :func:`dispatched_delta_macs`
    with two terms replaced, the rest (the WY system, the recurrence, the reads) being the same
    products of the same shapes:

    * ``Gc(L)`` for the scalar gate's ``7 L^2 K``: the decayed Grams cannot take the decay out of
      the sum, so they are built level by level (:func:`_channel_gram_macs`):
      ``2 K L (L - 1) + sum_{half < 8} L^2 K + sum_{half >= 8} 2 half K L``, i.e.
      ``2 K L (L - 1) + K L (5 L - 16)`` for ``L >= 16`` (``K L^2 (2 + log2 L) - 2 K L`` below);
    * ``2 L^2 K`` for ``2 L^2``: the gate's segmented sums' backward
      ``sums^T [L, 2L] @ [dG | dsuf] [2L, H K]``, per chunk, now ``K`` wide per head;
    * ``I(L)``: the blocked WY inverse (:func:`_wy_inverse_macs`), forward only.

    The ideal :func:`scan_macs` is ``3 * 2 H K V`` per token."""
    L, k, v = int(chunk), int(key_dim), int(value_dim)
    per = _channel_gram_macs(L, k) + 6 * L * L * v + 9 * L * k * v + 2 * L * L * k + _wy_inverse_macs(L)
    return _chunks(tokens, L) * int(heads) * per


def dispatched_delta_product_macs(tokens: int, *, num_householder: int, heads: int, key_dim: int, value_dim: int,
                                  chunk: int) -> int:
    """Multiply-adds of forward + backward Gated DeltaProduct's chunked delta rule dispatches on one
    row: :func:`dispatched_delta_macs` on ``nh T`` steps, ``nh = num_householder``.

    ``mixers.ops.delta_rule.reference`` runs the scalar-gate delta rule over the sub-steps
    (``[B, T nh, ...]``: each token's ``nh`` keys, values and betas interleaved, the gate at its
    first sub-step, zeros elsewhere); on the fast path the queries are read at each token's last
    sub-step only (``q_every = nh``), but ``blocked._chunks`` lays them out as a full ``[L, K]``
    chunk (zeros on the other sub-steps), so every product keeps the shape it has for
    GatedDeltaNet on ``nh T`` tokens: ``ceil(nh T / L) H (7 L^2 K + 6 L^2 V + 9 L K V + 2 L^2 + I(L))``.

    The ideal :func:`scan_macs` is ``3 (nh + 1) H K V`` per token (``nh`` updates and one read)."""
    return dispatched_delta_macs(int(num_householder) * int(tokens), heads=heads, key_dim=key_dim,
                                 value_dim=value_dim, chunk=chunk)


def attention_reach(span: int, left: int = -1, block: int = ATTENTION_BLOCK) -> int:
    """Keys a query block of the reference kernel sees besides its own (``reference._reach``,
    causal, eager): ``min(span - 1, left)`` (``left < 0``: ``span - 1``) rounded up to ``block``."""
    need = span - 1 if left < 0 else min(span - 1, left)
    return 0 if need <= 0 else -(-need // block) * block


def dispatched_attention_macs(tokens: int, span: int, *, q_heads: int, head_dim: int, left: int = -1,
                              block: int = ATTENTION_BLOCK) -> int:
    """Multiply-adds of forward + backward the blockwise reference attention
    (``mixers.ops.attention.reference._BlockAttention``, causal) dispatches on one row.

        n = ceil(T / Q) query blocks, Q = block, W = reach + Q keys per block (``attention_reach``
        of ``span``, the longest segment of the row, the padding tail included: ``max_seqlen``),
        Hq = query heads, D = head dim (keys and values alike)

    Per block, ``7 Hq Q W D + 2 Q W``:

    * ``7 Hq Q W D``: the scores ``q [Q, D] @ k^T [D, W]`` per head (forward, recomputed in the
      backward: 2), ``p @ v`` (1), and the backward's ``p^T @ do``, ``do @ v^T``, ``ds @ k``,
      ``ds^T @ q`` (4): every key of the window, masked ones included;
    * ``2 Q W``: the non-finite guards, ``keep [Q, W] @ bad keys [W, 1]`` forward and
      ``bad rows [1, Q] @ keep`` backward.

    The ideal (``3 * attention_macs * attention_pairs``) counts ``6 Hq D`` per causal pair."""
    width = attention_reach(span, left, block) + block
    return _chunks(tokens, block) * (7 * int(q_heads) * block * width * int(head_dim) + 2 * block * width)


def longest_segment(boundaries, total: int) -> int:
    """The row's ``max_seqlen``: its longest physical slot, the padding tail counted as one."""
    return _longest_in(cover_of(boundaries, total), 0, total)


def dispatched_parts(geo: dict, hidden: int, boundaries, total: int) -> dict:
    """``{"projections", "attention", "scan"}``: multiply-adds of one forward + backward of one
    layer that the torch reference backends dispatch on one packed row in one process (document
    slots starting at ``boundaries``, ``total`` tokens with the padding tail), exactly as
    :class:`benchmarks.op_counts.MatmulCounter` counts them (``attention + scan`` = its ``other``).
    ``geo["dispatch"]`` (``bench_context_parallel.geometry``) names the backend: ``ssd`` (Mamba2),
    ``delta`` (GatedDeltaNet), ``kda`` (KDA), ``delta_product`` (Gated DeltaProduct) or
    ``attention``; a geometry without it raises ``ValueError``."""
    spec = geo.get("dispatch")
    if spec is None:
        raise ValueError("this geometry has no dispatch model (Mamba2, GatedDeltaNet, KDA, Gated DeltaProduct and "
                         "attention have one)")
    spec = dict(spec)
    kind = spec.pop("kind")
    parts = {"projections": 3 * projection_macs(geo, hidden) * int(total), "attention": 0, "scan": 0}
    if kind == "ssd":
        parts["scan"] = dispatched_ssd_macs(total, **spec)
    elif kind == "delta":
        parts["scan"] = dispatched_delta_macs(total, **spec)
    elif kind == "kda":
        parts["scan"] = dispatched_kda_macs(total, **spec)
    elif kind == "delta_product":
        parts["scan"] = dispatched_delta_product_macs(total, **spec)
    elif kind == "attention":
        parts["attention"] = dispatched_attention_macs(total, longest_segment(boundaries, total), **spec)
    else:
        raise ValueError(f"unknown dispatch kind {kind!r}")
    return parts


def _conv_exchange_macs(facts, channels: int, j: int) -> list[int]:
    """Per rank: the products of ``causal_conv1d``'s CP exchange (``mixers.ops.causal_conv1d.cp``),
    one conv of ``channels`` channels (``D``), window ``J``, rounds as :func:`chain` plans them with
    a segment closed where it starts on the rank or fills the window. A rank receiving a window
    in a doubling round moves it, ``S_recv [D, J] @ M [J, J]`` (``D J^2``), with the received
    window's gradient ``grad @ M^T`` and, once ``M`` carries a gradient, ``S_recv^T @ grad``; a
    round that also brings the sender's map composes ``M_recv [J, J] @ M`` (``J^3``), with
    ``M_recv``'s gradient and, again once ``M`` carries one, ``M``'s. The rank's own ``M`` (the
    shift by its last segment's tokens) is a constant; it carries a gradient from the first map
    received on. Per round: ``(2 or 3) D J^2`` + ``(2 or 3) J^3`` where a map comes along."""
    closed = [f["last_starts_here"] or f["last_len"] >= j for f in facts]
    rounds, _ = chain(facts, closed)
    out = [0] * len(facts)
    graded = [False] * len(facts)
    for _, receiver, with_m in (p for rnd in rounds for p in rnd):
        times = 3 if graded[receiver] else 2
        out[receiver] += times * channels * j * j + (times * j ** 3 if with_m else 0)
        graded[receiver] = graded[receiver] or with_m
    return out


def _longest_in(cover: list[int], lo: int, hi: int) -> int:
    """The longest piece of a segment of ``cover`` within ``[lo, hi)`` (the padding tail counted as one)."""
    return max([min(b, hi) - max(a, lo) for a, b in zip(cover[:-1], cover[1:]) if min(b, hi) > max(a, lo)] or [0])


def _run_width(n: int) -> int:
    """The padded length of a run of ``n`` tokens in :func:`mixers.ops.common.grouped.buckets`: the
    next power of two (runs are batched by that length, padding included in every product)."""
    return 1 << (int(n) - 1).bit_length()


def _last_chunk_runs(pieces, steps_per_token: int, chunk: int) -> list[int]:
    """Per non-empty piece ``(a, b)`` (tokens of one call), the steps of its run inside its last
    chunk (``varlen_states.doc_final_states``: from ``max(start, last chunk's start)`` to its end),
    a token being ``steps_per_token`` steps (Gated DeltaProduct's sub-steps)."""
    runs = []
    for a, b in pieces:
        if b > a:
            end = steps_per_token * b
            runs.append(end - max(steps_per_token * a, (end - 1) // chunk * chunk))
    return runs


def _delta_keep_macs(steps: int, runs, *, heads: int, key_dim: int, value_dim: int, chunk: int, channel: bool,
                     init: bool, final_used: bool) -> int:
    """Multiply-adds of forward + backward one call of the chunked delta rule on the reference's
    keep-intermediates path (``reference._chunked`` with ``keep_intermediates``: per-document final
    states asked for; ``PrepFunction``, ``_composed`` and ``varlen_states``), one row of ``steps``
    steps whose documents end in last-chunk runs of ``runs`` steps (:func:`_last_chunk_runs`).

        C = ceil(n / L) chunks, n = steps, L = chunk, H = heads, N = C H chunk-heads, K = key dim,
        V' = value_dim (the call's value columns), Kg = K (``channel``: KDA's gate) or 1,
        p(x) = x rounded up to a power of two (:func:`_run_width`)

    Per chunk-head, ``Gk + 6 L^2 Kg + 2 I(L) + 4 L^2 (K + V') + 3 L^2 V'``
    (``PrepFunction``: its backward recomputes the whole preparation, then ``prep_backward``):

    * ``Gk``, the Grams: scalar gate ``8 L^2 K``, ``[q; beta k] [2L, K] @ k^T`` in the forward and
      in the recompute (2 + 2) and the backward's ``dS [2L, L] @ k``, ``dS^T @ [q; beta k]``
      (2 + 2); per-channel gate ``Gc(L)`` (:func:`_channel_gram_macs`: the levels in the forward
      and the recompute, and their backward, as on the fast path);
    * ``6 L^2 Kg``: the segmented sums ``sums [2L, L] @ g [L, H Kg]`` per chunk (forward,
      recompute) and their backward ``sums^T [L, 2L] @ [dG | dsuf]``;
    * ``2 I(L)``: the blocked WY inverse (:func:`_wy_inverse_macs`), forward and recompute;
    * ``4 L^2 (K + V')``: ``[W | U] = T [L, L] @ R [L, K + V']`` (forward, recompute) and its
      backward ``T^T @ [dW | dU]``, ``dR_W [L, K] @ W^T``, ``dR_U [L, V'] @ U^T``;
    * ``3 L^2 V'``: ``qk [L, L] @ delta [L, V']`` and its two gradients.

    The recurrence (``_composed``, chunk by chunk) and the reads: ``(9 C - 3) H L K V'``
    (``5 H L K V'`` for one chunk):

    * ``w_read [L, K] @ S [K, V']`` per chunk and its two gradients, but the first chunk's state
      (zeros) has none: ``3 C - 1``;
    * ``k_out^T [K, L] @ delta [L, V']`` per chunk and its two gradients, but the state leaving the
      last chunk feeds nothing (the final states are rebuilt from the chunks): ``3 C - 2``;
    * ``q_read [L, K] @ S_enter [K, V']``, all chunks in one product, the gradient of ``q_read``
      and, with more than one chunk (the stacked entering states then carry a gradient), of
      ``S_enter``: ``3 C`` (``2`` for one chunk).

    Per document, on runs padded to powers of two (``mixers.ops.common.grouped.buckets``):

    * the final state (``doc_final_states``): ``keys^T [K, p(n)] @ delta [p(n), V']`` over its run
      of ``n`` steps in its last chunk, ``H K V' p(n)``, and its two gradients where the call's
      final states reach the loss (``final_used``: the state sent on to the next rank), else
      forward only;
    * ``init`` (one document from step 0 with an initial state ``S0``: the CP continuing call's
      ``[0 | I]``): the corrections ``W [p(m), K] @ S0 [K, V']`` and the reads
      ``(exp(G) q) [p(m), K] @ S0`` on its first-chunk run of ``m = min(n, L)`` steps, each with
      the rows' gradient only (``S0`` is a constant): ``4 H K V' p(m)``."""
    L, h, k, v = int(chunk), int(heads), int(key_dim), int(value_dim)
    c = _chunks(steps, L)
    kg = k if channel else 1
    grams = _channel_gram_macs(L, k) if channel else 8 * L * L * k
    per = grams + 6 * L * L * kg + 2 * _wy_inverse_macs(L) + 4 * L * L * (k + v) + 3 * L * L * v
    total = c * h * per + (9 * c - (3 if c > 1 else 4)) * h * L * k * v
    if init:
        total += 4 * h * k * v * _run_width(min(steps, L))
    return total + (3 if final_used else 1) * h * k * v * sum(_run_width(n) for n in runs)


def _delta_rank_scan(kind: str, spec: dict, cover: list[int], facts: list[dict], bounds, rank: int, t1: int,
                     received: list[bool]) -> int:
    """The delta rule's ``scan`` on one CP rank (``mixers.ops.delta_rule.cp.delta_rule_cp``), the
    conv exchange apart: see :func:`dispatched_rank_parts`. ``received``: per doubling round this
    rank receives in, whether a map came along."""
    nh = int(spec.get("num_householder", 1))
    h, k, v, L = int(spec["heads"]), int(spec["key_dim"]), int(spec["value_dim"]), int(spec["chunk"])
    f, start, end = facts[rank], bounds[rank], bounds[rank + 1]
    closed = f["last_starts_here"]
    sizes = dict(heads=h, key_dim=k, chunk=L, channel=kind == "kda")
    scan = 0
    if t1:           # the continuing segment apart, K more value columns, from [0 | I]
        scan += _delta_keep_macs(nh * t1, _last_chunk_runs([(0, t1)], nh, L), value_dim=v + k, init=True,
                                 final_used=f["continues_out"] and not closed, **sizes)
        scan += 3 * h * t1 * k * v                          # o1 [T1, K] @ S_in [K, V] per head, two gradients
    if t1 < end - start:  # the documents starting here (and the tail), one call
        lo = start + t1
        pieces = [(max(a, lo) - lo, min(b, end) - lo) for a, b in zip(cover[:-1], cover[1:])]
        scan += _delta_keep_macs(nh * (end - lo), _last_chunk_runs(pieces, nh, L), value_dim=v, init=False,
                                 final_used=f["continues_out"] and closed, **sizes)
    for with_m in received:       # S <- M @ S_recv (+ M <- M @ M_recv), each with two gradients
        scan += 3 * h * k * k * v + (3 * h * k * k * k if with_m else 0)
    return scan


def dispatched_rank_parts(geo: dict, hidden: int, boundaries, lengths, bounds) -> list[dict]:
    """Per rank ``{"projections", "attention", "scan"}``: what one forward + backward of one layer
    (a training step: no initial states, no final states asked for) dispatches on each
    context-parallel rank (``bounds``) of one packed row (document slots starting at
    ``boundaries``, ``bounds[-1]`` tokens; ``lengths`` unused, for ``work_parts``' signature), as
    :class:`benchmarks.op_counts.MatmulCounter` counts it there. Exact per rank (checked on the
    gloo runs of ``tests/benchmarks/test_cost_model.py``, fp64, and on single-rank layouts there)
    for **Mamba2**, **GatedDeltaNet**, **KDA**, **Gated DeltaProduct** and **attention** (plain
    and windowed); another kind raises ``ValueError``. ``T_r`` = a rank's tokens, ``T1`` = its
    first segment's tokens where that continues a document from earlier ranks (else 0), ``T_pre``
    its keys on earlier ranks a query can reach.

    * ``projections``: ``3 proj T_r`` (as ``work_parts``);
    * Mamba2 ``scan``: the local pass, ``dispatched_ssd_macs(T_r)`` (the shard chunked from its
      start, one call over all its segments), + the entering state's correction
      ``einsum(C1 [T1, H, Ns], S_in [H, P, Ns])`` and its two gradients: ``3 H T1 P Ns``; the
      state chain's products are elementwise (a scalar decay per head); + the conv exchange
      (:func:`_conv_exchange_macs`, per short conv call: ``2 D J^2`` per doubling round
      received, more where windows are composed over shards shorter than ``J``);
    * delta rule ``scan`` (``mixers.ops.delta_rule.cp``; ``H`` value heads, ``K`` / ``V`` head
      dims, ``nh`` steps per token: Gated DeltaProduct's ``num_householder``, else 1): the local
      calls ask for per-document final states, so they take the reference's keep-intermediates
      path (:func:`_delta_keep_macs`, not the one-process fast path of ``dispatched_delta_macs``),
      whose per-document products follow where the documents end inside the chunks (a rank's
      16 tokens, its last document going on, count 74,752 as one document and 80,896 as four of
      3, 5, 3 and 5 tokens: GatedDeltaNet, 4 value heads of ``K = 4``, ``V = 8``, ``L = 8``):

      - a continuing rank runs its first segment apart, ``nh T1`` steps with ``V + K`` value
        columns (the extra K carry the map ``M``) from the initial state ``[0 | I]``:
        ``_delta_keep_macs(nh T1, value_dim=V + K, init)``, its final state's gradient taken where
        that segment leaves the rank; + the entering state's correction
        ``o1 [T1, K] @ S_in [K, V]`` per head and its two gradients: ``3 H T1 K V``;
      - the tokens after it (all of them on a rank whose first segment starts there), one call
        over their documents and the tail: ``_delta_keep_macs(nh (T_r - T1), value_dim=V)``, the
        final states' gradients taken where the rank's last segment starts on it and leaves it;
      - the state chain (``chain_scan``): per doubling round received, ``M [K, K] @ S_recv [K, V]``
        per head (``3 H K^2 V`` with its gradients) and, where a map comes along,
        ``M @ M_recv`` (``3 H K^3``); the final shift only hands ``S_in`` over;
      - + the conv exchange of its three short convs (:func:`_conv_exchange_macs`);
    * attention: a rank whose first segment starts on it runs the blockwise reference over the
      shard, ``dispatched_attention_macs(T_r, span)`` with ``span`` its longest local segment; a
      continuing rank runs that on the ``T_r - T1`` tokens after the segment (0 if none) and the
      segment apart (``attention.cp._continuing``: SDPA with a mask, the math path in fp64):
      per block of ``Q <= 256`` of its queries over the ``W`` keys it reaches (``T_pre`` + the
      block's causal prefix, clipped to the window), ``6 Hq Q W D`` (``q k^T``, ``p v``, and
      the four gradients ``do v^T``, ``p^T do``, ``ds k``, ``ds^T q``)."""
    spec = dict(geo.get("dispatch") or {})
    kind = spec.pop("kind", None)
    if kind not in ("ssd", "delta", "kda", "delta_product", "attention"):
        raise ValueError(f"no per-rank dispatched model for {kind!r} (exact per rank: ssd, delta, kda, "
                         "delta_product, attention)")
    cover = cover_of(boundaries, bounds[-1])
    facts = rank_facts(cover, bounds)
    conv = [0] * len(facts)
    for channels in geo["convs"]:
        conv = [a + b for a, b in zip(conv, _conv_exchange_macs(facts, channels, geo["width"] - 1))]
    rounds, _ = chain(facts, [f["last_starts_here"] for f in facts])
    parts = []
    for r, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        f, tokens = facts[r], end - start
        t1 = min(cover[bisect.bisect_right(cover, start)], end) - start if f["continues_in"] else 0
        rank = {"projections": 3 * projection_macs(geo, hidden) * tokens, "attention": 0, "scan": 0}
        if kind == "ssd":
            h, p, ns = spec["heads"], spec["head_dim"], spec["state_size"]
            rank["scan"] = dispatched_ssd_macs(tokens, **spec) + 3 * h * t1 * p * ns + conv[r]
        elif kind != "attention":
            received = [with_m for rnd in rounds for _, j, with_m in rnd if j == r]
            rank["scan"] = _delta_rank_scan(kind, spec, cover, facts, bounds, r, t1, received) + conv[r]
        else:
            rest = tokens - t1
            if rest:
                rank["attention"] = dispatched_attention_macs(rest, _longest_in(cover, start + t1, end), **spec)
            left, pre = spec.get("left", -1), start - f["first_seg_start"]
            for a in range(0, t1, CP_ATTENTION_BLOCK):
                b = min(a + CP_ATTENTION_BLOCK, t1)
                lo = 0 if left < 0 else max(0, pre + a - left)
                rank["attention"] += 6 * spec["q_heads"] * (b - a) * (pre + b - lo) * spec["head_dim"]
        parts.append(rank)
    return parts


WORK_PARTS = ("projections", "attention", "scan")
EXACT_PARTS = ("projections",)          # of ``work_parts``: equal to the matmuls a real run dispatches
# ``dispatched_parts``: every part equals the counted matmuls (one process; tests/benchmarks)


def work_parts(geo: dict, hidden: int, boundaries, lengths, bounds, window: int | None = None) -> list[dict]:
    """Per rank ``{"projections", "attention", "scan"}``: multiply-adds of one forward + backward
    (3 forwards: a product's backward is two products of its size, the input and the weight
    gradient) of one layer. ``projections``: every token of the shard, padding included (exact);
    ``attention``: the query-key pairs of the causal mask (``attention_pairs``), not what a
    blocked kernel multiplies; ``scan``: ``(u + 1) S`` per token. The last two are the algorithm's work;
    ``dispatched_parts`` gives what the reference backends multiply."""
    pairs = attention_pairs(boundaries, lengths, bounds, window) if "kv" in geo else [0] * (len(bounds) - 1)
    proj, att, scan = projection_macs(geo, hidden), attention_macs(geo), scan_macs(geo)
    return [{"projections": 3 * proj * (hi - a), "attention": 3 * att * n, "scan": 3 * scan * (hi - a)}
            for a, hi, n in zip(bounds[:-1], bounds[1:], pairs)]


def work(geo: dict, hidden: int, boundaries, lengths, bounds, window: int | None = None) -> list[int]:
    """Per rank: multiply-adds of one forward + backward (3 forwards) of one layer, all parts."""
    return [sum(parts.values()) for parts in work_parts(geo, hidden, boundaries, lengths, bounds, window)]


def activation_bytes(geo: dict, hidden: int, bounds, b: int, received_keys=None) -> list[int]:
    """Per rank: bytes of one layer's activations kept for backward; ``received_keys``: per rank,
    keys received from earlier ranks (ours, attention) kept too."""
    received = received_keys or [0] * (len(bounds) - 1)
    return [(hi - a) * (hidden + geo["w_in"] + geo["w_out"]) * b + k * geo.get("kv", 0) * b
            for a, hi, k in zip(bounds[:-1], bounds[1:], received)]


def received_keys(cover, bounds, left: int) -> list[int]:
    """Per rank: keys (rows) its first segment receives from earlier ranks."""
    got = [0] * (len(bounds) - 1)
    for (_, r), (a, hi) in key_ranges(rank_facts(cover, bounds), bounds, left).items():
        got[r] += hi - a
    return got


def ceil_log2(k: int) -> int:
    return 0 if k <= 1 else math.ceil(math.log2(k))


__all__ = ["ATTENTION_BLOCK", "a2a_bytes", "a2a_fits", "activation_bytes", "attention_pairs", "attention_reach",
           "ceil_log2", "chain", "cover_of", "dispatched_attention_macs", "dispatched_delta_macs",
           "dispatched_delta_product_macs", "dispatched_kda_macs", "dispatched_parts", "dispatched_rank_parts",
           "dispatched_ssd_macs",
           "even_bounds", "key_ranges", "linear_macs", "longest_segment", "ours_bytes", "ours_total",
           "projection_macs", "rank_facts", "received_keys", "scan_macs", "work", "work_parts"]
