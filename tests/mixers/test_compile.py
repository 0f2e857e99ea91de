"""``torch.compile`` on the reference path, with the packing metadata built before the call.

* ``torch._dynamo.explain`` of every layer's packed forward and of ``HybridLM`` finds 0 graph
  breaks (no host read of a tensor value, no data-dependent shape, no ``torch.autograd.grad``
  inside an autograd function);
* ``fullgraph=True`` compiles forward and backward (``aot_eager``: AOTAutograd traces the
  hand-written backwards too), and the compiled outputs and gradients equal eager;
* a new document layout with the same number of tokens reuses the compiled graph: it recompiles
  only when a size the graph depends on changes (the number of segments, which the first
  recompile marks dynamic, and the attention key window, a power-of-two multiple of 128 tokens
  that follows the longest document).
"""

import pytest
import torch
import torch._dynamo as dynamo

from mixers import HybridLM
from ssm_pack import PackedSeqParams, VarlenBatch
from tests.mixers.layers.test_layers import HIDDEN, LAYERS

TRACEABLE = [pytest.param(n, id=n) for n in LAYERS]

OVERRIDES = {"M": {"head_dim": 16, "state_size": 8, "chunk_size": 16}, "G": {"head_dim": 8, "chunk_size": 16},
             "K": {"head_dim": 8, "chunk_size": 16}, "P": {"head_dim": 8, "chunk_size": 16}, "A": {"head_dim": 8}}
TOKENS = 70


def _varlen(lengths, tail=3):
    return VarlenBatch.build(PackedSeqParams.from_lengths(lengths, total_tokens=sum(lengths) + tail),
                             sum(lengths) + tail).materialize()


def _breaks(fn, *args) -> list[str]:
    explained = dynamo.explain(fn)(*args)
    return [r.reason.splitlines()[0] for r in explained.break_reasons]


@pytest.mark.parametrize("name", TRACEABLE)
def test_layer_forward_has_no_graph_break(name):
    torch.manual_seed(0)
    layer = LAYERS[name](backend="reference")
    varlen = _varlen([5, 0, 40, 22])
    assert _breaks(lambda x: layer(x, packed_seq_params=varlen), torch.randn(1, TOKENS, HIDDEN)) == []


def test_hybrid_forward_and_loss_have_no_graph_break():
    model = HybridLM(256, 32, "MGKPA", backend="reference", mixer_overrides=OVERRIDES)
    varlen = _varlen([5, 0, 40, 22])
    ids = torch.randint(0, 256, (1, TOKENS))
    assert _breaks(lambda ids: model(ids, packed_seq_params=varlen, labels=ids)["loss"], ids) == []


@pytest.mark.parametrize("name", TRACEABLE)
def test_fullgraph_compile_equals_eager(name):
    torch.manual_seed(0)
    layer = LAYERS[name](backend="reference").double()
    varlen = _varlen([5, 0, 40, 22])
    x = torch.randn(1, TOKENS, HIDDEN, dtype=torch.float64)
    dynamo.reset()              # one lambda code object for every layer: each layer would count as a recompile
    compiled = torch.compile(lambda x: layer(x, packed_seq_params=varlen), fullgraph=True, backend="aot_eager")
    runs = []
    for fn in (lambda x: layer(x, packed_seq_params=varlen), compiled):
        leaf = x.clone().requires_grad_()
        out = fn(leaf)
        grads = torch.autograd.grad(out.square().sum(), [leaf, *layer.parameters()])
        runs.append((out, grads))
    (eager, eager_grads), (got, got_grads) = runs
    assert (got - eager).abs().max() < 1e-10
    for a, b in zip(got_grads, eager_grads):
        assert (a - b).abs().max() < 1e-10


@pytest.mark.parametrize("name", TRACEABLE)
def test_new_layouts_reuse_the_compiled_graph(name):
    """Six layouts of 70 tokens: at most the recompiles the module docstring names."""
    torch.manual_seed(0)
    layer = LAYERS[name](backend="reference")
    dynamo.reset()
    counts = torch._dynamo.utils.counters
    counts.clear()
    compiled = torch.compile(lambda x, v: layer(x, packed_seq_params=v), backend="eager")
    x = torch.randn(1, TOKENS, HIDDEN)
    for lengths in ([5, 0, 40, 22], [30, 37], [1] * 67, [10, 20, 30, 7], [67], [2, 3, 60, 2]):
        compiled(x, _varlen(lengths))
    frames = counts["stats"]["unique_graphs"]
    assert frames <= 2, dict(counts["stats"])          # the first compile, and one making segments dynamic


def test_hybrid_without_delta_blocks_compiles_fullgraph():
    """Mamba2 and attention blocks, the model's embedding, norms, MLPs, head and packed loss."""
    torch.manual_seed(0)
    model = HybridLM(256, 32, "MA", backend="reference", mixer_overrides=OVERRIDES).double()
    varlen = _varlen([5, 0, 40, 22])
    ids = torch.randint(0, 256, (1, TOKENS))
    step = lambda: model(ids, packed_seq_params=varlen, labels=ids)["loss"]  # noqa: E731
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    eager_loss = step()
    eager = torch.autograd.grad(eager_loss, list(model.parameters()))
    got_loss = compiled()
    got = torch.autograd.grad(got_loss, list(model.parameters()))
    assert abs(float(got_loss) - float(eager_loss)) < 1e-12
    assert max(float((a - b).abs().max()) for a, b in zip(got, eager)) < 1e-10
