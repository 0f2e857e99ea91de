"""``VarlenBatch``: the packing metadata of one forward, resolved once and handed to every layer.

    N = documents, T = tokens the kernels see (the physical, padded layout, after any gather),
    S = segments (the non-empty documents, then the padding tail when there is one)

Every op and layer reads its packing facts from one of these, so each fact is derived at most
once per forward and one boundary policy holds everywhere:

* the physical boundaries ``cu_seqlens`` (int32; ``cu_seqlens_long`` is the int64 copy fla
  wants) are the padded ones when the params have them (:func:`ssm_pack.get_cu_seqlens`);
* the tokens after ``cu_seqlens[-1]`` (the padding tail) form one more document: ``seq_idx``
  gives them index N, the references a segment of their own, the kernels a boundary at T;
* an empty document (equal neighbouring offsets) owns no token; its state passes through.

Building one reads the boundary values once (validation, the longest document), unless the
params were built with ``validate=False`` (e.g. for CUDA-graph capture): then nothing is read,
and ``max_seqlen`` comes from ``max_seqlen_q`` (read from the boundaries, once, only if a path
needs it and it was not given). Everything else (int64 copy, positions, the references'
segment structure, the kernels' boundary layouts) is derived on first use and kept on the
object, so a kernel path never builds what only the reference reads, and no layer repeats
another's work. :meth:`VarlenBatch.materialize` derives all of it up front (before
``torch.compile`` or graph capture).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property

import torch

from .checks import as_boundaries, check_boundaries, check_int, describe, is_numpy_array
from .formats.consistency import check_metadata, check_within_int32
from .formats.params import PackedSeqParams
from .formats.segments import Segments, segments_from_cu_seqlens
from .formats.seq_idx import get_cu_seqlens, renumber_seq_idx, seq_idx_from_cu_seqlens
from .parallel import layout as context_parallel
from .params_cache import BuiltPerParams

# fla's Triton causal_conv1d works in chunks of this many tokens (fla/modules/causal_conv1d/ops.py, 0.6.0)
FLA_CONV_CHUNK = 64
# the fields any Megatron-core style PackedSeqParams has (duck typing: no methods of ours needed)
_MCORE_CU_SEQLENS_FIELDS = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")


def _empty_last(cu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cu, order)``: the segments of ``cu`` reordered so every empty one comes last (stable, so the
    same on the host and the device); ``order[j]`` is the original index of entry j."""
    lengths = cu[1:] - cu[:-1]
    order = torch.argsort((lengths == 0).to(torch.int8), stable=True)
    return torch.cat([cu[:1], torch.cumsum(lengths[order], 0)]), order


