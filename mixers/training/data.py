"""The training documents and their tokenizer: what :func:`ssm_pack.pack_stream` packs.

    [data] files / dataset / neither (the embedded corpus), tokenizer "" (bytes) or a local directory

:func:`load_corpus` opens the source named by a :class:`~mixers.training.config.DataConfig` and
returns a :class:`Corpus`. Files and map-style datasets give an indexable sequence (``len`` and
``__getitem__``) whose items are tokenized when read, so ``pack_stream`` shuffles them by seed and
resumes them by index, and an item reads the same every time (its length is stable across calls);
a streaming dataset gives a re-iterable. Tokens are the text's UTF-8 bytes (vocabulary 256) or a
Hugging Face tokenizer's ids (no special tokens added).
"""

from __future__ import annotations

import bisect
import glob
import json
import os
from dataclasses import dataclass

import torch

from .config import DataConfig, check_data_source

TEXT_SUFFIXES = (".txt", ".md")
SUFFIXES = (*TEXT_SUFFIXES, ".jsonl", ".parquet")


@dataclass
class Corpus:
    documents: object        # what pack_stream takes: an indexable of 1-D int64 tensors / bytes, or a re-iterable
    vocab_size: int          # the tokenizer's vocabulary (256 for bytes)
    description: str         # one line: source, documents (if known), tokens/bytes (if known)
    pad_token_id: int = 0


# ------------------------------------------------------------------ tokenizers
class ByteEncoder:
    """Text to its UTF-8 bytes (byte-level tokens, vocabulary 256)."""

    vocab_size = 256
    pad_token_id = 0
    unit = "bytes"

    def __call__(self, text: str | bytes) -> bytes:
        return text if isinstance(text, bytes) else text.encode("utf-8")


class HFEncoder:
    """Text to a Hugging Face tokenizer's ids (``[L]`` int64), special tokens left out."""

    unit = "tokens"

    def __init__(self, path: str):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ImportError(f"data.tokenizer={path!r} needs transformers: pip install transformers (or set "
                              'data.tokenizer="" for byte-level tokens)') from None
        if not os.path.isdir(path):
            raise ValueError(f"data.tokenizer={path!r} is not a directory; point it at a local tokenizer folder "
                             '(save_pretrained) or set data.tokenizer="" for byte-level tokens')
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.vocab_size = len(self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = 0 if pad is None else int(pad)

    def __call__(self, text: str | bytes) -> torch.Tensor:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return torch.tensor(ids, dtype=torch.int64)


def make_encoder(tokenizer: str):
    """The encoder of ``data.tokenizer``: bytes for ``""``, else the local Hugging Face tokenizer."""
    return ByteEncoder() if tokenizer == "" else HFEncoder(tokenizer)


# ------------------------------------------------------------------ text sources (indexable, lazy)
class Concatenated:
    """Several indexable sources read as one."""

    def __init__(self, parts: list):
        self.parts, self.starts = parts, [0]
        for part in parts:
            self.starts.append(self.starts[-1] + len(part))

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, i: int):
        part = bisect.bisect_right(self.starts, i) - 1
        return self.parts[part][i - self.starts[part]]


class TextFiles:
    """One document per file (its bytes; decoded by the encoder when it needs text)."""

    def __init__(self, paths: list[str]):
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> bytes:
        with open(self.paths[i], "rb") as handle:
            return handle.read()


class JsonlLines:
    """One document per line of ``.jsonl`` files: the ``field`` of each line's object. Every line is
    read and checked once here; items are read again by their byte offset."""

    def __init__(self, paths: list[str], field: str):
        self.field, self.where = field, []           # (path, byte offset, line number)
        for path in paths:
            offset = 0
            with open(path, "rb") as handle:
                for number, line in enumerate(handle, start=1):
                    if line.strip():
                        self._text(line, path, number)
                        self.where.append((path, offset, number))
                    offset += len(line)

    def _text(self, line: bytes, path: str, number: int) -> str:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number} is not a JSON object ({err}); fix the line (data.files)") from None
        if not isinstance(row, dict) or self.field not in row:
            keys = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise ValueError(f"{path}:{number} has no key data.text_field={self.field!r} (it has {keys}); set "
                             "data.text_field to the key holding the text")
        if not isinstance(row[self.field], str):
            raise ValueError(f"{path}:{number}: {self.field!r} holds {type(row[self.field]).__name__}, not text; "
                             "set data.text_field to the key holding the text")
        return row[self.field]

    def __len__(self) -> int:
        return len(self.where)

    def __getitem__(self, i: int) -> str:
        path, offset, number = self.where[i]
        with open(path, "rb") as handle:
            handle.seek(offset)
            return self._text(handle.readline(), path, number)


