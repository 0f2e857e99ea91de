"""PyTorch's ``varlen_attn`` as the first attention kernel, against a strict fake per signature form.

    T = packed tokens, Hq / Hk = query / key-value heads, D = head dim

Each fake has exactly the signature of one form of ``torch.nn.attention.varlen.varlen_attn``
and refuses what upstream refuses (torch/nn/attention/varlen.py: ``Hq != Hk`` without
``enable_gqa``, causal only as the tuple ``(-1, 0)``; aten's flash forward: fp16 / bf16, equal
dtypes, int32 boundaries covering every token, a contiguous last dim, ``max_q`` at least the
longest document); it computes with the reference. A call the form cannot express must not reach
it: ``auto`` takes the next kernel (here: none, so the reference), ``kernel`` raises.
"""

import inspect

import pytest
import torch

from mixers.ops import dispatch, varlen_attention
from mixers.ops.attention import kernel as flash_kernel
from mixers.ops.attention import kernel_torch as tv
from ssm_pack import lengths_to_cu_seqlens

LENGTHS = [5, 0, 9, 1]          # an empty and a 1-token document; the 4-token tail is one more segment
TOTAL = 19


def _flash_checks(q, k, v, cu_q, cu_k, max_q, max_k):
    """aten ``_flash_attention_forward``'s input checks (varlen path)."""
    if q.dtype not in (torch.float16, torch.bfloat16) or not (q.dtype == k.dtype == v.dtype):
        raise RuntimeError(f"FlashAttention only supports fp16 and bf16 with equal dtypes, got {q.dtype, k.dtype}")
    if cu_q.dtype != torch.int32 or cu_k.dtype != torch.int32:
        raise RuntimeError("cu_seqlens_q and cu_seqlens_k must be int32")
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        raise RuntimeError("Input tensor must have contiguous last dimension")
    if int(cu_q[-1]) != q.shape[0] or int(cu_k[-1]) != k.shape[0] or int(cu_q[0]) != 0:
        raise RuntimeError(f"cu_seqlens must cover every token: {cu_q.tolist()} for T={q.shape[0]}")
    if max_q < int((cu_q[1:] - cu_q[:-1]).max()) or max_k < int((cu_k[1:] - cu_k[:-1]).max()):
        raise RuntimeError("max_q / max_k below the longest document")


def _reference(q, k, v, cu, max_q, causal, window, scale):
    return varlen_attention(q, k, v, cu, max_q, causal=causal, window_size=window, softmax_scale=scale,
                            backend="reference")


def fake_2_10(calls):
    """torch 2.10: positional is_causal, no scale, no window, no GQA."""
    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        _flash_checks(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)
        if query.shape[1] != key.shape[1]:
            raise RuntimeError(f"torch 2.10 varlen_attn: Hq={query.shape[1]} != Hkv={key.shape[1]}")
        calls.append(dict(is_causal=is_causal, heads=key.shape[1]))
        return _reference(query, key, value, cu_seq_q, max_q, bool(is_causal), None, None)
    return varlen_attn


def _keyword_form(calls, gqa: bool):
    def body(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size, enable_gqa):
        _flash_checks(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)
        if not isinstance(window_size, tuple) or len(window_size) != 2:
            raise ValueError(f"window_size must be a (left, right) tuple, got {window_size!r}")
        hq, hk = query.shape[1], key.shape[1]
        if (not enable_gqa and hq != hk) or hq % hk:
            raise ValueError(f"Expect query and key/value to have the same number of heads but got Hq={hq} "
                             f"and Hkv={hk}. Try setting enable_gqa=True for GQA.")
        calls.append(dict(window_size=window_size, scale=scale, enable_gqa=enable_gqa, heads=hk))
        causal = window_size[1] == 0          # (-1, 0) causal, (W, 0) causal sliding window
        return _reference(query, key, value, cu_seq_q, max_q, causal, window_size, scale)

    if gqa:
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                        window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
            return body(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size, enable_gqa)
    else:
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                        window_size=(-1, -1)):
            return body(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size, False)
    return varlen_attn


FORMS = {"2.10-is_causal": fake_2_10, "window-no-gqa": lambda calls: _keyword_form(calls, False),
         "window-and-gqa": lambda calls: _keyword_form(calls, True)}


@pytest.fixture
def cuda_with(monkeypatch):
    """Pretend CUDA, install the fake ``form``, and say which kernels are installed."""
    def install(form, kernels=("torch_varlen",)):
        calls = {"torch": [], "flash": []}
        monkeypatch.setattr(dispatch, "is_cuda", lambda t: True)
        monkeypatch.setattr(tv, "on_cuda", lambda t: True)
        monkeypatch.setattr(tv, "load_upstream", lambda: FORMS[form](calls["torch"]))

        def flash(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False, window_size=(-1, -1)):
            calls["flash"].append(window_size)
            return _reference(q, k, v, cu_q, max_q, causal, window_size, softmax_scale)
        monkeypatch.setattr(flash_kernel, "load_upstream", lambda: flash)
        monkeypatch.setattr(dispatch, "cached_support", lambda name, features=(): (
            (True, None) if name in kernels else (False, f"{name} is not installed")))
        return calls
    return install


def inputs(hq=4, hk=4, d=8):
    torch.manual_seed(0)
    return [torch.randn(TOTAL, h, d, dtype=torch.bfloat16, requires_grad=True) for h in (hq, hk, hk)]


