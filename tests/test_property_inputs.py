"""Property test over the input space (issue 11): arbitrary prompts and arbitrary settings on the
tiny fixture of every family. Every call either raises the package's own error (SettingsError or
CheckpointError, both ValueError) with a message, or returns output with no mask token, at most
max_tokens tokens per row and a valid finish reason. No other exception escapes.

Allocation bound: no call's peak memory exceeds the loaded weights plus PEAK_BOUND. The fixtures
hold a few MB of weights and decode at most 8 tokens, so a call that sized anything by a setting
(a (B, steps) schedule at steps=10**9, a block or a canvas of 10**9 positions, a context of
max_tokens=10**12) would exceed it by orders of magnitude.

Values are drawn per setting from a pool of junk (None, booleans, negatives, 0, 2**64, 10**12,
NaN, inf, strings, containers) and small valid values. Valid values whose only effect is a long
run (max_tokens of a few thousand, max_denoising_steps or max_post_steps in the millions: forwards
the user asked for) are left out of the pools to keep the test fast; unbounded *allocation* from
any setting is in.
"""

import math

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fixtures import all_checkpoints
from mlx_dllm_models import (
    CheckpointError,
    SettingsError,
    batch_generate_diffusion,
    load,
    stream_generate_diffusion,
)
from mlx_dllm_models.settings import SETTINGS

FAMILIES = sorted(all_checkpoints())
PEAK_BOUND = 64 << 20  # bytes above the weights (see the module docstring)
REASONS = {"stop", "length"}
OUTCOMES = {"output": 0, "error": 0}  # tallied by the property test, read by the last test

JUNK = [
    None,
    True,
    False,
    -1,
    0,
    1,
    2**64,
    10**12,
    -(10**12),
    0.0,
    0.5,
    1.5,
    -0.5,
    math.nan,
    math.inf,
    -math.inf,
    "",
    "x",
    "none",
    [],
    [1],
    {},
    b"1",
]
# Small valid values of each setting (besides the junk); names absent here get the junk only.
VALID = {
    "max_tokens": [1, 2, 3, 5, 8],
    "block_length": [1, 2, 4, 8, 32],
    "steps": [1, 2, 3, 8, 10**9],
    "sampler": ["quota", "threshold", "factor", "entropy", "dream", "sequential", "bogus"],
    "threshold": [0.1, 0.5, 0.9, 1.0, 1e-9],
    "factor": [0.5, 1.0, 4.0, 1e9],
    "entropy_bound": [0.0, 0.1, 10.0, 1e30],
    "temperature": [0.0, 0.5, 1.0, 1e-9, 1e6],
    "top_p": [0.1, 0.9, 1.0],
    "top_k": [0, 1, 5, 10**9],
    "seed": [0, 7, 2**64 - 1],
    "cache": ["auto", "none", "prefix", "dual"],
    "alg": ["origin", "maskgit_plus", "topk_margin", "entropy"],
    "alg_temp": [0.0, 0.5],
    "eps": [1e-3, 0.5, 1e-9],
    "editing_threshold": [0.0, 0.5, 0.9],
    "max_post_steps": [0, 1, 4],
    "mode": ["diffusion", "self_spec"],
    "max_denoising_steps": [1, 2, 4],
    "t_min": [0.0, 0.1],
    "t_max": [0.5, 1.0],
    "stability_threshold": [0, 1, 10**9],
    "confidence_threshold": [0.0, 0.5, 1e9],
    "min_canvas_length": [1, 2, 8, 10**12],
    "max_canvas_length": [1, 4, 8, 10**12],
}
# Junk that is a long run, not an error, for these (see the module docstring).
LONG_RUNS = {"max_denoising_steps", "max_post_steps", "max_tokens"}
NAMES = [s.name for s in SETTINGS] + ["bogus", "Temperature", "max_new_tokens", "gen_length"]


def _values(name, junk=True):
    # None as max_tokens means the default (128 or more): a long run, see LONG_RUNS.
    junk = [
        v for v in JUNK if not (name in LONG_RUNS and (v is None or (isinstance(v, int) and v > 8)))
    ]
    valid = VALID.get(name, [])
    return st.sampled_from(valid + junk if junk or not valid else valid)


def _settings(names, junk):
    return st.lists(st.sampled_from(names), max_size=4, unique=True).flatmap(
        lambda chosen: st.fixed_dictionaries({n: _values(n, junk) for n in chosen})
    )


# The settings family of each fixture, for the settings it understands.
FAMILY_OF = {"llada2_moe": "llada2", "nemotron_tied": "nemotron"}


def _understood(fixture):
    family = FAMILY_OF.get(fixture, fixture)
    return [
        s.name
        for s in SETTINGS
        if (not s.families or family in s.families) and family not in s.unused
    ]


