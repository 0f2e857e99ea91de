"""What the real upstream Triton kernels need to run on CPU under ``TRITON_INTERPRET=1``.

Tests only. Nothing here changes what a kernel computes: each shim fills a gap of Triton's CPU
interpreter (triton 3.9) or of an upstream package's import on a machine without CUDA. The
product side is one switch, ``SSM_PACK_TRITON_INTERPRET=1`` (``ssm_pack.support.installed.triton_interpreter``),
which the lane's fixtures set.

1. ``mamba_ssm`` package: its ``__init__`` imports the compiled ``selective_scan_cuda``, which a
   build without CUDA lacks, so ``import mamba_ssm.ops.triton.ssd_combined`` fails before any
   Triton code is reached. A package object with the real ``__path__`` in ``sys.modules`` lets
   the Triton submodules import; nothing else of mamba-ssm is used.
2. Support probe: for the same reason ssm-pack's check asks for that extension (on a real
   machine the import needs it). Under the shim of 1 it is not needed, so the lane's probe
   reports it present and ``import mamba_ssm`` (which the real probe tries) as working; every
   version check still reads the installed metadata, and
   causal-conv1d's extension is reported as it is (missing: its kernels are CUDA C++).
3. ``torch.cuda.device(index)`` and ``torch.cuda.get_device_properties``: mamba-ssm's wrappers
   enter the first around every launch, and its SSD backward reads the SM count to split the
   ``dB`` work over programs; a CPU-only torch has neither. A null context stands in for the
   first, an H100's 132 SMs for the second (at the lane's sizes that splits over every head of a
   group, as on that GPU, so the split path is exercised).
4. Autotuning: benchmarking configs needs a GPU driver; the interpreter has none. Every
   autotuned kernel keeps its first config (any config computes the same result).
5. Comparison results: the interpreter types ``a < b`` with the operands' dtype instead of
   int1, so a scalar comparison broadcast into a block mask becomes an int64 mask and
   ``tl.load`` rejects it ("mask has unsupported dtype"; fla's conv backward). Results are
   retyped to int1, as compiled Triton does.
6. Dynamic loop indices: compiled Triton makes the index of ``range``/``tl.range`` loops a
   tensor; the interpreter leaves a Python int, and fla calls ``i_t.to(tl.int64)``. The
   interpreter's source rewriter is extended to turn those indices into tensors
   (``tl.static_range`` indices stay ints, as compiled).
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import os
import sys
import types

ENABLED = ("mamba_package", "cuda_device", "autotune", "comparisons", "loop_indices")


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def lane(*packages: tuple[str, str]) -> list:
    """Marks of a lane test module: ``interpret``, and skipped unless ``TRITON_INTERPRET=1`` and
    every ``(import name, distribution)`` of ``packages`` is installed."""
    import pytest
    marks = [pytest.mark.interpret,
             pytest.mark.skipif(not interpreter_on(), reason="interpreter lane: run TRITON_INTERPRET=1 python -m "
                                                             "pytest -m interpret")]
    for module, dist in packages:
        marks.append(pytest.mark.skipif(not installed(module), reason=f"{dist} is not installed (the lane's "
                                                                      "packages: see docs/testing.md)"))
    return marks


def _mamba_package(undo):
    """1: ``mamba_ssm`` as a bare package (no ``__init__``, so no CUDA extension import)."""
    if "mamba_ssm" in sys.modules:
        return
    spec = importlib.util.find_spec("mamba_ssm")
    if spec is None:                  # not installed: its tests skip (their marks), the others still run
        return
    package = types.ModuleType("mamba_ssm")
    package.__path__ = list(spec.submodule_search_locations)
    package.__spec__ = spec
    sys.modules["mamba_ssm"] = package
    undo.append(lambda: [sys.modules.pop(name) for name in list(sys.modules)
                         if name == "mamba_ssm" or name.startswith("mamba_ssm.")])


def _set(undo, owner, name, value):
    original = getattr(owner, name)
    setattr(owner, name, value)
    undo.append(lambda: setattr(owner, name, original))


def _cuda_device(undo):
    """3: ``torch.cuda.device(index)`` as a null context, an H100's SM count."""
    import torch
    _set(undo, torch.cuda, "device", lambda *args, **kwargs: contextlib.nullcontext())
    properties = types.SimpleNamespace(name="Triton interpreter", multi_processor_count=132)
    _set(undo, torch.cuda, "get_device_properties", lambda *args, **kwargs: properties)


def _autotune(undo):
    """4: the first config of every autotuned kernel, never a benchmark."""
    from triton.runtime.autotuner import Autotuner
    prune = Autotuner.prune_configs
    _set(undo, Autotuner, "prune_configs", lambda self, kwargs: prune(self, kwargs)[:1])


def _comparisons(undo):
    """5: comparison results typed int1."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    def int1(compare):
        return lambda self, lhs, rhs: interpreter.TensorHandle(
            np.asarray(compare(self, lhs, rhs).data).astype(bool), tl.int1)
    for name in [n for n in vars(interpreter.InterpreterBuilder) if n.startswith(("create_icmp", "create_fcmp"))]:
        _set(undo, interpreter.InterpreterBuilder, name, int1(getattr(interpreter.InterpreterBuilder, name)))


def _loop_indices(undo):
    """6: ``for i in range(...)`` / ``tl.range(...)`` bodies start with ``i = i``, which the
    interpreter's rewriter turns into ``i = to_tensor(i)``."""
    from triton.runtime import interpreter

    class Rewriter(interpreter.ASTTransformer):
        def visit_For(self, node):
            node = self.generic_visit(node)
            call = node.iter
            dynamic = isinstance(call, ast.Call) and (
                (isinstance(call.func, ast.Name) and call.func.id == "range")
                or (isinstance(call.func, ast.Attribute) and call.func.attr == "range"))
            if dynamic and isinstance(node.target, ast.Name):
                index = node.target.id
                rebind = ast.Assign(targets=[ast.Name(id=index, ctx=ast.Store())],
                                    value=ast.Name(id=index, ctx=ast.Load()))
                node.body.insert(0, self.visit_Assign(rebind))
            return node

    _set(undo, interpreter.FunctionRewriter, "ast_transformer", Rewriter())
    interpreter.InterpretedFunction.rewritten_fn.clear()   # kernels rewritten before the shim
    undo.append(interpreter.InterpretedFunction.rewritten_fn.clear)


_SHIMS = {"mamba_package": _mamba_package, "cuda_device": _cuda_device, "autotune": _autotune,
          "comparisons": _comparisons, "loop_indices": _loop_indices}


def install(enabled=ENABLED):
    """Install the process-wide shims (1, 3-6); returns a function that removes them."""
    assert interpreter_on(), "the shims are for TRITON_INTERPRET=1 only"
    undo = []
    for name in enabled:
        _SHIMS[name](undo)

    def remove():
        while undo:
            undo.pop()()
    return remove


class LaneProbe:
    """2: ssm-pack's support probe with mamba-ssm's extension present (see the module docstring)."""

    def __init__(self, real):
        self.real = real

    def version(self, dist):
        return self.real.version(dist)

    def has_module(self, module):
        return module == "selective_scan_cuda" or self.real.has_module(module)

    def import_error(self, module):
        return None if module == "mamba_ssm" else self.real.import_error(module)   # shim 1 stands for it

    def cuda_available(self):
        return self.real.cuda_available()
