"""Fast-dLLM v2's sub-block cache (`cache="sub_block"`, the remote generate's use_block_cache=True):
token parity at temperature 0 with the transcribed generate in that mode, which differs from the
exact decoding (so the parity can tell the two apart), batch rows equal single runs, the forwards
it runs, and the settings it refuses."""

import numpy as np
import pytest

from fixtures import build_once
from fixtures import fast_dllm_v2 as fx
from fixtures import sdar as sdar_fx
from helpers import checkpoint_fixtures, load_fixture
from mlx_dllm_models import SettingsError, batch_generate_diffusion
from mlx_dllm_models.generate import stream_events
from reference.fast_dllm_v2_torch import Reference

checkpoint, loaded = checkpoint_fixtures(
    "fast_dllm_v2", fx.build, name="checkpoint", loader=load_fixture
)


@pytest.fixture(scope="module")
def ref(checkpoint):
    return Reference(checkpoint)


def prompt(n):
    return np.random.default_rng(n).integers(0, 256, n).tolist()


# Prompts inside a block, past one, on a block edge and past two; the recipe, smaller sub-blocks
# at a lower threshold, and one token a step. Fixed cases, as in test_fast_dllm_v2.py.
CASES = [
    (7, {}),
    (7, {"sub_block_length": 4, "threshold": 0.5}),
    (64, {}),
    (64, {"threshold": 1.0}),
    (33, {}),
    (33, {"sub_block_length": 4, "threshold": 0.5}),
    (31, {"threshold": 1.0}),
    (100, {}),
]


@pytest.mark.slow
@pytest.mark.parametrize("length, settings", CASES)
def test_tokens_match_the_reference_with_its_sub_block_cache(loaded, ref, length, settings):
    model, tok = loaded
    ids = prompt(length)
    got = batch_generate_diffusion(model, tok, [ids], max_tokens=80, cache="sub_block", **settings)
    assert got.tokens[0] == fx.reference_tokens(ref, ids, 80, settings, True)


@pytest.mark.slow
def test_the_cases_tell_the_cache_from_exact_decoding(ref):
    # The approximation shows: most cases decode other tokens without the sub-block cache.
    differ = [
        fx.reference_tokens(ref, prompt(n), 80, s, True)
        != fx.reference_tokens(ref, prompt(n), 80, s, False)
        for n, s in CASES
    ]
    assert sum(differ) >= len(CASES) // 2


@pytest.mark.slow
def test_batch_rows_equal_single_runs(loaded):
    model, tok = loaded
    prompts = [prompt(n) for n in (7, 45, 64, 33, 100)]
    batch = batch_generate_diffusion(model, tok, prompts, max_tokens=70, cache="sub_block")
    for i, p in enumerate(prompts):
        alone = batch_generate_diffusion(model, tok, [p], max_tokens=70, cache="sub_block")
        assert batch.tokens[i] == alone.tokens[0], i


def test_later_steps_of_a_sub_block_run_the_sub_block_alone(loaded):
    model, tok = loaded
    widths = []
    real = type(model).__call__

    def spy(self, inputs, cache=None, mask=None, head_span=None):
        widths.append(inputs.shape[1])
        return real(self, inputs, cache=cache, mask=mask, head_span=head_span)

    type(model).__call__ = spy
    try:
        _, ids, decoder = stream_events(
            model, tok, [prompt(33)], max_tokens=80, cache="sub_block", threshold=1.0
        )
        list(decoder.run(ids))
    finally:
        type(model).__call__ = real
    # The prefill and block commits, full forwards (a block's first step, a sub-block whose first
    # position is a mask) and the sub-block's own steps; nothing else.
    assert widths.count(8) > 0 and widths.count(fx.BLOCK_SIZE) > 0
    assert set(widths) <= {8, fx.BLOCK_SIZE}


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"sampler": "threshold"}, "needs the sub_block sampler"),
        ({"steps": 16}, r"steps \(16\) must be at least block_length \(32\)"),
    ],
)
def test_settings_it_cannot_honour_are_refused(loaded, settings, message):
    model, tok = loaded
    with pytest.raises(SettingsError, match=message) as e:
        batch_generate_diffusion(
            model, tok, [prompt(5)], max_tokens=8, cache="sub_block", **settings
        )
    assert "\n" not in str(e.value)


def test_other_block_causal_families_refuse_it(fixture_dir):
    model, tok = load_fixture(build_once(fixture_dir / "sdar", sdar_fx.build_sdar))
    with pytest.raises(SettingsError, match="Fast-dLLM v2's sub-block cache"):
        batch_generate_diffusion(model, tok, [prompt(5)], max_tokens=8, cache="sub_block")
