"""Nemotron-Labs-Diffusion forward: parity with mlx-vlm's independent implementation in both
attention modes and with a causal prefix cache, per-row positions, the tied head, and AR use
through mlx-lm.

Sequences reach past original_max_position_embeddings (16), so the Llama-4 query scale is active.
"""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from fixtures import build_once
from fixtures import nemotron as fx
from helpers import assert_close, load_fixture, parity
from mlx_dllm_models.cache import Positions
from mlx_dllm_models.masks import padding_mask
from mlx_dllm_models.models.nemotron_labs_diffusion import Model, ModelArgs
from mlx_dllm_models.settings import family_settings

PROMPT_LEN, BLOCK_LEN = 21, fx.BLOCK_SIZE


@pytest.fixture(scope="module", params=["nemotron", "nemotron_tied"])
def checkpoint(request, fixture_dir):
    return build_once(fixture_dir / request.param, fx.CHECKPOINTS[request.param])


@pytest.fixture(scope="module")
def loaded(checkpoint):
    model, tokenizer = load_fixture(checkpoint)
    return model, tokenizer, _mlx_vlm_model(checkpoint)


def _mlx_vlm_model(path):
    from mlx_vlm.models.nemotron_labs_diffusion import Model as VlmModel
    from mlx_vlm.models.nemotron_labs_diffusion import ModelConfig

    ref = VlmModel(ModelConfig.from_dict(json.loads((path / "config.json").read_text())))
    weights = ref.sanitize(mx.load(str(path / "model.safetensors")))
    ref.load_weights(list(weights.items()))
    mx.eval(ref.parameters())
    return ref


def _ids(length, seed=1):
    rng = np.random.default_rng(seed)
    ids = rng.integers(32, 127, size=(1, length))
    ids[0, 0] = fx.BOS
    return mx.array(ids)


def _block(seed=2):
    block = np.array(_ids(BLOCK_LEN, seed))
    block[0, 2::2] = fx.MASK
    return mx.array(block)


class PrefixView:
    """A causal prefix that a diffusion block reads but does not extend (as the engine's cache)."""

    def __init__(self, kv):
        self.kv, self.offset = kv, kv.offset

    def update_and_fetch(self, keys, values):
        pk, pv = self.kv.keys[..., : self.offset, :], self.kv.values[..., : self.offset, :]
        return mx.concatenate([pk, keys], axis=2), mx.concatenate([pv, values], axis=2)


def test_bidirectional_full_sequence_matches_mlx_vlm(loaded):
    model, _, ref = loaded
    ids = _ids(40)
    assert_close(model(ids), ref(ids, use_causal_mask=False).logits)


def test_causal_matches_mlx_vlm(loaded):
    model, _, ref = loaded
    ids = _ids(40)
    assert_close(model(ids, mask="causal"), ref(ids).logits)


def test_parity_fails_on_wrong_mode_or_query_scale(checkpoint, loaded):
    """The parity tests above would catch a swapped attention mode or a missing Llama-4 scale."""
    model, _, ref = loaded
    ids = _ids(40)
    bidirectional = ref(ids, use_causal_mask=False).logits
    assert not parity(model(ids, mask="causal"), bidirectional)[0]

    cfg = json.loads((checkpoint / "config.json").read_text())
    cfg["rope_parameters"]["llama_4_scaling_beta"] = 0.0
    unscaled = Model(ModelArgs.from_dict(cfg))
    unscaled.update(model.parameters())
    assert not parity(unscaled(ids), bidirectional)[0]
    # Below original_max_position_embeddings the scale is 1, so only the long positions differ.
    assert_close(unscaled(ids[:, :16]), ref(ids[:, :16], use_causal_mask=False).logits)


def test_causal_prefix_then_bidirectional_block(loaded):
    """Prefill causally into a KV cache, then denoise a block bidirectionally against it: equal to
    mlx-vlm's diffusion step and to one full forward with a causal-prefix + bidirectional-block
    mask."""
    model, _, ref = loaded
    prompt, block = _ids(PROMPT_LEN), _block()

    kv = [KVCache() for _ in model.layers]
    model(prompt, cache=kv, mask="causal")
    ours = model(block, cache=[PrefixView(c) for c in kv])

    ref_kv = ref.make_cache()
    ref(prompt, cache=ref_kv)
    expected = ref(block, cache=ref_kv, use_causal_mask=False, use_cache=False).logits
    assert_close(ours, expected)

    n = PROMPT_LEN + BLOCK_LEN
    q, k = mx.arange(n)[:, None], mx.arange(n)[None, :]
    keep = (k <= q) | ((q >= PROMPT_LEN) & (k >= PROMPT_LEN))
    sequence = mx.concatenate([prompt, block], axis=1)
    causal = model(sequence, mask="causal")[:, PROMPT_LEN:]
    assert_close(ours, model(sequence, mask=keep, head_span=(PROMPT_LEN, n)))
    assert not parity(ours, causal)[0]

    # Commit: a causal forward over the finished block extends the cache exactly.
    committed = model(block, cache=kv, mask="causal")
    assert kv[0].offset == n
    assert_close(committed, causal)


