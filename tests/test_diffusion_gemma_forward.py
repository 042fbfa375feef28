"""DiffusionGemma forward: parity with transformers' own DiffusionGemmaForBlockDiffusion.

The checkpoint is written by transformers (tests/fixtures/diffusion_gemma.py) and converted by
`python -m mlx_lm convert` in a fresh interpreter. The prompt is longer than the sliding window, so
the encoder's windowed mask and the decoder's truncated view of the sliding layers' cache both
matter; encoder and decoder layer scalars differ; the head drives logits into the tanh softcap.
"""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from fixtures import build_once
from fixtures import diffusion_gemma as fx
from helpers import assert_close, load_fixture, mlx_lm_convert, parity
from mlx_dllm_models.models.diffusion_gemma import Model, ModelArgs
from mlx_dllm_models.settings import family_settings
from mlx_dllm_models.spec import ENCODER_CANVAS

PROMPT_LEN = 13  # > SLIDING_WINDOW (8): sliding layers see only part of the prompt
CANVAS = fx.CANVAS_LENGTH
SC_TEMPERATURE = 0.7  # the engine feeds back temperature-processed logits


@pytest.fixture(scope="module")
def checkpoint(fixture_dir):
    return build_once(fixture_dir / "diffusion_gemma", fx.CHECKPOINTS["diffusion_gemma"])


@pytest.fixture(scope="module")
def converted(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("diffusion_gemma_mlx")
    return {
        "f32": mlx_lm_convert(checkpoint, out / "f32"),
        "q4": mlx_lm_convert(checkpoint, out / "q4", "-q", "--q-bits", "4"),
    }


@pytest.fixture(scope="module")
def model(converted):
    return load_fixture(converted["f32"])[0]


def _inputs():
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, 256, size=(1, PROMPT_LEN))
    prompt[0, 0] = fx.BOS
    canvas = rng.integers(0, fx.VOCAB, size=(1, CANVAS))  # uniform noise, as the sampler starts
    canvas2 = canvas.copy()
    canvas2[0, ::3] = rng.integers(0, fx.VOCAB, size=canvas2[0, ::3].shape)
    return prompt, canvas, canvas2


@pytest.fixture(scope="module")
def expected(checkpoint):
    """transformers' logits: the encoder's (its last hidden state through the tied head), the
    decoder's first step, and a second step self-conditioned on the first step's logits."""
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(str(checkpoint), dtype=torch.float32)
    ref.eval()
    prompt, canvas, canvas2 = (torch.tensor(a) for a in _inputs())
    cap = ref.config.text_config.final_logit_softcapping
    with torch.no_grad():
        first = ref(input_ids=prompt, decoder_input_ids=canvas)
        encoder = cap * torch.tanh(ref.lm_head(first.encoder_last_hidden_state) / cap)
        sc_logits = first.logits / SC_TEMPERATURE
        second = ref(
            cache=first.cache, decoder_input_ids=canvas2, self_conditioning_logits=sc_logits
        )
    return {
        "encoder": encoder.numpy(),
        "first": first.logits.numpy(),
        "sc_logits": sc_logits.numpy(),
        "second": second.logits.numpy(),
    }


def _run(model, chunks=(PROMPT_LEN,)):
    """Encode the prompt in `chunks`, then two decoder steps as the engine runs them."""
    prompt, canvas, canvas2 = (mx.array(a) for a in _inputs())
    cache = model.make_cache()
    encoder, start = [], 0
    for n in chunks:
        encoder.append(model.logits(model.encode(prompt[:, start : start + n], cache)))
        start += n
    first = model.decode(canvas, cache)
    second = model.decode(canvas2, cache, first / SC_TEMPERATURE)
    return {
        "encoder": mx.concatenate(encoder, axis=1),
        "first": first,
        "second": second,
        "cache": cache,
    }


@pytest.mark.slow
def test_encoder_logits_match_transformers(model, expected):
    assert_close(_run(model)["encoder"], expected["encoder"])


@pytest.mark.slow
def test_decoder_logits_match_transformers_with_and_without_self_conditioning(model, expected):
    out = _run(model)
    assert out["first"].dtype == mx.float32
    assert_close(out["first"], expected["first"])
    assert_close(out["second"], expected["second"])


@pytest.mark.slow
def test_self_conditioning_reads_the_given_logits(model, expected):
    """transformers' second step, fed with its own first-step logits, also matches."""
    _, _, canvas2 = _inputs()
    cache = model.make_cache()
    model.encode(mx.array(_inputs()[0]), cache)
    got = model.decode(mx.array(canvas2), cache, mx.array(expected["sc_logits"]))
    assert_close(got, expected["second"])


