"""The training config: one TOML file, every key with a default, overridable from the command line.

    [model] [data] [train] [parallel] [checkpoint] [metrics]: see docs/training.md for every key.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    kind: str = "hybrid"                 # "hybrid" (HybridLM) or "hf" (a Hugging Face hybrid with enable_packing)
    pattern: str = "MGKPA"               # HybridLM: one letter per block
    hidden_size: int = 64
    vocab_size: int = 0                  # 0: the tokenizer's vocabulary (256 for bytes)
    mixer_overrides: dict = field(default_factory=dict)   # per letter, e.g. {M = {state_size = 16}}
    backend: str = "auto"                # "auto", "kernel" or "reference" for every mixer
    hf_path: str = ""                    # kind = "hf": a local model directory
    init_from: str = ""                  # initial weights: a checkpoint the converters read


@dataclass
class DataConfig:
    files: list = field(default_factory=list)   # text / jsonl / parquet paths or globs; empty: the embedded corpus
    dataset: str = ""                    # a Hugging Face dataset saved with save_to_disk
    text_field: str = "text"             # the column / jsonl key holding each document's text
    streaming: bool = False              # read the dataset as an IterableDataset
    tokenizer: str = ""                  # a local Hugging Face tokenizer directory; "": bytes (vocabulary 256)
    max_tokens: int = 2048               # tokens per pack
    batch_packs: int = 4                 # packs per optimizer step (the global batch, split over dp ranks)
    lookahead: int = 4096                # documents held for best-fit packing
    shuffle_seed: int = -1               # -1: the source's order; else shuffle per epoch with this seed
    carry: bool = True                   # a document longer than a pack continues from its carried states


@dataclass
class TrainConfig:
    steps: int = 120
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup_steps: int = 10
    grad_clip: float = 1.0               # 0: no clipping
    seed: int = 0
    dtype: str = "float32"               # parameters; "bfloat16" / "float16": mixed precision (FSDP2 policy)
    activation_checkpointing: bool = False   # recompute each block in the backward
    compile: bool = False                # torch.compile each block


@dataclass
class ParallelConfig:
    cp: int = 1                          # context-parallel degree; dp = world size / cp


@dataclass
class CheckpointConfig:
    every: int = 0                       # steps between checkpoints; 0: only at the end and on SIGTERM
    keep: int = 2                        # complete checkpoints kept (the newest)
    resume: str = "auto"                 # "auto": the latest complete one in out_dir; "never"; or a path
    export: bool = True                  # at the end, the weights in the upstream layout (safetensors)


@dataclass
class MetricsConfig:
    log_every: int = 1                   # steps per progress line
    tensorboard: bool = True             # when tensorboard is installed
    plot: bool = True                    # loss against tokens at the end (matplotlib when installed)


@dataclass
class Config:
    out_dir: str = "runs/ssm-pack-train"  # checkpoints, metrics.jsonl, the plot and the export
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