def test_per_row_positions(loaded):
    """cache.offset may be a (B,) array: each row gets its own RoPE positions and query scale."""
    model, _, ref = loaded
    ids = mx.concatenate([_ids(10, seed=3), _ids(10, seed=4)], axis=0)
    offsets = [2, 19]  # row 0 stays below 16, row 1 is scaled
    cache = [Positions(mx.array(offsets)) for _ in model.layers]
    ours = model(ids, cache=cache)
    for row, offset in enumerate(offsets):
        positions = [Positions(offset) for _ in model.layers]
        expected = ref(ids[row : row + 1], cache=positions, use_causal_mask=False).logits
        assert_close(ours[row : row + 1], expected)


def test_left_padded_batch_equals_single_rows(loaded):
    """Left padding gives pad positions negative offsets; they must not turn into NaN (the Llama-4
    log of a negative floor) and leak into the real rows."""
    model, _, _ = loaded
    long, short = _ids(24, seed=5), _ids(19, seed=6)
    pads = [0, 5]
    batch = mx.concatenate([long, mx.concatenate([mx.full((1, 5), fx.PAD), short], axis=1)])
    cache = Positions.for_left_padding(pads, len(model.layers))
    out = model(batch, cache=cache, mask=padding_mask(pads, 24))
    assert_close(out[:1], model(long))
    assert_close(out[1:, 5:], model(short))


def test_rows_slice_the_head(loaded):
    model, _, _ = loaded
    ids = _ids(24)
    assert model(ids, head_span=(20, 24)).shape[1] == 4
    assert_close(model(ids, head_span=(20, 24)), model(ids)[:, 20:24])


def test_tied_checkpoint_has_no_stray_head(fixture_dir):
    path = build_once(fixture_dir / "nemotron_tied", fx.build_tied)
    model, _ = load_fixture(path)
    assert not hasattr(model, "diffusion_head")
    # A tied export that still carries the head's copy (mlx-vlm bug B2 keeps it) loads strictly.
    weights = dict(mx.load(str(path / "model.safetensors")))
    weights["diffusion_head.weight"] = weights["encoder.embed_tokens.weight"]
    weights = model.sanitize(weights)
    assert "diffusion_head.weight" not in weights
    model.load_weights(list(weights.items()), strict=True)


def test_bad_checkpoints_raise_clear_errors(fixture_dir):
    path = fx.shared_checkpoint(fixture_dir)
    cfg = json.loads((path / "config.json").read_text())
    model = Model(ModelArgs.from_dict(cfg))
    weights = dict(mx.load(str(path / "model.safetensors")))
    with pytest.raises(ValueError, match="no diffusion_head.weight"):
        model.sanitize({k: v for k, v in weights.items() if k != "diffusion_head.weight"})
    with pytest.raises(ValueError, match="unexpected weights"):
        model.sanitize({**weights, "model.norm.weight": weights["encoder.norm.weight"]})
    with pytest.raises(ValueError, match="has shape"):
        model.sanitize({**weights, "diffusion_head.weight": weights["diffusion_head.weight"][:-1]})


def test_diffusion_spec(loaded):
    model, _, _ = loaded
    spec = model.diffusion_spec
    assert (spec.family, spec.attention, spec.mask_token_id, spec.eos_token_ids) == (
        "nemotron",
        "causal_prefix",
        fx.MASK,
        (fx.EOS,),
    )
    assert (spec.logit_shift, spec.confidence, spec.quota_base) == (0, "raw", "masks")
    assert spec.trained_block_length == fx.BLOCK_SIZE
    assert spec.defaults["block_length"] == fx.BLOCK_SIZE and "steps" not in spec.defaults
    # Confidence-thresholded diffusion mode at 0.9 (issue #12); self-speculation settings.
    assert spec.defaults["sampler"] == "threshold" and spec.defaults["threshold"] == 0.9
    assert family_settings(spec.family) == (
        "mode",
        "draft_threshold",
        "causal_context",
        "max_thinking_tokens",
        "end_think_token_id",
    )
    assert spec.defaults["causal_context"] is True  # generate_diffusion's default

    for missing in ({}, {"mask_token_id": -1}):
        cfg = {**fx.config(), **missing}
        if not missing:
            del cfg["mask_token_id"]
        with pytest.raises(ValueError, match="mask_token_id"):
            Model(ModelArgs.from_dict(cfg)).diffusion_spec


def _greedy(model, prompt, max_tokens, mask):
    ids = list(prompt)
    for _ in range(max_tokens):
        token = model(mx.array([ids]), mask=mask)[0, -1].argmax().item()
        if token == fx.EOS:
            break
        ids.append(token)
    return ids[len(prompt) :]


def test_mlx_lm_generate_runs_the_checkpoint_causally(loaded):
    """mlx-lm's AR generation (mlx-lm caches, no mask) is the causal model: it equals a greedy loop
    of causal full recomputes, not the bidirectional one."""
    from mlx_lm import generate, stream_generate

    model, tokenizer, _ = loaded
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert len(prompt) > 16  # generated positions carry the Llama-4 query scale

    tokens = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=8)]
    tokens = [t for t in tokens if t != fx.EOS]
    expected = _greedy(model, prompt, 8, mask="causal")
    assert tokens == expected
    # Byte-level tokens may split characters, so compare with mlx-lm's streaming detokenizer.
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    for t in expected:
        detokenizer.add_token(t)
    detokenizer.finalize()
    assert generate(model, tokenizer, prompt, max_tokens=8) == detokenizer.text
    assert _greedy(model, prompt, 8, mask=None) != expected