class ParquetColumns:
    """One document per row of ``.parquet`` files: the ``field`` column (read with pyarrow)."""

    def __init__(self, paths: list[str], field: str):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError(f"data.files {paths[0]!r} is parquet, read with pyarrow: pip install pyarrow") from None
        columns = []
        for path in paths:
            names = pq.read_schema(path).names
            if field not in names:
                raise ValueError(f"{path} has no column data.text_field={field!r} (it has {names}); set "
                                 "data.text_field to the column holding the text")
            columns.append(pq.read_table(path, columns=[field]).column(field))
        self.rows, self.field = Concatenated(columns), field

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> str:
        text = self.rows[i].as_py()
        if not isinstance(text, str):
            raise ValueError(f"parquet row {i} of data.files holds {text!r} in {self.field!r}, not text; drop or "
                             "fill such rows, or set data.text_field to the text column")
        return text


class Tokenized:
    """``texts[i]`` tokenized when read: an indexable source for ``pack_stream`` (``len`` and
    ``__getitem__``), the same tokens on every read."""

    def __init__(self, texts, encode, fingerprint: str | None = None):
        self.texts, self.encode = texts, encode
        if fingerprint is not None:
            self._fingerprint = fingerprint          # pack_stream's resume check reads it

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, i: int):
        if isinstance(i, bool) or not isinstance(i, int):
            raise TypeError(f"documents[{i!r}]: index by one int")
        if not -len(self) <= i < len(self):
            raise IndexError(f"documents[{i}] out of range for {len(self)} documents")
        try:
            return self.encode(self.texts[i % len(self)])
        except UnicodeDecodeError as err:
            raise ValueError(f"documents[{i}] is not UTF-8 text ({err}); fix the file's encoding or use "
                             'data.tokenizer="" (bytes)') from None


class TokenizedStream:
    """A streaming dataset's ``field`` tokenized as it is read; re-iterable (each ``iter`` starts over)."""

    def __init__(self, dataset, field: str, encode):
        self.dataset, self.field, self.encode = dataset, field, encode

    def __iter__(self):
        for row in self.dataset:
            yield self.encode(row[self.field])


# ------------------------------------------------------------------ sources
def expand_files(entries: list[str]) -> list[str]:
    """``data.files`` as paths: each glob's matches sorted, in the order of the entries, each path once."""
    paths: list[str] = []
    for entry in entries:
        if glob.has_magic(entry):
            found = sorted(p for p in glob.glob(entry, recursive=True) if os.path.isfile(p))
            if not found:
                raise ValueError(f"data.files entry {entry!r} matches no file; fix the glob or the working folder")
        elif os.path.isfile(entry):
            found = [entry]
        else:
            raise ValueError(f"data.files entry {entry!r} is not a file; fix the path")
        for path in found:
            if not path.endswith(SUFFIXES):
                raise ValueError(f"data.files: {path!r} is none of {SUFFIXES}; list only text, jsonl or parquet "
                                 "files (or narrow the glob)")
            if path not in paths:
                paths.append(path)
    return paths


def _from_files(data: DataConfig, encode) -> tuple[object, str]:
    paths = expand_files(data.files)
    parts, kinds = [], []                     # consecutive files of one kind read together, in order
    for path in paths:
        kind = ".txt" if path.endswith(TEXT_SUFFIXES) else os.path.splitext(path)[1]
        if kinds and kinds[-1][0] == kind:
            kinds[-1][1].append(path)
        else:
            kinds.append((kind, [path]))
    for kind, group in kinds:
        if kind == ".txt":
            parts.append(TextFiles(group))
        elif kind == ".jsonl":
            parts.append(JsonlLines(group, data.text_field))
        else:
            parts.append(ParquetColumns(group, data.text_field))
    texts = parts[0] if len(parts) == 1 else Concatenated(parts)
    if len(texts) == 0:
        raise ValueError(f"data.files={data.files!r} hold no document (only blank lines or empty tables); add "
                         "documents or fix the paths")
    size = sum(os.path.getsize(p) for p in paths)
    return Tokenized(texts, encode), f"{len(paths)} file(s) of data.files, {len(texts)} documents, {size} bytes on disk"


