"""Nemotron-Labs-Diffusion's `linear_spec_lora` draft adapter: loaded when the checkpoint ships it,
switched on for self-speculation's draft forwards only (the reference's linear_spec_generate with its
LoRA), and self-speculation stays lossless: identical to AR greedy at temperature 0. With the adapter
or with draft_threshold, the rounds are those of a plain transcription of linear_spec_generate
(tests/reference/nemotron_reference.py): the same tokens per round, the same forwards."""

import json

import mlx.core as mx
import numpy as np
import pytest

from fixtures import nemotron as fx
from helpers import load_fixture, spy_forwards, stream_tokens
from mlx_dllm_models import load
from mlx_dllm_models.engine import BlockEvent, make_decoder
from mlx_dllm_models.errors import CheckpointError
from mlx_dllm_models.models.nemotron_labs_diffusion import DraftLoRALinear
from mlx_dllm_models.settings import resolve_settings
from reference.nemotron_reference import OurForward, linear_spec_generate


@pytest.fixture(scope="module")
def with_adapter(tmp_path_factory):
    path = fx.build_with_draft_adapter(tmp_path_factory.mktemp("nemotron_lora") / "ckpt")
    return path, load(path)


@pytest.fixture(scope="module")
def without_adapter(tmp_path_factory):
    return load_fixture(fx.build(tmp_path_factory.mktemp("nemotron") / "ckpt"))


def test_the_adapter_is_loaded_switched_off(with_adapter, without_adapter):
    _, (model, _) = with_adapter
    base, _ = without_adapter
    assert model.has_draft_adapter and not base.has_draft_adapter
    assert len(model.draft_adapters()) == fx.LAYERS * len(fx.DRAFT_ADAPTER_TARGETS)
    x = mx.array([[5, 6, 7, fx.MASK, fx.MASK, fx.MASK]])
    off = np.array(model(x))
    np.testing.assert_array_equal(off, np.array(base(x)))  # off: the base model, bit for bit
    model.set_draft_adapter(True)
    try:
        on = np.array(model(x))
    finally:
        model.set_draft_adapter(False)
    assert np.abs(on - off).max() > 1e-2
    # The delta is PEFT's scale (x A^T) B^T with scale = lora_alpha / r.
    layer = model.layers[0].self_attn.q_proj
    assert isinstance(layer, DraftLoRALinear) and layer.scale == 8.0 / 4


@pytest.mark.parametrize("cache", ["prefix", "none"])
def test_self_spec_with_the_adapter_equals_greedy_ar(with_adapter, cache):
    _, (model, tok) = with_adapter
    rng = np.random.default_rng(2)
    for n in (5, 9):
        prompt = rng.integers(20, 250, n).tolist()
        got = stream_tokens(model, tok, prompt, max_tokens=14, mode="self_spec", cache=cache)
        assert got == fx.ar_greedy(model, prompt, 14)


def test_drafts_run_with_the_adapter_and_verification_without(with_adapter):
    """Draft forwards (a bidirectional window: no mask) have the adapter on; the prefill and the
    verify forwards (causal) have it off; every round is one of each."""
    _, (model, tok) = with_adapter
    seen = []

    def record(inputs, cache, mask, head_span):
        seen.append((mask is None, model.draft_adapters()[0].active))

    with spy_forwards(model, record):
        stream_tokens(model, tok, [30, 31, 32, 33], max_tokens=10, mode="self_spec")
    assert seen[0] == (False, False)  # the causal prefill
    drafts = [active for bidirectional, active in seen if bidirectional]
    verifies = [active for bidirectional, active in seen[1:] if not bidirectional]
    assert drafts and all(drafts) and verifies and not any(verifies)
    assert len(drafts) == len(verifies)
    assert not model.draft_adapters()[0].active  # left off


def test_sampling_with_the_adapter_is_seeded(with_adapter):
    _, (model, tok) = with_adapter
    kw = dict(max_tokens=10, mode="self_spec", temperature=0.8, seed=4)
    a = stream_tokens(model, tok, [30, 31, 32], **kw)
    assert a == stream_tokens(model, tok, [30, 31, 32], **kw) and len(a) > 0


def test_an_adapter_that_fits_nothing_is_a_clear_error(tmp_path):
    path = fx.build_with_draft_adapter(tmp_path / "ckpt")
    (path / "linear_spec_lora" / "adapter_config.json").write_text(json.dumps({"r": 4}))
    with pytest.raises(CheckpointError, match="linear_spec_lora.*lora_alpha"):
        load(path)


