"""enable_packing on tiny Mamba, Falcon-Mamba and Jamba models, what only the selective-scan
families need beyond test_transformers_families.py (which checks every family against each
document alone, the gradient leak, the weights' round trip and both training calls): each swapped
layer is a ``Mamba1Mixer`` with its family's dt / B / C norm, and the cache object an eval call
returns is refused on the next call with the fix."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mixers import Mamba1Mixer  # noqa: E402
from mixers.integrations.transformers import PackedMixer, disable_packing, enable_packing  # noqa: E402
from tests.mixers.integrations.hf_models import build  # noqa: E402

FAMILIES = [pytest.param("mamba", id="mamba"), pytest.param("falcon_mamba", id="falcon_mamba"),
            pytest.param("jamba", id="jamba")]
SWAPPED = {"mamba": 2, "falcon_mamba": 2, "jamba": 1}
NORM = {"mamba": None, "falcon_mamba": "weightless", "jamba": "weighted"}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_scan_layer_is_swapped_with_its_family_norm(monkeypatch, family):
    model = enable_packing(build(family, monkeypatch))
    mixers = [m.mixer for m in model.modules() if isinstance(m, PackedMixer)]
    assert len(mixers) == SWAPPED[family] and all(isinstance(m, Mamba1Mixer) for m in mixers)
    assert {m.config.dt_bc_norm for m in mixers} == {NORM[family]}


@torch.no_grad()
@pytest.mark.parametrize("family", FAMILIES)
def test_the_returned_cache_is_refused_and_generate_runs_after_disable(monkeypatch, family):
    """An eval call with the default ``use_cache`` returns Hugging Face's cache object, which the swapped
    layers did not fill: continuing from it raises with the fix; after ``disable_packing`` the
    model decodes with its own cache again."""
    model = enable_packing(build(family, monkeypatch))
    ids = torch.tensor([[5, 17, 3, 40, 2, 9]])
    out = model(input_ids=ids)
    assert out.cache is not None                        # transformers' DynamicCache, left unfilled
    with pytest.raises(RuntimeError, match="call disable_packing"):
        model(input_ids=ids[:, -1:], cache=out.cache, use_cache=True)
    disable_packing(model)
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, ids.shape[1] + 3)
