"""HybridLM the way other code calls it: a Hugging Face collator's batch (``model(**batch)``, as
HF's Trainer does), and sizes that do not split into heads (the error says what works)."""

import re

import pytest
import torch

from mixers import HybridLM
from ssm_pack import PackedSeqParams, hf_batch_from_packed_seq_params

SMALL = {"M": {"head_dim": 16, "state_size": 8, "chunk_size": 16}, "G": {"head_dim": 8, "chunk_size": 16},
         "K": {"head_dim": 8, "chunk_size": 16}, "P": {"head_dim": 8, "chunk_size": 16}, "A": {"head_dim": 8}}
LENGTHS = [9, 1, 20, 6]


def model():
    torch.manual_seed(0)
    return HybridLM(256, 32, "MGKPA", mixer_overrides=SMALL).double()


def collated(keys):
    """A DataCollatorWithFlattening-style batch (built without transformers) and its metadata."""
    params = PackedSeqParams.from_lengths(LENGTHS)
    ids = torch.randint(1, 256, (1, params.total_tokens), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, params.cu_seqlens_q[:-1].long()] = -100                # the collator's separator label
    boundaries = hf_batch_from_packed_seq_params(params)
    return {"input_ids": ids, "labels": labels, **{k: boundaries[k] for k in keys}}, params


@pytest.mark.parametrize("keys", [
    pytest.param(("position_ids",), id="position_ids"),
    pytest.param(("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"),
                 id="flash-attn-kwargs"),
    pytest.param(("position_ids", "seq_idx"), id="seq_idx"),
])
def test_forward_packs_from_a_collated_batch(keys):
    m = model()
    batch, params = collated(keys)
    out = m(**batch)
    want = m(batch["input_ids"], params, labels=batch["labels"])
    assert torch.equal(out["logits"], want["logits"]) and torch.equal(out["loss"], want["loss"])
    # negative control: read as one sequence, the documents would leak into each other
    unpacked = m(batch["input_ids"], labels=batch["labels"])
    assert not torch.allclose(unpacked["logits"], want["logits"])


def test_forward_takes_a_real_data_collator_with_flattening_batch():
    transformers = pytest.importorskip("transformers")
    features = [{"input_ids": list(range(1, n + 1))} for n in LENGTHS]
    m = model()
    for kwargs in ({}, {"return_flash_attn_kwargs": True, "return_seq_idx": True}):
        batch = transformers.DataCollatorWithFlattening(**kwargs)(features)
        out = m(**batch)
        params = PackedSeqParams.from_lengths(LENGTHS)
        assert torch.equal(out["loss"], m(batch["input_ids"], params, labels=batch["labels"])["loss"])


def test_hf_trainer_trains_hybrid_lm_on_flattened_batches(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    m = HybridLM(256, 32, "MGA", mixer_overrides=SMALL)
    before = [p.detach().clone() for p in m.parameters()]
    documents = [{"input_ids": list(range(1, n + 1))} for n in (40, 7, 90, 23)] * 2
    args = transformers.TrainingArguments(str(tmp_path), per_device_train_batch_size=4, max_steps=2, report_to=[],
                                          use_cpu=True, save_strategy="no", learning_rate=1e-2)
    result = transformers.Trainer(model=m, args=args, train_dataset=documents,
                                  data_collator=transformers.DataCollatorWithFlattening()).train()
    assert result.global_step == 2 and result.training_loss > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, m.parameters()))


def test_rows_with_position_ids_run_as_one_packed_row():
    m = model()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    positions = torch.tensor([list(range(5)) + list(range(7)), list(range(12))])    # row 0 holds two documents
    out = m(ids, labels=ids, position_ids=positions)
    assert out["logits"].shape == (2, 12, 256)
    params = PackedSeqParams.from_lengths([5, 7, 12])
    want = m(ids.reshape(1, -1), params, labels=ids.reshape(1, -1))
    assert torch.equal(out["logits"], want["logits"].reshape(2, 12, 256)) and torch.equal(out["loss"], want["loss"])


def test_collated_batch_errors_name_the_argument():
    m = model()
    batch, params = collated(("position_ids", "cu_seq_lens_q"))
    with pytest.raises(ValueError, match=r"give packed_seq_params or a collator's boundaries \(position_ids, "
                                         r"cu_seq_lens_q\), not both"):
        m(**batch, packed_seq_params=params)
    ids = torch.zeros(2, 6, dtype=torch.long)
    with pytest.raises(ValueError, match=r"cu_seq_lens_q describe one packed row, but input_ids has 2 rows"):
        m(ids, cu_seq_lens_q=torch.tensor([0, 6], dtype=torch.int32), position_ids=torch.zeros(2, 6, dtype=torch.long))
    with pytest.raises(ValueError, match=r"position_ids must be \[B, S\] \(or MRoPE \[3, B, S\]\) like input_ids "
                                         r"\(2, 6\), got \(2, 5\)"):
        m(ids, position_ids=torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(TypeError, match="attention_mask"):
        m(ids, attention_mask=torch.ones(2, 6))               # no mask is silently ignored


def test_hidden_size_without_a_head_split_says_which_block_and_what_works():
    with pytest.raises(ValueError) as err:
        HybridLM(hidden_size=100)
    message = str(err.value)
    assert message.startswith("HybridLM: hidden_size=100: block 0 ('M', Mamba2Mixer) cannot be built: "
                              "head_dim=64 must divide expand * hidden_size=200")
    assert "hidden_size=96 or hidden_size=128" in message
    override = re.search(r"mixer_overrides=(\{'M': \{'head_dim': (\d+)\}\})", message)
    assert override and override.group(2) == "50"
    # every fix the message offers works
    HybridLM(hidden_size=96)
    HybridLM(hidden_size=128)
    HybridLM(hidden_size=100, mixer_overrides={"M": {"head_dim": 50}})


def test_the_head_sizes_offered_reach_one_and_four_times_the_head_size():
    """Head sizes from 1 to 4 x the given one are searched, nearest first: at hidden_size=11 a Mamba2
    head of 3 (expand * hidden = 22) leaves 2, then 1, then 11 = the last size below 4 x 3."""
    with pytest.raises(ValueError, match=r"mixer_overrides=\{'M': \{'head_dim': 2\}\} \(head_dim 2, 1, 11 fit\)$"):
        HybridLM(64, 11, "M", mixer_overrides={"M": {"head_dim": 3}})
    for head_dim in (2, 1, 11):                                              # every size offered builds
        HybridLM(64, 11, "M", mixer_overrides={"M": {"head_dim": head_dim}})


def test_token_arguments_that_are_not_tensors_are_refused_by_name():
    m = model()
    with pytest.raises(TypeError, match="input_ids must be a \\[B, T\\] integer tensor, got list"):
        m([[1, 2, 3]])
    with pytest.raises(TypeError, match="labels must be a \\[B, T\\] integer tensor, got list"):
        m(torch.zeros(1, 3, dtype=torch.long), labels=[[1, 2, 3]])
