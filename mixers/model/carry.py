"""Carried states: train on :func:`ssm_pack.pack_stream` packs whose long documents span several packs.

    T = max_tokens, N = documents (pieces) in one pack, V = vocabulary

With ``split_long="carry"`` a long document is cut into pieces in consecutive packs of one rank;
``pack["continues"]`` says the first piece continues the last piece of the previous pack.
:class:`CarriedStates` runs each pack through the model's inference-cache path (one cache slot
per piece, :mod:`mixers.model.cached`): a fresh piece starts from a reset slot, a continuing
piece from the slot its previous piece left, so every mixer starts it from that piece's final
states (conv window, SSM / delta-rule state). The slots hold their states detached, so
gradients stop at the cut: truncated backpropagation through time.

Attention: the slot keeps the keys and values of every earlier piece of the document (detached,
up to ``max_document_tokens``), and rotary positions continue, so a continuing piece attends to
the whole document so far, exactly as in one row. The forward over a document split across k
packs therefore equals the forward over the whole document in one row for every mixer; the
gradients do not (nothing flows into earlier packs).

A run that stops and resumes keeps its carried document: :meth:`CarriedStates.state_dict` holds
the carried ``(document, slot, next offset)``, that slot's token count and its states in every
mixer's cache (CPU copies; other slots are reset before use, so they are not kept), and
:meth:`CarriedStates.load_state_dict` writes them back into a fresh ``CarriedStates`` of the
same model configuration: the next pack then runs bitwise as if the run had never stopped.
"""

from __future__ import annotations

import torch

from ssm_pack import VarlenBatch
from ssm_pack.checks import describe

from .hybrid import check_token_ids
from .loss import next_token_loss

_STATE_KEYS = ("carried", "length", "states")
_PACK_KEYS = ("input_ids", "targets", "packed_seq_params", "documents", "offsets", "continues", "continued")


