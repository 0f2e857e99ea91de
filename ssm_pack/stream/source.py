"""Reading the documents of :func:`ssm_pack.pack_stream`: lengths first, tokens only when packed.

    L = tokens of one document

A document is a 1-D sequence of token ids: a list or tuple of ints, an integer tensor or numpy
array, or ``bytes`` (byte-level tokens). Planning needs only its length (:func:`document_length`,
a type check and ``len``); its tokens are converted and checked when the pack that holds it is
built (:func:`document_tokens`). A source is read in order, or, when it is indexable (``len``
and ``__getitem__``: a list, a tensor of rows, a Hugging Face ``datasets`` column), in a seeded
permutation per epoch; a resumed pass re-reads it up to where the saved one stopped.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..checks import describe, is_numpy_array

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
_CHECKSUM_MOD = (1 << 61) - 1


_SIZED = (bytes, list, tuple, bytearray)       # their len() is the length; ids are checked when packed


def document_length(index: int, doc) -> int:
    """Tokens of ``doc`` (``documents[index]``), read without converting it."""
    if type(doc) in _SIZED:
        return len(doc)
    if isinstance(doc, torch.Tensor):
        if doc.dim() != 1:
            raise ValueError(f"documents[{index}] must be a 1-D sequence of token ids, got a tensor of shape "
                             f"{tuple(doc.shape)}; pass one document per item")
        if doc.dtype not in _INT_DTYPES:
            raise TypeError(f"documents[{index}] must hold integer token ids, got dtype {doc.dtype}; "
                            "tokenize first or convert with .long()")
        return doc.shape[0]
    if is_numpy_array(doc):
        if doc.ndim != 1 or doc.dtype.kind not in "iu":
            raise TypeError(f"documents[{index}] must be a 1-D integer array, got dtype {doc.dtype} shape "
                            f"{doc.shape}")
        return int(doc.shape[0])
    if isinstance(doc, str):
        raise TypeError(f"documents[{index}] is a str ({doc[:40]!r}...); pack token ids: tokenize the text first "
                        "(or pass its UTF-8 bytes for byte-level tokens)")
    if isinstance(doc, Mapping):
        raise TypeError(f"documents[{index}] is a mapping with keys {sorted(doc)[:5]}; pass one column of token ids "
                        "(e.g. dataset['input_ids'], or (row['input_ids'] for row in dataset))")
    try:
        return len(doc)
    except TypeError:
        raise TypeError(f"documents[{index}] must be a sequence of token ids with a length (list, tuple, tensor, "
                        f"numpy array, bytes), got {describe(doc)}") from None


def document_tokens(index: int, doc) -> torch.Tensor:
    """``[L]`` int64 token ids of ``doc``; non-integer ids are refused by index (negative ones by
    :func:`check_token_ids`, once per pack)."""
    if isinstance(doc, torch.Tensor):
        if doc.dtype == torch.int64 and doc.device.type == "cpu" and not doc.requires_grad:
            return doc
        return doc.detach().to("cpu", torch.int64)
    if isinstance(doc, (bytes, bytearray, memoryview)):
        return torch.frombuffer(bytearray(doc), dtype=torch.uint8).to(torch.int64)
    try:
        tokens = torch.as_tensor(doc)
    except (TypeError, ValueError, RuntimeError, OverflowError) as err:
        raise TypeError(f"documents[{index}] must hold integer token ids, got {describe(doc)} ({err})") from None
    if tokens.dtype not in _INT_DTYPES or tokens.dim() != 1:
        bad = next((v for v in doc if isinstance(v, bool) or not isinstance(v, int)), None) \
            if isinstance(doc, (list, tuple)) else None
        shown = f"element {bad!r}" if bad is not None else f"dtype {tokens.dtype} shape {tuple(tokens.shape)}"
        raise TypeError(f"documents[{index}] must be a 1-D sequence of integer token ids, got {shown}")
    return tokens.to(torch.int64)


def check_token_ids(row: torch.Tensor, pieces: list[torch.Tensor], indices: list[int]) -> None:
    """No negative id in a pack (one ``min`` over its row, whose padding id is >= 0); the culprit
    document is named by index."""
    if int(row.min()) >= 0:
        return
    for tokens, index in zip(pieces, indices):
        if int(tokens.min()) < 0:
            raise ValueError(f"documents[{index}] holds a negative token id {int(tokens.min())}; token ids must "
                             "be >= 0")


def is_indexable(documents) -> bool:
    """Random access by position (``len`` and ``__getitem__``), not a mapping or a string."""
    kind = type(documents)
    return (hasattr(kind, "__len__") and hasattr(kind, "__getitem__")
            and not isinstance(documents, (Mapping, str, bytes, bytearray)))


def fingerprint(documents) -> dict:
    """What identifies a source without reading it: its type, its length if it has one, and the
    ``_fingerprint`` a Hugging Face dataset carries."""
    found = {"type": type(documents).__name__}
    if is_indexable(documents):
        found["length"] = len(documents)
    hf = getattr(documents, "_fingerprint", None)
    if isinstance(hf, str):
        found["fingerprint"] = hf
    return found


def checksum(previous: int, length: int) -> int:
    """Running checksum of the lengths read so far (order-sensitive)."""
    return (previous * 1_000_003 + length + 1) % _CHECKSUM_MOD


class Source:
    """One pass over ``documents``: ``(source index, document)`` pairs from position ``start`` on.

    Indexable sources are visited in ``order`` (a permutation or ``range``); others in iteration
    order, the prefix before ``start`` re-read and the documents listed in ``keep`` held for the
    caller. The prefix's lengths are checked against ``prefix_checksum`` for iterables, lists and
    tuples (a dataset's rows are not read again).
    """

    def __init__(self, documents, *, seed: int | None, epoch: int):
        self.documents = documents
        self.indexable = is_indexable(documents)
        self.order = None
        if self.indexable and seed is not None:
            generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
            self.order = torch.randperm(len(documents), generator=generator).tolist()
        self.iterator = None
        self.position = 0

    def open(self, start: int, keep: set[int], prefix_checksum: int | None) -> dict[int, object]:
        """Position the pass at ``start`` and return the documents of ``keep`` by source index."""
        self.position = start
        if self.indexable:
            self.iterator = None
            kept = {i: self.documents[i] for i in sorted(keep)}
            if not isinstance(self.documents, (list, tuple)):    # a dataset's rows are not read again
                return kept
            check = 0
            for i in (range(start) if self.order is None else self.order[:start]):
                check = checksum(check, document_length(i, self.documents[i]))
        else:
            self.iterator = iter(self.documents)
            kept, check = {}, 0
            for i in range(start):
                try:
                    doc = next(self.iterator)
                except StopIteration:
                    raise ValueError(f"load_state_dict: the state was saved after {start} documents but documents "
                                     f"holds only {i}; resume with the same documents") from None
                if i in keep:
                    kept[i] = doc
                check = checksum(check, document_length(i, doc))
        if prefix_checksum is not None and check != prefix_checksum:
            raise ValueError("load_state_dict: the first documents differ from the ones the state was saved with "
                             "(their lengths do not match); resume with the same documents in the same order")
        return kept

    def next(self):
        """``(source index, document)`` or ``None`` when the pass is over."""
        if self.indexable:
            if self.position >= len(self.documents):
                return None
            index = self.position if self.order is None else self.order[self.position]
            self.position += 1
            return index, self.documents[index]
        if self.iterator is None:
            self.iterator = iter(self.documents)
        try:
            doc = next(self.iterator)
        except StopIteration:
            return None
        self.position += 1
        return self.position - 1, doc
