"""The masked-diffusion loss against a transcription of LLaDA's GUIDELINES.md, and the training loop."""

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mlx.utils import tree_flatten

from fixtures.dream import build as build_dream
from fixtures.llada import build_llada, build_llada_moe
from helpers import load_fixture, spy_forwards
from mlx_dllm_models.training import (
    apply_lora,
    diffusion_loss,
    forward_process,
    fuse_lora,
    hf_weights,
    sample_noise,
    save_checkpoint,
    train,
)

EPS = 1e-3


@pytest.fixture(scope="module")
def llada(tmp_path_factory):
    return load_fixture(build_llada(tmp_path_factory.mktemp("train") / "llada"))


@pytest.fixture(scope="module")
def dream(tmp_path_factory):
    return load_fixture(build_dream(tmp_path_factory.mktemp("train") / "dream"))


def _batch(seed, B=4, L=24, vocab=256, prompt=(5, 9, 3, 12)):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, size=(B, L)).astype(np.int32)
    return tokens, np.array(prompt[:B], np.int32)


def _draws(seed, B, L):
    rng = np.random.default_rng(seed)
    return rng.random(B).astype(np.float32), rng.random((B, L)).astype(np.float32)


def _torch_logits(model, noisy, shift):
    logits = torch.from_numpy(np.array(model(mx.array(noisy)).astype(mx.float32)))
    if shift:  # Dream's _sample: cat([logits[:, :1], logits[:, :-1]], dim=1)
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
    return logits


def reference_pretraining_loss(model, mask_id, input_ids, t, u, shift=0):
    """LLaDA GUIDELINES.md, Pre-training, with torch.rand replaced by the given draws."""
    input_ids, t, u = map(torch.from_numpy, (input_ids, t, u))
    b, l = input_ids.shape
    p_mask = (1 - EPS) * t + EPS
    p_mask = p_mask[:, None].repeat(1, l)
    masked_indices = u < p_mask
    noisy_batch = torch.where(masked_indices, mask_id, input_ids)
    logits = _torch_logits(model, noisy_batch.numpy(), shift)
    token_loss = (
        F.cross_entropy(logits[masked_indices], input_ids[masked_indices].long(), reduction="none")
        / p_mask[masked_indices]
    )
    return (token_loss.sum() / (b * l)).item()


def reference_sft_loss(model, mask_id, input_ids, prompt_lengths, t, u, shift=0, kept=None):
    """LLaDA GUIDELINES.md, SFT: noise everything, restore the prompt, divide by answer length.
    `kept` (B, L), when given, replaces the prompt mask (the positions restored)."""
    input_ids, prompt_lengths, t, u = map(torch.from_numpy, (input_ids, prompt_lengths, t, u))
    b, l = input_ids.shape
    p_mask = ((1 - EPS) * t + EPS)[:, None].repeat(1, l)
    noisy_batch = torch.where(u < p_mask, mask_id, input_ids)
    token_positions = torch.arange(l).expand(b, l)
    prompt_mask = token_positions < prompt_lengths.unsqueeze(1)
    if kept is not None:
        prompt_mask = torch.from_numpy(kept)
    noisy_batch[prompt_mask] = input_ids[prompt_mask]
    answer_lengths = torch.sum(1 - prompt_mask.to(torch.int64), dim=-1, keepdim=True).repeat(1, l)
    masked_indices = noisy_batch == mask_id
    logits = _torch_logits(model, noisy_batch.numpy(), shift)
    token_loss = (
        F.cross_entropy(logits[masked_indices], input_ids[masked_indices].long(), reduction="none")
        / p_mask[masked_indices]
    )
    return (torch.sum(token_loss / answer_lengths[masked_indices]) / b).item()


def _close(a, b):
    assert abs(a - b) <= 1e-5 * abs(b) + 1e-6, (a, b)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_loss_matches_llada_guidelines(family, llada, dream):
    model, _ = llada if family == "llada" else dream
    spec = model.diffusion_spec
    tokens, plen = _batch(0)  # ids < 256: never the mask token, so `== mask_id` finds the noise
    t, u = _draws(1, *tokens.shape)
    t[0] = 0.0  # p = eps: the 1/p weight at its largest
    args = dict(mask_token_id=spec.mask_token_id, logit_shift=spec.logit_shift)
    got = diffusion_loss(model, mx.array(tokens), mx.array(t), mx.array(u), **args).item()
    _close(
        got, reference_pretraining_loss(model, spec.mask_token_id, tokens, t, u, spec.logit_shift)
    )
    got = diffusion_loss(
        model, mx.array(tokens), mx.array(t), mx.array(u), prompt_lengths=mx.array(plen), **args
    ).item()
    want = reference_sft_loss(model, spec.mask_token_id, tokens, plen, t, u, spec.logit_shift)
    _close(got, want)
    if family == "dream":  # the shift matters: the unshifted loss is another number
        unshifted = reference_sft_loss(model, spec.mask_token_id, tokens, plen, t, u, 0)
        assert abs(unshifted - want) > 1e-3 * abs(want)