@pytest.mark.parametrize("adapter", [True, False])
def test_draft_threshold_drafts_over_several_forwards_and_stays_lossless(
    with_adapter, without_adapter, adapter
):
    """linear_spec_generate's threshold > 0: a block's drafts take several forwards (each reveals
    the masks at or above the threshold, at least one); the output is still AR greedy."""
    model, tok = with_adapter[1] if adapter else without_adapter
    prompt = [30, 31, 32, 33, 34]
    seen = []

    def record(inputs, cache, mask, head_span):
        seen.append(mask is None)

    with spy_forwards(model, record):
        got = stream_tokens(
            model, tok, prompt, max_tokens=12, mode="self_spec", draft_threshold=0.99
        )
    assert got == fx.ar_greedy(model, prompt, 12)
    # Runs of draft forwards between verifies: some round drafted in more than one forward.
    runs, n = [], 0
    for bidirectional in seen[1:]:
        if bidirectional:
            n += 1
        else:
            runs.append(n)
            n = 0
    assert runs and max(runs) > 1


def test_draft_threshold_is_self_spec_only(without_adapter):
    from mlx_dllm_models.settings import SettingsError

    model, tok = without_adapter
    with pytest.raises(SettingsError, match="draft_threshold only acts with mode='self_spec'"):
        stream_tokens(model, tok, [30, 31], max_tokens=4, mode="diffusion", draft_threshold=0.5)
    with pytest.raises(SettingsError, match="draft_threshold must be"):
        stream_tokens(model, tok, [30, 31], max_tokens=4, mode="self_spec", draft_threshold=1.5)


# ------------------------------------------------------------------ parity with linear_spec_generate

L = fx.BLOCK_SIZE
# (prompt, max_tokens): max_tokens not a multiple of the block; the first prompt's run meets the
# fixture's EOS before max_tokens, the others stop at max_tokens.
_rng = np.random.default_rng(5)
SPEC_RUNS = [
    ([fx.BOS] + _rng.integers(32, 250, size=int(_rng.integers(3, 20))).tolist(), n)
    for n in (13, 2 * L + 3, 13)
]


def _self_spec_rounds(model, prompt, max_tokens, draft_threshold):
    """Our self_spec decoder's rounds (each BlockEvent's tokens, the prefill's first) and its nfe."""
    settings = resolve_settings(
        model.diffusion_spec,
        {"max_tokens": max_tokens, "mode": "self_spec", "draft_threshold": draft_threshold},
        {},
    )
    decoder = make_decoder(model, settings, [fx.EOS])
    rounds = [e.tokens[0] for e in decoder.run([prompt]) if isinstance(e, BlockEvent)]
    return rounds, decoder.nfe


def _reference_rounds(model, prompt, max_tokens, draft_threshold):
    """linear_spec_generate's rounds as the package returns them (the first max_tokens tokens, each
    round cut before an EOS), its nfe and its trace (draft forwards, accepted, drafted the mask)."""
    trace = []
    x, nfe = linear_spec_generate(
        OurForward(model), [prompt], max_tokens, L, fx.MASK, fx.EOS, draft_threshold or 0.0, trace
    )
    new = x[0, len(prompt) :].tolist()
    rounds, at, made = [], 0, 0
    for size in [1] + [accepted for _, accepted, _ in trace]:
        r = new[at : at + size][: max_tokens - made]
        at, made = at + size, made + len(r)
        rounds.append(r[: r.index(fx.EOS)] if fx.EOS in r else r)
    return rounds, nfe, trace


@pytest.mark.slow
@pytest.mark.parametrize("draft_threshold", [None, 0.9])
@pytest.mark.parametrize("adapter", [True, False])
def test_self_spec_rounds_equal_linear_spec_generate(
    with_adapter, without_adapter, adapter, draft_threshold
):
    """At temperature 0 each round keeps the tokens the reference keeps (so the drafts agree where
    they are kept, and the first rejected draft is rejected by both), and the forwards (prefill, each
    draft forward, each verify) are as many. Without the adapter and without draft_threshold, ours
    folds the next round's draft into the verify forward (engine/self_spec.py): its drafts, rounds
    and forwards differ by construction; its tokens do not."""
    model, _ = with_adapter[1] if adapter else without_adapter
    draft_forwards, eos_met = [], 0
    for prompt, max_tokens in SPEC_RUNS:
        ours, nfe = _self_spec_rounds(model, prompt, max_tokens, draft_threshold)
        want, ref_nfe, trace = _reference_rounds(model, prompt, max_tokens, draft_threshold)
        # Upstream may draft the mask id (ours never does); these runs must not, or they would
        # compare something else.
        assert trace and not any(masked for _, _, masked in trace)
        draft_forwards += [n for n, _, _ in trace]
        eos_met += sum(len(r) for r in want) < max_tokens
        if adapter or draft_threshold is not None:
            assert ours == want
            assert nfe == ref_nfe
        else:
            assert sum(ours, []) == sum(want, [])
            assert nfe < ref_nfe  # one forward a round instead of a draft and a verify
    assert eos_met >= 1
    if draft_threshold is None:
        assert set(draft_forwards) == {1}
    else:  # the threshold made drafting iterate
        assert max(draft_forwards) > 1