@pytest.mark.slow
@pytest.mark.parametrize("chunks", [(5, 1, 7), (1,) * PROMPT_LEN, (9, 4)])
def test_encoding_in_chunks_continues_positions_and_windows(model, expected, chunks):
    out = _run(model, chunks)
    assert out["cache"][0].offset == PROMPT_LEN
    assert_close(out["encoder"], expected["encoder"])
    assert_close(out["first"], expected["first"])
    assert_close(out["second"], expected["second"])


@pytest.mark.slow
def test_decode_reads_the_cache_without_writing_it(model):
    out = _run(model)
    before = [(c.offset, np.array(c.keys)) for c in out["cache"]]
    canvas = mx.array(_inputs()[1])
    again = model.decode(canvas, out["cache"])
    assert np.array_equal(np.array(again), np.array(out["first"]))
    for (offset, keys), c in zip(before, out["cache"]):
        assert c.offset == offset and np.array_equal(keys, np.array(c.keys))


@pytest.mark.slow
def test_protocol_call_is_the_decoder_without_self_conditioning(model):
    _, canvas, _ = (mx.array(a) for a in _inputs())
    alone = model.decode(canvas, None)
    assert np.array_equal(np.array(model(canvas)), np.array(alone))
    assert_close(model.decode(canvas, model.make_cache()), alone)
    assert_close(model(canvas, head_span=(3, 9)), alone[:, 3:9])
    out = _run(model)
    assert_close(model(canvas, cache=out["cache"]), out["first"])


def _swap_scalars(model, source):
    for layer in model.layers:
        value = mx.array(layer[f"{source}_layer_scalar"])
        target = "decoder" if source == "encoder" else "encoder"
        layer.update({f"{target}_layer_scalar": value})


def _set_window(model, window):
    model.model.sliding_window = window


