"""Fast-dLLM v2's forwards against its reference's `generate` (issues #41, #43): a block's first
token is the argmax after the finished block before it (the reference's
`update_past_key_values` forward), so where that token is the last one wanted, or the end token,
the reference opens no block after it; neither does the package. Tokens equal the reference's in
every case; so do the forwards, except the reference's forward after its last block for a seed
it never returns (the package runs none)."""

import numpy as np
import pytest
import torch

from fixtures import fast_dllm_v2 as fx
from helpers import checkpoint_fixtures, cut_at_eos, load_fixture
from mlx_dllm_models import batch_generate_diffusion
from reference.fast_dllm_v2_torch import Reference, generate

B = fx.BLOCK_SIZE


checkpoint, loaded = checkpoint_fixtures(
    "fast_dllm_v2", fx.build, name="checkpoint", loader=load_fixture
)


@pytest.fixture(scope="module")
def ref(checkpoint):
    return Reference(checkpoint)


def prompt(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


def ref_generate(ref, ids, max_new_tokens):
    """The reference's generate at the recipe (threshold 0.9, sub-blocks of 8): its new tokens
    cut at the end token, and its forwards."""
    out, nfe = generate(
        ref,
        torch.tensor([ids]),
        max_new_tokens,
        fx.MASK,
        threshold=0.9,
        small_block_size=8,
        block_size=B,
        stop_token=fx.IM_END,
    )
    return cut_at_eos(out[0, len(ids) :].tolist(), {fx.IM_END}), nfe


def reference(ref, ids, n):
    """The reference's call that covers n new tokens: max_new_tokens of the whole blocks that
    hold a mask among them (a token on a block's first column is the seed of the block before)."""
    last = len(ids) + n - 1
    blocks = (last - 1) // B + 1 - len(ids) // B
    toks, nfe = ref_generate(ref, ids, blocks * B)
    return toks[:n], nfe


@pytest.mark.parametrize("n", [57, 58, 89, 90])
def test_a_last_token_that_is_a_seed_costs_one_forward(loaded, ref, n):
    """Prompt 7: new tokens 58 and 90 end on a block's first column (64, 96)."""
    model, tok = loaded
    ids = prompt(7, 7)
    got = batch_generate_diffusion(model, tok, [ids], max_tokens=n)
    want, ref_nfe = reference(ref, ids, n)
    assert got.tokens[0] == want and len(want) == n
    seed_last = (len(ids) + n - 1) % B == 0
    assert got.nfe == (ref_nfe if seed_last else ref_nfe - 1)


# (prompt length, rng seed): prompts whose end token is the argmax after a finished block.
EOS_SEEDED = [(17, 17), (39, 1039), (58, 1058)]


@pytest.mark.parametrize("length, seed", EOS_SEEDED)
def test_an_end_token_seed_ends_the_row_without_a_step(loaded, ref, length, seed):
    model, tok = loaded
    ids = prompt(length, seed)
    got = batch_generate_diffusion(model, tok, [ids], max_tokens=96)
    want, ref_nfe = ref_generate(ref, ids, 4 * B)
    assert got.tokens[0] == want and got.finish_reasons[0] == "stop"
    assert (length + len(want)) % B == 0  # the end token sits on a block's first column
    assert got.nfe == ref_nfe


def test_batch_rows_that_a_seed_finishes_equal_their_single_runs(loaded):
    model, tok = loaded
    prompts = [prompt(n, s) for n, s in EOS_SEEDED] + [prompt(7, 7)]
    batch = batch_generate_diffusion(model, tok, prompts, max_tokens=58)
    for ids, got in zip(prompts, batch.tokens):
        assert got == batch_generate_diffusion(model, tok, [ids], max_tokens=58).tokens[0]
