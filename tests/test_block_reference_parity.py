"""Block-diffusion decoding's token parity at temperature 0 with plain transcriptions of the
reference loops: SDAR's generate.py (every remasking strategy, on transformers' SDAR forward) and
LLaDA2.0 / 2.1's generate (threshold and token editing, on mlx-vlm's llada2_moe forward), with
the number of forwards each takes."""

import pytest
import torch

from block_checks import family_fixture, mlx_vlm_forward, run, tokens, transformers_forward
from reference.llada2_generate import llada20_generate, llada21_generate
from reference.sdar_generate import sdar_generate

family = family_fixture()

# ------------------------------------------------------------------------------ SDAR reference


def cut_at_eos(ids, eos):
    ids = [int(t) for t in ids]
    return next((ids[:i] for i, t in enumerate(ids) if t in eos), ids)


SDAR_STRATEGIES = {
    "quota": "low_confidence_static",
    "threshold": "low_confidence_dynamic",
    "sequential": "sequential",
    "entropy_bounded": "entropy_bounded",
}


@pytest.mark.parametrize(
    "name,sampler,block_length,steps",
    [
        ("sdar", "quota", 4, 4),
        ("sdar", "threshold", 4, 4),
        ("sdar", "sequential", 4, 4),
        ("sdar", "quota", 4, 2),
        ("sdar", "threshold", 8, 4),
        ("sdar", "sequential", 8, 4),
        ("sdar_moe", "threshold", 4, 4),
    ],
)
def test_sdar_matches_block_diffusion_generate(family, name, sampler, block_length, steps):
    _check_sdar_against_reference(family, name, sampler, block_length, steps)


def test_sdar_entropy_bounded_matches_block_diffusion_generate(family):
    """generate.py's default eb_threshold (0.35) and larger budgets that commit several masks a
    step. Prompts that end on a block edge: upstream's sum also covers prompt tokens that share the
    first block, the engine's does not (see decoding.block.entropy_bounded_commit)."""
    forwards = [
        tuple(
            _check_sdar_against_reference(
                family, "sdar", "entropy_bounded", 4, 4, eb_threshold=eb, prompts=(8,)
            )
        )
        for eb in (0.35, 2.0, 6.0)
    ]
    assert len(set(forwards)) == 3, f"the budgets did not change the commits: {forwards}"


