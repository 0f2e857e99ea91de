"""``pack_stream``: documents in, fixed-size packs out; streaming, resumable, rank- and worker-aware.

    T = max_tokens, N = documents (pieces) in one pack

Packing is best-fit decreasing over a lookahead buffer of documents (:mod:`ssm_pack.stream.buffer`);
memory is bounded by the buffer. Every rank and DataLoader worker reads the whole stream's
lengths and plans the same global sequence of packs, in rounds of ``world``; each round gives one
pack to each rank, balancing real tokens (:func:`ssm_pack.stream.buffer.deal`; the epoch's last
round spreads the remaining documents over every rank when they fit), and round ``r`` belongs to
worker ``r % num_workers``; only a pack's owner converts its tokens. So every document is packed
exactly once over all ranks and workers, and at the end of an epoch the ranks with one pack fewer
get one padding pack (all padding, labels -100): every rank yields ``ceil(P / world)`` packs per
epoch; ``pack_index`` is ``round * world + rank``. A carried
document stays on its rank, so when the stream runs dry while one rank still carries one, the
others get empty packs until it ends (at most ``ceil(longest / max_tokens)`` per epoch).

A refused document (a bad token, a type that holds no ids, one too long under
``split_long="refuse"``, ``MAX_EMPTY_RUN`` empty documents in a row) stops the stream:
the documents read with it cannot be handed back to the source, so every later ``next()`` and
``state_dict()`` raises the same error rather than go on without them. Fix the documents and
resume from a ``state_dict()`` saved before the refusal (or start a new stream).
"""

from __future__ import annotations

import torch
from torch.utils.data import IterableDataset, get_worker_info

from ..checks import check_int, describe
from .assemble import assemble_pack, byte_pieces
from .buffer import Doc, Piece, Planner, deal
from .source import (
    _CHECKSUM_MOD,
    _SIZED,
    Source,
    check_token_ids,
    document_length,
    document_tokens,
    fingerprint,
    is_indexable,
)
from .state import check_state

SPLIT_LONG = ("carry", "truncate", "refuse")
MAX_EMPTY_RUN = 65536       # consecutive empty documents read before the stream refuses the source
_CONFIG = ("max_tokens", "align_to", "lookahead", "split_long", "world", "rank", "seed")
_COUNTERS = ("documents", "empty_documents", "truncated_tokens", "split_documents", "packs", "padding_packs",
             "real_tokens", "padding_tokens", "max_buffered_tokens")


class _Pass:
    """The state of one pass (epoch) over the documents on one shard."""

    def __init__(self, stream: PackStream, worker: int, num_workers: int):
        self.worker, self.num_workers = worker, num_workers
        self.source = Source(stream.documents, seed=stream.seed, epoch=stream.epoch)
        self.planner = Planner(stream.max_tokens, stream.align_to, stream.world)
        self.source_done = False
        self.checksum = 0
        self.g = 0                      # next global pack to plan
        self.total = None               # packs planned in the epoch, once known
        self.pad_next = 0               # next rank-local index to consider for padding packs
        self.rank_tokens = [0] * stream.world       # real tokens dealt to each rank so far (all shards agree)
        self.done = False
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self.cache: dict[int, torch.Tensor] = {}    # converted long documents, by source index
        self.empty_run = 0              # empty documents read since the last non-empty one


