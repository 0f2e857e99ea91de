"""Cached decoding vs recomputing the whole sequence: the check the demo prints.

    n = generated tokens of a sequence, V = vocabulary
"""

from __future__ import annotations

import torch


def check_against_recompute(model, prompts, outputs, logits) -> dict:
    """Compare the logits each generated token was chosen from (``logits[i]`` ``[n_i, V]``, e.g. a
    :class:`~mixers.inference.ContinuousBatcher`'s with ``record_logits=True``) with one full forward
    of each sequence alone (``prompt + outputs[:-1]``, no cache).

    Returns ``{"sequences", "tokens", "max_abs", "rel_rms", "greedy_match"}``: the largest absolute
    and the largest relative RMS difference over the sequences, and whether every generated token is
    the full forward's argmax (what greedy decoding must give).
    """
    worst_abs = worst_rel = 0.0
    tokens, greedy = 0, True
    with torch.no_grad():
        for prompt, out, cached in zip(prompts, outputs, logits):
            if not out:
                continue
            prompt = [int(t) for t in prompt]
            device = next(model.parameters()).device
            ids = torch.tensor(prompt + list(out[:-1]), dtype=torch.long, device=device).unsqueeze(0)
            full = model(ids)["logits"][0, len(prompt) - 1:].double()
            diff = cached.to(full.device).double() - full
            worst_abs = max(worst_abs, float(diff.abs().max()))
            scale = full.square().mean().sqrt().clamp_min(1e-30)
            worst_rel = max(worst_rel, float(diff.square().mean().sqrt() / scale))
            greedy &= full.argmax(-1).tolist() == list(out)
            tokens += len(out)
    return {"sequences": sum(1 for out in outputs if out), "tokens": tokens, "max_abs": worst_abs,
            "rel_rms": worst_rel, "greedy_match": greedy}