def _check_sdar_against_reference(
    family, name, sampler, block_length, steps, eb_threshold=None, prompts=None
):
    """Greedy (the reference's T=0 divides by zero; see the transcription). With several tokens a
    step the reference's top-k may take non-mask positions; the transcription is told to take
    only masks there (topk_over_masks_only), which is what the engine does."""
    path, model, tok = family(name)
    spec = model.diffusion_spec
    eos = set(spec.eos_token_ids)
    forward = transformers_forward(path)
    # Requests that end on a block edge, and mid-block (the reference decodes the whole last
    # block and cuts it; so must the engine).
    cases = ((8, None), (7, None), (11, 32), (13, 18))
    if prompts is not None:
        cases = [(n, gen) for n in prompts for gen in (None, 30)]
    out = []
    for n, gen in cases:
        prompt = tokens(n, seed=n)
        if gen is None:
            gen = -(-(n + 16) // block_length) * block_length - n
        x, ref_forwards = sdar_generate(
            forward,
            torch.tensor([prompt]),
            spec.mask_token_id,
            gen_length=gen,
            block_length=block_length,
            denoising_steps=steps,
            temperature=0.0,
            remasking_strategy=SDAR_STRATEGIES[sampler],
            confidence_threshold=0.9,  # the family default (the README's engine examples)
            stopping_criteria_idx=sorted(eos),
            topk_over_masks_only=steps < block_length,
            eb_threshold=eb_threshold,
        )
        want = cut_at_eos(x[0, n : n + gen], eos)
        extra = {} if eb_threshold is None else {"eb_threshold": eb_threshold}
        (got,), _, dec = run(
            model,
            tok,
            [prompt],
            max_tokens=gen,
            block_length=block_length,
            steps=steps,
            sampler=sampler,
            temperature=0.0,
            **extra,
        )
        assert got == want
        # The reference's cache costs one store forward per finished block; folded here.
        assert dec.nfe == ref_forwards - dec.backend.commits_saved
        out.append(dec.nfe)
    return out


# ---------------------------------------------------------------------------- LLaDA2 reference


@pytest.fixture(scope="module")
def llada2(family):
    path, model, tok = family("llada2_moe")
    return model, tok, mlx_vlm_forward(path)


def llada2_cases(block_length):
    """(prompt, max_tokens): requests that end on a block edge, and mid-block (11 + 32, 32 + 40),
    where the reference decodes the whole last block and cuts it."""
    edge = [(n, -(-(n + 40) // block_length) * block_length - n) for n in (7, 40)]
    cases = edge + [(11, 32), (32, 40)]
    assert any((n + gen) % block_length for n, gen in cases)
    return [(tokens(n, seed=n), gen) for n, gen in cases]


def without_eos(ids, eos_id):
    ids = [int(t) for t in ids]
    return ids[:-1] if ids and ids[-1] == eos_id else ids


@pytest.mark.parametrize(
    "block_length,steps,threshold",
    [(32, 32, 0.95), (32, 32, 0.7), (32, 8, 0.95), (16, 16, 0.95)],
)
def test_llada20_matches_reference_generate(llada2, block_length, steps, threshold):
    model, tok, forward = llada2
    spec = model.diffusion_spec
    eos = spec.eos_token_ids[0]
    for prompt, gen in llada2_cases(block_length):
        want, ref_forwards = llada20_generate(
            forward,
            torch.tensor([prompt]),
            block_length=block_length,
            steps=steps,
            gen_length=gen,
            threshold=threshold,
            eos_id=eos,
            mask_id=spec.mask_token_id,
        )
        (got,), _, dec = run(
            model,
            tok,
            [prompt],
            max_tokens=gen,
            block_length=block_length,
            steps=steps,
            threshold=threshold,
        )
        assert got == without_eos(want, eos)
        assert dec.nfe - dec.backend.prefill_forwards == ref_forwards


@pytest.mark.slow
@pytest.mark.parametrize(
    "block_length,threshold,editing_threshold,max_post_steps",
    [
        (32, 0.95, 0.9, 16),
        (32, 0.7, 0.7, 4),
        (16, 0.7, 0.5, 4),
        (16, 0.9, 0.6, 8),
        (16, 0.7, 0.8, 16),
    ],
)
def test_llada21_editing_matches_reference_generate(
    llada2, block_length, threshold, editing_threshold, max_post_steps
):
    """steps == block_length: one mask a step at least, the reference's num_to_transfer=1."""
    model, tok, forward = llada2
    spec = model.diffusion_spec
    eos = spec.eos_token_ids[0]
    for prompt, gen in llada2_cases(block_length):
        want, ref_forwards, remasked = llada21_generate(
            forward,
            torch.tensor([prompt]),
            block_length=block_length,
            steps=block_length,
            gen_length=gen,
            threshold=threshold,
            editing_threshold=editing_threshold,
            max_post_steps=max_post_steps,
            eos_id=eos,
            mask_id=spec.mask_token_id,
        )
        assert remasked == 0, "the reference edited a token into the mask token: pick another case"
        (got,), (reason,), dec = run(
            model,
            tok,
            [prompt],
            max_tokens=gen,
            block_length=block_length,
            steps=block_length,
            threshold=threshold,
            editing_threshold=editing_threshold,
            max_post_steps=max_post_steps,
        )
        assert got == without_eos(want, eos)
        if reason == "length":  # the reference does not stop at an EOS; forwards agree otherwise
            assert dec.nfe - dec.backend.prefill_forwards == ref_forwards
