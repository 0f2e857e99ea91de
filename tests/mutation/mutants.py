"""The planted changes of the mutation check (see ``run.py``): each one is a small, realistic bug.

A mutant is one or more exact text edits (``file``, ``old``, ``new``; ``old`` must occur exactly
once in ``file``, or in one of several candidate files when code moves) in one ``area``, and the
test files that should catch it, run in this order with ``-x`` (put the most likely killers
first). A mutant no test catches is a hole in the suite.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Edit:
    file: str | tuple[str, ...]            # candidates: the one holding ``old`` exactly once is edited
    old: str
    new: str


@dataclass(frozen=True)
class Mutant:
    name: str
    area: str
    edits: tuple[Edit, ...]
    tests: tuple[str, ...]
    what: str


INFERENCE = "tests/mixers/inference"


def _inference(*files: str) -> tuple[str, ...]:
    return tuple(f"{INFERENCE}/{name}.py" for name in files)


CONTINUATION = _inference("test_continuation", "test_mixer_cache", "test_model_cache")
CACHE_WRITES = _inference("test_continuation", "test_cache_api", "test_mixer_cache", "test_model_cache")
GENERATION = _inference("test_sampling", "test_inference_api", "test_cache_api", "test_model_cache")
DECODE = _inference("test_mamba2_decode", "test_decode_ops", "test_continuation", "test_cache_api",
                    "test_mixer_cache")
SLOT_CHECKS = _inference("test_cache_api", "test_inference_api", "test_mixer_cache")
OLDER = _inference("test_model_cache", "test_mixer_cache", "test_decode_ops")
API, CONT, SAMPLE, CACHE, MAMBA = _inference("test_inference_api", "test_continuation", "test_sampling",
                                             "test_cache_api", "test_mamba2_decode")
VARLEN_TESTS = ("tests/ssm_pack/test_varlen.py", "tests/ssm_pack/test_metadata_hardening.py",
                "tests/ssm_pack/test_seq_idx.py")
CONVERTER_TESTS = tuple(f"tests/mixers/checkpoints/{name}.py" for name in (
    "test_upstream_layouts", "test_convert", "test_upstream_equality", "test_readme"))
HF_TESTS = tuple(f"tests/mixers/integrations/test_{name}.py" for name in (
    "transformers_packing", "transformers_attention", "hf_attention", "transformers_load"))


def _m(name, area, tests, what, *edits):
    return Mutant(name, area, tuple(Edit(*e) for e in edits), tuple(tests), what)


SLOTS = "mixers/inference/slots.py"
LAYER_CACHE = "mixers/inference/layer_cache.py"
GENERATE = "mixers/inference/generate.py"
CP_PREFILL_MODULE = "mixers/layers/cp_prefill.py"
CP_PREFILL = "tests/context_parallel/test_cp_prefill.py"
VARLEN = "ssm_pack/varlen.py"
MAMBA2_CKPT = "mixers/checkpoints/mamba2.py"
CACHED = "mixers/layers/cached.py"
SSD_UPDATE = "mixers/ops/ssd/update.py"
CONV_UPDATE = "mixers/ops/causal_conv1d/update.py"
KVCACHE = "mixers/ops/attention/update.py"
RECURRENT = "mixers/ops/delta_rule/step.py"

MUTANTS: tuple[Mutant, ...] = (
    # ------------------------------------------------------------------ inference
    _m("spread-off-by-one", "inference/slots", CONTINUATION,
       "a padded packed continuation writes each slot's initial state into the padding piece",
       (SLOTS, "return out.index_copy(0, self.state_rows, states)",
        "return out.index_copy(0, self.state_rows + 1, states)")),
    _m("pick-off-by-one", "inference/slots", CONTINUATION,
       "a padded packed call stores the padding piece's final state as the slot's state",
       (SLOTS, "states.index_select(0, self.state_rows)", "states.index_select(0, self.state_rows + 1)")),
    _m("layer-cache-write-no-detach", "inference/grad", CACHE_WRITES,
       "cached states keep their autograd graph",
       (LAYER_CACHE, "state.index_copy_(0, batch.slots, values.detach().to(state.dtype))",
        "state.index_copy_(0, batch.slots, values.to(state.dtype))")),
    _m("layer-cache-tokens-no-detach", "inference/grad", CACHE_WRITES,
       "cached keys / values keep their autograd graph",
       (LAYER_CACHE, "state[slots, positions] = values.detach().to(state.dtype)",
        "state[slots, positions] = values.to(state.dtype)")),
    _m("ssd-update-no-detach", "inference/grad", DECODE,
       "the SSD decode step stores its state with the graph",
       ("mixers/ops/ssd/update.py", "new = h.detach().to(state.dtype)", "new = h.to(state.dtype)")),
    _m("sampling-times-temperature", "inference/sampling", GENERATION,
       "sampling from softmax(logits * T) instead of softmax(logits / T)",
       (GENERATE, "(logits - logits.max()) / self.temperature", "(logits - logits.max()) * self.temperature")),
    _m("generate-ignores-cache", "inference/generate", GENERATION,
       "generate() allocates its own cache whatever cache= says",
       (GENERATE, "eos_token_id=eos_token_id, generator=generator, cache=cache)",
        "eos_token_id=eos_token_id, generator=generator, cache=None)")),
    _m("mamba2-decode-drops-dt-limit", "inference/decode", DECODE,
       "the Mamba2 decode step ignores the layer's dt_limit",
       ("mixers/layers/mamba2.py", "state_batch_indices=batch.slots, dt_limit=c.dt_limit, ",
        "state_batch_indices=batch.slots, ")),
    _m("bool-cache-slots-accepted", "inference/slots", SLOT_CHECKS,
       "a bool tensor passed as cache_slots is read as slots 0 / 1",
       (SLOTS, " or slots.dtype == torch.bool:", ":")),
    _m("cache-overflow-off-by-one", "inference/slots", SLOT_CHECKS,
       "a slot may hold one token more than max_seqlen",
       (SLOTS, "over = torch.nonzero(ends > self.max_seqlen)", "over = torch.nonzero(ends > self.max_seqlen + 1)")),
    _m("reset-keeps-states", "inference/cache", CACHE_WRITES,
       "cache.reset forgets the lengths but keeps the states",
       ("mixers/inference/cache.py", "            layer.clear(host)", "            pass")),
    _m("packed-positions-ignore-cache", "inference/slots", CONTINUATION,
       "a packed continuation restarts attention positions at 0",
       (SLOTS, "offset = self.starts_device[doc.clamp(max=len(self.host) - 1)] * (doc < len(self.host))",
        "offset = 0 * (doc < len(self.host))")),
    _m("reset-keeps-lengths", "inference/slots", (CACHE, *OLDER),
       "cache.reset clears the states but not the cached lengths",
       (SLOTS, "            self.lengths[host] = 0\n", "            pass\n")),
    _m("conv-update-no-detach", "inference/grad", (CONT, *OLDER),
       "the conv decode step stores its state with the graph",
       (CONV_UPDATE, "new = full[:, :, full.shape[2] - state_len:].detach().to(conv_state.dtype)",
        "new = full[:, :, full.shape[2] - state_len:].to(conv_state.dtype)")),
    _m("kvcache-append-no-detach", "inference/grad", (CONT, *OLDER),
       "keys / values appended to the KV cache keep their graph",
       (KVCACHE, "_append(call.k_cache, call.v_cache, k.detach(), call.v.detach(), index, lens)",
        "_append(call.k_cache, call.v_cache, k, call.v, index, lens)")),
    _m("sampling-no-max-shift", "inference/sampling", (SAMPLE, *OLDER),
       "softmax of the raw logits over T (overflows to nan for large logits / small T)",
       (GENERATE, "probs = torch.softmax((logits - logits.max()) / self.temperature, dim=-1)",
        "probs = torch.softmax(logits / self.temperature, dim=-1)")),
    _m("greedy-takes-argmin", "inference/sampling", (SAMPLE, *OLDER),
       "greedy decoding picks the least likely token",
       (GENERATE, "return int(torch.argmax(logits))", "return int(torch.argmin(logits))")),
    _m("generator-allocates-own-cache", "inference/generate", (SAMPLE, API, *OLDER),
       "the generator ignores its cache and allocates a fresh one of the same size",
       (GENERATE, "        cache = self.cache\n        if not isinstance(cache, InferenceCache):",
        "        cache = self.model.allocate_inference_cache(self.cache.capacity, self.cache.max_seqlen)\n"
        "        if not isinstance(cache, InferenceCache):")),
    _m("cache-checked-after-reset", "inference/generate", (API, SAMPLE, *OLDER),
       "a mismatched cache is reset (its contents lost) before it is refused",
       (GENERATE, '        cache.check(self.model, reference.dtype, reference.device, what="the model")\n',
        '        cache.reset()\n'
        '        cache.check(self.model, reference.dtype, reference.device, what="the model")\n')),
    _m("nan-temperature-accepted", "inference/generate", (API, SAMPLE, *OLDER),
       "temperature=nan (or inf) is accepted",
       (GENERATE, "if not math.isfinite(temperature) or temperature < 0:", "if temperature < 0:")),
    _m("inf-temperature-accepted", "inference/generate", (API, SAMPLE, *OLDER),
       "temperature=inf is accepted (nan still refused)",
       (GENERATE, "if not math.isfinite(temperature) or temperature < 0:",
        "if math.isnan(temperature) or temperature < 0:")),
    _m("max-batch-size-ignored", "inference/generate", (API, SAMPLE, *OLDER),
       "max_batch_size is ignored: every free slot is filled",
       (GENERATE, "return cache, cache.capacity if self.max_batch_size is None else self.max_batch_size",
        "return cache, cache.capacity")),
    _m("prompt-vocabulary-unchecked", "inference/generate", (API, *OLDER),
       "prompt token ids outside the vocabulary are not refused",
       (GENERATE, "    if vocab is not None and not all(0 <= t < vocab for t in tokens):", "    if False:")),
    _m("token-ids-unchecked", "inference/model", (API, *OLDER),
       "the model embeds out-of-range token ids without checking",
       ("mixers/model/hybrid.py", "        check_token_ids(input_ids, self.embed.num_embeddings)\n", "")),
    _m("cp-prefill-takes-padding", "inference/model", (API, *OLDER),
       "a context-parallel prefill accepts per-document padding",
       ("mixers/layers/cp_prefill.py", "    if padded is None:\n        return\n", "    return\n")),
    _m("mixer-cp-prefill-takes-padding", "inference/model", (API, *OLDER),
       "a mixer's context-parallel prefill accepts per-document padding",
       (CACHED, "        cp_prefill.refuse_unsupported(packed_seq_params, name)\n", "")),
    _m("cp-prefill-drops-received-states", "inference/cp-prefill", (CP_PREFILL,),
       "the cache's rank keeps its own zeros for documents another rank owns",
       (CP_PREFILL_MODULE, "            full.index_copy_(0, ", "            full.index_copy(0, ")),
    _m("cp-prefill-slots-unchecked", "inference/cp-prefill", (CP_PREFILL,),
       "ranks passing different cache_slots are not refused",
       (CP_PREFILL_MODULE, "    if any(s != host for s in slots):\n", "    if False:\n")),
    _m("cp-prefill-busy-slots", "inference/cp-prefill", (CP_PREFILL,),
       "a context-parallel prefill writes into slots that hold tokens",
       (CP_PREFILL_MODULE, "            if busy:\n", "            if False:\n")),
    _m("generate-resets-prefilled", "inference/generate", (*GENERATION, CP_PREFILL),
       "generate resets the slots it was told are prefilled",
       (GENERATE, "cache.reset([s for s in range(cache.capacity) if s not in kept])", "cache.reset()")),
    _m("allocate-ignores-dtype", "inference/cache", (CACHE, *OLDER),
       "allocate_inference_cache(dtype=...) allocates in the model's dtype",
       (CACHED, "        dtype = reference.dtype if dtype is None else dtype\n", "        dtype = reference.dtype\n")),
    _m("ssd-update-ignores-dt-limit", "inference/decode", (MAMBA, *OLDER),
       "the SSD decode op drops its dt_limit argument",
       (SSD_UPDATE, "dt = process_dt(call.dt, call.dt_bias, call.dt_softplus, call.dt_limit, compute)",
        "dt = process_dt(call.dt, call.dt_bias, call.dt_softplus, (0.0, float('inf')), compute)")),
    _m("ssd-update-skips-d", "inference/decode", (MAMBA, *OLDER),
       "the SSD decode step leaves out the D skip connection",
       (SSD_UPDATE, "        out = out + xc * call.D.to(compute)\n", "        out = out + 0 * call.D.to(compute)\n")),
    _m("delta-step-decays-after-update", "inference/decode", (CONT, *OLDER),
       "the delta-rule decode step applies the gate after the delta update",
       (RECURRENT, "state = _delta_update(_decay(state, g), k, v, beta)",
        "state = _decay(_delta_update(state, k, v, beta), g)")),
    _m("gdp-step-first-householder-only", "inference/decode", (CONT, *OLDER),
       "the DeltaProduct decode step applies only the first of its Householder products",
       (RECURRENT, "for j in range(k.shape[1]):", "for j in range(1):")),
    _m("delta-decode-from-zero-state", "inference/decode", (CONT, *OLDER),
       "delta-rule layers decode from a zero state instead of the cached one",
       ("mixers/layers/delta_base.py",
        "o, state = self.STEP(*args, initial_state=initial, **kwargs)",
        "o, state = self.STEP(*args, initial_state=None, **kwargs)")),
    _m("conv-update-state-shifted", "inference/decode", (CONT, *OLDER),
       "the conv decode step keeps a window shifted one token into the past",
       (CONV_UPDATE, "new = full[:, :, full.shape[2] - state_len:].detach()",
        "new = full[:, :, full.shape[2] - state_len - 1:-1].detach()")),
    _m("kvcache-window-off-by-one", "inference/decode", (CONT, *OLDER),
       "sliding-window attention over the KV cache drops its oldest key",
       (KVCACHE, "keep = keep & (key_pos >= query_pos[..., None] - left)",
        "keep = keep & (key_pos > query_pos[..., None] - left)")),
    _m("kvcache-chunk-not-causal", "inference/decode", (CONT, *OLDER),
       "a multi-token chunk over the KV cache sees its own future keys",
       (KVCACHE, "keep = keep & (key_pos <= query_pos[..., None]) if causal else keep", "keep = keep")),
    # ------------------------------------------------------------------ VarlenBatch
    _m("foreign-params-unvalidated", "varlen", VARLEN_TESTS,
       "Megatron-style params are no longer checked (decreasing boundaries pass)",
       (VARLEN, "if validate and not ours:", "if validate and ours:")),
    _m("real-tokens-ignore-padding", "varlen", VARLEN_TESTS,
       "real_tokens counts per-document padding as real",
       (VARLEN, "real = self.real_cu_seqlens.to(torch.int64)", "real = self.cu_seqlens.to(torch.int64)")),
    _m("max-seqlen-without-tail", "varlen", VARLEN_TESTS,
       "max_seqlen forgets the padding tail",
       (VARLEN, "0, total_tokens - int(wide[-1]))", "0, 0)")),
    _m("nonempty-layout-reversed", "varlen", VARLEN_TESTS,
       "the non-empty layout puts the empty documents first",
       (VARLEN, "torch.argsort((lengths == 0).to(torch.int8), stable=True)",
        "torch.argsort((lengths != 0).to(torch.int8), stable=True)")),
    _m("materialize-skips-real-tokens", "varlen", VARLEN_TESTS,
       "materialize() leaves real_tokens lazy",
       (VARLEN, '"fla_conv_layout", "real_tokens"):', '"fla_conv_layout"):')),
    _m("foreign-seq-idx-trusted", "varlen", VARLEN_TESTS,
       "a Megatron object's own seq_idx is used without checking",
       (VARLEN, 'cached = getattr(params, "seq_idx", None) if ours else None',
        'cached = getattr(params, "seq_idx", None)')),
    _m("padded-boundaries-ignored", "varlen", VARLEN_TESTS,
       "the physical layout is read from the unpadded boundaries",
       (VARLEN, 'physical = values["cu_seqlens_q_padded"] if', 'physical = values["cu_seqlens_q"] if')),
    _m("token-count-unchecked", "varlen", VARLEN_TESTS,
       "a VarlenBatch of another row length passes through",
       (VARLEN, "if total_tokens != self.total_tokens:", "if False:")),
    # ------------------------------------------------------------------ checkpoint converters
    _m("megatron-conv-names-swapped", "converters", CONVERTER_TESTS,
       "Megatron's conv1d_weight / conv1d_bias swapped consistently in both directions",
       (MAMBA2_CKPT, 'renaming({"conv.weight": "conv1d_weight", "conv.bias": "conv1d_bias"})',
        'renaming({"conv.weight": "conv1d_bias", "conv.bias": "conv1d_weight"})')),
    _m("mamba-ssm-megatron-names", "converters", CONVERTER_TESTS,
       "mamba-ssm's layout read with Megatron's conv names",
       (MAMBA2_CKPT, "config_type=Mamba2Config, to_ours=_to_ours, to_upstream=_to_upstream)",
        "config_type=Mamba2Config, to_ours=_mg_to_ours, to_upstream=_mg_to_upstream)")),
    _m("kimi-conv-q-k-swapped", "converters", CONVERTER_TESTS,
       "Kimi-Linear's fused conv split as [k, q, v] when reading",
       ("mixers/checkpoints/kimi_linear.py", 'out["q_conv.weight"], out["k_conv.weight"], out["v_conv.weight"] =',
        'out["k_conv.weight"], out["q_conv.weight"], out["v_conv.weight"] =')),
    _m("qwen3-next-b-a-swapped", "converters", CONVERTER_TESTS,
       "Qwen3-Next's in_proj_ba read as [a, b]",
       ("mixers/checkpoints/qwen3_next.py", 'b, a = sd["in_proj_ba.weight"]', 'a, b = sd["in_proj_ba.weight"]')),
    _m("qwen3-next-conv-q-k-consistent", "converters", CONVERTER_TESTS,
       "Qwen3-Next's conv rows read and written as [k, q, v] (a consistent swap)",
       ("mixers/checkpoints/qwen3_next.py", 'cq, ck, cv = sd["conv1d.weight"]', 'ck, cq, cv = sd["conv1d.weight"]'),
       ("mixers/checkpoints/qwen3_next.py", 'torch.cat([sd["q_conv.weight"], sd["k_conv.weight"], sd["v_conv.weight"]]',
        'torch.cat([sd["k_conv.weight"], sd["q_conv.weight"], sd["v_conv.weight"]]')),
    _m("fla-conv-q-k-consistent", "converters", CONVERTER_TESTS,
       "fla's q_conv1d / k_conv1d swapped consistently in both directions",
       ("mixers/checkpoints/fla.py", '_CONVS = {f"{x}_conv.weight": f"{x}_conv1d.weight" for x in "qkv"}',
        '_CONVS = {"q_conv.weight": "k_conv1d.weight", "k_conv.weight": "q_conv1d.weight", '
        '"v_conv.weight": "v_conv1d.weight"}')),
    _m("te-extra-state-float-ignored", "converters", CONVERTER_TESTS,
       "a float tensor named *._extra_state is passed over as no weight",
       (MAMBA2_CKPT, "value.dtype == torch.uint8 or value.numel() == 0)",
        "value.dtype == torch.uint8 or value.dtype.is_floating_point)")),
    _m("hf-mamba2-eps-dropped", "converters", CONVERTER_TESTS,
       "the transformers Mamba2 norm eps is not carried into our config",
       (MAMBA2_CKPT, "norm_eps=float(norm.variance_epsilon))", "norm_eps=1e-5)")),
    # ------------------------------------------------------------------ Hugging Face integration
    _m("hf-packing-with-padding-mask", "hf", HF_TESTS,
       "packing plus a padding attention_mask is no longer refused",
       ("mixers/integrations/transformers.py", "        if _has_padding(mask):\n            raise ValueError",
        "        if False:\n            raise ValueError")),
    _m("hf-padding-mask-ignored", "hf", HF_TESTS,
       "a padded batch runs without its attention_mask (padding mixes into the next row's state)",
       ("mixers/integrations/transformers.py", "if params is None and _has_padding(mask):",
        "if params is None and _has_padding(mask) and False:")),
)
