"""Continuous batching: many prompts through a fixed pool of slots, one forward per step.

    S = slots (``max_batch_size``), N = sequences active in a step, V = vocabulary

Every step admits waiting prompts into free slots, then runs **one** forward over every active
sequence: a sequence still reading its prompt brings its next piece (the whole rest, or
``prefill_chunk`` tokens), a generating one its last token. When every piece is one token the
step is a row call ``[N, 1]`` (the decode-step kernels); otherwise one packed call ``[1, T]``
with one document per sequence, each continuing its slot (prefill chunks and decodes together).
The logits at each piece's last token give the next token of the sequences that have read their
whole prompt (greedy at ``temperature=0``, else sampled). A prompt already prefilled into a slot
of the given cache (``prefilled=``, e.g. by a context-parallel prefill) starts there generating,
from the logits at its last token, next to the others. A sequence that has its
``max_new_tokens`` (or produced ``eos_token_id``) leaves; its slot is reset and taken by the next
prompt. Works with any model that has ``allocate_inference_cache`` and takes ``cache=`` /
``cache_slots=`` (``HybridLM``).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import torch

from ssm_pack import PackedSeqParams
from ssm_pack.checks import check_int, describe

from .cache import InferenceCache


@dataclass
class _Sequence:
    index: int
    prompt: list[int]
    slot: int
    fed: int = 0
    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)


def _as_prompt(i: int, prompt, vocab: int | None) -> list[int]:
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.is_floating_point():
            raise TypeError(f"prompts[{i}] must be a 1-D integer tensor or a sequence of ints, got {describe(prompt)}")
        tokens = [int(t) for t in prompt.tolist()]
    else:
        try:
            tokens = list(prompt)
        except TypeError:
            raise TypeError(f"prompts[{i}] must be a sequence of token ids, got {describe(prompt)}") from None
        if any(isinstance(t, bool) or not isinstance(t, int) for t in tokens):
            raise TypeError(f"prompts[{i}] must hold int token ids, got {describe(prompt)}")
    if not tokens:
        raise ValueError(f"prompts[{i}] is empty; every prompt needs at least one token")
    if vocab is not None and not all(0 <= t < vocab for t in tokens):
        j, bad = next((j, t) for j, t in enumerate(tokens) if not 0 <= t < vocab)
        raise ValueError(f"prompts[{i}][{j}]={bad} is outside the vocabulary of {vocab} tokens (0..{vocab - 1}); "
                         "map unknown tokens to a valid id")
    return tokens


def check_temperature(temperature) -> float:
    """``temperature`` as a float: finite and >= 0 (``inf``, uniform sampling, is refused too)."""
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool):
        raise TypeError(f"temperature must be a finite number >= 0 (0 = greedy), got {describe(temperature)}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    return float(temperature)


class ContinuousBatcher:
    """Runs :func:`generate`'s loop (see the module docstring); after :meth:`run`, ``steps``,
    ``packed_steps``, ``decode_steps``, ``admitted`` and ``slots_reused`` describe what happened and,
    with ``record_logits=True``, ``logits[i]`` ``[len(outputs[i]), V]`` holds the logits each
    generated token of prompt i was chosen from."""

    def __init__(self, model, *, max_batch_size: int | None = None, prefill_chunk: int | None = None,
                 temperature: float = 0.0, eos_token_id: int | None = None, generator: torch.Generator | None = None,
                 record_logits: bool = False, cache=None):
        self.model = model
        self.max_batch_size = check_int("max_batch_size", max_batch_size, minimum=1, allow_none=True)
        self.prefill_chunk = check_int("prefill_chunk", prefill_chunk, minimum=1, allow_none=True)
        self.temperature = check_temperature(temperature)
        self.eos_token_id = check_int("eos_token_id", eos_token_id, minimum=0, allow_none=True)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator (CPU) or None, got {describe(generator)}; "
                            "pass torch.Generator().manual_seed(seed)")
        if generator is not None and generator.device.type != "cpu":
            raise ValueError(f"generator must be a CPU torch.Generator (the sampler draws on the CPU), got one on "
                             f"{generator.device}; pass torch.Generator().manual_seed(seed)")
        self.generator, self.record_logits, self.cache = generator, record_logits, cache
        self.steps = self.packed_steps = self.decode_steps = self.admitted = self.slots_reused = 0
        self.logits: list[torch.Tensor] = []

    def _cache_for(self, longest: int) -> tuple[InferenceCache, int]:
        """The cache and how many of its slots to use; a given cache is checked whole (model, dtype,
        device, sizes) before anything touches it."""
        if self.cache is None:
            slots = 8 if self.max_batch_size is None else self.max_batch_size
            return self.model.allocate_inference_cache(slots, longest), slots
        cache = self.cache
        if not isinstance(cache, InferenceCache):
            raise TypeError(f"cache must be an InferenceCache of this model's allocate_inference_cache, got "
                            f"{describe(cache)}")
        embed = getattr(self.model, "embed", None)
        reference = embed.weight if isinstance(getattr(embed, "weight", None), torch.Tensor) \
            else next(self.model.parameters())
        cache.check(self.model, reference.dtype, reference.device, what="the model")
        if cache.max_seqlen < longest:
            raise ValueError(f"the cache holds {cache.max_seqlen} tokens per slot but a prompt plus "
                             f"max_new_tokens needs {longest}; allocate a longer cache")
        if self.max_batch_size is not None and self.max_batch_size > cache.capacity:
            raise ValueError(f"max_batch_size={self.max_batch_size} but the cache has {cache.capacity} slots; "
                             "pass max_batch_size <= the cache's slots (or leave it None to use them all)")
        return cache, cache.capacity if self.max_batch_size is None else self.max_batch_size

    def _check_prefilled(self, prefilled, prompts: list[list[int]], cache, capacity: int) -> dict:
        """``{prompt index: (slot, logits [V])}`` checked against the prompts and the cache (nothing
        touched yet)."""
        if not prefilled:
            return {}
        if self.cache is None:
            raise ValueError("prefilled= names slots of a cache that already hold the prompts; pass that cache "
                             "(cache=...)")
        if not isinstance(prefilled, dict):
            raise TypeError(f"prefilled must be a dict {{prompt index: (slot, logits)}}, got {describe(prefilled)}")
        vocab = getattr(getattr(self.model, "embed", None), "num_embeddings", None)
        checked, slots = {}, {}
        for index, entry in prefilled.items():
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(prompts):
                raise ValueError(f"prefilled names prompt {index!r} but there are {len(prompts)} prompts; key it by "
                                 "the prompt's index")
            if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], torch.Tensor)):
                raise TypeError(f"prefilled[{index}] must be (slot, logits at the prompt's last token [V]), got "
                                f"{describe(entry)}")
            slot, logits = entry
            slot = check_int(f"prefilled[{index}]'s slot", slot, minimum=0)
            if slot >= capacity:
                raise ValueError(f"prefilled[{index}] is in slot {slot} but the batcher uses slots 0..{capacity - 1} "
                                 "(max_batch_size); use a slot below it")
            if slot in slots:
                raise ValueError(f"prefilled puts prompts {slots[slot]} and {index} in slot {slot}; one slot each")
            held = int(cache.table.lengths[slot])
            if held != len(prompts[index]):
                raise ValueError(f"slot {slot} holds {held} tokens but prompts[{index}] has {len(prompts[index])}; "
                                 "prefill the prompt into that slot first (e.g. a context-parallel prefill)")
            if logits.dim() != 1 or (vocab is not None and logits.numel() != vocab):
                raise ValueError(f"prefilled[{index}]'s logits must be [V] (V={vocab}), the logits at the prompt's "
                                 f"last token, got shape {tuple(logits.shape)}")
            slots[slot] = index
            checked[index] = (slot, logits)
        return checked

    def _take(self, seq: _Sequence, logits: torch.Tensor, max_new_tokens: int) -> bool:
        """Choose ``seq``'s next token from ``logits [V]``; whether it is done."""
        token = self._choose(logits)
        seq.tokens.append(token)
        if self.record_logits:
            seq.logits.append(logits.detach().clone())
        return len(seq.tokens) >= max_new_tokens or token == self.eos_token_id

    def run(self, prompts, max_new_tokens: int, *, prefilled: dict | None = None) -> list[list[int]]:
        """The generated tokens of every prompt, in the prompts' order. ``prefilled`` ``{i: (slot,
        logits [V])}``: prompt i already fills ``slot`` of the given cache (its length checked) and
        ``logits`` are those at its last token; it is not fed again, and its slot is kept."""
        max_new_tokens = check_int("max_new_tokens", max_new_tokens, minimum=0)
        if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
            raise TypeError(f"prompts must be a list of token-id sequences, got {describe(prompts)}")
        vocab = getattr(getattr(self.model, "embed", None), "num_embeddings", None)
        prompts = [_as_prompt(i, p, vocab) for i, p in enumerate(prompts)]
        outputs: list[list[int]] = [[] for _ in prompts]
        self.logits = [torch.zeros(0) for _ in prompts]
        busy = bool(prompts) and max_new_tokens > 0
        if busy or self.cache is not None:            # a given cache is checked even when there is nothing to do
            cache, capacity = self._cache_for(max((len(p) for p in prompts), default=0) + max_new_tokens)
        elif prefilled:
            raise ValueError("prefilled= names slots of a cache that already hold the prompts; pass that cache "
                             "(cache=...)")
        if busy or prefilled:
            prefilled = self._check_prefilled(prefilled, prompts, cache, capacity)
        if not busy:
            return outputs
        kept = {slot for slot, _ in prefilled.values()}
        cache.reset([s for s in range(cache.capacity) if s not in kept])
        waiting, active, used = deque(i for i in range(len(prompts)) if i not in prefilled), [], set(kept)
        free = deque(s for s in range(capacity) if s not in kept)

        def finish(seq: _Sequence) -> None:
            outputs[seq.index] = seq.tokens
            if self.record_logits:
                self.logits[seq.index] = torch.stack(seq.logits)
            cache.reset([seq.slot])
            free.append(seq.slot)

        for index, (slot, logits) in sorted(prefilled.items()):
            seq = _Sequence(index, prompts[index], slot, fed=len(prompts[index]))
            self.admitted += 1
            if self._take(seq, logits, max_new_tokens):
                finish(seq)
            else:
                active.append(seq)
        with torch.no_grad():
            while waiting or active:
                while waiting and free:
                    slot = free.popleft()
                    self.slots_reused += slot in used
                    used.add(slot)
                    index = waiting.popleft()
                    active.append(_Sequence(index, prompts[index], slot))
                    self.admitted += 1
                finished = self._step(cache, active, max_new_tokens)
                for seq in finished:
                    active.remove(seq)
                    finish(seq)
        return outputs

    def _step(self, cache, active: list[_Sequence], max_new_tokens: int) -> list[_Sequence]:
        """One forward over every active sequence; returns those that are done."""
        pieces = []
        for seq in active:
            if seq.fed < len(seq.prompt):
                end = len(seq.prompt) if self.prefill_chunk is None else seq.fed + self.prefill_chunk
                pieces.append(seq.prompt[seq.fed:end])
            else:
                pieces.append(seq.tokens[-1:])
        last = self._forward(cache, pieces, [seq.slot for seq in active])
        done = []
        for seq, piece, logits in zip(active, pieces, last):
            if seq.fed < len(seq.prompt):
                seq.fed += len(piece)
                if seq.fed < len(seq.prompt):
                    continue                                   # still reading its prompt
            if self._take(seq, logits, max_new_tokens):
                done.append(seq)
        return done

    def _forward(self, cache, pieces: list[list[int]], slots: list[int]) -> torch.Tensor:
        """``[N, V]`` logits at the last token of every piece."""
        device = cache.device
        self.steps += 1
        if all(len(p) == 1 for p in pieces):
            self.decode_steps += 1
            ids = torch.tensor(pieces, dtype=torch.long, device=device)
            return self.model(ids, cache=cache, cache_slots=slots)["logits"][:, -1]
        self.packed_steps += 1
        lengths = [len(p) for p in pieces]
        params = PackedSeqParams.from_lengths(lengths)
        ids = torch.tensor([t for p in pieces for t in p], dtype=torch.long, device=device).unsqueeze(0)
        logits = self.model(ids, params, cache=cache, cache_slots=slots)["logits"][0]
        ends = params.cu_seqlens_q[1:].to(torch.long) - 1
        return logits[ends.to(logits.device)]

    def _choose(self, logits: torch.Tensor) -> int:
        if self.temperature == 0.0:
            return int(torch.argmax(logits))
        logits = logits.double()                    # shifted first: a tiny temperature gives -inf, never nan
        probs = torch.softmax((logits - logits.max()) / self.temperature, dim=-1)
        return int(torch.multinomial(probs.cpu(), 1, generator=self.generator))


