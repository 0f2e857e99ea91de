"""The training documents: each source kind read from a tiny file, tokenized as bytes or by a local
Hugging Face tokenizer, refused with the path / key and the fix, and packed and resumed by
``ssm_pack.pack_stream``."""

from __future__ import annotations

import json

import pytest
import torch

from mixers.training.config import DataConfig
from mixers.training.data import Corpus, check_vocab, load_corpus
from ssm_pack import pack_stream

TEXTS = ["the first document, longer than the others " * 3, "a second one", "third: é and ü", "4", "fifth " * 9]


def _write(tmp_path, kind: str) -> list[str]:
    """``TEXTS`` as files of ``kind``; the ``data.files`` entries naming them."""
    if kind == "txt":
        for i, text in enumerate(TEXTS):
            (tmp_path / f"doc{i}.{'md' if i % 2 else 'txt'}").write_text(text, encoding="utf-8")
        return [str(tmp_path / "*.txt"), str(tmp_path / "*.md")]
    if kind == "jsonl":
        head, tail = TEXTS[:2], TEXTS[2:]
        (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(head)))
        (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in tail) + "\n\n")
        return [str(tmp_path / "*.jsonl")]
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": TEXTS[:3], "n": [1, 2, 3]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": TEXTS[3:]}), tmp_path / "b.parquet")
    return [str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")]


def _order(kind: str) -> list[str]:
    if kind == "txt":                # the *.txt glob first (doc0, doc2, doc4), then *.md
        return [TEXTS[0], TEXTS[2], TEXTS[4], TEXTS[1], TEXTS[3]]
    return TEXTS


def _as_bytes(documents) -> list[bytes]:
    return [bytes(documents[i]) for i in range(len(documents))]


@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet"])
def test_files_are_read_as_utf8_bytes_one_document_each(tmp_path, kind):
    corpus = load_corpus(DataConfig(files=_write(tmp_path, kind)))
    assert isinstance(corpus, Corpus) and corpus.vocab_size == 256 and corpus.pad_token_id == 0
    assert _as_bytes(corpus.documents) == [t.encode("utf-8") for t in _order(kind)]
    assert _as_bytes(corpus.documents) == _as_bytes(corpus.documents)          # stable across reads
    assert "5 documents" in corpus.description and "bytes" in corpus.description


def test_mixed_kinds_keep_the_listed_order(tmp_path):
    (tmp_path / "a.txt").write_text("plain")
    (tmp_path / "b.jsonl").write_text(json.dumps({"body": "json one"}) + "\n" + json.dumps({"body": "two"}) + "\n")
    corpus = load_corpus(DataConfig(files=[str(tmp_path / "b.jsonl"), str(tmp_path / "a.txt")], text_field="body"))
    assert _as_bytes(corpus.documents) == [b"json one", b"two", b"plain"]


def _dataset(tmp_path, splits: bool = False) -> str:
    datasets = pytest.importorskip("datasets")
    pa = pytest.importorskip("pyarrow")
    from datasets.table import InMemoryTable

    # a fingerprint given, not hashed from the table (datasets' hashing fails on some pyarrow versions)
    table = InMemoryTable(pa.table({"text": TEXTS, "n": list(range(len(TEXTS)))}))
    data = datasets.Dataset(table, fingerprint=f"test-{splits}")
    if splits:
        data = datasets.DatasetDict({"train": data})
    data.save_to_disk(str(tmp_path / "ds"))
    return str(tmp_path / "ds")


def test_a_map_style_dataset_is_indexable(tmp_path):
    corpus = load_corpus(DataConfig(dataset=_dataset(tmp_path)))
    assert len(corpus.documents) == len(TEXTS) and corpus.documents[-1] == TEXTS[-1].encode()
    assert _as_bytes(corpus.documents) == [t.encode() for t in TEXTS]
    assert isinstance(corpus.documents._fingerprint, str)            # pack_stream's resume check reads it


def test_a_streaming_dataset_is_re_iterable(tmp_path):
    corpus = load_corpus(DataConfig(dataset=_dataset(tmp_path), streaming=True))
    assert not hasattr(corpus.documents, "__len__")
    first, second = list(corpus.documents), list(corpus.documents)
    assert first == second == [t.encode() for t in TEXTS]


def test_neither_source_is_the_embedded_corpus():
    corpus = load_corpus(DataConfig())
    assert len(corpus.documents) > 100 and all(isinstance(d, bytes) for d in corpus.documents[:50])
    assert corpus.vocab_size == 256 and "standard-library docstrings" in corpus.description
    assert corpus.description.endswith("; bytes"), f"byte-level tokens are named so: {corpus.description!r}"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A tiny word-level tokenizer saved offline (``tokenizers`` + ``transformers``)."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    words = sorted({w for t in TEXTS for w in t.replace(",", " ").replace(":", " ").split()})
    vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=model, pad_token="[PAD]", unk_token="[UNK]",
                                                eos_token="[PAD]")
    path = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(str(path))
    return str(path), fast, len(vocab)


