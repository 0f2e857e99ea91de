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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


class CarriedStates:
    """Per-document states kept between training steps (one rank's packs, in order).

    Args:
        model: a :class:`mixers.HybridLM`.
        max_documents: the most pieces one pack holds (one cache slot each, plus the carried one).
        max_document_tokens: the longest document (attention keeps its keys and values).
        dtype / device: of the cache (default: the model's).
    """

    def __init__(self, model, *, max_documents: int, max_document_tokens: int, dtype=None, device=None):
        for name, value in (("max_documents", max_documents), ("max_document_tokens", max_document_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.model = model
        self.max_documents = max_documents
        self.cache = model.allocate_inference_cache(max_documents + 1, max_document_tokens, dtype=dtype,
                                                    device=device)
        self.carried: tuple[int, int] | None = None      # (source index of the document, its slot)

    def reset(self) -> None:
        """Forget every state (a new epoch, or packs that do not follow the previous ones)."""
        self.cache.reset()
        self.carried = None

    def __call__(self, pack: dict) -> dict:
        """``{"logits" [1, T, V], "loss"}`` of one pack; the loss is the mean cross-entropy on
        ``pack["targets"]`` (a carried piece's last token predicts the next piece's first)."""
        documents = pack["documents"].tolist()
        params = pack["packed_seq_params"]
        if len(documents) > self.max_documents:
            raise ValueError(f"the pack holds {len(documents)} documents but CarriedStates was built with "
                             f"max_documents={self.max_documents}; raise max_documents")
        continues = bool(pack["continues"])
        if continues != (self.carried is not None) or (continues and self.carried[0] != documents[0]):
            want = "none" if self.carried is None else f"document {self.carried[0]}"
            got = f"document {documents[0]}" if continues else "none"
            raise ValueError(f"the pack continues {got} but the carried state is {want}; feed one rank's packs "
                             "in order (DataLoader batch_size=None, shuffle off) or call reset() first")
        keep = [self.carried[1]] if continues else []
        free = [s for s in range(self.cache.capacity) if s not in keep]
        fresh = free[:len(documents) - len(keep)]
        slots = keep + fresh
        if fresh:
            self.cache.reset(fresh)
        if documents:
            out = self.model(pack["input_ids"], packed_seq_params=params, cache=self.cache, cache_slots=slots)
        else:                                                            # a padding pack: no document, no slot
            out = self.model(pack["input_ids"], packed_seq_params=params)
        logits = out["logits"]
        targets = pack["targets"].to(logits.device)
        flat = logits.reshape(-1, logits.shape[-1])
        if flat.dtype in (torch.float16, torch.bfloat16):
            flat = flat.float()                                          # the loss in fp32, as HybridLM's
        if bool((targets != IGNORE_INDEX).any()):
            loss = F.cross_entropy(flat, targets.reshape(-1), ignore_index=IGNORE_INDEX)
        else:                                                            # a padding pack: nothing to predict
            loss = flat.sum() * 0
        self.carried = (documents[-1], slots[-1]) if pack["continued"] else None
        return {"logits": logits, "loss": loss}