# (kwargs, heads (hq, hk), which forms can run it)
CASES = [
    pytest.param(dict(), (4, 4), set(FORMS), id="causal"),
    pytest.param(dict(causal=False), (4, 4), set(FORMS), id="not-causal"),
    pytest.param(dict(window_size=(3, 0)), (4, 4), {"window-no-gqa", "window-and-gqa"}, id="causal-window-3"),
    pytest.param(dict(causal=False, window_size=(2, 2)), (4, 4), {"window-no-gqa", "window-and-gqa"},
                 id="two-sided-window"),
    pytest.param(dict(), (4, 2), set(FORMS), id="gqa-4-over-2"),
    pytest.param(dict(softmax_scale=0.3), (4, 4), {"window-no-gqa", "window-and-gqa"}, id="scale-0.3"),
]


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("kwargs, heads, runs_on", CASES)
def test_each_form_runs_what_it_can_and_equals_the_reference(cuda_with, form, kwargs, heads, runs_on):
    calls = cuda_with(form)
    q, k, v = inputs(*heads)
    cu = lengths_to_cu_seqlens(LENGTHS)
    out = varlen_attention(q, k, v, cu, 9, **kwargs)
    want = varlen_attention(q, k, v, cu, 9, **kwargs, backend="reference")
    assert len(calls["torch"]) == (1 if form in runs_on else 0), calls
    torch.testing.assert_close(out, want, rtol=0, atol=1e-2)
    g = torch.randn_like(out)
    got_grads = torch.autograd.grad(out, (q, k, v), g)
    want_grads = torch.autograd.grad(want, (q, k, v), g)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-2)
    if form in runs_on and heads[0] != heads[1]:
        # a form without enable_gqa gets the key/value heads repeated; one with it, the grouped heads
        assert calls["torch"][0]["heads"] == (heads[1] if form == "window-and-gqa" else heads[0])


def test_auto_prefers_torch_varlen_to_flash_attn(cuda_with):
    calls = cuda_with("window-and-gqa", kernels=("torch_varlen", "flash_attn"))
    q, k, v = inputs()
    varlen_attention(q, k, v, lengths_to_cu_seqlens(LENGTHS), 9, window_size=(3, 0))
    assert len(calls["torch"]) == 1 and calls["flash"] == []
    assert calls["torch"][0]["window_size"] == (3, 0)


def test_a_form_without_windows_hands_the_window_to_flash_attn(cuda_with):
    calls = cuda_with("2.10-is_causal", kernels=("torch_varlen", "flash_attn"))
    q, k, v = inputs()
    varlen_attention(q, k, v, lengths_to_cu_seqlens(LENGTHS), 9, window_size=(3, 0))
    assert calls["torch"] == [] and calls["flash"] == [(3, 0)]


def test_kernel_backend_refuses_what_no_installed_kernel_can_do(cuda_with):
    cuda_with("2.10-is_causal")
    q, k, v = inputs()
    with pytest.raises(RuntimeError, match=r"PyTorch's varlen_attn cannot do sliding window \(3, 0\)"):
        varlen_attention(q, k, v, lengths_to_cu_seqlens(LENGTHS), 9, window_size=(3, 0), backend="kernel")


def test_cpu_tensors_never_reach_torch_varlen(monkeypatch):
    # the interpreter lane and pretend-CUDA tests say is_cuda, but torch's kernel needs a real device
    calls = []
    monkeypatch.setattr(dispatch, "is_cuda", lambda t: True)
    monkeypatch.setattr(dispatch, "cached_support", lambda name, features=(): (name == "torch_varlen", "no"))
    monkeypatch.setattr(tv, "load_upstream", lambda: FORMS["window-and-gqa"](calls))
    q, k, v = inputs()
    varlen_attention(q, k, v, lengths_to_cu_seqlens(LENGTHS), 9)
    assert calls == []


@pytest.mark.parametrize("form", list(FORMS))
def test_the_fakes_refuse_what_upstream_refuses(form):
    fn = FORMS[form]([])
    q, k, v = (t.detach() for t in inputs(4, 2))
    cu = torch.tensor([0, 5, 5, 14, 15, TOTAL], dtype=torch.int32)
    with pytest.raises((RuntimeError, ValueError), match="heads|Hq"):
        fn(q, k, v, cu, cu, 9, 9)                                              # GQA without enable_gqa
    q, k, v = (t.detach() for t in inputs())
    with pytest.raises(RuntimeError, match="int32"):
        fn(q, k, v, cu.long(), cu.long(), 9, 9)
    with pytest.raises(RuntimeError, match="fp16 and bf16"):
        fn(q.float(), k.float(), v.float(), cu, cu, 9, 9)
    with pytest.raises(RuntimeError, match="longest"):
        fn(q, k, v, cu, cu, 4, 4)
    if form != "2.10-is_causal":
        with pytest.raises(ValueError, match="tuple"):
            fn(q, k, v, cu, cu, 9, 9, window_size=[-1, 0])


def test_the_installed_torch_form_is_read_from_its_signature():
    fn = tv.load_upstream()
    if fn is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    params = inspect.signature(fn).parameters
    assert tv.form_of(fn) == tv.VarlenForm(is_causal="is_causal" in params, window="window_size" in params,
                                           gqa="enable_gqa" in params, scale="scale" in params)
    assert {name: tv.form_of(make([])) for name, make in FORMS.items()} == {
        "2.10-is_causal": tv.VarlenForm(is_causal=True, window=False, gqa=False, scale=False),
        "window-no-gqa": tv.VarlenForm(is_causal=False, window=True, gqa=False, scale=True),
        "window-and-gqa": tv.VarlenForm(is_causal=False, window=True, gqa=True, scale=True)}
    assert tv.form_of(lambda q, k, v, cu_q, cu_k, max_q, max_k: q) is None
