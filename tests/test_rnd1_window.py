"""RND1's window as its reference's own call builds it (issue #43): `generate(max_new_tokens=N)`
(rnd/generation_utils.py, RadicalNumerics/RND1) makes a sequence of prompt + N positions, of which
diffusion_sample keeps the last as the pad token (an EOS id is always set): N - 1 masks, then the
pad. A default call with max_tokens=N builds that window, and returns the same tokens with the
same forwards. Config ids are read as published: a pad_token_id of 0 is id 0."""

import dataclasses
import json

import mlx.core as mx
import pytest

from fixtures.rnd1 import ENDOFTEXT, IM_END, MASK, build, config
from helpers import checkpoint_fixtures
from mlx_dllm_models import batch_generate_diffusion
from mlx_dllm_models.models import rnd1
from mlx_dllm_models.request import prepare
from mlx_dllm_models.settings import SettingsError
from reference.rnd1_sampling import greedy_answer, reference_forward

PROMPT = list(range(30, 39))


ckpt, loaded = checkpoint_fixtures("rnd1", build)


def reference_call(ckpt, prompt, max_new_tokens, steps):
    """generate(inputs=prompt, max_new_tokens=..., num_diffusion_steps=steps) at greedy=True,
    temperature 1 (what temperature 0 is here, tests/test_rnd1.py): the first forward's input,
    the generated tokens before the pad (cut at the first EOS, as the package returns them) and
    the forwards."""
    forward, windows = reference_forward(ckpt), []

    def recorded(x):
        windows.append(x[0].tolist())
        return forward(x)

    ids = dict(mask_token_id=MASK, eos_token_id=IM_END, pad_token_id=ENDOFTEXT)
    toks, _, nfe = greedy_answer(recorded, prompt, max_new_tokens, steps, **ids)
    return windows[0], toks, nfe


def package_call(model, tok, prompt, monkeypatch, **kw):
    """batch_generate_diffusion's tokens and forwards, and the first forward's input."""
    windows = []
    call = type(model).__call__

    def recorded(self, inputs, *a, **k):
        windows.append(inputs[0].tolist())
        return call(self, inputs, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(type(model), "__call__", recorded)
        out = batch_generate_diffusion(model, tok, [prompt], **kw)
    return windows[0], out.tokens[0], out.nfe


def test_the_readme_call_builds_the_references_window(loaded, ckpt, monkeypatch):
    model, tok = loaded
    want_window, want, ref_nfe = reference_call(ckpt, PROMPT, 16, 4)
    assert want_window == PROMPT + [MASK] * 15 + [ENDOFTEXT]
    window, got, nfe = package_call(
        model, tok, PROMPT, monkeypatch, max_tokens=16, steps=4, temperature=0.0
    )
    assert window == want_window
    assert got == want and len(got) <= 15
    assert nfe == ref_nfe == 4


def test_the_default_canvas_is_max_tokens_less_the_pad(loaded):
    model, tok = loaded
    request = prepare(model, tok, [PROMPT], {"max_tokens": 16})
    assert request.settings.max_tokens == 15 and request.suffix == [ENDOFTEXT]
    assert request.settings.block_length == 15 and request.reserved == 1
    # The recipe's max_new_tokens=256 is 255 masks under the reference's 256 steps.
    request = prepare(model, tok, [PROMPT], {})
    assert (request.settings.max_tokens, request.settings.steps) == (255, 256)
    # An explicit suffix is infilling: max_tokens masks between prompt and suffix.
    request = prepare(model, tok, [PROMPT], {"max_tokens": 16}, suffix=[40, 41])
    assert request.settings.max_tokens == 16 and request.reserved == 0
    with pytest.raises(SettingsError, match="max_tokens must be at least 2 for the rnd1 family"):
        prepare(model, tok, [PROMPT], {"max_tokens": 1})


def test_a_pad_token_id_of_zero_is_an_id():
    cfg = config()
    cfg["pad_token_id"] = 0
    args = rnd1.ModelArgs.from_dict(json.loads(json.dumps(cfg)))
    assert args.pad_token_id == 0
    assert rnd1.Model(args).diffusion_spec.default_suffix == (0,)
    unset = dataclasses.replace(args, pad_token_id=None)
    assert rnd1.Model(unset).diffusion_spec.default_suffix == (rnd1.RND1_PAD_TOKEN_ID,)
    mx.clear_cache()
