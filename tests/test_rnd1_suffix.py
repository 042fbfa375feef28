"""RND1's trailing pad by default: RND1GenerationMixin.generate always sets an EOS id, so its
diffusion_sample keeps the sequence's last position as the pad token <|endoftext|>, which the model
sees at every step. A call that names no suffix places it (spec.default_suffix, read by
request.prepare) in the last of its max_tokens positions and equals the reference's
generate(max_new_tokens=max_tokens)."""

import dataclasses

import pytest

from fixtures.rnd1 import ENDOFTEXT, IM_END, MASK, build
from helpers import checkpoint_fixtures
from helpers import random_prompt as prompt
from mlx_dllm_models import batch_generate_diffusion
from mlx_dllm_models.models import rnd1
from mlx_dllm_models.request import prepare
from reference.rnd1_sampling import greedy_answer, reference_forward

ckpt, loaded = checkpoint_fixtures("rnd1", build)


def reference(ckpt, p, max_tokens, steps):
    """generate(max_new_tokens=max_tokens) at greedy=True, temperature 1 (what temperature 0 is
    here, tests/test_rnd1.py): max_tokens - 1 masks, then the pad it reserves."""
    ids = dict(mask_token_id=MASK, eos_token_id=IM_END, pad_token_id=ENDOFTEXT)
    toks, pad, _ = greedy_answer(reference_forward(ckpt), p, max_tokens, steps, **ids)
    assert pad == ENDOFTEXT
    return toks


def test_the_spec_declares_the_pad_of_config_json(loaded):
    model, tok = loaded
    assert model.args.pad_token_id == ENDOFTEXT
    assert model.diffusion_spec.default_suffix == (ENDOFTEXT,)
    assert prepare(model, tok, [[40, 41]], {}).suffix == [ENDOFTEXT]
    assert prepare(model, tok, [[40, 41]], {}, suffix=[41, 42]).suffix == [41, 42]  # replaces it


def test_without_pad_token_id_the_references_fallback(loaded):
    """generation_utils.py: `pad_token_id = gen_config.pad_token_id or config.pad_token_id`,
    151643 when both are unset."""
    model, _ = loaded
    args = dataclasses.replace(model.args, pad_token_id=None)
    assert rnd1.Model(args).diffusion_spec.default_suffix == (rnd1.RND1_PAD_TOKEN_ID,) == (151643,)


CASES = [(7, 0, 12, 12), (3, 1, 16, 5), (10, 2, 9, 20)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"P{c[0]}-N{c[2]}-S{c[3]}")
def test_a_default_call_equals_the_reference(loaded, ckpt, case):
    n, seed, max_tokens, steps = case
    model, tok = loaded
    p = prompt(n, seed)
    got = batch_generate_diffusion(
        model, tok, [p], max_tokens=max_tokens, steps=steps, temperature=0.0
    )
    assert got.tokens[0] == reference(ckpt, p, max_tokens, steps)


def test_the_check_can_fail_without_the_pad(loaded, ckpt):
    """Without the pad (an explicit empty suffix: as many masks, no pad) the canvas the model sees
    differs, and so do the tokens: the default is what makes the call above equal the
    reference."""
    model, tok = loaded
    differ = 0
    for n, seed, max_tokens, steps in CASES:
        p = prompt(n, seed)
        got = batch_generate_diffusion(
            model, tok, [p], max_tokens=max_tokens - 1, steps=steps, temperature=0.0, suffix=[]
        )
        differ += got.tokens[0] != reference(ckpt, p, max_tokens, steps)
    assert differ > 0


def test_the_servers_lowered_max_tokens_leaves_room_for_the_pad(loaded):
    """fit_context (the server's rule) lowers max_tokens to what fits with the pad after it."""
    model, tok = loaded
    limit = model.diffusion_spec.max_position_embeddings
    p = prompt(7, 0)
    request = prepare(model, tok, [p], {"max_tokens": limit}, fit_context=True)
    assert len(p) + request.settings.max_tokens + len(request.suffix) == limit
