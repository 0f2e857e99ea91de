"""``HybridLM``: a small language model stacking any mix of the registered mixers.

    B = rows, T = tokens, D = hidden, V = vocabulary

token embedding -> blocks (pre-norm RMSNorm -> mixer -> residual; pre-norm RMSNorm -> SwiGLU
MLP -> residual) -> final RMSNorm -> output head tied to the embedding. The stack is a pattern
string, one letter per block, read from the mixer registry (:mod:`mixers.layers.registry`): ``M``
Mamba2, ``G`` Gated DeltaNet, ``K`` KDA, ``P`` Gated DeltaProduct, ``A`` attention, ``C`` LFM2's
gated short convolution, ``L`` MiniMax's lightning attention (its slopes from the block's place in
the pattern), and any mixer registered there.
"""

from __future__ import annotations

import torch
from torch import nn

from ssm_pack import PackedSeqParams, VarlenBatch
from ssm_pack.checks import check_int

from ..layers import RMSNorm, registry
from ..layers.blocks.mlp import SwiGLU
from ..layers.cp_prefill import is_context_parallel, refuse_unsupported
from ..ops.device_policy import policy_for
from .cached import CachedLM
from .cp_loss import continue_targets
from .loss import IGNORE_INDEX, next_token_loss
from .sizes import size_problem


def depth_fields(letter: str, index: int, count: int, overrides: dict) -> dict:
    """``layer_idx`` / ``num_layers`` for a mixer whose config has them (its behaviour depends on its depth,
    e.g. MiniMax's lightning-attention slopes): the block's place in the pattern, unless overridden."""
    fields = registry.MIXERS[letter].config.__dataclass_fields__
    depth = {"layer_idx": index, "num_layers": count}
    return {name: value for name, value in depth.items() if name in fields and name not in overrides}


class Block(nn.Module):
    def __init__(self, letter: str, hidden: int, backend: str, overrides: dict, index: int = 0, count: int = 1):
        super().__init__()
        self.mixer_norm, self.mlp_norm = RMSNorm(hidden), RMSNorm(hidden)
        own = overrides.get(letter, {})
        self.mixer = registry.MIXERS[letter].mixer(hidden, backend=backend, **own,
                                                   **depth_fields(letter, index, count, own))
        self.mlp = SwiGLU(hidden)

    def forward(self, x, packed_seq_params=None, *, cache=None, cache_slots=None):
        if cache is None:
            x = x + self.mixer(self.mixer_norm(x), packed_seq_params=packed_seq_params)
        else:                                      # inference: the mixer's own per-slot states
            x = x + self.mixer(self.mixer_norm(x), packed_seq_params=packed_seq_params, cache=cache,
                               cache_slots=cache_slots)
        return x + self.mlp(self.mlp_norm(x))


