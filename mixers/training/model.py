"""The model ``ssm-pack train`` trains, built from ``[model]``: a :class:`mixers.HybridLM`
(``kind = "hybrid"``) or a Hugging Face hybrid from a local directory with
:func:`mixers.integrations.enable_packing` (``kind = "hf"``), and the few things the loop asks
of either: its blocks, its vocabulary and the mean loss of a packed row.

    T = tokens of a row, V = vocabulary
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..model.hybrid import HybridLM
from .config import Config
from .data import check_vocab


def model_vocab(config: Config, corpus) -> int:
    """The vocabulary the model will have (``model.vocab_size``, 0: the tokenizer's; a Hugging Face
    model's own), refused when smaller than the tokenizer's, before anything starts."""
    if config.model.kind != "hf":
        return check_vocab(config.model.vocab_size, corpus)
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(config.model.hf_path, local_files_only=True).vocab_size
    if vocab < corpus.vocab_size:
        raise ValueError(f"the model in model.hf_path={config.model.hf_path!r} has a vocabulary of {vocab} but the "
                         f"tokenizer's is {corpus.vocab_size} ({corpus.description}): token ids would fall outside "
                         "the embedding; use that model's tokenizer (data.tokenizer)")
    return vocab


def build_model(config: Config, vocab_size: int) -> nn.Module:
    """The model, its weights initialised from ``train.seed`` (or loaded from ``model.init_from``)."""
    m = config.model
    torch.manual_seed(config.train.seed)
    if m.kind == "hf":
        return hf_model(config)
    model = HybridLM(vocab_size, m.hidden_size, m.pattern, backend=m.backend, mixer_overrides=m.mixer_overrides)
    if m.init_from:
        from ..checkpoints import load_checkpoint
        state = load_checkpoint(m.init_from)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"model.init_from={m.init_from!r} does not fit this model: missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}; point it at weights exported by ssm-pack train for the "
                             "same model.pattern / hidden_size / vocabulary")
    return model


def hf_model(config: Config) -> nn.Module:
    """The Hugging Face model in ``model.hf_path`` (sdpa attention, fp32), patched by ``enable_packing``."""
    from transformers import AutoModelForCausalLM

    from ..integrations.transformers import enable_packing
    model = AutoModelForCausalLM.from_pretrained(config.model.hf_path, local_files_only=True,
                                                 attn_implementation="sdpa", dtype=torch.float32)
    return enable_packing(model, backend=config.model.backend)


def parameter_names(model: nn.Module):
    """A context in which ``state_dict`` keys are parameter paths (what torch.distributed.checkpoint
    needs): a Hugging Face model patched by ``enable_packing`` otherwise speaks Hugging Face's names."""
    if isinstance(model, HybridLM):
        return contextlib.nullcontext()
    from ..integrations.transformers import native_names
    return native_names(model)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks (what FSDP2 shards, activation checkpointing recomputes, compile compiles)."""
    if isinstance(model, HybridLM):
        return list(model.blocks)
    for owner in ("model", "backbone"):            # Hugging Face decoders keep them in <owner>.layers
        layers = getattr(getattr(model, owner, None), "layers", None)
        if isinstance(layers, nn.ModuleList):
            return list(layers)
    raise ValueError(f"{type(model).__name__} keeps no .model.layers or .backbone.layers; ssm-pack train cannot "
                     "find its blocks")


def row_loss(model: nn.Module, ids: torch.Tensor, params, labels: torch.Tensor):
    """The mean next-token cross-entropy of one packed row ``ids [1, T]`` (a cp share under context
    parallelism: the shares of a row sum to its mean)."""
    if isinstance(model, HybridLM):
        return model(ids, params, labels=labels)["loss"]
    return model(input_ids=ids, labels=labels, use_cache=False, **hf_boundaries(params, ids.shape[1])).loss


def hf_boundaries(params, tokens: int) -> dict:
    """A packed row's boundaries as a ``DataCollatorWithFlattening`` batch gives them: every
    physical slot (and a padding tail) a document, positions restarting at 0 in each."""
    cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    cu = cu.to(torch.int32)
    if int(cu[-1]) < tokens:
        cu = torch.cat([cu, cu.new_tensor([tokens])])
    lengths = cu.diff()
    starts = torch.repeat_interleave(cu[:-1], lengths, output_size=tokens)
    positions = (torch.arange(tokens, device=cu.device) - starts).unsqueeze(0)
    longest = int(lengths.max())
    return {"position_ids": positions, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest,
            "max_length_k": longest}
