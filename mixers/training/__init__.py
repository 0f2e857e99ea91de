"""``ssm-pack train``: train a hybrid on a corpus with packing, FSDP2 and context parallelism.

    config.py      the TOML config: sections, keys, defaults, command-line overrides, checks
    data.py        documents from files or a dataset on disk, and their tokenizer
    parallel.py    the DeviceMesh (dp x cp), FSDP2 and which packs each rank trains on
    checkpoint.py  sharded checkpoints (torch.distributed.checkpoint): complete or absent, last K kept
    metrics.py     per-step metrics: a JSONL file, a progress line, TensorBoard, a plot
    train.py       the training loop that puts them together

Run it as one process (``ssm-pack train``) or under ``torchrun --nproc-per-node N -m mixers.training``.
"""