def _family_and_settings(fixture):
    # Half the calls draw the family's own settings with valid values only, so that many decode.
    return st.tuples(
        st.just(fixture),
        st.one_of(_settings(_understood(fixture), junk=False), _settings(NAMES, junk=True)),
    )


FAMILY_AND_SETTINGS = st.sampled_from(FAMILIES).flatmap(_family_and_settings)
# max_tokens is always given (a small valid value, mostly): the defaults (128 and more) are slow.
MAX_TOKENS = st.one_of(st.sampled_from([1, 2, 4, 8]), _values("max_tokens"))

TOKEN = st.one_of(
    st.integers(0, 319),  # every fixture's vocabulary is 320 (special ids, the mask, included)
    st.sampled_from([-1, 320, 2**70, True, 1.0, 10.7, math.nan, "a", None]),
)
PROMPT = st.one_of(
    st.text(max_size=12),
    st.lists(st.integers(0, 319), min_size=1, max_size=6),
    st.lists(st.integers(10, 250), min_size=1, max_size=6),  # no special ids
    st.lists(TOKEN, max_size=6),
    st.sampled_from(["\ud800", "hi\udfff", None, b"hi", 12, 1.5, {"a": 1}, [[1, 2]], ()]),
)
GOOD_PROMPT = st.one_of(
    st.text(min_size=1, max_size=12), st.lists(st.integers(10, 250), min_size=1, max_size=6)
)
# Well-formed prompts half the time, so that the settings get to decode.
CALL = st.one_of(
    st.tuples(st.just("single"), GOOD_PROMPT),
    st.tuples(st.just("batch"), st.lists(GOOD_PROMPT, min_size=1, max_size=3)),
    st.tuples(st.just("single"), PROMPT),
    st.tuples(st.just("batch"), st.lists(PROMPT, max_size=3)),
    st.tuples(st.just("batch"), st.sampled_from(["hello", b"hello", None, 5, [[]]])),
)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("property")
    out = {}
    for name, build in all_checkpoints().items():
        model, tok = load(build(root / name))
        mx.eval(model.parameters())
        out[name] = (model, tok)
    return out


def _decode(model, tok, call, prompt_or_batch, kw):
    """(rows of tokens, finish reasons) of one call."""
    if call == "single":
        rows, reasons = [[]], []
        for r in stream_generate_diffusion(model, tok, prompt_or_batch, **kw):
            rows[0].extend(r.tokens)
            if r.finish_reason is not None:
                reasons.append(r.finish_reason)
        return rows, reasons
    out = batch_generate_diffusion(model, tok, prompt_or_batch, **kw)
    return out.tokens, out.finish_reasons


@pytest.mark.slow
@settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(family_and_settings=FAMILY_AND_SETTINGS, call=CALL, max_tokens=MAX_TOKENS)
def test_any_input_gives_output_or_a_clear_error(models, family_and_settings, call, max_tokens):
    family, extra = family_and_settings
    model, tok = models[family]
    kw = {"max_tokens": max_tokens, **extra}
    kind, prompts = call
    mx.synchronize()
    mx.reset_peak_memory()
    try:
        rows, reasons = _decode(model, tok, kind, prompts, kw)
    except (SettingsError, CheckpointError) as e:
        assert str(e).strip(), "an error without a message"
        OUTCOMES["error"] += 1
        return
    finally:
        peak = mx.get_peak_memory() - mx.get_active_memory()
        assert peak <= PEAK_BOUND, f"peak {peak / 2**20:.1f} MB above the weights"
    mask = model.diffusion_spec.mask_token_id
    # A family's default suffix (RND1's trailing pad) takes its positions from max_tokens.
    reserved = len(model.diffusion_spec.default_suffix)
    batch = [prompts] if kind == "single" else prompts
    assert len(rows) == len(batch) and len(reasons) == len(batch)
    for prompt, tokens, reason in zip(batch, rows, reasons):
        # Masks in a prompt of ids are filled (infilling) and returned with the new tokens.
        infilled = prompt.count(mask) if isinstance(prompt, list) and mask is not None else 0
        assert len(tokens) <= kw["max_tokens"] + infilled
        assert mask is None or mask not in tokens
        assert reason in REASONS
        assert reason == "stop" or len(tokens) == kw["max_tokens"] + infilled - reserved
    OUTCOMES["output"] += 1


def test_the_examples_reach_both_outcomes(models):
    """The strategies are not all errors (nor all output): the property was checked on many
    decodes. Runs after the property test (file order); alone, it checks every family decodes."""
    if not sum(OUTCOMES.values()):
        for name in FAMILIES:
            rows, reasons = _decode(*models[name], "single", "hi", {"max_tokens": 2})
            assert len(rows[0]) <= 2 and reasons and reasons[0] in REASONS
        return
    assert OUTCOMES["output"] >= 30 and OUTCOMES["error"] >= 30, OUTCOMES