def _maskable(tokens, plen):
    """The answer (after the prompt) and, in each prompt, a 3-token span: a solved example's answer
    in a few-shot prompt."""
    L = tokens.shape[1]
    maskable = np.arange(L)[None] >= plen[:, None]
    for row, p in enumerate(plen):
        if p >= 4:
            maskable[row, p - 4 : p - 1] = True
    return maskable


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_loss_with_several_answers_a_row(family, llada, dream):
    model, _ = llada if family == "llada" else dream
    spec = model.diffusion_spec
    tokens, plen = _batch(3)
    t, u = _draws(4, *tokens.shape)
    args = dict(mask_token_id=spec.mask_token_id, logit_shift=spec.logit_shift)
    after_prompt = np.arange(tokens.shape[1])[None] >= plen[:, None]
    # maskable = "after the prompt" is the SFT loss itself
    got = diffusion_loss(
        model, mx.array(tokens), mx.array(t), mx.array(u), maskable=mx.array(after_prompt), **args
    ).item()
    _close(got, reference_sft_loss(model, spec.mask_token_id, tokens, plen, t, u, spec.logit_shift))
    # spans inside the prompt are noised and scored too, each row divided by its maskable count
    maskable = _maskable(tokens, plen)
    got = diffusion_loss(
        model, mx.array(tokens), mx.array(t), mx.array(u), maskable=mx.array(maskable), **args
    ).item()
    want = reference_sft_loss(
        model, spec.mask_token_id, tokens, plen, t, u, spec.logit_shift, kept=~maskable
    )
    _close(got, want)
    assert abs(got - reference_sft_loss(model, spec.mask_token_id, tokens, plen, t, u)) > 1e-4


def test_training_masks_only_maskable_positions(llada):
    model, _ = llada
    mask = model.diffusion_spec.mask_token_id
    tokens, plen = _batch(5)
    maskable = _maskable(tokens, plen)
    seen = []
    with spy_forwards(model, lambda inputs, *_: seen.append(np.array(inputs))):
        train(
            model,
            [{"tokens": tokens, "maskable": maskable}] * 4,
            optimizer=optim.SGD(learning_rate=0.0),
            seed=2,
        )
    seen = np.stack(seen)
    assert (seen[:, ~maskable] == tokens[~maskable]).all()
    in_prompt = maskable & (np.arange(tokens.shape[1])[None] < plen[:, None])
    assert (seen[:, in_prompt] == mask).any()  # the in-prompt answers are trained on


def test_maskable_batches_are_checked(llada):
    model, _ = llada
    tokens, plen = _batch(6)
    maskable = _maskable(tokens, plen)
    sgd = optim.SGD(learning_rate=0.0)
    cases = [
        ({"tokens": tokens, "maskable": maskable, "prompt_lengths": plen}, "not both"),
        ({"tokens": tokens, "maskable": maskable[:, :-1]}, "booleans of the tokens' shape"),
        (
            {"tokens": tokens, "maskable": maskable.astype(np.int32)},
            "booleans of the tokens' shape",
        ),
        ({"tokens": tokens, "maskable": np.zeros_like(maskable)}, "no maskable position"),
    ]
    for batch, message in cases:
        with pytest.raises(ValueError, match=message):
            train(model, [batch], optimizer=sgd)


def test_sft_never_masks_the_prompt(llada):
    model, _ = llada
    mask = model.diffusion_spec.mask_token_id
    tokens, plen = _batch(2)
    t = mx.ones((4,))  # p = 1: every answer position is masked
    noisy, masked, _ = forward_process(
        mx.array(tokens), t, mx.zeros(tokens.shape), mask, prompt_lengths=mx.array(plen)
    )
    noisy, masked = np.array(noisy), np.array(masked)
    for row, p in enumerate(plen):
        assert (noisy[row, :p] == tokens[row, :p]).all() and not masked[row, :p].any()
        assert (noisy[row, p:] == mask).all() and masked[row, p:].all()

    # And inside the loop, over random draws: the model never sees a masked prompt position.
    seen = []
    with spy_forwards(model, lambda inputs, *_: seen.append(np.array(inputs))):
        train(model, [(tokens, plen)] * 3, optimizer=optim.SGD(learning_rate=0.0), seed=5)
    assert len(seen) == 3 and any((s == mask).any() for s in seen)
    for s in seen:
        for row, p in enumerate(plen):
            assert (s[row, :p] == tokens[row, :p]).all()


