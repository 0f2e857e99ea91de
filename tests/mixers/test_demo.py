"""The main job runs end to end (tiny settings), prints everything docs/demo.md shows on stdout, and
reports every bad flag as one clear line before any work."""

import io
import json
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from mixers.cli import main as cli_main
from mixers.demo import build_parser, check_args, corpus, main
from mixers.demo.corpus import load_documents
from mixers.demo.plot import require_matplotlib, write_png
from mixers.demo.train import Progress, make_batches
from mixers.layers.registry import MIXERS

README = Path(__file__).resolve().parents[2] / "docs" / "demo.md"      # its sample output


def test_corpus_is_real_and_deterministic():
    docs = load_documents(50)
    assert len(docs) == 50 and docs == load_documents(50)
    assert all(24 <= len(d) <= 1024 for d in docs) and len(set(docs)) > 40


def _stdlib_of(tmp_path, monkeypatch, *docstrings):
    """A standard library of one file holding a function per docstring."""
    path = tmp_path / "lib.py"
    path.write_text("".join(f"def f{i}():\n    {d!r}\n" for i, d in enumerate(docstrings)), encoding="utf-8")
    monkeypatch.setattr(corpus, "stdlib_files", lambda: (path,))


def test_corpus_keeps_documents_of_24_bytes_and_cuts_at_1024(tmp_path, monkeypatch):
    _stdlib_of(tmp_path, monkeypatch, "x" * 23, "y" * 24, "z" * 1500, "w" * 25)
    assert load_documents(10) == [b"y" * 24, b"z" * 1024, b"w" * 25]


def test_corpus_without_docstrings_is_an_error_naming_the_folder(tmp_path, monkeypatch):
    _stdlib_of(tmp_path, monkeypatch, "too short")
    with pytest.raises(RuntimeError, match="found no docstrings under"):
        load_documents(10)