class HybridLM(CachedLM, nn.Module):
    """``forward(input_ids [B, T], packed_seq_params=None, labels=None) -> {"logits", "loss"}``.

    Args:
        vocab_size: tokens (256 for bytes).
        hidden_size: D of every block.
        pattern: one letter per block (``"MGKPA"`` is one of each).
        backend: ``"auto"``, ``"kernel"`` or ``"reference"`` for every mixer.
        mixer_overrides: per letter, keyword overrides of that mixer's config
            (e.g. ``{"M": {"state_size": 32}}``).

    With ``labels`` (``[B, T]``, ``-100`` = ignore), the loss is the mean next-token cross-entropy;
    on a packed row the last token of a document never predicts the first of the next one.
    Under context parallelism (``packed_seq_params`` from :func:`ssm_pack.shard_for_context_parallel`
    with its ``cp_group`` set) the loss is this rank's share: the shares sum to the whole row's
    mean, so gradients summed over the CP group equal the single-process ones.

    Inference (:mod:`mixers.model.cached`): ``allocate_inference_cache``, ``forward(...,
    cache=, cache_slots=)`` (packed prefill ``[1, T]`` with one slot per document, or rows
    ``[N, t]`` with one slot per row) and ``generate`` (continuous batching).
    """

    def __init__(self, vocab_size: int = 256, hidden_size: int = 128, pattern: str = "MGKPA", *,
                 backend: str = "auto", mixer_overrides: dict | None = None):
        super().__init__()
        vocab_size = check_int("vocab_size", vocab_size, minimum=1)
        hidden_size = check_int("hidden_size", hidden_size, minimum=1)
        if not isinstance(pattern, str) or not pattern or registry.unknown_letters(pattern):
            raise ValueError(f"pattern must be letters of {registry.letters()} ({registry.legend()}), got {pattern!r}")
        problem = size_problem(pattern, hidden_size, mixer_overrides)
        if problem is not None:
            raise ValueError(f"HybridLM: {problem.message(pattern=pattern)}")
        self.pattern = pattern
        self.embed = nn.Embedding(vocab_size, hidden_size)
        self.blocks = nn.ModuleList(Block(letter, hidden_size, backend, mixer_overrides or {}, i, len(pattern))
                                    for i, letter in enumerate(pattern))
        self.norm = RMSNorm(hidden_size)
        nn.init.normal_(self.embed.weight, std=hidden_size ** -0.5)

    def backbone(self, hidden_states: torch.Tensor, packed_seq_params=None, *, cache=None,
                 cache_slots=None) -> torch.Tensor:
        """The blocks and the final norm: ``[B, T, D] -> [B, T, D]`` (what the leakage checker probes).

        The packing metadata is resolved once here (a :class:`ssm_pack.VarlenBatch`, its value reads
        done up front: :meth:`~ssm_pack.VarlenBatch.read_ahead`) and handed to every block, so no
        block derives it again or synchronises with the device for it."""
        varlen = None
        if packed_seq_params is not None:
            varlen = VarlenBatch.build(packed_seq_params, hidden_states.shape[1],
                                       device=hidden_states.device).read_ahead()
        if cache is not None or cache_slots is not None:  # inference: per-slot states (mixers/model/cached.py)
            return self._backbone_cached(hidden_states, varlen, cache, cache_slots)
        for block in self.blocks:
            hidden_states = block(hidden_states, packed_seq_params=varlen)
        return self.norm(hidden_states)

    def forward(self, input_ids: torch.Tensor, packed_seq_params: PackedSeqParams | None = None,
                labels: torch.Tensor | None = None, *, position_ids: torch.Tensor | None = None,
                cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q: int | None = None,
                max_length_k: int | None = None, seq_idx: torch.Tensor | None = None, cache=None,
                cache_slots=None) -> dict:
        """``{"logits" [B, T, V], "loss"}``; packed by ``packed_seq_params`` or by the boundaries of a
        Hugging Face ``DataCollatorWithFlattening`` batch, so ``model(**batch)`` works the way HF's
        ``Trainer`` calls a model: ``position_ids`` restarting at 0, optionally ``cu_seq_lens_q/k``
        with ``max_length_q/k`` and ``seq_idx`` (read by :meth:`ssm_pack.PackedSeqParams.from_hf_batch`).
        ``[B, S]`` rows with ``position_ids`` run as one packed row of ``B * S`` tokens (every row
        start is a boundary) and come back as ``[B, S]``. With ``cache`` and ``cache_slots``:
        inference on per-slot states (:mod:`mixers.model.cached`).
        """
        for name, value in (("input_ids", input_ids), ("labels", labels)):
            if value is not None and not isinstance(value, torch.Tensor):
                raise TypeError(f"{name} must be a [B, T] integer tensor, got {type(value).__name__}")
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"input_ids must be [B, T] integer token ids, got {input_ids.dtype} "
                             f"{tuple(input_ids.shape)}")
        if input_ids.numel() == 0:
            raise ValueError(f"input_ids must hold at least one token, got shape {tuple(input_ids.shape)}; skip "
                             "empty batches before the model")
        check_token_ids(input_ids, self.embed.num_embeddings)
        if labels is not None and labels.shape != input_ids.shape:
            raise ValueError(f"labels must match input_ids {tuple(input_ids.shape)}, got {tuple(labels.shape)}")
        if labels is not None:
            check_label_ids(labels, self.embed.num_embeddings)
        hf = {name: value for name, value in (("position_ids", position_ids), ("cu_seq_lens_q", cu_seq_lens_q),
                                               ("cu_seq_lens_k", cu_seq_lens_k), ("max_length_q", max_length_q),
                                               ("max_length_k", max_length_k), ("seq_idx", seq_idx))
              if value is not None}
        rows = input_ids.shape
        if hf:
            if packed_seq_params is not None:
                raise ValueError(f"give packed_seq_params or a collator's boundaries ({', '.join(hf)}), not both")
            packed_seq_params = _params_from_hf(input_ids, hf)
            input_ids = input_ids.reshape(1, -1)
            labels = None if labels is None else labels.reshape(1, -1)
        if (cache is not None or cache_slots is not None) and is_context_parallel(packed_seq_params):
            refuse_unsupported(packed_seq_params, type(self).__name__)     # the same on every rank, first
        varlen = None
        if packed_seq_params is not None:
            varlen = VarlenBatch.build(packed_seq_params, input_ids.shape[1], device=input_ids.device)
        hidden = self.backbone(self.embed(input_ids), varlen, cache=cache, cache_slots=cache_slots)
        logits = hidden @ self.embed.weight.t()                                     # tied output head
        loss = None
        if labels is not None:      # no target at all: zero loss, zero gradient (mixers/model/loss.py)
            loss = next_token_loss(logits, next_token_targets(labels, varlen), None if varlen is None else varlen.cp)
        return {"logits": logits.reshape(*rows, -1), "loss": loss}