class PackStream(IterableDataset):
    """Iterator over packs of exactly ``max_tokens`` tokens; see :func:`pack_stream`."""

    def __init__(self, documents, max_tokens: int, *, lookahead: int = 4096, align_to: int = 1,
                 split_long: str = "carry", rank: int = 0, world: int = 1, seed: int | None = None,
                 pad_token_id: int = 0):
        max_tokens = check_int("max_tokens", max_tokens, minimum=1)
        align_to = check_int("align_to", align_to, minimum=1)
        if max_tokens < align_to:
            raise ValueError(f"max_tokens={max_tokens} is smaller than align_to={align_to}: no document fits a "
                             "pack; raise max_tokens to a multiple of align_to")
        self.lookahead = check_int("lookahead", lookahead, minimum=1)
        if split_long not in SPLIT_LONG:
            raise ValueError(f"split_long must be one of {SPLIT_LONG}, got {split_long!r}")
        self.world = check_int("world", world, minimum=1)
        self.rank = check_int("rank", rank, minimum=0)
        if self.rank >= self.world:
            raise ValueError(f"rank must be in [0, world={self.world}), got {self.rank}")
        self.seed = check_int("seed", seed, minimum=0, allow_none=True)
        self.pad_token_id = check_int("pad_token_id", pad_token_id, minimum=0)
        iterable = hasattr(documents, "__iter__") or is_indexable(documents)
        if isinstance(documents, (str, bytes, bytearray, dict)) or not iterable:
            raise TypeError(f"documents must be an iterable of token sequences (list, generator, dataset column), "
                            f"got {describe(documents)}")
        if isinstance(documents, torch.Tensor) and documents.dim() != 2:
            raise ValueError(f"documents as a tensor must be [N, L] (one document per row), got shape "
                             f"{tuple(documents.shape)}; pass a list of 1-D tensors for documents of any length")
        if self.seed is not None and not is_indexable(documents):
            raise ValueError(f"seed={self.seed} shuffles an indexable source (len and __getitem__), but documents is "
                             f"a {type(documents).__name__}; shuffle the stream itself (e.g. an IterableDataset's "
                             ".shuffle(seed)) and pass seed=None")
        self.documents, self.max_tokens, self.align_to, self.split_long = documents, max_tokens, align_to, split_long
        self.epoch = 0
        self._pass: _Pass | None = None
        self._pending: dict | None = None
        self._failure: Exception | None = None      # a refused document: the stream cannot go on

    # ------------------------------------------------------------------ iteration
    def set_epoch(self, epoch: int) -> None:
        """The epoch whose shuffle the next pass uses (with ``seed``); call it before each epoch, as
        with ``DistributedSampler`` (DataLoader workers iterate copies of this object)."""
        self.epoch = check_int("epoch", epoch, minimum=0)

    def __iter__(self):
        if self._pass is not None and self._pass.done:
            self._pass = None
        return self

    def __next__(self) -> dict:
        self._check_not_failed()
        try:
            return self._next()
        except (ValueError, TypeError) as err:
            if self._pass is not None:               # a refusal inside a pass: documents were read
                self._failure = err
            raise

    def _check_not_failed(self) -> None:
        if self._failure is not None:
            err = self._failure
            raise type(err)(f"pack_stream stopped at a refused document and cannot go on without losing the "
                            f"documents read with it ({err}); fix the documents and resume from a state_dict() "
                            "saved before the refusal, or build a new stream") from err

    def _next(self) -> dict:
        p = self._pass if self._pass is not None else self._begin()
        if p.done:
            raise StopIteration
        while p.total is None:
            start, round_ = p.g, self._plan_round(p)
            if round_ is not None:
                return self._build(p, round_, start + self.rank)
        mine = (p.total - self.rank + self.world - 1) // self.world      # this rank's planned packs
        per_rank = (p.total + self.world - 1) // self.world
        for k in range(max(p.pad_next, mine), per_rank):
            if k % p.num_workers == p.worker:
                p.pad_next = k + 1
                p.counters["padding_packs"] += 1
                return self._build(p, [], k * self.world + self.rank)
        p.done = True
        raise StopIteration

    def _plan_round(self, p: _Pass) -> list[Piece] | None:
        """Plan the next round of ``world`` packs (fewer at the end of the epoch) and deal them to
        ranks; this shard's pack of the round if it is this worker's round, else ``None``."""
        planned = []
        self._refill(p)
        last = p.planner.spread(p.rank_tokens) if self.world > 1 and p.source_done else None
        if last is not None:                       # the epoch's last round, one pack per rank
            for pieces in last:
                p.rank_tokens[len(planned)] += sum(piece.length for piece in pieces)
                planned.append(pieces)
            p.g += self.world
            p.total = p.g
            if (p.g - 1) // self.world % p.num_workers != p.worker:
                return None
            return planned[self.rank]
        for _ in range(self.world):
            self._refill(p)
            if p.source_done and p.planner.idle():
                p.total = p.g
                break
            planned.append(p.planner.plan(p.g))
            p.g += 1
        if not planned:
            return None
        tokens = [sum(piece.length for piece in pieces) for pieces in planned]
        pinned = [bool(pieces) and (pieces[0].offset > 0 or pieces[-1].continued) for pieces in planned]
        ranks = deal(tokens, pinned, p.rank_tokens)
        if ((p.g - 1) // self.world) % p.num_workers != p.worker or self.rank not in ranks:
            return None
        return planned[ranks.index(self.rank)]

    def _begin(self) -> _Pass:
        info = get_worker_info()
        worker, num_workers = (0, 1) if info is None else (info.id, info.num_workers)
        p = _Pass(self, worker, num_workers)
        if self._pending is not None:
            self._restore(p, self._pending)
            self._pending = None
        self._pass = p
        return p

    def _refill(self, p: _Pass) -> None:
        """Read documents until the buffer holds ``lookahead`` (or the source ends); lengths only."""
        buffer, source, counters, planner = p.planner.buffer, p.source, p.counters, p.planner
        capacity, align_to, room = planner.capacity, self.align_to, self.lookahead - len(buffer)
        if room <= 0 or p.source_done:
            return
        fitting, read, empty, check, run = [], 0, 0, p.checksum, p.empty_run
        take, sized = source.next, _SIZED
        try:                                  # a bad document raises: what was read stays read
            while room > 0:
                item = take()
                if item is None:
                    p.source_done = True
                    break
                index, doc = item
                length = len(doc) if type(doc) in sized else document_length(index, doc)
                check = (check * 1_000_003 + length + 1) % _CHECKSUM_MOD
                read += 1
                if length == 0:
                    empty += 1
                    run += 1
                    if run >= MAX_EMPTY_RUN:
                        raise ValueError(f"documents[{index}] is the {run}th empty document in a row (at most "
                                         f"MAX_EMPTY_RUN={MAX_EMPTY_RUN}); the source yields no tokens: check "
                                         "its tokenizer or filter empty documents out")
                    continue
                run = 0
                units = -(-length // align_to)
                if units <= capacity:
                    fitting.append(Doc(index, doc, length, units))
                else:
                    buffer.extend(fitting)
                    fitting = []
                    self._admit_long(p, Doc(index, doc, length, units))
                room -= 1
        finally:
            buffer.extend(fitting)
            p.checksum, p.empty_run = check, run
            counters["documents"] += read
            counters["empty_documents"] += empty
        counters["max_buffered_tokens"] = max(counters["max_buffered_tokens"], buffer.tokens)

    def _admit_long(self, p: _Pass, item: Doc) -> None:
        """A document longer than a pack into the buffer, per ``split_long``."""
        capacity = p.planner.capacity
        assert item.units > capacity, "_refill buffers the documents that fit a pack itself"
        fits = capacity * self.align_to
        if self.split_long == "refuse":
            raise ValueError(f"documents[{item.index}] has {item.length} tokens but a pack holds {fits} "
                             f"(max_tokens={self.max_tokens}, align_to={self.align_to}); pass split_long='carry' "
                             "(pieces in consecutive packs) or 'truncate', or raise max_tokens")
        if self.split_long == "truncate":
            p.counters["truncated_tokens"] += item.length - fits
            p.planner.buffer.add(Doc(item.index, item.doc, fits, capacity))
            return
        p.counters["split_documents"] += 1
        p.planner.buffer.add(item, long=True)

    def _build(self, p: _Pass, pieces: list[Piece], g: int) -> dict:
        lengths = None
        if pieces and all(isinstance(piece.doc, (bytes, bytearray)) for piece in pieces):
            tokens, next_token = byte_pieces(pieces, split=self.align_to != 1)
            lengths = None if self.align_to != 1 else [piece.length for piece in pieces]
        else:
            tokens, next_token = [], None
            for piece in pieces:
                whole = self._tokens(p, piece)
                whole_piece = piece.offset == 0 and piece.length == whole.shape[0]
                tokens.append(whole if whole_piece else whole[piece.offset:piece.offset + piece.length])
                if piece.continued:
                    next_token = int(whole[piece.offset + piece.length])
        offsets = [piece.offset for piece in pieces]
        pack = assemble_pack(tokens, offsets, max_tokens=self.max_tokens, align_to=self.align_to,
                             pad_token_id=self.pad_token_id, next_token=next_token, lengths=lengths)
        if lengths is None:                                   # bytes are never negative
            check_token_ids(pack["input_ids"], tokens, [piece.index for piece in pieces])
        real = sum(piece.length for piece in pieces)
        p.counters["packs"] += 1
        p.counters["real_tokens"] += real
        p.counters["padding_tokens"] += self.max_tokens - real
        where = torch.tensor([[piece.index for piece in pieces], offsets], dtype=torch.int64).reshape(2, -1)
        pack.update(documents=where[0], offsets=where[1],
                    continues=bool(pieces) and pieces[0].offset > 0,
                    continued=bool(pieces) and pieces[-1].continued, pack_index=g)
        return pack

    def _tokens(self, p: _Pass, piece: Piece) -> torch.Tensor:
        """The whole document's ids, converted once per split document while its pieces last."""
        if piece.offset == 0 and not piece.continued:
            return document_tokens(piece.index, piece.doc)
        whole = p.cache.get(piece.index)
        if whole is None:
            whole = document_tokens(piece.index, piece.doc)
            while len(p.cache) >= self.world:
                p.cache.pop(next(iter(p.cache)))
            p.cache[piece.index] = whole
        if not piece.continued:
            p.cache.pop(piece.index, None)
        return whole

    # ------------------------------------------------------------------ figures and state
    @property
    def stats(self) -> dict:
        """This shard's counters for the current (or last) pass: documents read, empty documents
        skipped, tokens truncated, documents split, packs and padding packs yielded, real and
        padding tokens in them, and the most document tokens the buffer held."""
        return dict(self._pass.counters) if self._pass is not None else dict.fromkeys(_COUNTERS, 0)

    def _config(self) -> dict:
        return {name: getattr(self, name) for name in _CONFIG}

    def state_dict(self) -> dict:
        """Where this shard stands: after loading it into a stream built with the same documents and
        arguments, iteration yields exactly the packs this one would have yielded next. Inside
        DataLoader workers each worker's copy keeps its own state: a loader that gathers and restores
        them per worker (torchdata's ``StatefulDataLoader``) resumes the whole loader. After a refused
        document it raises (the state would skip the documents read with it)."""
        self._check_not_failed()
        state = {"config": self._config(), "source": fingerprint(self.documents), "epoch": self.epoch, "pass": None}
        p = self._pass
        if p is None or p.done:
            state["pass"] = self._pending
            return state
        lanes = [None if lane is None else [lane.index, lane.offset, lane.length] for lane in p.planner.lanes]
        state["pass"] = {
            "worker": p.worker, "num_workers": p.num_workers, "position": p.source.position,
            "source_done": p.source_done, "checksum": p.checksum, "g": p.g, "total": p.total,
            "pad_next": p.pad_next, "counters": dict(p.counters), "lanes": lanes, "rank_tokens": list(p.rank_tokens),
            "buffer": [[d.index, d.length, d.units > p.planner.capacity] for d in p.planner.buffer.items()],
        }
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`; a state from another configuration or source, or one
        edited since, is refused before the stream changes (it also clears an earlier refusal)."""
        check_state(state, config_keys=_CONFIG, counter_keys=_COUNTERS, checksum_mod=_CHECKSUM_MOD)
        for name, saved in state["config"].items():
            if getattr(self, name) != saved:
                raise ValueError(f"load_state_dict: the state was saved with {name}={saved!r} but this stream has "
                                 f"{name}={getattr(self, name)!r}; build the stream with the same arguments")
        if state["source"] != fingerprint(self.documents):
            raise ValueError(f"load_state_dict: the state was saved from documents {state['source']} but these are "
                             f"{fingerprint(self.documents)}; resume with the same documents")
        self.epoch = state["epoch"]
        self._pass, self._pending, self._failure = None, state["pass"], None

    def _restore(self, p: _Pass, saved: dict) -> None:
        if (saved["worker"], saved["num_workers"]) != (p.worker, p.num_workers):
            raise ValueError(f"load_state_dict: the state was saved by worker {saved['worker']} of "
                             f"{saved['num_workers']} but is loaded in worker {p.worker} of {p.num_workers}; "
                             "resume with the same num_workers")
        keep = {entry[0] for entry in saved["buffer"]} | {lane[0] for lane in saved["lanes"] if lane is not None}
        found = p.source.open(saved["position"], keep, saved["checksum"])
        for index, length, long in saved["buffer"]:
            doc = found[index]
            read = document_length(index, doc)
            if read != length and not (long is False and self.split_long == "truncate" and read > length):
                raise ValueError(f"load_state_dict: documents[{index}] has {read} tokens but had {length} when the "
                                 "state was saved; resume with the same documents")
            p.planner.buffer.add(Doc(index, doc, length, p.planner.units(length)), long=long)
        for lane, entry in enumerate(saved["lanes"]):
            if entry is not None:
                index, offset, length = entry
                p.planner.lanes[lane] = Piece(index, found[index], offset, length, True)
        p.source_done, p.checksum, p.g = saved["source_done"], saved["checksum"], saved["g"]
        p.total, p.pad_next, p.counters = saved["total"], saved["pad_next"], dict(saved["counters"])
        p.rank_tokens = list(saved["rank_tokens"])


def pack_stream(documents, max_tokens: int, *, lookahead: int = 4096, align_to: int = 1, split_long: str = "carry",
                rank: int = 0, world: int = 1, seed: int | None = None, pad_token_id: int = 0) -> PackStream:
    """Pack a stream of documents into rows of exactly ``max_tokens`` tokens.

    Args:
        documents: any iterable of token sequences (lists or tuples of ints, integer tensors or
            numpy arrays, ``bytes``): a list, a generator, a Hugging Face ``datasets`` column
            (``dataset["input_ids"]``), an ``[N, L]`` tensor (one document per row). Empty
            documents are skipped and counted.
        max_tokens: T, the tokens of every pack (documents, their alignment padding and a tail).
        lookahead: documents held for best-fit decreasing; padding falls as it grows, memory
            grows with it.
        align_to: every document starts at a multiple of this (``2 * cp_size`` for context
            parallelism, a block size for block-sparse attention); the slot padding counts
            against ``max_tokens``.
        split_long: a document longer than a pack: ``"carry"`` (its head fills the room a pack has
            left, the rest continues at the start of the same rank's next packs; see
            ``continues`` / ``continued``), ``"truncate"`` (keep the first tokens that fit; the
            rest is counted in ``stats["truncated_tokens"]``) or ``"refuse"`` (``ValueError``).
        rank / world: this data-parallel rank's share (every rank passes the same documents).
        seed: shuffle an indexable source per epoch (see :meth:`PackStream.set_epoch`); ``None``
            keeps the source's order.
        pad_token_id: the id written into padding.

    Returns:
        A :class:`PackStream` (a ``torch.utils.data.IterableDataset``, each DataLoader worker a
        disjoint share) with ``state_dict()`` / ``load_state_dict()`` for exact resume and
        ``stats``. Each pack is a dict: ``input_ids``, ``labels``, ``targets``, ``position_ids``
        (``[1, T]`` int64, see :func:`ssm_pack.stream.assemble.assemble_pack`),
        ``packed_seq_params`` (real boundaries in ``cu_seqlens_q``, aligned slots in
        ``cu_seqlens_q_padded``, ``total_tokens == T``), ``documents`` / ``offsets`` (``[N]``
        int64: each piece's index in the source and first token in its document),
        ``continues`` (the first piece continues the last piece of this rank's previous pack),
        ``continued`` (the last piece goes on in this rank's next pack) and ``pack_index``.
    """
    return PackStream(documents, max_tokens, lookahead=lookahead, align_to=align_to, split_long=split_long,
                      rank=rank, world=world, seed=seed, pad_token_id=pad_token_id)