def test_demo_runs_on_one_stream_and_writes_its_outputs(tmp_path, capsys):
    # --max-tokens 100: documents longer than a pack are split across packs, their states carried
    code = cli_main(["demo", "--steps", "4", "--docs", "24", "--hidden", "32", "--max-tokens", "100",
                     "--pattern", "mgA", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.err == ""                       # `ssm-pack demo > log` keeps every line
    out = captured.out
    assert (tmp_path / "demo.png").stat().st_size > 10_000
    summary = json.loads((tmp_path / "demo.json").read_text())
    assert len(summary["losses"]) == 4 and summary["throughput"]["packed"] > 0
    assert "MGA hybrid" in out and "packs of 100 (pack_stream, best-fit)" in out
    assert summary["split_documents"] > 0 and summary["pieces_carried"] >= summary["split_documents"]
    assert (f"  carry:  {summary['split_documents']} documents longer than a pack split; {summary['pieces_carried']} "
            "pieces start from the state their previous piece left") in out
    for line in ("training: loss = mean cross-entropy", "step 4/4  loss", "tok/s", "loss:", "speed:",
                 "leaks:  none"):
        assert line in out
    # every kind of line the docs' sample output shows is printed, in the sample's order
    sample = README.read_text().split("```\nssm-pack demo: ", 1)[1].split("```", 1)[0].splitlines()
    labels = [re.match(r"\s*(\[|[a-z]+:?)", line).group(1) for line in sample[1:]]
    positions = [out.index("  " + label) for label in dict.fromkeys(labels)]
    assert len(labels) >= 8 and positions == sorted(positions)
    assert "(first step -> best of the last 5)" in out and "real tokens per second of a training step" in out


def test_demo_batches_hold_every_document_once_and_carry_the_long_ones():
    docs = load_documents(40, max_bytes=8192)
    batches, figures = make_batches(docs, 256, 8, "cpu")
    long = [i for i, d in enumerate(docs) if len(d) > 256]
    assert long and figures.split_documents == len(long) and figures.packs == len(batches)
    pieces = {}                                     # document -> its pieces' bytes, in stream order
    for b in batches:
        rows = b.padded_labels != -100
        assert b.input_ids.shape == (1, 256) and b.padded_ids.shape[1] == int(rows.sum(1).max())
        for row, (doc, offset) in enumerate(zip(b.pack["documents"].tolist(), b.pack["offsets"].tolist())):
            piece = bytes(b.padded_ids[row][rows[row]].tolist())
            assert len(b"".join(pieces.get(doc, []))) == offset
            pieces.setdefault(doc, []).append(piece)
    assert sorted(pieces) == list(range(len(docs)))
    assert all(b"".join(pieces[i]) == d for i, d in enumerate(docs))
    carried = sum(len(pieces[i]) - 1 for i in long)
    assert figures.pieces_carried == carried == sum(bool(b.pack["continues"]) for b in batches)
    assert figures.tokens == sum(map(len, docs)) and 0 < figures.padding_packed < figures.padding_padded


def test_demo_figures_count_the_documents_that_hold_tokens():
    docs = [b"a" * 40, b"", b"b" * 300, b"", b"c" * 17]
    _, figures = make_batches(docs, 256, 8, "cpu")
    assert figures.documents == 3 and figures.tokens == 357, figures
    assert figures.summary().startswith("3 documents, 357 tokens -> ")


class FakeClock:
    def __init__(self, durations):
        self.t, self.durations = 0.0, iter(durations)

    def __call__(self):
        value = self.t
        self.t += next(self.durations, 0.0)
        return value


class Log(io.StringIO):
    def isatty(self):
        return False


def test_progress_shows_the_recent_rate_not_the_average_since_step_one():
    # step 1 takes 10 s (warm-up), the next 11 take 0.1 s each, 100 tokens per step
    log = Log()
    progress = Progress(12, stream=log, clock=FakeClock([0.0, 10.0] + [0.1] * 11))
    for step in range(12):
        progress.step(loss=2.0 + step, tokens=100)
    lines = log.getvalue().splitlines()
    assert lines[0] == ("  training: loss = mean cross-entropy (nats per byte), tok/s = real tokens per second, "
                        "both over the last 2 steps")
    assert len(lines) == 1 + 6                              # a line every sixth of the run
    assert lines[-1].endswith("step 12/12  loss 12.500  1,000 tok/s")   # 200 tokens in 0.2 s; not 1200 / 11.1 s
    assert lines[1].endswith("step 2/12  loss 2.500  20 tok/s")         # the first window holds the warm-up


def test_progress_bar_is_as_wide_as_the_docs_show():
    sample = [line for line in README.read_text().splitlines() if line.startswith("  [")]
    width = len(sample[0].split("]")[0]) - len("  [")
    log = Log()
    progress = Progress(12, stream=log, clock=FakeClock([0.1] * 13))
    for step in range(12):
        progress.step(loss=1.0, tokens=10)
    bars = [line.split("]")[0] for line in log.getvalue().splitlines()[1:]]
    assert width == 28 and all(len(bar) == len("  [") + width for bar in bars), (width, bars)
    assert bars[-1] == "  [" + "#" * width


def test_progress_with_a_window_of_one_step_shows_each_step_alone():
    # 6 steps: a line per step, each over its own step; step 1 ends 5 s after the start, step 2 0.5 s later
    log = Log()
    progress = Progress(6, stream=log, clock=FakeClock([5.0, 0.5] + [0.25] * 5))
    for step in range(6):
        progress.step(loss=1.0 + step, tokens=100)
    lines = log.getvalue().splitlines()
    assert lines[0].endswith("both over the last 1 step") and len(lines) == 1 + 6
    assert lines[1].endswith("step 1/6  loss 1.000  20 tok/s")          # 100 tokens in 5 s
    assert lines[2].endswith("step 2/6  loss 2.000  200 tok/s"), lines[2]   # 100 tokens in 0.5 s, not in 5.5 s


def test_the_picture_is_written_into_a_new_folder_with_labelled_axes(tmp_path, monkeypatch):
    plt = require_matplotlib()
    from matplotlib.figure import Figure
    drawn, real_savefig = [], Figure.savefig

    def savefig(fig, *args, **kwargs):
        drawn.append([(ax.get_xlabel(), ax.get_ylabel(), ax.get_title()) for ax in fig.axes])
        return real_savefig(fig, *args, **kwargs)
    monkeypatch.setattr(Figure, "savefig", savefig)
    open_before = plt.get_fignums()
    path = tmp_path / "out" / "run 1" / "demo.png"
    assert write_png(path, [5.8, 4.9, 3.9, 3.2], {"packed": 433.0, "padded": 280.0}, "title") == path
    assert plt.get_fignums() == open_before, "the figure is closed once written"
    header = path.read_bytes()[:24]
    docs_picture = (README.parent / "demo-short.png").read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", header[16:24]) == struct.unpack(">II", docs_picture[16:24]) == (1210, 440)
    assert drawn == [[("step", "next-byte cross-entropy (nats)", "training loss (packed)"),
                      ("", "real tokens / s (forward + backward + step)", "training throughput")]]


@pytest.mark.parametrize("argv,ok", [
    pytest.param(["--docs", "4", "--max-tokens", "64"], True, id="smallest"),
    pytest.param(["--docs", "3"], False, id="docs-3"),
    pytest.param(["--max-tokens", "63"], False, id="max-tokens-63"),
])
def test_the_smallest_corpus_and_pack_are_accepted(argv, ok):
    args = build_parser().parse_args(argv)
    if ok:
        assert check_args(args).docs == int(argv[1])
    else:
        with pytest.raises(ValueError, match="need --steps >= 1, --hidden >= 16, --docs >= 4, --max-tokens >= 64"):
            check_args(args)


def test_python_m_mixers_demo_exits_with_the_demo_status(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mixers.demo", "--steps", "0", "--out", str(tmp_path)],
                          capture_output=True, text=True)
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("ssm-pack demo failed: ValueError: need --steps >= 1"), done.stderr


@pytest.mark.parametrize("argv,message", [
    pytest.param(["--steps", "0"], "need --steps >= 1", id="steps"),
    pytest.param(["--pattern", "MXZ"], "--pattern must be letters of MGKPACSRL (M Mamba2, G Gated DeltaNet, K KDA, "
                                       "P Gated DeltaProduct, A attention, C gated short conv, "
                                       "S Mamba-1 selective scan, R RG-LRU, L lightning attention; any case), "
                                       "got 'MXZ'",
                 id="pattern"),
    pytest.param(["--hidden", "30"], "--hidden 30: block 0 ('M', Mamba2Mixer) cannot be built: head_dim=16 must "
                                     "divide expand * hidden_size=60; sizes that work for pattern 'MGKPA' with these "
                                     "head sizes: --hidden 24 or --hidden 32; or keep --hidden 30 and change that "
                                     "block's head size (now 16): mixer_overrides={'M': {'head_dim': 15}}",
                 id="hidden"),
    pytest.param(["--device", "tpu"], "--device must be cpu, cuda or cuda:N, got 'tpu'", id="device-unknown"),
    pytest.param(["--device", "cuda"], "--device cuda but torch.cuda.is_available() is False", id="device-cuda"),
])
def test_bad_flags_fail_in_one_line_before_loading_the_corpus(tmp_path, capsys, monkeypatch, argv, message):
    import torch

    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")

    def corpus_loaded(*args, **kwargs):
        raise AssertionError("the corpus was loaded before the flags were checked")

    monkeypatch.setattr("mixers.demo.corpus.load_documents", corpus_loaded)
    assert main(argv + ["--out", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    err = captured.err
    assert err.startswith("ssm-pack demo failed: ValueError: " + message) and err.count("\n") == 1
    assert captured.out == ""


def test_pattern_accepts_lower_case():
    assert check_args(build_parser().parse_args(["--pattern", "mgkpa"])).pattern == "MGKPA"


def test_help_shows_defaults_and_no_markup(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "``" not in text
    for flag, default in (("--steps", "120"), ("--pattern", "MGKPA"), ("--hidden", "64"), ("--docs", "600"),
                          ("--max-tokens", "2048"), ("--device", "cpu"), ("--seed", "0"), ("--lr", "0.003"),
                          ("--out", "demo_out")):
        option = text[text.index(f"  {flag} "):]
        assert f"(default: {default})" in " ".join(option.split()[:40]), flag
    with pytest.raises(SystemExit):
        cli_main(["--help"])
    assert "``" not in capsys.readouterr().out


@pytest.mark.parametrize("letter", sorted(MIXERS))
def test_every_mixer_runs_in_the_demo_at_its_default_hidden_size(letter):
    """``ssm-pack demo --pattern X`` for each registered letter: the flags pass their checks and the
    demo's model (each mixer at its registry ``small=`` sizes) runs a packed forward and backward."""
    import torch

    from mixers import HybridLM
    from mixers.demo import mixer_overrides
    from ssm_pack import PackedSeqParams

    args = check_args(build_parser().parse_args(["--pattern", letter.lower()]))
    torch.manual_seed(0)
    model = HybridLM(256, args.hidden, args.pattern, mixer_overrides=mixer_overrides())
    ids = torch.randint(0, 256, (1, 24))
    loss = model(ids, packed_seq_params=PackedSeqParams.from_lengths([9, 15]), labels=ids)["loss"]
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters() if p.requires_grad)
