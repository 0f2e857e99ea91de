"""Helpers for the pack_stream tests: corpora and reading documents back out of packs."""

import random

import torch


def corpus(n: int, *, seed: int = 0, longest: int = 40, empty: int = 0, long: tuple[int, ...] = ()) -> list:
    """``n`` random documents of 1..``longest`` tokens, ``empty`` empty ones and the ``long`` lengths,
    shuffled deterministically; ids from a counter so every token is distinct."""
    rng = random.Random(seed)
    lengths = [rng.randint(1, longest) for _ in range(n)] + [0] * empty + list(long)
    rng.shuffle(lengths)
    docs, start = [], 1
    for length in lengths:
        docs.append(torch.arange(start, start + length))
        start += length
    return docs


def real_tokens(pack: dict) -> list[torch.Tensor]:
    """The pieces' tokens of one pack, read from the row at the boundaries its metadata gives."""
    params = pack["packed_seq_params"]
    starts, lengths = params.cu_seqlens.tolist()[:-1], params.lengths().tolist()
    return [pack["input_ids"][0, s:s + n] for s, n in zip(starts, lengths)]


def pieces_of(packs: list[dict]) -> dict[int, list[tuple[int, torch.Tensor]]]:
    """``{document: [(offset, tokens), ...]}`` read back from the packs' rows and metadata."""
    found: dict[int, list] = {}
    for pack in packs:
        pieces = zip(pack["documents"].tolist(), pack["offsets"].tolist(), real_tokens(pack), strict=True)
        for doc, offset, tokens in pieces:
            found.setdefault(doc, []).append((offset, tokens))
    return found


def documents_of(packs: list[dict]) -> dict[int, torch.Tensor]:
    """Each document reassembled from its pieces (in offset order; pieces must tile it)."""
    out = {}
    for doc, pieces in pieces_of(packs).items():
        pieces.sort(key=lambda item: item[0])
        at = 0
        for offset, tokens in pieces:
            assert offset == at, f"document {doc}: piece at {offset}, expected {at}"
            at += tokens.shape[0]
        out[doc] = torch.cat([tokens for _, tokens in pieces])
    return out


def same_packs(a: list[dict], b: list[dict]) -> bool:
    """Equal rows, metadata and boundaries, pack by pack."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        for key in ("input_ids", "labels", "targets", "position_ids", "documents", "offsets"):
            if not torch.equal(x[key], y[key]):
                return False
        if (x["continues"], x["continued"], x["pack_index"]) != (y["continues"], y["continued"], y["pack_index"]):
            return False
        if not torch.equal(x["packed_seq_params"].cu_seqlens, y["packed_seq_params"].cu_seqlens):
            return False
    return True