def generate(model, prompts, max_new_tokens: int = 64, temperature: float = 0.0, *, max_batch_size: int | None = None,
             prefill_chunk: int | None = None, eos_token_id: int | None = None,
             generator: torch.Generator | None = None, cache=None, prefilled: dict | None = None) -> list[list[int]]:
    """Continuations of ``prompts`` (each a sequence of token ids: a list, a 1-D tensor, bytes), by
    continuous batching over ``max_batch_size`` slots (see the module docstring).

    Args:
        max_new_tokens: tokens to generate per prompt (fewer when ``eos_token_id`` comes first).
        temperature: 0 = greedy (argmax), else sampling from ``softmax(logits / temperature)``; must
            be finite (``nan`` and ``inf`` are refused; as it goes to 0 sampling becomes greedy).
        max_batch_size: slots used at once; ``None``: 8, or every slot of ``cache``.
        prefill_chunk: at most this many prompt tokens per sequence and step (chunked prefill);
            ``None`` reads a prompt in one step.
        generator: the sampler's ``torch.Generator`` (CPU).
        cache: an :class:`~mixers.inference.InferenceCache` of ``model`` to use: checked first (its
            model, dtype, device, ``max_seqlen`` and slots; a refused cache is left bitwise
            unchanged), then all its slots are reset (but ``prefilled`` ones); ``None`` allocates one
            sized to the prompts.
        prefilled: ``{prompt index: (slot, logits [V])}``: prompts already in ``cache`` (e.g. a
            context-parallel prefill), with the logits at each one's last token; they generate from
            there (see :meth:`ContinuousBatcher.run`).

    Returns:
        The generated token ids of every prompt, in order.
    """
    batcher = ContinuousBatcher(model, max_batch_size=max_batch_size, prefill_chunk=prefill_chunk,
                                temperature=temperature, eos_token_id=eos_token_id, generator=generator, cache=cache)
    return batcher.run(prompts, max_new_tokens, prefilled=prefilled)
