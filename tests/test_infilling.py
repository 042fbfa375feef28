"""Infilling for the bidirectional families: `suffix=` puts max_tokens masks between the prompt and
the suffix, and mask tokens inside a prompt are filled too. Token parity at temperature 0 with the
transcriptions of LLaDA's generate.py (every mask before the block's end is a candidate) and
Dream's diffusion_generate (the whole canvas); refusals for the other layouts; the CLI's --suffix."""

import functools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fixtures.dream import MASK as DREAM_MASK
from fixtures.dream import build as build_dream
from fixtures.llada import CHECKPOINTS as LLADA
from helpers import cli_env, cut_at_eos, load_fixture, stream_tokens, torch_logits_fn
from mlx_dllm_models import batch_generate_diffusion, generate_diffusion
from mlx_dllm_models.settings import SettingsError
from reference.dream_torch import dream_generate, reference_forward
from reference.llada_torch import llada_generate

ROOT = Path(__file__).resolve().parents[1]
PREFIX = [40, 41, 42, 43, 44, 45, 46]
SUFFIX = [60, 61, 62, 63]


@pytest.fixture(scope="module")
def llada(tmp_path_factory):
    path = LLADA["llada"](tmp_path_factory.mktemp("llada") / "ckpt")
    model, tok = load_fixture(path)
    return path, model, tok


@pytest.fixture(scope="module")
def dream(tmp_path_factory):
    path = build_dream(tmp_path_factory.mktemp("dream") / "ckpt")
    model, tok = load_fixture(path)
    return path, model, tok


