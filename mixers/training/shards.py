"""Stream shards: the packs one position of the global batch trains on, step after step.

    B = data.batch_packs, T = data.max_tokens

Shard ``s`` of ``B`` is ``pack_stream(documents, T, rank=s, world=B)``; dp ranks take shards in
blocks (:meth:`mixers.training.parallel.World.shards`). With ``data.carry`` a shard also keeps the
states its split documents carry from one of its packs to the next (:class:`CarriedStates`).
"""

from __future__ import annotations

from ssm_pack import pack_stream
from ssm_pack.stream.source import document_length

from ..model.carry import CarriedStates
from .config import Config
from .data import Corpus

FIRST_SLOTS = 16      # carried-state cache slots to start with; doubled when a pack holds more pieces


class Shard:
    """Stream shard ``index`` of ``B``: its packs in order and, with ``data.carry``, the states its
    split documents carry from one pack to the next.

    The carried-state cache holds one slot per piece of a pack, each as long as the corpus's
    longest document (attention keeps a whole document's keys and values); it starts with
    ``FIRST_SLOTS`` slots and doubles when a pack holds more pieces, keeping the carried state.
    """

    def __init__(self, index: int, corpus: Corpus, config: Config, model, dtype):
        data = config.data
        seed = None if data.shuffle_seed < 0 else data.shuffle_seed
        self.index, self.model, self.dtype = index, model, dtype
        self.stream = pack_stream(corpus.documents, data.max_tokens, lookahead=data.lookahead, rank=index,
                                  world=data.batch_packs, seed=seed, pad_token_id=corpus.pad_token_id,
                                  split_long="carry")
        self.carry = None
        if data.carry:
            self.longest = longest_document(corpus)
            self.carry = CarriedStates(model, max_documents=FIRST_SLOTS, max_document_tokens=self.longest,
                                       dtype=dtype)

    def _room_for(self, pieces: int) -> None:
        """Grow the carried-state cache to hold ``pieces`` pieces (the carried state moves along)."""
        if self.carry is None or pieces <= self.carry.max_documents:
            return
        size = self.carry.max_documents
        while size < pieces:
            size *= 2
        grown = CarriedStates(self.model, max_documents=size, max_document_tokens=self.longest, dtype=self.dtype)
        grown.load_state_dict(self.carry.state_dict())
        self.carry = grown

    def next(self) -> dict:
        """The next pack (at the end of an epoch the next epoch's first, states reset), with room
        for its pieces in the carried-state cache."""
        try:
            pack = next(iter(self.stream))
        except StopIteration:
            self.stream.set_epoch(self.stream.epoch + 1)
            if self.carry is not None:
                self.carry.reset()
            try:
                pack = next(iter(self.stream))
            except StopIteration:
                raise ValueError("the corpus yields no pack: every document is empty; check data.files / "
                                 "data.dataset and data.text_field") from None
        self._room_for(len(pack["documents"]))
        return pack

    def state_dict(self) -> dict:
        return {"stream": self.stream.state_dict(),
                "carry": None if self.carry is None else self.carry.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.carry is not None:
            carried = state["carry"].get("carried") if isinstance(state.get("carry"), dict) else None
            if carried is not None:
                self._room_for(carried[1])
            self.carry.load_state_dict(state["carry"])
        self.stream.load_state_dict(state["stream"])


def longest_document(corpus: Corpus) -> int:
    """The most tokens one document of an indexable corpus holds (at least 1)."""
    documents = corpus.documents
    return max([document_length(i, documents[i]) for i in range(len(documents))] + [1])
