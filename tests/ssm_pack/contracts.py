"""The contract of the public entry points, as code: bad inputs each must refuse, and properties
any input must satisfy (a clear refusal, or the oracle's result with nothing else changed).

An outcome is ``clear`` (a ``ValueError`` / ``TypeError`` naming the argument), ``ok`` (no
error, and the result equals the oracle), ``obscure`` (another exception, or a message that
names no argument), ``silent`` (accepted with a result the oracle rejects, or accepted where
a refusal is due) or ``hang`` (no answer within the time limit). Used by
``tests/ssm_pack/test_contract_properties.py``, ``tests/ssm_pack/test_error_corpus.py`` and the
``python -m tests.ssm_pack.error_corpus`` report.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Callable

import torch
from hypothesis import strategies as st

import ssm_pack as sp

VERDICTS = ("clear", "ok", "obscure", "silent", "hang")


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang


def outcome(fn: Callable, names: tuple[str, ...], oracle: Callable | None = None, *, seconds: int = 20) -> str:
    """The verdict of ``fn()`` (see the module docstring); ``oracle(result) -> bool`` for an accepted call,
    ``None`` where only a refusal is right; ``names``: what a clear message must mention (any one)."""
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(seconds)
    try:
        result = fn()
    except _Hang:
        return "hang"
    except (ValueError, TypeError) as err:
        return "clear" if any(name in str(err) for name in names) else "obscure"
    except Exception:                                   # noqa: BLE001 - any other exception is obscure
        return "obscure"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    if oracle is None:
        return "silent"
    return "ok" if oracle(result) else "silent"


# ----------------------------------------------------------------- properties
def _cu_oracle(lengths, total):
    def check(params):
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        want_total = cu[-1] if total is None else total
        return params.cu_seqlens_q.tolist() == cu and params.total_tokens == want_total \
            and params.seq_idx.shape == (1, want_total)
    return check


@st.composite
def lengths_case(draw):
    lengths = draw(st.lists(st.one_of(st.integers(0, 9), st.integers(-3, -1)), max_size=5))
    if draw(st.booleans()):                       # past int32 in total (each length fits)
        lengths += [2**31 - 1, draw(st.integers(1, 9))]
    total = draw(st.one_of(st.none(), st.integers(-2, 60)))
    return lengths, total


def from_lengths_verdict(case) -> str:
    """``PackedSeqParams.from_lengths``: any lengths and total_tokens."""
    lengths, total = case
    return outcome(lambda: sp.PackedSeqParams.from_lengths(lengths, total_tokens=total),
                   ("lengths", "total_tokens"), _cu_oracle(lengths, total))


_DOC = st.one_of(st.lists(st.integers(0, 50), max_size=12), st.just([]), st.just([1.5, 2]), st.just([3, -4]),
                 st.just("text"), st.lists(st.integers(0, 50), min_size=20, max_size=30))


@st.composite
def stream_case(draw):
    docs = draw(st.lists(_DOC, max_size=8))
    return docs, draw(st.sampled_from(["carry", "truncate", "refuse"])), draw(st.integers(1, 4))


def stream_verdict(case) -> str:
    """``pack_stream``: every document packed once in full (or truncated as counted), or a clear
    refusal after which every later call refuses too (nothing silently skipped)."""
    docs, split_long, lookahead = case
    stream = sp.pack_stream(docs, 16, split_long=split_long, lookahead=lookahead)
    packs: list = []

    def drain():
        for pack in stream:
            packs.append(pack)
        return packs

    def read_back(got) -> bool:
        found: dict[int, list[int]] = {}
        for pack in got:
            params = pack["packed_seq_params"]
            for d, start, n in zip(pack["documents"].tolist(), params.cu_seqlens.tolist(), params.lengths().tolist()):
                found.setdefault(d, []).extend(pack["input_ids"][0, start:start + n].tolist())
        want = {i: list(d)[:16] if split_long == "truncate" else list(d) for i, d in enumerate(docs) if len(d)}
        return found == want

    verdict = outcome(drain, ("documents[",), read_back)
    if verdict == "clear" and outcome(lambda: next(stream), ("stopped at a refused document",)) != "clear":
        return "silent"                                   # went on after a refusal
    return verdict


__all__ = ["VERDICTS", "Case", "from_lengths_verdict", "lengths_case", "outcome", "stream_case", "stream_verdict"]


@dataclass(frozen=True)
class Case:
    """A bad input of one entry point that must be refused naming one of ``names``."""

    id: str
    entry: str
    names: tuple[str, ...]
    call: Callable

    def verdict(self) -> str:
        return outcome(self.call, self.names)


def tensor(*values, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype)
