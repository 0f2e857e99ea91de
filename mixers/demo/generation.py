"""The demo's last step: continuations of a few prompts from the trained model by continuous
batching, and the check that cached decoding matched a full recompute.

Prompts of different lengths (the first bytes of a few documents) go through fewer slots than
prompts, so slots are reused; long prompts are read in chunks while other sequences decode, all
in one packed call per step.
"""

from __future__ import annotations

import torch

from ssm_pack.testing import TOLERANCES

from ..inference import ContinuousBatcher, check_against_recompute

PROMPT_BYTES = (40, 12, 28, 64, 20, 48)


def _show(data: bytes, width: int = 44) -> str:
    text = data.decode("utf-8", errors="replace").replace("\n", " ")
    return repr(text if len(text) <= width else text[:width - 3] + "...")


def generation_demo(model, documents: list[bytes], max_new_tokens: int = 32, slots: int = 3,
                    prefill_chunk: int = 24) -> dict:
    """Generate from ``model`` (greedy), print the continuations and the recompute check.

    Raises ``RuntimeError`` when the cached logits differ from the full forward's by more than the
    project's tolerance for the model's dtype."""
    picked = [d for d in documents if len(d) >= max(PROMPT_BYTES)][:len(PROMPT_BYTES)] or documents[:1]
    prompts = [list(doc[:n]) for doc, n in zip(picked, PROMPT_BYTES)]
    model.eval()
    batcher = ContinuousBatcher(model, max_batch_size=slots, prefill_chunk=prefill_chunk, record_logits=True)
    outputs = batcher.run(prompts, max_new_tokens)
    lengths = [len(p) for p in prompts]
    print(f"  generate: {len(prompts)} prompts ({min(lengths)}-{max(lengths)} bytes) through {slots} slots, "
          f"{batcher.steps} steps ({batcher.packed_steps} packed: prefill chunks of <= {prefill_chunk} with decodes; "
          f"{batcher.decode_steps} decode-only), {batcher.slots_reused} slots reused")
    for prompt, out in zip(prompts, outputs):
        print(f"    prompt {_show(bytes(prompt))} -> {_show(bytes(out))}")
    check = check_against_recompute(model, prompts, outputs, batcher.logits)
    dtype = next(model.parameters()).dtype
    limit = TOLERANCES.get(dtype, TOLERANCES[torch.float32])[0]
    verdict = "matches" if check["rel_rms"] <= limit else "DOES NOT match"
    print(f"  check:  cached decoding {verdict} a full recompute: {check['sequences']} sequences, {check['tokens']} "
          f"tokens, logits max |diff| {check['max_abs']:.1e}, relative RMS {check['rel_rms']:.1e} "
          f"({str(dtype).removeprefix('torch.')} tolerance {limit:.0e}); greedy tokens "
          f"{'identical' if check['greedy_match'] else 'differ at a near tie'}")
    if check["rel_rms"] > limit:
        raise RuntimeError(f"cached decoding differs from a full recompute (relative RMS {check['rel_rms']:.2e} > "
                           f"{limit:.0e})")
    return {"prompts": [bytes(p).decode("utf-8", "replace") for p in prompts],
            "continuations": [bytes(o).decode("utf-8", "replace") for o in outputs], **check}
