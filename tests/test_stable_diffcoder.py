"""What only Stable-DiffCoder has: its forward under generate_block's block-causal mask, its
generate_block's tokens and forwards at the model card's call (and at generate_block's own threshold
default), the last block cut at max_tokens, and the published config (model_type "llama") reached
through `mlx_dllm convert --model-type stable_diffcoder`. The rows every family shares are in
tests/test_conformance.py."""

import mlx.core as mx
import numpy as np
import pytest

from fixtures import build_once
from fixtures import stable_diffcoder as fixture
from helpers import assert_close, checkpoint_fixtures, cut_at_eos, far
from mlx_dllm_models import CheckpointError, batch_generate_diffusion, load
from mlx_dllm_models.conversion import retyped_config
from mlx_dllm_models.engine.base import BlockEvent
from mlx_dllm_models.generate import stream_events
from mlx_dllm_models.masks import block_causal_mask
from mlx_dllm_models.settings import resolve_settings
from reference import stable_diffcoder_torch as reference

BLOCK = fixture.BLOCK_LENGTH


ckpt, loaded = checkpoint_fixtures("stable_diffcoder", fixture.build_converted)


def run(model, tok, prompt, **settings):
    """One row's tokens and the decoder (its backend holds the forward counters)."""
    _, ids, decoder = stream_events(model, tok, [prompt], **settings)
    out = []
    for event in decoder.run(ids):
        if isinstance(event, BlockEvent):
            out.extend(event.tokens[0])
    return out, decoder


@pytest.mark.parametrize("length", [8, 11])
def test_block_causal_logits_match_the_reference(ckpt, loaded, length):
    model, _ = loaded
    ids = np.random.default_rng(length).integers(0, 256, (2, length))
    ids[:, length // 2 :] = fixture.MASK
    ours = model(mx.array(ids), mask=block_causal_mask(length, BLOCK))
    assert_close(ours, reference.reference_logits(ckpt, ids, block_length=BLOCK))
    assert far(ours, reference.reference_logits(ckpt, ids, causal=True))


def test_defaults_are_the_model_cards_call(loaded):
    model, _ = loaded
    spec = model.diffusion_spec
    assert dict(spec.defaults) == {
        "block_length": 4,
        "sampler": "quota",
        "temperature": 0.0,
        "threshold": 0.95,
        "max_tokens": 512,
    }
    resolved = resolve_settings(spec, {}, {})
    # One token a step: 512 steps over 512 / 4 blocks is 4 a block.
    assert (resolved.steps, resolved.block_length, resolved.max_tokens) == (4, 4, 512)
    assert (resolved.sampler, resolved.temperature) == ("quota", 0.0)
    assert (spec.mask_token_id, spec.eos_token_ids) == (fixture.MASK, (fixture.EOS,))
    assert spec.confidence == "raw" and spec.quota_base == "masks" and spec.logit_shift == 0


# (prompt length, gen_length, settings): the model card's call (steps = gen_length, one token a
# step, threshold None) on prompts on and off the block grid, fewer steps a block, and
# generate_block's own threshold default (sampler "threshold", 0.95).
CASES = [
    (8, 32, {}),
    (7, 32, {}),
    (13, 64, {}),
    (10, 32, {"steps": 2}),
    (9, 32, {"sampler": "threshold"}),
]


@pytest.mark.slow
@pytest.mark.parametrize("n, gen, settings", CASES)
def test_tokens_and_forwards_match_generate_block(ckpt, loaded, n, gen, settings):
    model, tok = loaded
    prompt = np.random.default_rng(n).integers(0, 256, n).tolist()
    per_block = settings.get("steps", BLOCK)
    threshold = 0.95 if settings.get("sampler") == "threshold" else None
    x, ref_nfe = reference.generate_block(
        ckpt,
        prompt,
        steps=per_block * gen // BLOCK,
        gen_length=gen,
        block_length=BLOCK,
        mask_id=fixture.MASK,
        threshold=threshold,
        eos_id=fixture.EOS,
    )
    got, dec = run(model, tok, prompt, max_tokens=gen, **settings)
    assert got == cut_at_eos(x[n:], {fixture.EOS})
    assert len(got) == gen
    # Upstream's nfe leaves out the prefill and counts one store forward per finished block,
    # which the engine folds into the next block's first forward.
    assert dec.nfe - dec.backend.prefill_forwards == ref_nfe - dec.backend.commits_saved


@pytest.mark.parametrize("seed", [15, 17, 19])
def test_a_run_ends_at_its_eos_as_generate_block_does(fixture_dir, seed):
    # generate_block stops after the block that holds the EOS (no store forward for it) and fills
    # the block from the EOS on with it; the package returns the tokens before the EOS.
    ckpt = build_once(fixture_dir / "stable_diffcoder_eos", fixture.build_eos_prone)
    model, tok = load(ckpt)
    prompt = np.random.default_rng(seed).integers(0, 256, 6).tolist()
    x, ref_nfe = reference.generate_block(
        ckpt, prompt, steps=32, gen_length=32, mask_id=fixture.MASK, eos_id=fixture.EOS
    )
    assert fixture.EOS in x[6:] and len(x) < 6 + 32
    got, dec = run(model, tok, prompt, max_tokens=32)
    assert got == cut_at_eos(x[6:], {fixture.EOS})
    # Upstream stores every finished block but the EOS one; the engine counts that one saved too.
    stores = dec.backend.commits_saved - 1
    assert dec.nfe - dec.backend.prefill_forwards == ref_nfe - stores


def test_a_prompt_off_the_grid_decodes_only_max_tokens(loaded):
    # generate_block's last block is the prompt's remainder: 7 + 32 ends 3 into a block, whose
    # three masks take three forwards (one token a step), not a whole block of four.
    model, tok = loaded
    prompt = np.random.default_rng(7).integers(0, 256, 7).tolist()
    _, ids, dec = stream_events(model, tok, [prompt], max_tokens=32)
    steps = 0
    last = None
    for event in dec.run(ids):
        if isinstance(event, BlockEvent):
            last = (steps, event.tokens[0])
            steps = 0
        else:
            steps += 1
    assert last == (3, last[1]) and len(last[1]) == 3


def test_the_published_config_is_converted_with_the_tokenizers_mask(fixture_dir):
    published = build_once(fixture_dir / "stable_diffcoder_published", fixture.build)
    with pytest.raises(CheckpointError, match="--model-type stable_diffcoder") as e:
        load(published)
    assert "\n" not in str(e.value)
    assert retyped_config(published, "stable_diffcoder") == {
        "model_type": "stable_diffcoder",
        "mask_token_id": fixture.MASK,
    }


def test_batch_rows_are_their_single_runs(loaded):
    # Rows whose canvases end at different columns: each row's last block stops at its own end,
    # and the columns after it, which the longer rows fill, are out of its view.
    model, tok = loaded
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, n).tolist() for n in (10, 8, 7)]
    together = batch_generate_diffusion(model, tok, prompts, max_tokens=8).tokens
    assert together == [
        batch_generate_diffusion(model, tok, [p], max_tokens=8).tokens[0] for p in prompts
    ]
    assert all(len(t) == 8 for t in together)
