"""``rg_lru``: Griffin's real-gated linear recurrent unit (RecurrentGemma's RG-LRU), packed.

    B = rows, T = tokens, D = channels (RecurrentGemma's ``lru_width``), N = documents

No upstream kernel has this op; its arguments are RecurrentGemma's tensors: the input ``x`` (the
convolution's output), the two gates' pre-activations (``gate_x``: input gate, ``gate_a``:
recurrence gate; the layer computes them with its block-diagonal linears) and the decay
parameter ``recurrent_param`` (``Λ``: ``a = sigmoid(-Λ)``), with fla's conventions for states
and documents (``initial_state``, ``output_final_state``, ``cu_seqlens``; returns
``(out, final_state)``). The recurrence is :mod:`.naive`'s.

A sequence start resets: the first token of every row (without ``cu_seqlens``) or document
(with it; and of the padding tail) is not decayed into and its input is not normalised, as
RecurrentGemma does where ``position_ids == 0``. ``continues`` (keyword-only, ``[B or N]``
bool) names the rows / documents that instead continue a state (their ``initial_state`` row,
zero where none is given): their first token is an ordinary step. Its default: every row /
document when ``initial_state`` is given, none otherwise.

Backends: fla's ``fused_recurrent_hgrn`` (:mod:`.kernel`: the gates computed here, the recurrence with
its per-document resets and states in fla's Triton kernel) on CUDA when fla is installed, else the
torch backend (:mod:`.reference`, a segmented parallel scan), the one route on CPU and for fp64.
Context parallelism (``cu_seqlens`` a CP :class:`ssm_pack.VarlenBatch`): :mod:`.cp`.
"""

from __future__ import annotations

from .. import dispatch
from ..common.autocast import outside_autocast
from ..common.empty import no_tokens
from ._validate import RGLRUCall, checked_call
from .kernel import fla_kernel, unsupported
from .reference import rg_lru_reference

__all__ = ["rg_lru"]


def _run(call: RGLRUCall):
    """Context parallelism (:mod:`.cp`), else fla's kernel or the torch backend (one backend choice)."""
    if call.varlen is not None and call.varlen.cp is not None:
        from .cp import rg_lru_cp
        return rg_lru_cp(call, rg_lru)
    features = dispatch.backward_of(call.x, call.gate_x, call.gate_a, call.recurrent_param, call.initial_state)
    choice = dispatch.select_backend("rg_lru", call.backend, on_cuda=dispatch.is_cuda(call.x),
                                     support_state=lambda: dispatch.cached_support("fla_hgrn", features),
                                     missing_feature=unsupported(call))
    if choice == "kernel" and not no_tokens(call.x.shape[0], call.x.shape[1]):
        return fla_kernel(call)
    return rg_lru_reference(call)


@outside_autocast
def rg_lru(x, gate_x, gate_a, recurrent_param, *, scale=8.0, initial_state=None, output_final_state=False,
           cu_seqlens=None, continues=None, backend="auto"):
    """The RG-LRU over packed rows, restarting at every document.

    Args:
        x: ``[B, T, D]`` input; gate_x, gate_a: ``[B, T, D]`` input and recurrence gate
            pre-activations; recurrent_param: ``[D]`` (``a = sigmoid(-recurrent_param)``).
        scale: the exponent constant ``c`` of ``a_t = a^(c r_t)`` (8.0 in Griffin / RecurrentGemma).
        initial_state: ``[B, D]`` per row, or ``[N, D]`` per document with ``cu_seqlens``.
        output_final_state: also return the state after each row / document (``[B or N, D]``).
        cu_seqlens: ``[N+1]`` document boundaries (``B == 1``) or a prebuilt :class:`ssm_pack.VarlenBatch`.
        continues: ``[B or N]`` bool, which rows / documents continue a state (module docstring).
        backend: ``"auto"`` (fla's kernel on CUDA when it can run, else the torch backend), ``"kernel"``
            (fla's, or raise) or ``"reference"`` (the torch backend).

    Returns:
        ``(out [B, T, D] in x's dtype, final_state)``; ``final_state`` is ``None`` unless asked for,
        else ``[B or N, D]`` in the compute dtype (fp32 for half inputs, as RecurrentGemma keeps it).
    """
    return _run(checked_call(x, gate_x, gate_a, recurrent_param, scale=scale, initial_state=initial_state,
                             continues=continues, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                             backend=backend))