@dataclass(frozen=True, eq=False)
class VarlenBatch:
    """The packing facts of one packed row of ``total_tokens`` tokens (see the module docstring).

    Attributes:
        cu_seqlens: ``[N+1]`` int32 physical boundaries, on the tokens' device.
        total_tokens: T, the tokens the ops see.
        real_cu_seqlens: ``[N+1]`` int32 boundaries of the real tokens (equal to
            ``cu_seqlens`` without per-document padding); each document's real tokens start at
            its physical start.

    Build it with :meth:`build` (once per params object, :mod:`ssm_pack.params_cache`); a ``VarlenBatch`` is
    immutable.
    """

    cu_seqlens: torch.Tensor
    total_tokens: int
    real_cu_seqlens: torch.Tensor
    given_seq_idx: torch.Tensor | None = field(default=None, repr=False)
    given_max_seqlen: int | None = field(default=None, repr=False)
    validated: bool = field(default=True, repr=False)
    # context parallelism (ssm_pack.parallel.layout): this rank's shard of a row split over ranks
    cp: object = field(default=None, repr=False)
    # the physical boundaries as given, when they live on the host and the tokens elsewhere: the
    # fields that need boundary values on the host read them here (no device synchronisation)
    host_cu_seqlens: torch.Tensor | None = field(default=None, repr=False)

    # ----------------------------------------------------------------- construction
    @classmethod
    def build(cls, packed_seq_params, total_tokens: int, *, device=None) -> VarlenBatch:
        """The metadata of a packed row of ``total_tokens`` tokens, on ``device``.

        ``packed_seq_params`` is a :class:`VarlenBatch` (returned as is when it matches), an
        ssm-pack or Megatron-core ``PackedSeqParams`` (any object with Megatron's
        ``cu_seqlens_q`` / ``cu_seqlens_q_padded`` fields), or the boundaries themselves (a
        tensor, list or numpy array of offsets).
        """
        total_tokens = check_int("total_tokens", total_tokens, minimum=0)
        if isinstance(packed_seq_params, VarlenBatch):
            return packed_seq_params.check_tokens(total_tokens, device)
        if packed_seq_params is None:
            raise TypeError("packed_seq_params must be a PackedSeqParams, a VarlenBatch or cu_seqlens, got None")
        if hasattr(packed_seq_params, "cu_seqlens_q"):      # once per params object (Megatron passes it per layer)
            return BUILT_PER_PARAMS.get(packed_seq_params, total_tokens, device, cls._from_params)
        if not isinstance(packed_seq_params, (torch.Tensor, list, tuple)) and not is_numpy_array(packed_seq_params):
            raise TypeError("packed_seq_params must be a PackedSeqParams (or any object with Megatron's "
                            "cu_seqlens_q field), a VarlenBatch or a cu_seqlens tensor / list / numpy array, got "
                            f"{describe(packed_seq_params)}")
        check_within_int32(f"the input ({total_tokens} tokens)", total_tokens)
        cu = as_boundaries("cu_seqlens", packed_seq_params, device=device)
        # bare offsets are checked where that reads nothing remote (on CPU), like upstream's ops
        on_cpu = cu.device.type == "cpu"
        return cls._assemble(cu, None, total_tokens, device, validate=on_cpu, checked=False, max_seqlen=None,
                             seq_idx=None)

    @classmethod
    def _from_params(cls, params, total_tokens: int, device) -> VarlenBatch:
        ours = isinstance(params, PackedSeqParams)
        validate = getattr(params, "validate", True)
        check_metadata(params, total_tokens)                 # reads no value: always
        if ours:
            params.check_unmodified()
        values = {}
        for name in _MCORE_CU_SEQLENS_FIELDS:
            value = getattr(params, name, None)
            values[name] = None if value is None else as_boundaries(name, value)
        if values["cu_seqlens_q"] is None:
            raise ValueError("packed_seq_params.cu_seqlens_q is None; build the params with "
                             "PackedSeqParams.from_lengths(...) or from_cu_seqlens(...)")
        if validate and not ours:       # ours were validated at construction and cannot change since
            for name, value in values.items():
                if value is not None:
                    check_boundaries(f"packed_seq_params.{name}", value)
        if validate:
            _check_self_attention(values)
        physical = values["cu_seqlens_q_padded"] if values["cu_seqlens_q_padded"] is not None \
            else values["cu_seqlens_q"]
        limit = max(v for v in (getattr(params, "max_seqlen_q", None), getattr(params, "max_seqlen_kv", None), -1)
                    if isinstance(v, int) and not isinstance(v, bool))
        # ssm-pack's own seq_idx is consistent by construction; a foreign copy is never trusted
        cached = getattr(params, "seq_idx", None) if ours else None
        if cached is not None and (getattr(params, "total_tokens", None) != total_tokens
                                   or tuple(cached.shape) != (1, total_tokens)):
            cached = None
        real = values["cu_seqlens_q"] if values["cu_seqlens_q_padded"] is not None else None
        batch = cls._assemble(physical, real, total_tokens, device, validate=validate, checked=True,
                              max_seqlen=limit if limit >= 0 else None, seq_idx=cached)
        cp = context_parallel.resolve(params, total_tokens, batch.device, cls.build)
        return batch if cp is None else dataclasses.replace(batch, cp=cp)

    @classmethod
    def _assemble(cls, physical, real, total_tokens, device, *, validate, checked, max_seqlen,
                  seq_idx) -> VarlenBatch:
        """``checked``: the boundaries' own values were validated already."""
        device = physical.device if device is None else torch.device(device)
        cu = physical.to(device=device, dtype=torch.int32)
        if validate:
            if not checked:
                check_boundaries("cu_seqlens", physical)
            last = int(physical[-1])
            check_within_int32("cu_seqlens[-1]", last)
            if last > total_tokens:
                raise ValueError(f"cu_seqlens[-1]={last} is beyond the {total_tokens} tokens of the packed row; "
                                 "pass the boundaries of this row (the physical ones, padding included)")
            max_seqlen = _longest(physical, total_tokens)      # measured: a given one is a second copy
        if seq_idx is not None:
            seq_idx = seq_idx.to(device=device, dtype=torch.int32)
        real_cu = cu if real is None else real.to(device=device, dtype=torch.int32)
        host = physical if physical.device.type == "cpu" and cu.device.type != "cpu" else None
        return cls(cu_seqlens=cu, total_tokens=total_tokens, real_cu_seqlens=real_cu, given_seq_idx=seq_idx,
                   given_max_seqlen=max_seqlen, validated=validate, host_cu_seqlens=host)

    def check_tokens(self, total_tokens: int, device=None) -> VarlenBatch:
        """``self`` after checking it describes ``total_tokens`` tokens on ``device``."""
        if total_tokens != self.total_tokens:
            raise ValueError(f"this VarlenBatch describes {self.total_tokens} tokens but the input has "
                             f"{total_tokens}; build one per packed row (VarlenBatch.build(params, tokens))")
        if device is not None and torch.device(device) != self.cu_seqlens.device:
            raise ValueError(f"this VarlenBatch lives on {self.cu_seqlens.device} but the input on "
                             f"{torch.device(device)}; build it on the input's device")
        return self

    # ----------------------------------------------------------------- derived on first use
    @property
    def num_docs(self) -> int:
        """N, empty documents included (the padding tail is not one)."""
        return self.cu_seqlens.numel() - 1

    @property
    def device(self) -> torch.device:
        return self.cu_seqlens.device

    @cached_property
    def max_seqlen(self) -> int:
        """The longest segment (the padding tail counts as one): given or checked at build time,
        else read from the boundaries here (once)."""
        if self.given_max_seqlen is not None:
            return self.given_max_seqlen
        return _longest(self.cu_seqlens if self.host_cu_seqlens is None else self.host_cu_seqlens, self.total_tokens)

    @cached_property
    def seq_idx(self) -> torch.Tensor:
        """``[1, T]`` int32 document index per token (the padding tail is index N), contiguous."""
        if self.given_seq_idx is not None:
            return self.given_seq_idx.contiguous()
        return seq_idx_from_cu_seqlens(self.cu_seqlens, self.total_tokens, validate=self.validated).to(self.device)

    @cached_property
    def renumbered_seq_idx(self) -> torch.Tensor:
        """``[1, T]`` int32: ``seq_idx`` renumbered 0, 1, ... (the indices of empty documents closed up),
        what causal-conv1d's by-value compare wants (:func:`ssm_pack.formats.seq_idx.renumber_seq_idx`)."""
        return renumber_seq_idx(self.seq_idx)

    @cached_property
    def cu_seqlens_long(self) -> torch.Tensor:
        """``[N+1]`` int64 copy of ``cu_seqlens`` (fla's dtype)."""
        return self.cu_seqlens.to(torch.int64)

    @cached_property
    def position_ids(self) -> torch.Tensor:
        """``[1, T]`` int64 positions restarting at 0 at every physical document start (and the tail);
        under context parallelism, a document continuing from an earlier rank keeps counting."""
        index = torch.arange(self.total_tokens, device=self.device)
        positions = (index - self.cu_seqlens_long[self.seq_idx[0].to(torch.int64)]).unsqueeze(0)
        return positions if self.cp is None else self.cp.global_positions(positions)

    @cached_property
    def segments(self) -> Segments:
        """The references' segment structure (built once, only when a reference runs)."""
        if self.host_cu_seqlens is None:
            return segments_from_cu_seqlens(self.cu_seqlens_long, self.total_tokens)
        return _to_device(self._host_segments, self.device)

    @cached_property
    def _host_segments(self) -> Segments:
        """The segments built from the host copy of the boundaries (no device value read)."""
        return segments_from_cu_seqlens(self.host_cu_seqlens.to(torch.int64), self.total_tokens)

    @cached_property
    def covering_cu_seqlens(self) -> torch.Tensor:
        """``[N+2]`` int32: ``cu_seqlens`` with a final boundary at T, so the padding tail is a
        document of its own (empty when there is no tail), what flash-attn's varlen kernel wants."""
        return torch.cat([self.cu_seqlens, self.cu_seqlens.new_tensor([self.total_tokens])])

    @cached_property
    def nonempty_layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cu [N+2] int64, order [N+1])`` for kernels that misread empty documents (fla).

        The N documents and the padding tail, reordered so every empty one comes last (the
        tokens do not move: an empty document owns none); ``order[j]`` is the original index of
        entry j (N = the tail). No value is read on the host.
        """
        return _empty_last(self.covering_cu_seqlens.to(torch.int64))

    @cached_property
    def host_nonempty_cu(self) -> torch.Tensor:
        """``nonempty_layout``'s ``cu`` ``[N+2]`` int64 on the host, for fla's ``cu_seqlens_cpu`` (its
        chunk grid then needs no device read): from the host boundaries when there are (no read),
        else one read of the device's, once per forward."""
        if self.host_cu_seqlens is None:
            return self.nonempty_layout[0].cpu()
        return _empty_last(torch.cat([self.host_cu_seqlens.to(torch.int64), torch.tensor([self.total_tokens])]))[0]

    @cached_property
    def fla_conv_layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cu [S+1] int64, chunk_indices [NT, 2] int64)`` for fla's Triton conv: the segments'
        starts then T (no empty sequence, the padding tail its own), and the kernel's grid, one
        ``(segment, chunk)`` row per :data:`FLA_CONV_CHUNK` tokens of each segment. fla builds the
        indices itself when not given them (two host reads per call); here they cost one, once."""
        segs = self.segments if self.host_cu_seqlens is None else self._host_segments
        cu = torch.cat([segs.starts, segs.starts.new_tensor([self.total_tokens])])
        counts = torch.div(segs.lengths + (FLA_CONV_CHUNK - 1), FLA_CONV_CHUNK, rounding_mode="floor")
        total = int(counts.sum()) if counts.numel() else 0
        seg = torch.repeat_interleave(torch.arange(counts.numel(), device=cu.device), counts, output_size=total)
        within = torch.arange(total, device=cu.device) - (torch.cumsum(counts, 0) - counts)[seg]
        return cu.to(self.device), torch.stack([seg, within], 1).to(self.device)

    def read_ahead(self) -> VarlenBatch:
        """Derive now the fields whose derivation reads tensor values (the longest segment, the
        segments, fla's conv layout), so that no layer synchronises with the device later in the
        step. Metadata built without validation (``validate=False``) reads nothing: it is left as
        is (use :meth:`materialize` outside a capture instead)."""
        if self.validated:
            for name in ("max_seqlen", "segments", "fla_conv_layout"):
                getattr(self, name)
        return self

    @cached_property
    def real_tokens(self) -> torch.Tensor:
        """``[1, T]`` bool: the token is a real token of a document (not per-document padding or the tail)."""
        real = self.real_cu_seqlens.to(torch.int64)
        ends = self.cu_seqlens_long.clone()                      # the tail (index N) ends where it starts
        ends[:-1] += real[1:] - real[:-1]
        return (self.position_ids[0] < (ends - self.cu_seqlens_long)[self.seq_idx[0].to(torch.int64)]).unsqueeze(0)

    def materialize(self) -> VarlenBatch:
        """Derive every lazy field now (before ``torch.compile`` tracing or CUDA-graph capture).

        This reads the boundaries, so metadata built with ``validate=False`` gets its one check
        here: a given ``max_seqlen_q`` must cover every segment, the padding tail included
        (flash-attn sizes its work by it and would leave the rows past it unwritten);
        ``ValueError`` otherwise."""
        if not self.validated and self.given_max_seqlen is not None:
            longest = _longest(self.cu_seqlens if self.host_cu_seqlens is None else self.host_cu_seqlens,
                               self.total_tokens)
            if self.given_max_seqlen < longest:
                raise ValueError(f"max_seqlen_q={self.given_max_seqlen} is shorter than the longest segment of "
                                 f"this row ({longest} tokens, the padding tail after cu_seqlens[-1] counted); "
                                 f"build the params with max_seqlen_q >= {longest}, or leave it None")
        for name in ("max_seqlen", "seq_idx", "renumbered_seq_idx", "cu_seqlens_long", "position_ids", "segments",
                     "covering_cu_seqlens", "nonempty_layout", "fla_conv_layout", "real_tokens"):
            getattr(self, name)
        return self

    def __repr__(self) -> str:
        return (f"VarlenBatch(documents={self.num_docs}, total_tokens={self.total_tokens}, "
                f"max_seqlen={self.max_seqlen}, device={self.device})")


BUILT_PER_PARAMS = BuiltPerParams()


def _to_device(segs: Segments, device) -> Segments:
    return Segments(**{f.name: None if getattr(segs, f.name) is None else getattr(segs, f.name).to(device)
                       for f in dataclasses.fields(segs)})


def _longest(cu: torch.Tensor, total_tokens: int) -> int:
    """The longest segment of ``cu`` in a row of ``total_tokens`` (tail included); reads the values."""
    wide = cu.to(torch.int64)
    lengths = wide[1:] - wide[:-1]
    return max(int(lengths.max()) if lengths.numel() else 0, total_tokens - int(wide[-1]))


def _check_self_attention(values: dict) -> None:
    """The mixers are causal self-attention: key boundaries must be the query boundaries."""
    for q_name, kv_name in (("cu_seqlens_q", "cu_seqlens_kv"), ("cu_seqlens_q_padded", "cu_seqlens_kv_padded")):
        q, kv = values[q_name], values[kv_name]
        if kv is None or kv is q:
            continue
        if q is None or kv.shape != q.shape or not torch.equal(kv.to(torch.int64), q.to(torch.int64)):
            raise ValueError(f"packed_seq_params.{kv_name} differs from {q_name} "
                             f"({describe(kv)} vs {describe(q)}); ssm-pack's mixers attend within each "
                             f"document (self-attention), so both must describe the same documents. "
                             f"Set {kv_name}={q_name} (or leave it None)")


def as_varlen(packed_seq_params, total_tokens: int, *, device=None) -> VarlenBatch:
    """:meth:`VarlenBatch.build` (the short spelling the ops and layers use)."""
    return VarlenBatch.build(packed_seq_params, total_tokens, device=device)


__all__ = ["VarlenBatch", "as_varlen", "get_cu_seqlens"]