@pytest.mark.parametrize("gen, block, steps", [(16, 8, 8), (12, 12, 6)])
def test_llada_suffix_matches_generate_py(llada, gen, block, steps):
    _, model, tok = llada
    spec = model.diffusion_spec
    reference = functools.partial(
        llada_generate,
        torch_logits_fn(model),
        torch.tensor([PREFIX]),
        steps=steps * (gen // block),
        gen_length=gen,
        block_length=block,
        mask_id=spec.mask_token_id,
    )
    x = reference(suffix_ids=SUFFIX)
    assert x[0, -len(SUFFIX) :].tolist() == SUFFIX
    plain = reference()
    span = x[0, len(PREFIX) : len(PREFIX) + gen]
    assert (span != plain[0, len(PREFIX) :]).any(), "the suffix changes nothing: could not fail"
    want = cut_at_eos(span, set(spec.eos_token_ids))
    got = stream_tokens(
        model, tok, PREFIX, suffix=SUFFIX, max_tokens=gen, block_length=block, steps=steps
    )
    assert got == want


def test_llada_masks_in_the_prompt_match_generate_py(llada):
    _, model, tok = llada
    spec = model.diffusion_spec
    m = spec.mask_token_id
    prompt = [40, 41, m, m, 44, m, 46]
    kw = dict(gen_length=16, block_length=8, mask_id=m)
    # Upstream's quota counts the block's masks only, and leaves as many masks as the prompt held.
    upstream = llada_generate(torch_logits_fn(model), torch.tensor([prompt]), steps=16, **kw)
    assert int((upstream == m).sum()) == 3
    x = llada_generate(
        torch_logits_fn(model), torch.tensor([prompt]), steps=16, fill_prompt_masks=True, **kw
    )
    assert not (x == m).any()
    # The returned span starts at the prompt's first mask.
    want = x[0, 2:7].tolist() + cut_at_eos(x[0, 7:], set(spec.eos_token_ids))
    got = stream_tokens(model, tok, prompt, max_tokens=16, block_length=8, steps=8)
    assert got == want
    assert got[2] == 44  # the prompt's own token between the masks comes back unchanged
    text = generate_diffusion(model, tok, prompt, max_tokens=16, block_length=8, steps=8)
    assert text == tok.decode(got)


def test_llada_cfg_with_suffix_masks_the_suffix_too(llada):
    path, _, _ = llada
    model, tok = load_fixture(path)
    # A softer head: guidance sharpens the logits, and float32 confidences would tie at 1.0.
    model.lm_head.weight = model.lm_head.weight * 0.4
    spec = model.diffusion_spec
    x = llada_generate(
        torch_logits_fn(model),
        torch.tensor([PREFIX]),
        steps=8,
        gen_length=8,
        block_length=8,
        mask_id=spec.mask_token_id,
        suffix_ids=SUFFIX,
        cfg_scale=0.5,
    )
    want = cut_at_eos(x[0, len(PREFIX) : len(PREFIX) + 8], set(spec.eos_token_ids))
    assert stream_tokens(model, tok, PREFIX, suffix=SUFFIX, max_tokens=8, cfg_scale=0.5) == want


def test_llada_batch_with_a_shared_suffix(llada):
    _, model, tok = llada
    prompts = [PREFIX, [5, 6, 7]]
    batch = batch_generate_diffusion(model, tok, prompts, suffix=SUFFIX, max_tokens=8)
    assert batch.tokens == [
        stream_tokens(model, tok, p, suffix=SUFFIX, max_tokens=8) for p in prompts
    ]


DREAM_KW = dict(sampler="dream", alg="maskgit_plus", temperature=0.0, top_p=1.0)


def _dream_reference(path, ids, n, steps):
    seq = dream_generate(
        reference_forward(path),
        np.array([ids]),
        n,
        steps,
        alg="maskgit_plus",
        mask_token_id=DREAM_MASK,
    )
    assert not (seq == DREAM_MASK).any()
    return seq[0]


def test_dream_suffix_matches_diffusion_generate(dream):
    """Dream infills by decoding every mask of its input: prefix + masks + suffix, nothing
    appended."""
    path, model, tok = dream
    spec = model.diffusion_spec
    n, steps = 10, 5
    seq = _dream_reference(path, PREFIX + [DREAM_MASK] * n + SUFFIX, 0, steps)
    want = cut_at_eos(seq[len(PREFIX) : len(PREFIX) + n], set(spec.eos_token_ids))
    plain = _dream_reference(path, PREFIX, n, steps)
    assert list(seq[len(PREFIX) : len(PREFIX) + n]) != list(plain[len(PREFIX) :])
    got = stream_tokens(model, tok, PREFIX, suffix=SUFFIX, max_tokens=n, steps=steps, **DREAM_KW)
    assert got == want


def test_dream_masks_in_the_prompt_match_diffusion_generate(dream):
    path, model, tok = dream
    spec = model.diffusion_spec
    prompt = [40, DREAM_MASK, 42, DREAM_MASK, DREAM_MASK, 45]
    n, steps = 6, 4
    seq = _dream_reference(path, prompt, n, steps)
    want = seq[1:6].tolist() + cut_at_eos(seq[6:], set(spec.eos_token_ids))
    assert stream_tokens(model, tok, prompt, max_tokens=n, steps=steps, **DREAM_KW) == want


def test_dream_refuses_a_mask_at_the_first_position(dream):
    _, model, tok = dream
    with pytest.raises(SettingsError, match="first position"):
        stream_tokens(model, tok, [DREAM_MASK, 40, 41], max_tokens=4)


def test_suffix_holding_a_mask_is_refused(llada):
    _, model, tok = llada
    m = model.diffusion_spec.mask_token_id
    with pytest.raises(SettingsError, match="suffix holds the mask"):
        stream_tokens(model, tok, PREFIX, suffix=[60, m], max_tokens=4)


def test_text_suffix(llada):
    _, model, tok = llada
    text = generate_diffusion(model, tok, "def f(x):", suffix="    return y", max_tokens=8)
    ids = tok.encode("    return y", add_special_tokens=False)
    assert text == tok.decode(
        stream_tokens(model, tok, tok.encode("def f(x):"), suffix=ids, max_tokens=8)
    )


def _other_family(name, tmp_path_factory):
    if name in ("sdar", "sdar_moe"):
        from fixtures.sdar import CHECKPOINTS
    elif name == "nemotron":
        from fixtures.nemotron import CHECKPOINTS
    elif name == "llada2":
        from fixtures.llada2 import CHECKPOINTS
    else:
        from fixtures.diffusion_gemma import CHECKPOINTS
    key = name if name in CHECKPOINTS else sorted(CHECKPOINTS)[0]
    return load_fixture(CHECKPOINTS[key](tmp_path_factory.mktemp(name) / "ckpt"))


@pytest.mark.parametrize("family", ["sdar", "nemotron", "diffusion_gemma"])
def test_other_layouts_refuse_infilling(family, tmp_path_factory):
    model, tok = _other_family(family, tmp_path_factory)
    with pytest.raises(SettingsError, match="infilling .*suffix="):
        stream_tokens(model, tok, [40, 41, 42], suffix=[50, 51], max_tokens=4)
    m = model.diffusion_spec.mask_token_id
    if m is not None:
        with pytest.raises(SettingsError, match="infilling .*mask token"):
            stream_tokens(model, tok, [40, m, 42], max_tokens=4)


@pytest.mark.slow
def test_cli_suffix(llada):
    path, model, tok = llada
    env = cli_env()
    args = [
        "--model",
        str(path),
        "--prompt",
        "def f(x):",
        "--suffix",
        "    return y",
        "--ignore-chat-template",
        "--max-tokens",
        "8",
        "--no-live",
    ]
    out = subprocess.run(
        [sys.executable, "-m", "mlx_dllm_models", "generate", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    want = generate_diffusion(model, tok, "def f(x):", suffix="    return y", max_tokens=8)
    assert out.stdout.splitlines()[0] == want.splitlines()[0]
