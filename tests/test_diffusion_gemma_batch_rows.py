"""DiffusionGemma's batch rows equal their single runs (issue #40). The cause of the difference
was the positions of a left-padded row: its RoPE positions started at its padding, so its numbers
were those of its run alone shifted by that many positions (equal in exact arithmetic, RoPE being
relative, not in floating point: its first step's logits differed by about 1e-3, and the sampled
draws over the canvas amplified that into other tokens). Each row now takes its own positions:
the padded computation equals the unpadded one bit for bit."""

import mlx.core as mx
import pytest

from fixtures import build_once
from fixtures import diffusion_gemma as dg_fx
from mlx_dllm_models import batch_generate_diffusion, load
from mlx_dllm_models.vision import text_tokenizer

RAW = [[20 + (i * 13) % 200 for i in range(n)] for n in (5, 11, 17)]
QUESTIONS = ["Hello there", "What is two plus two?", "abc"]


@pytest.fixture(scope="module")
def loaded(fixture_dir):
    return load(build_once(fixture_dir / "diffusion_gemma_seed3", dg_fx.build, seed=3))


def first_step_logits(model, prompts, canvas):
    """The decoder's logits over `canvas` after the left-padded prompts, as the canvas loop runs
    its first step."""
    longest = max(len(p) for p in prompts)
    pads = [longest - len(p) for p in prompts]
    tokens = mx.array([[0] * pad + list(p) for pad, p in zip(pads, prompts)], dtype=mx.int32)
    valid = mx.arange(longest)[None, :] >= mx.array(pads)[:, None] if any(pads) else None
    cache = model.make_cache()
    model.encode(tokens, cache, valid=valid)
    mask = None if valid is None else model.padding_masks(valid, canvas.shape[1])
    return model.decode(mx.concatenate([canvas] * len(prompts)), cache, None, mask=mask)


def test_a_padded_rows_first_step_is_its_single_run_bit_for_bit(loaded):
    model, _ = loaded
    vocab = model.diffusion_spec.vocab_size
    canvas = mx.random.randint(0, vocab, (1, 32), key=mx.random.key(0)).astype(mx.int32)
    batch = first_step_logits(model, RAW, canvas)
    for i, p in enumerate(RAW):
        alone = first_step_logits(model, [p], canvas)
        assert mx.array_equal(batch[i], alone[0]).item(), f"row {i}"


@pytest.mark.slow
def test_raw_id_rows_equal_their_single_runs(loaded):
    model, tok = loaded
    batch = batch_generate_diffusion(model, tok, RAW, max_tokens=32)
    for p, got in zip(RAW, batch.tokens):
        assert got == batch_generate_diffusion(model, tok, [p], max_tokens=32).tokens[0]


def test_chat_rows_equal_their_single_runs(loaded):
    model, tok = loaded
    chat = text_tokenizer(tok)
    prompts = [
        chat.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in QUESTIONS
    ]
    batch = batch_generate_diffusion(model, tok, prompts, max_tokens=16, seed=3)
    for p, got in zip(prompts, batch.tokens):
        assert got == batch_generate_diffusion(model, tok, [p], max_tokens=16, seed=3).tokens[0]