class CarriedStates:
    """Per-document states kept between training steps (one rank's packs, in order).

    Args:
        model: a :class:`mixers.HybridLM`.
        max_documents: the most pieces one pack holds (one cache slot each, plus the carried one).
        max_document_tokens: the longest document (attention keeps its keys and values).
        dtype / device: of the cache (default: the model's).

    A pack is refused (``ValueError`` / ``TypeError``, states untouched) unless it is the one that
    follows: a continuing first piece must be the carried document from the token where its
    previous piece ended (the same pack twice, or a skipped one, is refused).
    """

    def __init__(self, model, *, max_documents: int, max_document_tokens: int, dtype=None, device=None):
        for name, value in (("max_documents", max_documents), ("max_document_tokens", max_document_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.model = model
        self.max_documents = max_documents
        self.cache = model.allocate_inference_cache(max_documents + 1, max_document_tokens, dtype=dtype,
                                                    device=device)
        self.carried: tuple[int, int, int] | None = None   # (source index of the document, its slot, next offset)

    def reset(self) -> None:
        """Forget every state (a new epoch, or packs that do not follow the previous ones)."""
        self.cache.reset()
        self.carried = None

    def _check(self, pack) -> tuple[list[int], list[int], VarlenBatch]:
        """The pack's documents, the token where its last piece ends, and its metadata, checked against
        its tokens and the carried state before anything changes."""
        if not isinstance(pack, dict) or not set(_PACK_KEYS) <= set(pack):
            missing = sorted(set(_PACK_KEYS) - set(pack)) if isinstance(pack, dict) else list(_PACK_KEYS)
            raise TypeError(f"pack must be a dict from ssm_pack.pack_stream; missing {missing}")
        ids = pack["input_ids"]
        varlen = VarlenBatch.build(pack["packed_seq_params"], ids.shape[-1], device=ids.device)
        check_token_ids(ids, self.model.embed.num_embeddings)
        documents, offsets = pack["documents"].tolist(), pack["offsets"].tolist()
        real = varlen.real_cu_seqlens.tolist()
        if not len(documents) == len(offsets) == len(real) - 1:
            raise ValueError(f"the pack's documents ({len(documents)}), offsets ({len(offsets)}) and "
                             f"packed_seq_params ({len(real) - 1} documents) disagree; pass packs as pack_stream "
                             "yields them")
        if len(documents) > self.max_documents:
            raise ValueError(f"the pack holds {len(documents)} documents but CarriedStates was built with "
                             f"max_documents={self.max_documents}; raise max_documents")
        continues = bool(pack["continues"])
        if continues != (bool(offsets) and offsets[0] > 0) or any(o != 0 for o in offsets[1:]):
            raise ValueError(f"the pack says continues={continues} but its offsets are {offsets}; pass packs as "
                             "pack_stream yields them")
        carried = self.carried
        if continues != (carried is not None) or (continues and carried[0::2] != (documents[0], offsets[0])):
            want = "none" if carried is None else f"document {carried[0]} from token {carried[2]}"
            got = f"document {documents[0]} from token {offsets[0]}" if continues else "none"
            raise ValueError(f"the pack continues {got} but the carried state is {want}; feed one rank's packs "
                             "in order, each once (DataLoader batch_size=None, shuffle off), or call reset() first")
        end = offsets[-1] + real[-1] - real[-2] if documents else 0
        return documents, [end], varlen

    def __call__(self, pack: dict) -> dict:
        """``{"logits" [1, T, V], "loss"}`` of one pack; the loss is the mean cross-entropy on
        ``pack["targets"]`` (a carried piece's last token predicts the next piece's first); zero
        with a zero gradient for a pack without targets (a padding pack)."""
        documents, (end,), varlen = self._check(pack)
        keep = [self.carried[1]] if self.carried is not None else []
        free = [s for s in range(self.cache.capacity) if s not in keep]
        fresh = free[:len(documents) - len(keep)]
        slots = keep + fresh
        if fresh:
            self.cache.reset(fresh)
        if documents:
            out = self.model(pack["input_ids"], packed_seq_params=varlen, cache=self.cache, cache_slots=slots)
        else:                                                            # a padding pack: no document, no slot
            out = self.model(pack["input_ids"], packed_seq_params=varlen)
        logits = out["logits"]
        loss = next_token_loss(logits, pack["targets"].to(logits.device))
        self.carried = (documents[-1], slots[-1], end) if pack["continued"] else None
        return {"logits": logits, "loss": loss}

    def state_dict(self) -> dict:
        """``{"carried": None}``, or with a carried document ``{"carried": (document, slot, next
        offset), "length": tokens its slot holds, "states": [{name: CPU tensor}] per mixer}``."""
        if self.carried is None:
            return {"carried": None}
        slot = self.carried[1]
        return {"carried": tuple(self.carried), "length": int(self.cache.table.lengths[slot]),
                "states": [{name: state[slot].detach().to("cpu", copy=True) for name, state in layer.states.items()}
                           for layer in self.cache.layers]}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output (every slot is reset, the carried one written back).
        Everything is checked first: a bad ``state`` raises ``ValueError`` / ``TypeError`` and
        leaves the states untouched."""
        carried = self._check_state(state)
        self.cache.reset()
        self.carried = None
        if carried is None:
            return
        slot = carried[1]
        for layer, saved in zip(self.cache.layers, state["states"]):
            for name, value in saved.items():
                layer.states[name][slot].copy_(value)
        self.cache.table.lengths[slot] = state["length"]
        self.carried = carried

    def _check_state(self, state) -> tuple[int, int, int] | None:
        """The carried tuple of a valid ``state`` for this cache (see :meth:`load_state_dict`)."""
        fix = "pass the dict CarriedStates.state_dict() returned for a model of the same configuration"
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict from CarriedStates.state_dict(), got {describe(state)}")
        carried = state.get("carried")
        keys = {"carried"} if carried is None else set(_STATE_KEYS)
        if set(state) != keys:
            raise ValueError(f"state has keys {sorted(state)} but a state with carried={carried!r} has "
                             f"{sorted(keys)}; {fix}")
        if carried is None:
            return None
        if (not isinstance(carried, (tuple, list)) or len(carried) != 3
                or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in carried)):
            raise ValueError(f"state['carried'] must be (document, slot, offset) of ints >= 0, got {carried!r}; {fix}")
        slot, length = carried[1], state["length"]
        if slot >= self.cache.capacity:
            raise ValueError(f"state['carried'] names slot {slot} but this cache has {self.cache.capacity} slots; "
                             f"build CarriedStates with max_documents >= {slot}")
        if isinstance(length, bool) or not isinstance(length, int) or not 1 <= length <= self.cache.max_seqlen:
            raise ValueError(f"state['length'] must be an int in 1..{self.cache.max_seqlen} (max_document_tokens), "
                             f"got {length!r}; build CarriedStates with max_document_tokens >= {length!r}")
        saved = state["states"]
        if not isinstance(saved, (list, tuple)) or len(saved) != len(self.cache.layers):
            got = len(saved) if isinstance(saved, (list, tuple)) else describe(saved)
            raise ValueError(f"state['states'] must hold one dict per mixer ({len(self.cache.layers)}), got {got}; "
                             f"{fix}")
        for i, (layer, names) in enumerate(zip(self.cache.layers, saved)):
            if not isinstance(names, dict) or set(names) != set(layer.states):
                got = sorted(names) if isinstance(names, dict) else describe(names)
                raise ValueError(f"state['states'][{i}] must hold {sorted(layer.states)} ({layer.owner_name}), "
                                 f"got {got}; {fix}")
            for name, value in names.items():
                want = layer.states[name]
                if (not isinstance(value, torch.Tensor) or value.shape != want.shape[1:]
                        or value.dtype != want.dtype):
                    raise ValueError(f"state['states'][{i}][{name!r}] must be a {want.dtype} tensor of shape "
                                     f"{tuple(want.shape[1:])}, got {describe(value)}; {fix}")
        return tuple(carried)
