"""dllm's A2D Qwen2 (model_type "a2d-qwen2", the Qwen2.5-Coder-0.5B-Instruct conversions): the
forward against transformers' Qwen2 under A2D's padding-only mask, both samplers' greedy tokens
against the transcribed MDLMSampler / BD3LMSampler (tests/reference/dllm_a2d.py), plain
`mlx_lm convert` / `mlx_lm.load`, the reconstructed config at full size."""

import json
import math
from pathlib import Path

import pytest

from fixtures.dllm import ENDOFTEXT, IM_END, MASK
from fixtures.dllm_qwen2 import build
from helpers import checkpoint_fixtures
from helpers import random_prompt as prompt
from mlx_dllm_models.engine import BlockEvent, make_decoder
from mlx_dllm_models.models import a2d_qwen2
from mlx_dllm_models.settings import resolve_settings
from reference.dllm_a2d import bd3lm_sample, mdlm_sample, reference_forward

DATA = Path(__file__).parent / "data" / "dllm-hub__Qwen2.5-Coder-0.5B-Instruct-diffusion-mdlm-v0.1"


ckpt, loaded = checkpoint_fixtures("a2d_qwen2", build)


@pytest.mark.parametrize("sampler", ["mdlm", "bd3lm"])
@pytest.mark.parametrize("case", [(6, 0, 16, 8, 8), (9, 2, 20, 8, 3)])
def test_greedy_tokens_match_dllms_samplers(loaded, ckpt, sampler, case):
    n, seed, max_tokens, block, steps = case
    model, tok = loaded
    p = prompt(n, seed)
    total = steps * math.ceil(max_tokens / block)
    if sampler == "mdlm":
        seq = mdlm_sample(
            reference_forward(ckpt), [p], max_tokens, block, total, mask_id=MASK, eos_id=IM_END
        )
        want = seq[0, n : n + max_tokens].tolist()
    else:
        seq, padded = bd3lm_sample(
            ckpt, [p], max_tokens, block, total, mask_id=MASK, pad_id=ENDOFTEXT, eos_id=IM_END
        )
        want = seq[0, padded:].tolist()
    kw = dict(sampler=sampler, max_tokens=max_tokens, block_length=block, steps=steps)
    s = resolve_settings(model.diffusion_spec, kw, {})
    got = []
    for event in make_decoder(model, s, eos_token_ids=()).run([p]):
        if isinstance(event, BlockEvent):
            got.extend(event.tokens[0])
    assert got[: len(want)] == want


def test_published_config_builds_the_full_model_lazily():
    from mlx.utils import tree_flatten

    args = a2d_qwen2.ModelArgs.from_dict(json.loads((DATA / "config.json").read_text()))
    model = a2d_qwen2.Model(args)
    count = sum(v.size for _, v in tree_flatten(model.parameters()))
    assert 4.8e8 < count < 5.1e8  # Qwen2.5-0.5B with its tied head (4.94e8)
    spec = model.diffusion_spec
    assert (spec.family, spec.mask_token_id, spec.eos_token_ids) == ("a2d", 151665, (151645,))
