"""enable_packing refuses a collator batch whose boundary sources describe different documents,
before any layer runs (the check every entry point shares, ssm_pack.formats.consistency)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mixers.integrations.transformers import enable_packing  # noqa: E402
from tests.mixers.integrations import hf_models  # noqa: E402

transformers.logging.set_verbosity_error()
LENGTHS = [5, 3, 6]


def _batch(**collator):
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, hf_models.VOCAB, (n,), generator=g).tolist() for n in LENGTHS]
    batch = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, **collator)(
        [{"input_ids": d} for d in docs])
    batch.pop("labels")
    return batch


@pytest.mark.parametrize("edit,match", [
    pytest.param(lambda b: b.__setitem__("position_ids", torch.arange(14)[None]),
                 r"position_ids'\] and batch\['cu_seq_lens_q'\] describe different documents", id="positions"),
    pytest.param(lambda b: b.__setitem__("position_ids", b["position_ids"][:, :10]),
                 "position_ids covers 10 tokens but the input has 14", id="positions-short"),
    pytest.param(lambda b: b.update(cu_seq_lens_q=torch.tensor([0, 4, 8, 14], dtype=torch.int32),
                                    cu_seq_lens_k=torch.tensor([0, 4, 8, 14], dtype=torch.int32)),
                 r"position_ids'\] and batch\['cu_seq_lens_q'\] describe different documents", id="boundaries"),
    pytest.param(lambda b: b.__setitem__("cu_seq_lens_q", torch.tensor([0, 4, 8, 14], dtype=torch.int32)),
                 "cu_seq_lens_k=.* differs from cu_seq_lens_q", id="query-boundaries-only"),
])
def test_a_patched_model_refuses_disagreeing_boundaries(monkeypatch, edit, match):
    model = enable_packing(hf_models.build("mamba2", monkeypatch))
    batch = _batch()
    with torch.no_grad():
        model(**batch)                                   # negative control: the collator's batch runs
        edit(batch)
        with pytest.raises(ValueError, match=match):
            model(**batch)