@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet"])
def test_a_local_tokenizer_gives_its_ids_and_vocabulary(tmp_path, tokenizer_dir, kind):
    path, fast, size = tokenizer_dir
    corpus = load_corpus(DataConfig(files=_write(tmp_path, kind), tokenizer=path))
    assert corpus.vocab_size == size and path in corpus.description
    for i, text in enumerate(_order(kind)):
        ids = corpus.documents[i]
        assert ids.dtype == torch.int64 and ids.dim() == 1
        assert ids.tolist() == fast(text, add_special_tokens=False)["input_ids"]       # nothing appended


def test_the_embedded_corpus_through_a_tokenizer(tokenizer_dir):
    path, _, size = tokenizer_dir
    corpus = load_corpus(DataConfig(tokenizer=path))
    assert corpus.vocab_size == size and corpus.documents[0].dtype == torch.int64 and len(corpus.documents) > 100


REFUSALS = [
    pytest.param(lambda p: DataConfig(files=[str(p / "none.txt")]), r"data\.files entry .*none\.txt' is not a file",
                 id="missing-file"),
    pytest.param(lambda p: DataConfig(files=[str(p / "*.txt")]), r"data\.files entry .*\*\.txt' matches no file",
                 id="empty-glob"),
    pytest.param(lambda p: DataConfig(files=[str(p / "x.csv")]), r"x\.csv' is none of .*\.jsonl", id="suffix"),
    pytest.param(lambda p: DataConfig(files=[str(p / "x.jsonl")], text_field="body"),
                 r"x\.jsonl:2 has no key data\.text_field='body' .*set data\.text_field", id="jsonl-field"),
    pytest.param(lambda p: DataConfig(files=[str(p / "bad.jsonl")]), r"bad\.jsonl:1 is not a JSON object",
                 id="jsonl-broken"),
    pytest.param(lambda p: DataConfig(files=[str(p / "num.jsonl")]), r"num\.jsonl:1: 'text' holds int, not text",
                 id="jsonl-not-text"),
    pytest.param(lambda p: DataConfig(files=[str(p / "blank.jsonl")]), r"data\.files=.*hold no document",
                 id="no-documents"),
    pytest.param(lambda p: DataConfig(files=["a"], dataset="b"), r"both set; keep one", id="two-sources"),
    pytest.param(lambda p: DataConfig(streaming=True), r"data\.streaming=true .*data\.dataset", id="stream-no-ds"),
    pytest.param(lambda p: DataConfig(tokenizer=str(p / "none")), r"data\.tokenizer=.*none' is not a directory",
                 id="tokenizer"),
]


@pytest.mark.parametrize("make,message", REFUSALS)
def test_a_bad_source_is_refused_naming_path_key_and_fix(tmp_path, make, message):
    (tmp_path / "x.csv").write_text("a,b\n")
    (tmp_path / "x.jsonl").write_text(json.dumps({"body": "ok"}) + "\n" + json.dumps({"text": "no body"}) + "\n")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    (tmp_path / "num.jsonl").write_text('{"text": 3}\n')
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    with pytest.raises(ValueError, match=message):
        load_corpus(make(tmp_path))


def test_a_parquet_file_without_the_column_is_refused(tmp_path):
    _write(tmp_path, "parquet")
    with pytest.raises(ValueError, match=r"b\.parquet has no column data\.text_field='n'"):
        load_corpus(DataConfig(files=[str(tmp_path / "*.parquet")], text_field="n"))


@pytest.mark.parametrize("splits,field,message", [
    pytest.param(False, "body", r"no column data\.text_field='body' .*set data\.text_field", id="field"),
    pytest.param(True, "text", r"holds the splits \['train'\]; point data\.dataset at one split", id="splits"),
])
def test_a_bad_dataset_is_refused(tmp_path, splits, field, message):
    with pytest.raises(ValueError, match=message):
        load_corpus(DataConfig(dataset=_dataset(tmp_path, splits), text_field=field))


