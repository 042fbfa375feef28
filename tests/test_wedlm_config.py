"""WeDLM's config.json read as published (issue #43): `mask_token_id: null` is the reference
engine's fallback, 151665 (wedlm/engine/model_runner.py `_init_mask_token`), and an id it names
is kept, 0 included."""

import json

import pytest

from fixtures.wedlm import DATA
from mlx_dllm_models.models import wedlm


def published(**changes):
    return {**json.loads((DATA / "config.json").read_text()), **changes}


@pytest.mark.parametrize("value, want", [(None, 151665), (151666, 151666), (0, 0)])
def test_mask_token_id_as_published(value, want):
    args = wedlm.ModelArgs.from_dict(published(mask_token_id=value))
    assert args.mask_token_id == want
    assert wedlm.Model(args).diffusion_spec.mask_token_id == want


def test_the_fallback_is_the_engines():
    assert wedlm.WEDLM_MASK_TOKEN_ID == 151665
    without = {k: v for k, v in published().items() if k != "mask_token_id"}
    assert wedlm.ModelArgs.from_dict(without).mask_token_id == 151665
