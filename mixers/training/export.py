"""The trained weights as one file: ``model.safetensors`` (full tensors, our names) and
``config.json`` (what :func:`load_exported` needs to rebuild the model).

Every rank takes part in gathering the full state dict (FSDP2 shards it); rank 0 writes.
"""

from __future__ import annotations

import json
from pathlib import Path

FORMAT = "ssm-pack-hybrid-lm/1"


def export_model(model, config, directory: Path, *, rank: int = 0) -> Path | None:
    """Write ``directory/model.safetensors`` and ``directory/config.json`` (a Hugging Face model:
    ``save_pretrained``, Hugging Face's names and layout); returns the directory on rank 0
    (``None`` elsewhere)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from ..model.hybrid import HybridLM
    from .model import hf_model, parameter_names
    with parameter_names(model):
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return None
    if not isinstance(model, HybridLM):      # Hugging Face's layout, through an unsharded copy of the model
        copy = hf_model(config)
        with parameter_names(copy):
            copy.load_state_dict(state, strict=True)
        copy.save_pretrained(str(directory))
        return Path(directory)
    from safetensors.torch import save_file
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in state.items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": FORMAT})
    m = config.model
    (directory / "config.json").write_text(json.dumps(
        {"format": FORMAT, "architecture": "HybridLM", "vocab_size": model.embed.num_embeddings,
         "hidden_size": m.hidden_size, "pattern": m.pattern, "mixer_overrides": m.mixer_overrides}, indent=2) + "\n")
    return directory


def load_exported(directory, *, backend: str = "auto"):
    """The :class:`mixers.HybridLM` an export holds, its weights loaded (strict)."""
    from safetensors.torch import load_file

    from ..model.hybrid import HybridLM
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{config_path} is missing; pass a directory written by ssm-pack train's export")
    config = json.loads(config_path.read_text())
    if config.get("format") != FORMAT:
        raise ValueError(f"{config_path} has format {config.get('format')!r}, not {FORMAT!r}; pass a directory "
                         "written by ssm-pack train's export")
    model = HybridLM(config["vocab_size"], config["hidden_size"], config["pattern"], backend=backend,
                     mixer_overrides=config["mixer_overrides"])
    model.load_state_dict(load_file(str(directory / "model.safetensors")), strict=True)
    return model


__all__ = ["export_model", "load_exported"]