@pytest.mark.parametrize("name", [pytest.param("missing", id="missing"), pytest.param("x.arrow", id="a-file")])
def test_a_dataset_that_is_not_a_folder_is_refused(tmp_path, name):
    pytest.importorskip("datasets")
    (tmp_path / "x.arrow").write_bytes(b"not a dataset folder")
    with pytest.raises(ValueError, match=rf"data\.dataset=.*{name}' is not a directory; .*Dataset\.save_to_disk"):
        load_corpus(DataConfig(dataset=str(tmp_path / name)))


def test_parquet_without_pyarrow_names_the_install(tmp_path, monkeypatch):
    (tmp_path / "a.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(__import__("sys").modules, "pyarrow", None)
    monkeypatch.setitem(__import__("sys").modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match="pip install pyarrow"):
        load_corpus(DataConfig(files=[str(tmp_path / "a.parquet")]))


@pytest.mark.parametrize("model_vocab,used", [pytest.param(0, 256, id="tokenizer's"),
                                              pytest.param(300, 300, id="larger")])
def test_check_vocab_takes_zero_or_a_larger_vocabulary(model_vocab, used):
    assert check_vocab(model_vocab, Corpus([b"x"], 256, "bytes")) == used


@pytest.mark.parametrize("model_vocab,message", [
    pytest.param(100, r"model\.vocab_size=100 is smaller than the tokenizer's vocabulary 256.*model\.vocab_size=0",
                 id="smaller"),
    pytest.param(-1, r"model\.vocab_size must be an int >= 0, got -1", id="negative"),
])
def test_check_vocab_refuses_a_smaller_vocabulary(model_vocab, message):
    with pytest.raises(ValueError, match=message):
        check_vocab(model_vocab, Corpus([b"x"], 256, "bytes"))


def _run(stream, count=None) -> list[torch.Tensor]:
    packs = []
    for pack in stream:
        packs.append(pack["input_ids"].clone())
        if count is not None and len(packs) == count:
            break
    return packs


@pytest.mark.parametrize("tokenizer", [pytest.param(False, id="bytes"), pytest.param(True, id="tokenizer")])
@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet"])
def test_pack_stream_packs_and_resumes_the_documents(tmp_path, tokenizer_dir, kind, tokenizer):
    data = DataConfig(files=_write(tmp_path, kind), tokenizer=tokenizer_dir[0] if tokenizer else "")
    max_tokens = 16 if tokenizer else 24
    whole = _run(pack_stream(load_corpus(data).documents, max_tokens, seed=5, lookahead=2))
    assert len(whole) >= 4
    stream = pack_stream(load_corpus(data).documents, max_tokens, seed=5, lookahead=2)
    head = _run(stream, 2)
    state = stream.state_dict()
    resumed = pack_stream(load_corpus(data).documents, max_tokens, seed=5, lookahead=2)    # a fresh process
    resumed.load_state_dict(state)
    tail = _run(resumed)
    assert len(head) + len(tail) == len(whole)
    assert all(torch.equal(a, b) for a, b in zip(head + tail, whole))
    other = _run(pack_stream(load_corpus(data).documents, max_tokens, seed=6, lookahead=2))
    assert any(not torch.equal(a, b) for a, b in zip(other, whole))            # the seed shuffles by index


def test_pack_stream_resumes_a_dataset(tmp_path):
    documents = load_corpus(DataConfig(dataset=_dataset(tmp_path))).documents
    stream = pack_stream(documents, 24, seed=1, lookahead=2)
    whole = _run(pack_stream(documents, 24, seed=1, lookahead=2))
    head = _run(stream, 2)
    resumed = pack_stream(load_corpus(DataConfig(dataset=str(tmp_path / "ds"))).documents, 24, seed=1, lookahead=2)
    resumed.load_state_dict(stream.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(head + _run(resumed), whole))


@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet"])
def test_the_documents_survive_pickling_for_dataloader_workers(tmp_path, tokenizer_dir, kind):
    import pickle

    documents = load_corpus(DataConfig(files=_write(tmp_path, kind), tokenizer=tokenizer_dir[0])).documents
    copy = pickle.loads(pickle.dumps(documents))
    assert len(copy) == len(documents) and all(torch.equal(copy[i], documents[i]) for i in range(len(documents)))