MISTAKES = {
    # (what to break, which output must then disagree with transformers)
    "encoder_uses_decoder_scalar": (lambda m: _swap_scalars(m, "decoder"), "encoder"),
    "decoder_uses_encoder_scalar": (lambda m: _swap_scalars(m, "encoder"), "first"),
    "window_one_wider": (lambda m: _set_window(m, fx.SLIDING_WINDOW + 1), "first"),
    "window_one_narrower": (lambda m: _set_window(m, fx.SLIDING_WINDOW - 1), "encoder"),
    "no_softcap": (lambda m: setattr(m, "final_logit_softcapping", None), "first"),
    "self_conditioning_ignored": (
        lambda m: setattr(m.model.self_conditioning, "pre_norm", lambda x: 0 * x),
        "second",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_the_parity_checks_catch_mistakes(converted, expected, mistake):
    model = load_fixture(converted["f32"])[0]
    breaks, output = MISTAKES[mistake]
    breaks(model)
    ok, err = parity(_run(model)[output], expected[output])
    assert not ok, f"{mistake} went unnoticed (max error {err:.3g})"


def _hf_weights(checkpoint):
    return dict(mx.load(str(checkpoint / "model.safetensors")))


def _fresh(checkpoint):
    return Model(ModelArgs.from_dict(json.loads((checkpoint / "config.json").read_text())))


def test_sanitize_takes_either_copy_of_the_tied_encoder_weights(checkpoint):
    """save_pretrained keeps only the decoder copy; the official conversion writes both; a
    checkpoint with only the encoder copy must load the same."""
    model = _fresh(checkpoint)
    hf = _hf_weights(checkpoint)
    reference = model.sanitize(dict(hf))
    assert not any(k.startswith(("model.encoder", "model.decoder", "lm_head")) for k in reference)
    assert "model.layers.0.encoder_layer_scalar" in reference
    assert not np.array_equal(
        np.array(reference["model.layers.0.encoder_layer_scalar"]),
        np.array(reference["model.layers.0.decoder_layer_scalar"]),
    )

    shared = {
        k: v
        for k, v in hf.items()
        if k.startswith("model.decoder.")
        and not k.endswith("layer_scalar")
        and ".self_conditioning." not in k
    }
    both = dict(hf)
    encoder = "model.encoder.language_model."
    both.update({k.replace("model.decoder.", encoder): v for k, v in shared.items()})
    both["lm_head.weight"] = hf["model.decoder.embed_tokens.weight"]
    encoder_only = {k: v for k, v in both.items() if k not in shared}
    for variant in (both, encoder_only):
        got = model.sanitize(variant)
        assert sorted(got) == sorted(reference)
        for k in reference:
            assert np.array_equal(np.array(got[k]), np.array(reference[k])), k


def test_sanitize_rejects_mismatched_weights(checkpoint):
    model = _fresh(checkpoint)
    hf = _hf_weights(checkpoint)
    bad_shape = dict(hf)
    key = "model.decoder.layers.1.experts.gate_up_proj"
    bad_shape[key] = mx.zeros((8, 2 * 32, 64))
    with pytest.raises(ValueError, match="shape"):
        model.sanitize(bad_shape)
    unknown = dict(hf)
    unknown["model.decoder.layers.0.mystery.weight"] = mx.zeros((2,))
    with pytest.raises(ValueError, match="unexpected weights"):
        model.sanitize(unknown)


def test_per_layer_config_and_named_global_fields_agree(checkpoint):
    cfg = json.loads((checkpoint / "config.json").read_text())
    text = dict(cfg["text_config"])
    text.pop("per_layer_config")
    text.update(global_head_dim=32, num_global_key_value_heads=1)
    a = ModelArgs.from_dict(cfg).text_config
    b = ModelArgs.from_dict(dict(cfg, text_config=text)).text_config
    assert (a.global_head_dim, a.num_global_key_value_heads) == (32, 1)
    assert (b.global_head_dim, b.num_global_key_value_heads) == (32, 1)


@pytest.mark.slow
def test_quantized_conversion_keeps_embeddings_attention_and_router_at_8_bits(converted, model):
    cfg = json.loads((converted["q4"] / "config.json").read_text())
    q = cfg["quantization"]
    assert (q["bits"], q["group_size"]) == (4, 64)
    eight = [p for p, v in q.items() if isinstance(v, dict) and v.get("bits") == 8]
    expected8 = {"model.embed_tokens"}
    for i, layer in enumerate(model.layers):
        expected8 |= {f"model.layers.{i}.router.proj"}
        expected8 |= {f"model.layers.{i}.self_attn.{p}" for p in ("q_proj", "k_proj", "o_proj")}
        if layer.self_attn.is_sliding:
            expected8.add(f"model.layers.{i}.self_attn.v_proj")
    assert set(eight) == expected8
    weights = mx.load(str(converted["q4"] / "model.safetensors"))
    # Experts and the dense MLP take the requested 4 bits: 64 inputs pack into 8 uint32 words.
    assert weights["model.layers.0.experts.switch_glu.gate_proj.weight"].shape == (8, 64, 8)
    assert weights["model.layers.0.mlp.gate_proj.weight"].shape == (128, 8)
    assert weights["model.embed_tokens.weight"].shape == (fx.VOCAB, 16)

    quantized = load_fixture(converted["q4"])[0]
    assert isinstance(quantized.model.embed_tokens, nn.QuantizedEmbedding)
    out = _run(quantized)  # the self-conditioning read-back goes through the quantized embedding
    full = _run(model)
    for name in ("encoder", "first", "second"):
        got = np.array(out[name])
        assert got.shape == np.array(full[name]).shape and np.isfinite(got).all()
    # 4-bit experts on random weights move the logits, but not far (a random canvas is the most
    # sensitive input: measured correlations 0.996 encoder, 0.93 / 0.87 decoder).
    for name, least in (("encoder", 0.95), ("first", 0.7), ("second", 0.7)):
        corr = np.corrcoef(np.array(out[name]).ravel(), np.array(full[name]).ravel())[0, 1]
        assert corr > least, (name, corr)


@pytest.mark.slow
def test_diffusion_spec_comes_from_config_and_generation_config(model):
    spec = model.diffusion_spec
    assert spec.family == "diffusion_gemma"
    assert spec.attention == ENCODER_CANVAS
    assert spec.mask_token_id is None
    assert spec.eos_token_ids == tuple(fx.EOS_IDS)
    assert spec.logit_shift == 0
    assert set(spec.samplers) == {"entropy", "threshold"}
    assert spec.defaults == {
        "sampler": "entropy",
        "max_tokens": 256,
        "max_denoising_steps": 48,
        "entropy_bound": 0.1,
        "t_min": 0.4,
        "t_max": 0.8,
        "stability_threshold": 1,
        "confidence_threshold": 0.005,
        "min_canvas_length": CANVAS,
        "max_canvas_length": CANVAS,
    }
    for name in (
        "max_denoising_steps",
        "t_min",
        "t_max",
        "stability_threshold",
        "confidence_threshold",
        "min_canvas_length",
        "max_canvas_length",
    ):
        assert name in family_settings(spec.family)


@pytest.mark.slow
def test_make_cache_windows_sliding_layers(model):
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    caches = model.make_cache()
    for kind, c in zip(fx.LAYER_TYPES, caches):
        if kind == "sliding_attention":
            assert isinstance(c, RotatingKVCache) and c.max_size == fx.SLIDING_WINDOW
        else:
            assert type(c) is KVCache


@pytest.mark.slow
def test_fixture_is_confident(expected):
    """At the first step's temperature (t_max = 0.8) a fair share of positions pass 0.9 and the
    proposals differ across positions, so samplers have something to choose."""
    logits = expected["first"] / 0.8
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    assert (probs.max(-1) > 0.9).mean() >= 0.25
    assert len(set(expected["first"].argmax(-1).ravel().tolist())) >= CANVAS // 2
