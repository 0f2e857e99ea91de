"""``PackedSeqParams``: the one packing-metadata type every path of ssm-pack takes.

    N = documents, T = tokens of the physical (padded) packed row

Fields and behaviour follow Megatron-core's ``PackedSeqParams`` so code written against it runs
unchanged: boundaries for attention (``cu_seqlens_q/kv``), the physical layout with
per-document padding (``cu_seqlens_*_padded``), the per-microbatch parallel topology
(``local_cp_size``, ``cp_group``, ``tp_cp_group``; MCore-only, never forwarded to Transformer
Engine) and ``seq_idx``, precomputed at construction when ``total_tokens`` is known.

ssm-pack adds three fields: ``doc_ids`` (the NeMo AutoModel ``[B, S]`` document map, kept for
losses and context-parallel consumers), ``validate`` (``False`` skips the value checks,
which read tensor values and therefore synchronise when the boundaries live on a GPU, e.g.
under CUDA-graph capture) and ``cp_layout`` (set by :func:`ssm_pack.shard_for_context_parallel`
on one rank's shard of a context-parallel row; with ``cp_group`` it turns CP on).

The boundary fields (``cu_seqlens_*``, ``max_seqlen_*``, ``total_tokens``, ``seq_idx``) are
fixed at construction: ``seq_idx`` and the checks depend on them, so assigning one raises
(use :meth:`PackedSeqParams.replace`), and a boundary tensor changed in place is detected
before use. The parallel-topology fields (``cp_group``, ...) stay assignable.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

from ..checks import as_boundaries, check_boundaries, check_int, check_tensor, describe
from .boundaries import (
    as_cu_seqlens,
    cu_seqlens_from_position_ids,
    lengths_from_attention_mask,
    lengths_to_cu_seqlens,
    max_seqlen_from_cu_seqlens,
    round_up_lengths,
)
from .doc_ids import doc_ids_fields
from .hf_batch import hf_batch_fields
from .seq_idx import get_cu_seqlens, seq_idx_from_cu_seqlens, seq_idx_of_checked

_QKV_FORMATS = (None, "thd", "sbhd", "bshd")
# Fields Transformer Engine's DotProductAttention.forward accepts; everything else is MCore's.
_TE_FIELDS = ("qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded",
              "cu_seqlens_kv_padded", "max_seqlen_q", "max_seqlen_kv", "pad_between_seqs")
# fixed after construction: seq_idx and the validation depend on them
_FROZEN_FIELDS = ("qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
                  "max_seqlen_q", "max_seqlen_kv", "total_tokens", "seq_idx", "pad_between_seqs", "validate",
                  "cp_layout")
_TENSOR_FIELDS = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "seq_idx")


@dataclass(eq=False)
class PackedSeqParams:
    """Packed-sequence boundaries and the microbatch's parallel topology.

    Build one with a classmethod (``from_lengths``, ``from_cu_seqlens``, ``from_doc_ids``,
    ``from_position_ids``, ``from_attention_mask``, ``from_hf_batch``) or directly with
    Megatron-core's keyword arguments. Bad boundaries raise ``ValueError`` here, at
    construction, rather than as a silent leak later.
    """

    qkv_format: str | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_kv: torch.Tensor | None = None
    cu_seqlens_q_padded: torch.Tensor | None = None
    cu_seqlens_kv_padded: torch.Tensor | None = None
    max_seqlen_q: int | None = None
    max_seqlen_kv: int | None = None
    local_cp_size: int | None = None
    cp_group: Any = None
    tp_cp_group: Any = None
    total_tokens: int | None = None
    seq_idx: torch.Tensor | None = None
    tokens_per_sample: int | None = None
    pad_between_seqs: bool | None = None
    cp_scatter_cache: object = None
    doc_ids: torch.Tensor | None = None
    validate: bool = field(default=True, repr=False)
    # context parallelism: set by ssm_pack.shard_for_context_parallel on one rank's shard
    cp_layout: Any = field(default=None, repr=False)

    def __post_init__(self):
        for name in _TENSOR_FIELDS[:4]:
            value = getattr(self, name)
            if value is not None and not isinstance(value, torch.Tensor):
                object.__setattr__(self, name, as_boundaries(name, value))
        if self.validate:
            self._check()
        if self.seq_idx is None and self.total_tokens is not None and self.cu_seqlens_q is not None:
            cu = get_cu_seqlens(self)      # checked with total_tokens just above when validating
            self.seq_idx = (seq_idx_of_checked(cu, self.total_tokens) if self.validate
                            else seq_idx_from_cu_seqlens(cu, self.total_tokens, validate=False))
        self._versions = self._tensor_versions()
        self._frozen = True

    def __setattr__(self, name, value):
        if name in _FROZEN_FIELDS and self.__dict__.get("_frozen", False):
            raise AttributeError(f"PackedSeqParams.{name} is fixed after construction (seq_idx and the "
                                 f"boundary checks depend on it); build a new one with "
                                 f"params.replace({name}=...)")
        object.__setattr__(self, name, value)

    def _tensor_versions(self) -> dict[str, int]:
        # tensors made under torch.inference_mode() have no version counter: their in-place changes
        # cannot be seen (and outside inference mode they cannot be changed in place at all)
        return {name: getattr(self, name)._version for name in _TENSOR_FIELDS
                if isinstance(getattr(self, name), torch.Tensor) and not getattr(self, name).is_inference()}

    def check_unmodified(self) -> None:
        """Raise ``ValueError`` if a boundary tensor was changed in place after construction
        (the precomputed ``seq_idx`` and the checks would be stale). Reads no tensor value."""
        changed = [name for name, version in self._tensor_versions().items() if version != self._versions.get(name)]
        if changed:
            raise ValueError(f"PackedSeqParams.{changed[0]} was modified in place after construction, so the "
                             f"precomputed seq_idx and the checks no longer hold; build a new PackedSeqParams "
                             f"(or params.replace({changed[0]}=new_tensor))")

    # ----------------------------------------------------------------- validation
    def _check(self) -> None:
        if self.qkv_format not in _QKV_FORMATS:
            raise ValueError(f"qkv_format must be one of {_QKV_FORMATS}, got {self.qkv_format!r}")
        if self.qkv_format == "thd" and self.cu_seqlens_q is None:
            raise ValueError("qkv_format='thd' needs cu_seqlens_q; build the params with "
                             "PackedSeqParams.from_lengths(...) or from_cu_seqlens(...)")
        self._check_side("q")
        if not self._kv_is_q():       # one tensor for both sides (self-attention): checked once
            self._check_side("kv")
        if self.cu_seqlens_q is not None and self.cu_seqlens_kv is not None:
            if self.cu_seqlens_q.numel() != self.cu_seqlens_kv.numel():
                raise ValueError(f"cu_seqlens_q and cu_seqlens_kv must describe the same number of "
                                 f"documents, got {self.cu_seqlens_q.numel() - 1} and "
                                 f"{self.cu_seqlens_kv.numel() - 1}")
        for name in ("max_seqlen_q", "max_seqlen_kv", "tokens_per_sample"):
            check_int(name, getattr(self, name), minimum=0, allow_none=True)
        check_int("total_tokens", self.total_tokens, minimum=0, allow_none=True)
        self._check_total_tokens()
        self._check_cp()
        if self.seq_idx is not None:
            self._check_seq_idx()
        if self.doc_ids is not None:
            check_tensor("doc_ids", self.doc_ids, ndim=2, integer=True)

    def _check_seq_idx(self) -> None:
        """A given ``seq_idx`` is a second copy of the boundaries: it must say the same thing."""
        check_tensor("seq_idx", self.seq_idx, ndim=2, integer=True)
        if self.total_tokens is not None and self.seq_idx.shape != (1, self.total_tokens):
            raise ValueError(f"seq_idx must be [1, total_tokens] = [1, {self.total_tokens}], "
                             f"got {tuple(self.seq_idx.shape)}")
        if self.seq_idx.shape[0] != 1:
            raise ValueError(f"seq_idx must be [1, T] (one packed row), got {tuple(self.seq_idx.shape)}")
        if self.cu_seqlens_q is None:
            return
        want = seq_idx_from_cu_seqlens(get_cu_seqlens(self), self.seq_idx.shape[1])
        if not torch.equal(want.to(self.seq_idx.device), self.seq_idx.to(torch.int32)):
            bad = int(torch.nonzero(want.to(self.seq_idx.device) != self.seq_idx)[0, 1])
            raise ValueError(f"seq_idx disagrees with the boundaries at token {bad}: seq_idx says document "
                             f"{int(self.seq_idx[0, bad])}, cu_seqlens say {int(want[0, bad])}. Leave seq_idx "
                             "None (it is derived from the boundaries) or pass the matching one")

    def _kv_is_q(self) -> bool:
        """The key side's boundaries are the query side's tensors and limit (so are its checks)."""
        return (self.cu_seqlens_kv is self.cu_seqlens_q and self.cu_seqlens_kv_padded is self.cu_seqlens_q_padded
                and self.max_seqlen_kv == self.max_seqlen_q and type(self.max_seqlen_kv) is type(self.max_seqlen_q))

    def _check_side(self, side: str) -> None:
        real = getattr(self, f"cu_seqlens_{side}")
        padded = getattr(self, f"cu_seqlens_{side}_padded")
        for name, cu in ((f"cu_seqlens_{side}", real), (f"cu_seqlens_{side}_padded", padded)):
            if cu is not None:
                check_boundaries(name, cu)
        limit = getattr(self, f"max_seqlen_{side}")
        if real is not None and real.numel() > 1 and isinstance(limit, int) and not isinstance(limit, bool):
            longest = max_seqlen_from_cu_seqlens(real)
            if longest > limit:
                raise ValueError(f"max_seqlen_{side}={limit} is smaller than the longest document "
                                 f"({longest} tokens); attention kernels would truncate it")
        if padded is None:
            return
        if real is None:
            raise ValueError(f"cu_seqlens_{side}_padded is set but cu_seqlens_{side} is None; "
                             f"give the real boundaries too (equal to the padded ones if there is no padding)")
        if padded.numel() != real.numel():
            raise ValueError(f"cu_seqlens_{side}_padded describes {padded.numel() - 1} documents but "
                             f"cu_seqlens_{side} describes {real.numel() - 1}; they must match")
        slack = (padded[1:] - padded[:-1]) - (real[1:] - real[:-1])
        if slack.numel() and bool((slack < 0).any()):
            i = int(torch.nonzero(slack < 0)[0, 0])
            raise ValueError(f"document {i} is longer than its padded slot: length "
                             f"{int(real[i + 1] - real[i])} > padded length "
                             f"{int(padded[i + 1] - padded[i])} (cu_seqlens_{side}_padded)")

    def _check_total_tokens(self) -> None:
        if self.total_tokens is None or self.cu_seqlens_q is None:
            return
        last = int(get_cu_seqlens(self)[-1])
        if self.total_tokens < last:
            raise ValueError(f"total_tokens={self.total_tokens} is smaller than the last physical "
                             f"boundary {last}; it must count every token the kernel sees")

    def _check_cp(self) -> None:
        if self.local_cp_size is None:
            return
        check_int("local_cp_size", self.local_cp_size, minimum=1)
        if self.cp_group is None:
            raise ValueError(f"local_cp_size={self.local_cp_size} needs the matching cp_group "
                             "(a singleton group when CP is off for this microbatch)")
        size = self.cp_group.size()
        if size != self.local_cp_size:
            raise ValueError(f"cp_group has size {size} but local_cp_size={self.local_cp_size}; "
                             "they must match")

    # ----------------------------------------------------------------- accessors
    @property
    def num_docs(self) -> int:
        """Number of documents described by ``cu_seqlens_q`` (empty ones included)."""
        if self.cu_seqlens_q is None:
            raise ValueError("num_docs needs cu_seqlens_q, which is None")
        return self.cu_seqlens_q.numel() - 1

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """The physical boundaries kernels use (padded when set), see :func:`get_cu_seqlens`."""
        return get_cu_seqlens(self)

    def lengths(self) -> torch.Tensor:
        """``[N]`` real length of each document."""
        return self.cu_seqlens_q[1:] - self.cu_seqlens_q[:-1]

    def to_te_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for Transformer Engine attention: MCore-only fields filtered out.

        ``cp_group``, ``local_cp_size``, ``tp_cp_group``, ``total_tokens``, ``seq_idx``,
        ``tokens_per_sample``, ``cp_scatter_cache`` and ssm-pack's ``doc_ids`` / ``validate``
        are dropped, as are fields left at ``None``.
        """
        return {name: getattr(self, name) for name in _TE_FIELDS if getattr(self, name) is not None}

    def replace(self, **changes) -> PackedSeqParams:
        """A copy with ``changes`` applied; ``seq_idx`` is rebuilt unless given, and so are
        ``max_seqlen_q`` / ``max_seqlen_kv`` when the boundaries change and they are not given."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        if "seq_idx" not in changes:
            values["seq_idx"] = None
        values.update(changes)
        moved = any(name.startswith("cu_seqlens") for name in changes)
        if moved and "max_seqlen_q" not in changes and "max_seqlen_kv" not in changes:
            values["max_seqlen_q"] = values["max_seqlen_kv"] = None
            physical = values["cu_seqlens_q_padded"] if values["cu_seqlens_q_padded"] is not None \
                else values["cu_seqlens_q"]
            if physical is not None and values.get("validate", True):
                longest = max_seqlen_from_cu_seqlens(as_boundaries("cu_seqlens_q", physical))
                values["max_seqlen_q"] = values["max_seqlen_kv"] = longest
        return PackedSeqParams(**values)

    def to(self, device) -> PackedSeqParams:
        """A new params with every tensor field on ``device`` (the boundaries, the precomputed
        ``seq_idx``, ``doc_ids``; ``None`` stays ``None``) and every other field as it is.

        The values are the ones checked at construction (a boundary changed in place since is
        refused first), so nothing is checked again and no value is read: moving to a GPU costs
        the copies only. A tensor shared by two fields (``cu_seqlens_q`` and ``cu_seqlens_kv``
        for self-attention) is copied once and stays shared.
        """
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as err:
            raise ValueError(f"device must be a torch.device or a device name ('cpu', 'cuda', 'cuda:1'), got "
                             f"{device!r}") from err
        self.check_unmodified()
        values, copies = {}, {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                if id(value) not in copies:
                    copies[id(value)] = value.to(device)
                value = copies[id(value)]
            values[f.name] = value
        moved = PackedSeqParams(**{**values, "validate": False})       # checked already: nothing to read
        object.__setattr__(moved, "validate", self.validate)
        return moved

    # ----------------------------------------------------------------- builders
    @classmethod
    def from_lengths(cls, lengths, *, pad_to_multiple_of: int = 1, total_tokens: int | None = None,
                     device=None) -> PackedSeqParams:
        """Documents of ``lengths`` laid out back to back.

        ``pad_to_multiple_of > 1`` pads every document up to a multiple (context parallelism
        needs ``2 * cp_size``; block-sparse attention its block size); the padded layout goes
        to ``cu_seqlens_*_padded`` and ``pad_between_seqs`` is set. ``total_tokens`` defaults
        to the physical length; a larger value adds a tail that ``seq_idx`` treats as one
        extra document.
        """
        real = lengths_to_cu_seqlens(lengths, device=device)
        padded_lengths = round_up_lengths(real[1:] - real[:-1], pad_to_multiple_of)
        padded = lengths_to_cu_seqlens(padded_lengths)
        has_pad = not torch.equal(padded, real)
        return cls._from_boundaries(real, padded if has_pad else None, total_tokens)

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens, *, cu_seqlens_padded=None,
                        total_tokens: int | None = None) -> PackedSeqParams:
        """From offsets (a tensor or a list), optionally with a padded physical layout."""
        real = as_cu_seqlens("cu_seqlens", cu_seqlens)
        padded = None if cu_seqlens_padded is None else as_cu_seqlens("cu_seqlens_padded",
                                                                      cu_seqlens_padded)
        return cls._from_boundaries(real, padded, total_tokens)

    @classmethod
    def _from_boundaries(cls, real, padded, total_tokens) -> PackedSeqParams:
        physical = real if padded is None else padded
        total = int(physical[-1]) if total_tokens is None else total_tokens
        longest = max_seqlen_from_cu_seqlens(physical)
        return cls(qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real,
                   cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded,
                   max_seqlen_q=longest, max_seqlen_kv=longest, total_tokens=total,
                   pad_between_seqs=padded is not None)

    @classmethod
    def from_doc_ids(cls, doc_ids: torch.Tensor) -> PackedSeqParams:
        """NeMo AutoModel neat packing: see :func:`ssm_pack.packed_seq_params_from_doc_ids`."""
        return cls(**doc_ids_fields(doc_ids))

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor) -> PackedSeqParams:
        """Documents start wherever ``position_ids`` restarts at 0 (and at every row start).

        ``[B, S]`` rows are flattened in order, so ``total_tokens == B * S``; MRoPE
        ``[3, B, S]`` positions use their temporal plane.
        """
        return cls._from_boundaries(cu_seqlens_from_position_ids(position_ids), None, None)

    @classmethod
    def from_attention_mask(cls, attention_mask: torch.Tensor, *,
                            pad_to_multiple_of: int = 1) -> PackedSeqParams:
        """The real tokens of a right-padded ``[B, S]`` batch packed back to back.

        Pack the tensors themselves with :func:`ssm_pack.pack_padded`.
        """
        return cls.from_lengths(lengths_from_attention_mask(attention_mask),
                                pad_to_multiple_of=pad_to_multiple_of)

    @classmethod
    def from_hf_batch(cls, batch) -> PackedSeqParams:
        """From a Hugging Face ``DataCollatorWithFlattening`` batch, see :mod:`ssm_pack.formats.hf`."""
        return cls(**hf_batch_fields(batch))

    def __repr__(self) -> str:
        parts = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or f.name == "validate":
                continue
            shown = describe(value) if isinstance(value, torch.Tensor) else repr(value)
            parts.append(f"{f.name}={shown}")
        return f"PackedSeqParams({', '.join(parts)})"


def build_packed_seq_idx(packed_seq_params, total_tokens: int) -> torch.Tensor:
    """Per-token sequence index ``[1, total_tokens]`` (int32) for the varlen kernels.

    Args:
        packed_seq_params: a :class:`~ssm_pack.PackedSeqParams` (its padded boundaries are
            preferred, see :func:`get_cu_seqlens`; its precomputed ``seq_idx`` is returned when
            ``total_tokens`` matches), any object with Megatron-core's fields (its ``seq_idx`` is
            not trusted: rebuilt from the boundaries) or a 1-D ``cu_seqlens`` tensor.
        total_tokens: the sequence length the kernel really consumes, i.e. measured after any
            sequence-parallel all-gather or context-parallel all-to-all, not the sharded
            ``hidden_states.shape``.

    ``[0, 5, 7, 11]`` with ``total_tokens=16`` gives
    ``[[0,0,0,0,0, 1,1, 2,2,2,2, 3,3,3,3,3]]``: the 5 tokens after offset 11 are one extra
    document.
    """
    if isinstance(packed_seq_params, torch.Tensor):
        cu = packed_seq_params
    elif packed_seq_params is None:
        raise TypeError("packed_seq_params must be a PackedSeqParams or a cu_seqlens tensor, got None")
    else:
        if not hasattr(packed_seq_params, "cu_seqlens_q"):
            raise TypeError("packed_seq_params must be a PackedSeqParams or a cu_seqlens tensor, "
                            f"got {describe(packed_seq_params)}")
        cu = get_cu_seqlens(packed_seq_params)
        # only ssm-pack's own cache is reused: it was checked against the boundaries, which cannot
        # change since; a foreign object's seq_idx is a second copy of the same fact, never trusted
        cached = getattr(packed_seq_params, "seq_idx", None) if isinstance(packed_seq_params, PackedSeqParams) else None
        if (cached is not None and getattr(packed_seq_params, "total_tokens", None) == total_tokens
                and cached.shape == (1, total_tokens)):
            packed_seq_params.check_unmodified()
            return cached
    return seq_idx_from_cu_seqlens(cu, total_tokens)