def _from_dataset(data: DataConfig, encode) -> tuple[object, str]:
    try:
        import datasets
    except ImportError:
        raise ImportError(f"data.dataset={data.dataset!r} is read with datasets: pip install datasets") from None
    if not os.path.isdir(data.dataset):
        raise ValueError(f"data.dataset={data.dataset!r} is not a directory; point it at a folder written by "
                         "Dataset.save_to_disk")
    found = datasets.load_from_disk(data.dataset)
    if isinstance(found, datasets.DatasetDict):
        raise ValueError(f"data.dataset={data.dataset!r} holds the splits {sorted(found)}; point data.dataset at "
                         f"one split's folder (e.g. {os.path.join(data.dataset, sorted(found)[0])!r})")
    if data.text_field not in found.column_names:
        raise ValueError(f"data.dataset={data.dataset!r} has no column data.text_field={data.text_field!r} (it has "
                         f"{found.column_names}); set data.text_field to the column holding the text")
    where = f"dataset {data.dataset}"
    if data.streaming:
        stream = found.select_columns([data.text_field]).to_iterable_dataset()
        return TokenizedStream(stream, data.text_field, encode), f"{where} (streaming), {len(found)} documents"
    column = _Column(found, data.text_field)
    return Tokenized(column, encode, fingerprint=found._fingerprint), f"{where}, {len(found)} documents"


class _Column:
    """One text column of a map-style dataset, read row by row."""

    def __init__(self, dataset, field: str):
        self.dataset, self.field = dataset, field

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> str:
        text = self.dataset[i][self.field]
        if not isinstance(text, str):
            raise ValueError(f"row {i} of data.dataset holds {text!r} in {self.field!r}, not text; filter such rows "
                             "out or set data.text_field to the text column")
        return text


def _embedded(encode) -> tuple[object, str]:
    from ..demo.corpus import load_documents

    texts = load_documents(1 << 62, max_bytes=1 << 62)
    documents = texts if isinstance(encode, ByteEncoder) else Tokenized(texts, encode)
    return documents, (f"the embedded corpus: {len(texts)} standard-library docstrings, "
                       f"{sum(map(len, texts))} bytes")


def load_corpus(data: DataConfig) -> Corpus:
    """The documents ``data`` names (``files``, else ``dataset``, else the embedded corpus) and
    the vocabulary of its tokenizer."""
    check_data_source(data)
    encode = make_encoder(data.tokenizer)
    if data.files:
        documents, source = _from_files(data, encode)
    elif data.dataset:
        documents, source = _from_dataset(data, encode)
    else:
        documents, source = _embedded(encode)
    tokens = "bytes" if data.tokenizer == "" else f"tokenizer {data.tokenizer} ({encode.vocab_size} ids)"
    return Corpus(documents, encode.vocab_size, f"{source}; {tokens}", encode.pad_token_id)


def check_vocab(model_vocab: int, corpus: Corpus) -> int:
    """The model's vocabulary: ``model.vocab_size`` (0: the tokenizer's); one smaller than the
    tokenizer's is refused, naming both."""
    if isinstance(model_vocab, bool) or not isinstance(model_vocab, int) or model_vocab < 0:
        raise ValueError(f"model.vocab_size must be an int >= 0, got {model_vocab!r}; set 0 for the tokenizer's")
    if model_vocab == 0:
        return corpus.vocab_size
    if model_vocab < corpus.vocab_size:
        raise ValueError(f"model.vocab_size={model_vocab} is smaller than the tokenizer's vocabulary "
                         f"{corpus.vocab_size} ({corpus.description}); set model.vocab_size=0 (the tokenizer's) or "
                         f">= {corpus.vocab_size}")
    return model_vocab