def check_label_ids(labels: torch.Tensor, vocab_size: int) -> None:
    """Refuse labels that are not integer ids in ``0 .. vocab_size - 1`` or ``-100`` (ignored), the
    way :func:`check_token_ids` refuses token ids (before the loss reads them)."""
    if labels.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"labels must hold integer token ids (int64, -100 = ignore), got dtype {labels.dtype}; "
                        "pass the token ids the model should predict, not probabilities")
    check_token_ids(labels.masked_fill(labels == IGNORE_INDEX, 0), vocab_size, name="labels",
                    fix="use -100 to ignore a position")


def check_token_ids(input_ids: torch.Tensor, vocab_size: int, *, name: str = "input_ids",
                    fix: str = "map unknown tokens to a valid id or enlarge vocab_size") -> None:
    """Refuse token ids outside ``0 .. vocab_size - 1`` (before the embedding reads them).

    Under the CPU device policy (:func:`mixers.ops.device_policy.policy_for`) one min/max reduction, and
    the first bad position is named in a ``ValueError``; under the accelerator policy, and under
    ``torch.compile``, a device-side assert (``torch._assert_async``), so a forward costs no host sync
    and no graph break: a bad id then fails at the next synchronisation with the same message,
    without its position."""
    if input_ids.numel() == 0:
        return
    if torch.compiler.is_compiling() or policy_for(input_ids) != "cpu":
        torch._assert_async(((input_ids >= 0) & (input_ids < vocab_size)).all(),
                            f"{name} holds a token id outside the vocabulary of {vocab_size} tokens "
                            f"(0..{vocab_size - 1})")
        return
    low, high = (int(v) for v in torch.aminmax(input_ids))
    if low >= 0 and high < vocab_size:
        return
    where = torch.nonzero((input_ids < 0) | (input_ids >= vocab_size))[0].tolist()
    value = int(input_ids[tuple(where)])
    raise ValueError(f"{name}[{', '.join(map(str, where))}]={value} is outside the vocabulary of {vocab_size} "
                     f"tokens (0..{vocab_size - 1}); {fix}")


def _params_from_hf(input_ids: torch.Tensor, hf: dict) -> PackedSeqParams:
    """The packing of a collator's batch: one ``[1, T]`` row (``from_hf_batch``), or ``[B, S]`` rows
    with ``position_ids`` flattened into one (a boundary at every row start)."""
    if input_ids.shape[0] == 1:
        return PackedSeqParams.from_hf_batch({"input_ids": input_ids, **hf})
    if set(hf) != {"position_ids"}:
        raise ValueError(f"{', '.join(sorted(set(hf) - {'position_ids'}))} describe one packed row, but input_ids "
                         f"has {input_ids.shape[0]} rows {tuple(input_ids.shape)}; flatten the batch to [1, T] "
                         "(DataCollatorWithFlattening does) or pass position_ids alone")
    positions = hf["position_ids"]
    if not isinstance(positions, torch.Tensor) or positions.shape[-2:] != input_ids.shape:
        shape = tuple(positions.shape) if isinstance(positions, torch.Tensor) else type(positions).__name__
        raise ValueError(f"position_ids must be [B, S] (or MRoPE [3, B, S]) like input_ids "
                         f"{tuple(input_ids.shape)}, got {shape}")
    return PackedSeqParams.from_position_ids(positions)


def next_token_targets(labels: torch.Tensor, packed_seq_params=None) -> torch.Tensor:
    """``[B, T]`` targets: ``labels`` shifted left by one, ``-100`` where the next token belongs to
    another document (or the padding tail, or is past the row's end), so no position predicts
    across a boundary. Reads no tensor value."""
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    if packed_seq_params is not None:
        varlen = VarlenBatch.build(packed_seq_params, labels.shape[1], device=labels.device)
        doc = varlen.seq_idx
        crosses = torch.zeros_like(targets, dtype=torch.bool)
        crosses[:, :-1] = doc[:, 1:] != doc[:, :-1]
        targets = targets.masked_fill(crosses, IGNORE_INDEX)
        if varlen.cp is not None:      # context parallel: the last token predicts the next rank's first
            targets = continue_targets(varlen.cp, targets, labels)
    return targets