def _fixed_loss(model, tokens, plen):
    t, u = sample_noise(mx.random.key(123), tokens.shape)
    spec = model.diffusion_spec
    return diffusion_loss(
        model,
        mx.array(tokens),
        t,
        u,
        mask_token_id=spec.mask_token_id,
        logit_shift=spec.logit_shift,
        prompt_lengths=mx.array(plen),
    ).item()


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_a_few_steps_lower_the_loss(family, tmp_path):
    build = build_llada if family == "llada" else build_dream
    model, _ = load_fixture(build(tmp_path / family))
    tokens, plen = _batch(3)
    before = _fixed_loss(model, tokens, plen)
    losses = train(model, [(tokens, plen)] * 15, learning_rate=3e-3, seed=0, low_discrepancy=True)
    after = _fixed_loss(model, tokens, plen)
    assert len(losses) == 15 and np.isfinite(losses).all()
    assert after < 0.8 * before, (before, after)


def test_lora_trains_only_the_adapters(tmp_path):
    model, tok = load_fixture(build_llada(tmp_path / "llada"))
    base = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    # The adapters' initial draw, not whatever earlier tests left in the generator.
    mx.random.seed(0)
    apply_lora(model, rank=4, scale=10.0)
    trainable = [k for k, _ in tree_flatten(model.trainable_parameters())]
    assert trainable and all(k.rsplit(".", 1)[-1] in ("lora_a", "lora_b") for k in trainable)
    assert any(".self_attn.q_proj." in k for k in trainable)
    assert any(".mlp.down_proj." in k for k in trainable)
    tokens, plen = _batch(4)
    before = _fixed_loss(model, tokens, plen)
    train(model, [(tokens, plen)] * 15, learning_rate=1e-2, seed=0, low_discrepancy=True)
    after = _fixed_loss(model, tokens, plen)
    assert after < 0.9 * before, (before, after)
    now = dict(tree_flatten(model.parameters()))
    for k, v in base.items():
        lora_key = k.replace(".weight", ".linear.weight")
        current = now[k] if k in now else now[lora_key]
        np.testing.assert_array_equal(np.array(current), v, err_msg=k)
    assert any(np.abs(np.array(v)).max() > 0 for k, v in now.items() if k.endswith("lora_b"))

    # Fused and saved, the adapted model is one plain checkpoint giving the same logits.
    x = mx.array(tokens)
    want = np.array(model(x))
    fuse_lora(model)
    path = save_checkpoint(tmp_path / "fused", model, _config(tmp_path / "llada"), tokenizer=tok)
    again, _ = load_fixture(path)
    got = np.array(again(x))
    # Fusing reassociates float32 sums (W x + s B A x against (W + s B A) x), and the trained
    # adapters of this sharpened fixture amplify that through the layers: about 1e-4 of the largest
    # logit, varying with the BLAS threads' summation order. A fusing bug (scale, transpose, a
    # missing adapter) moves logits by whole units.
    assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max()


def _config(path):
    import json

    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize("builder", [build_llada, build_llada_moe, build_dream])
def test_saved_checkpoint_has_hf_names_and_reloads(builder, tmp_path):
    src = builder(tmp_path / "src")
    model, tok = load_fixture(src)
    from safetensors import safe_open

    with safe_open(str(src / "model.safetensors"), "np") as f:
        hf_names = set(f.keys())
    if builder is build_llada:  # dense LLaDA: exactly the names of the HF checkpoint
        assert set(hf_weights(model)) == hf_names
    path = save_checkpoint(
        tmp_path / "out", model, _config(src), tokenizer=tok, generation_config={"eos_token_id": 1}
    )
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert (path / name).exists(), name
    again, tok2 = load_fixture(path)
    x = mx.array(_batch(6)[0])
    np.testing.assert_array_equal(np.array(again(x)), np.array(model(x)))
    assert tok2.encode("abc") == tok.encode("abc")
