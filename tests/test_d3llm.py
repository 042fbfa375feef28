"""d3LLM's multi-block entropy-threshold decoding (sampler "d3llm", decoding/d3llm.py) on the LLaDA
and Dream fixtures: tokens and forward counts at temperature 0 against a transcription of the
reference loops (tests/reference/d3llm_multi_block.py: LLaDA's generate_multi_block, Dream's
_sample_multi_block) on the transformers forwards, the recipe as the sampler's defaults, early stop,
batches, and bad settings."""

import dataclasses
import threading

import mlx.core as mx
import numpy as np
import pytest

from fixtures import build_once
from fixtures.dream import MASK as DREAM_MASK
from fixtures.dream import build as build_dream
from fixtures.llada import LLADA_TOKENS, build_llada
from helpers import decoded
from helpers import random_prompt as prompt
from mlx_dllm_models import SettingsError, batch_generate_diffusion, load
from mlx_dllm_models.decoding import d3llm
from mlx_dllm_models.engine import make_decoder
from mlx_dllm_models.request import checkpoint_settings
from mlx_dllm_models.settings import resolve_settings
from mlx_dllm_models.settings_fields import ResolvedSettings
from reference.d3llm_multi_block import multi_block_generate
from reference.dream_torch import reference_forward
from reference.llada_torch import torch_forward

LLADA_MASK = LLADA_TOKENS["<|mdm_mask|>"]
PATHS = {}  # the fixtures' checkpoint folders, by family


@pytest.fixture(scope="module", params=["llada", "dream"])
def family(request, fixture_dir):
    """(form, model, tokenizer, reference forward, mask id)."""
    if request.param == "llada":
        path = build_once(fixture_dir / "llada", build_llada)
        forward = torch_forward(path)
        mask = LLADA_MASK
    else:
        path = build_once(fixture_dir / "dream", build_dream)
        dream = reference_forward(path)
        forward = lambda x: dream(x, None, None)  # noqa: E731  (attention "full", no positions)
        mask = DREAM_MASK
    model, tok = load(path)
    PATHS[request.param] = path
    return request.param, model, tok, forward, mask


def ours(model, prompts, eos=(), **kw):
    settings = resolve_settings(model.diffusion_spec, {"sampler": "d3llm", **kw}, {})
    decoder = make_decoder(model, settings, eos_token_ids=eos)
    return decoded(decoder, prompts)


def reference(family, p, max_tokens, eos=None, **kw):
    form, _, _, forward, mask = family
    seq, nfe, forwards, mask_commits = multi_block_generate(
        forward, p, max_tokens, form=form, mask_id=mask, eos_token_id=eos, **kw
    )
    toks = seq[len(p) :].tolist()
    assert mask not in toks or mask_commits  # every mask is decoded unless one committed a mask
    if eos is not None and eos in toks:
        toks = toks[: toks.index(eos)]  # the package returns a row's tokens up to its first EOS
    return toks, nfe, forwards, mask_commits


# (prompt length, seed, max_tokens, settings). The fixtures' predictions are confident: thresholds
# of 0.05 - 1 nat take from one to most masks a step.
CASES = [
    (6, 0, 24, dict(block_size=8)),
    (5, 1, 32, dict(block_size=8, threshold=0.05)),
    (9, 2, 24, dict(block_size=4, threshold=1.0, block_add_threshold=0.5)),
    (7, 3, 24, dict(block_size=4, decoded_token_threshold=0.5, block_add_threshold=1.0)),
    (4, 4, 32, dict(block_size=16, threshold=0.9, decoded_token_threshold=0.0)),
    (8, 5, 20, dict(block_size=4, threshold=0.2, block_add_threshold=0.25)),
]


def _check(family, case, eos):
    n, seed, max_tokens, kw = case
    model = family[1]
    p = prompt(n, seed)
    want, _, forwards, mask_commits = reference(
        family, p, max_tokens, eos=eos, **{"early_stop": eos is not None, **kw}
    )
    got, nfe = ours(model, [p], eos=() if eos is None else (eos,), max_tokens=max_tokens, **kw)
    return got[0] == want and nfe == forwards, mask_commits


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"P{c[0]}-N{c[2]}-{c[3]}")
def test_tokens_and_forwards_match_the_reference(family, case):
    """Without EOS ids (early stop never fires). A case where the reference committed the mask
    token itself (its argmax is unrestricted; the position is decoded again later) is not
    comparable; most are."""
    same, mask_commits = _check(family, case, None)
    assert same or mask_commits


def test_most_cases_are_compared(family):
    assert sum(_check(family, c, None)[1] == 0 for c in CASES) >= len(CASES) - 1


# A token the fixtures propose often, taken as the EOS id so that early stop fires mid-canvas.
FREQUENT = {"llada": None, "dream": None}


def frequent_token(family):
    form, model = family[0], family[1]
    if FREQUENT[form] is None:
        toks, _ = ours(model, [prompt(6, 0)], max_tokens=32, block_size=8)
        values, counts = np.unique(toks[0][4:], return_counts=True)
        FREQUENT[form] = int(values[np.argmax(counts)])
    return FREQUENT[form]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"P{c[0]}-N{c[2]}-{c[3]}")
def test_early_stop_matches_the_reference(family, case):
    """handle_early_stop: once a position holds the EOS, every position after the first EOS
    becomes it and is no longer decoded (fewer forwards); the reference's own nfe counter also
    counts the iteration that ends there before its forward, the forwards run are compared."""
    same, mask_commits = _check(family, case, frequent_token(family))
    assert same or mask_commits


def early_token(model, p):
    """The token the first block decodes at its fourth position: as the EOS id, early stop fires
    within the first block."""
    return ours(model, [p], max_tokens=32, block_size=8)[0][0][3]


def test_early_stop_fires_and_saves_forwards(family):
    model = family[1]
    p = prompt(6, 0)
    eos = early_token(model, p)
    _, nfe_without = ours(model, [p], max_tokens=32, block_size=8)
    got, nfe = ours(model, [p], eos=(eos,), max_tokens=32, block_size=8)
    _, counted, forwards, _ = reference(family, p, 32, eos=eos, early_stop=True, block_size=8)
    assert len(got[0]) < 32 and nfe == forwards < nfe_without
    # The reference's counter may also count the iteration that early stop ends before its forward.
    assert counted in (forwards, forwards + 1)
    same_without, _ = _check(family, (6, 0, 32, dict(block_size=8, early_stop=False)), None)
    assert same_without


@pytest.mark.slow
def test_the_checks_can_fail(family):
    """The LLaDA and Dream forms of the threshold rule differ (the lowest-entropy mask always
    taken, <= against <), and decoding without the early stop the reference applies differs."""
    model = family[1]
    spec = model.diffusion_spec
    model.diffusion_spec = dataclasses.replace(
        spec, threshold_keeps_lowest=not spec.threshold_keeps_lowest
    )
    try:
        assert not all(_check(family, c, None)[0] for c in CASES)
    finally:
        model.diffusion_spec = spec
    p = prompt(6, 0)
    eos = early_token(model, p)
    want = reference(family, p, 32, eos=eos, early_stop=True, block_size=8)
    assert ours(model, [p], eos=(eos,), max_tokens=32, block_size=8, early_stop=False)[1] != want[2]


def test_batch_rows_equal_single_runs(family):
    model = family[1]
    prompts = [prompt(6, 0), prompt(9, 2), prompt(7, 3)]
    kw = dict(max_tokens=24, block_size=4, threshold=1.0, block_add_threshold=0.5)
    together, _ = ours(model, prompts, **kw)
    assert together == [ours(model, [p], **kw)[0][0] for p in prompts]


def test_defaults_are_the_d3llm_recipe(family):
    form, model = family[0], family[1]
    spec = model.diffusion_spec
    assert "d3llm" in spec.samplers and spec.threshold_keeps_lowest == (form == "llada")
    s = resolve_settings(spec, {"sampler": "d3llm"}, checkpoint_settings(model, spec))
    recipe = dict(
        max_tokens=256, block_size=32, threshold=0.5, block_add_threshold=0.1,
        decoded_token_threshold=0.95, early_stop=True, temperature=0.0,
    )  # fmt: skip
    assert {k: getattr(s, k) for k in recipe} == recipe
    assert (s.block_length, s.steps) == (256, 256)  # the canvas is the engine's one block
    if form == "dream":
        assert (s.top_p, s.top_k) == (None, None)
    other = resolve_settings(spec, {}, {})
    assert other.sampler != "d3llm" and other.block_size is None


def test_default_call_runs_through_generate(family):
    _, model, tok, _, _ = family
    out = batch_generate_diffusion(model, tok, [prompt(5, 9)], sampler="d3llm", max_tokens=64)
    assert out.nfe <= 64 and out.tokens[0]


def test_bad_settings_are_clear_errors(family):
    _, model, tok, _, _ = family
    run = lambda **kw: batch_generate_diffusion(model, tok, [[40, 41]], max_tokens=16, **kw)  # noqa: E731
    with pytest.raises(SettingsError, match="no step budget"):
        run(sampler="d3llm", steps=4)
    with pytest.raises(SettingsError, match="block_add_threshold"):
        run(sampler="d3llm", block_add_threshold=0.0)
    with pytest.raises(SettingsError, match="decoded_token_threshold"):
        run(sampler="d3llm", decoded_token_threshold=1.5)
    with pytest.raises(SettingsError, match="block_size"):
        run(sampler="d3llm", block_size=0)
    with pytest.raises(SettingsError, match="d3llm"):
        run(sampler="quota", block_size=8)


def test_rule_pieces():
    """Blocks counted from each row's first generated column; the blocks that exist run to the
    first one not yet block_add_threshold decoded; early stop fills after the first EOS."""
    gen = mx.array([[False, True, True, True, True, True, True]])
    assert d3llm.block_ids(gen, 2).tolist() == [[-1, 0, 0, 1, 1, 2, 2]]
    cand = mx.array([[False, False, True, True, True, True, True]])  # block 0 half decoded
    entropy = mx.array([[9.0, 9.0, 3.0, 0.1, 2.0, 0.0, 0.0]])
    s = ResolvedSettings.from_dict(
        dict(block_size=2, threshold=0.5, block_add_threshold=0.5, decoded_token_threshold=1.0)
    )
    # Block 1 exists (block 0 passed 0.5), block 2 does not; block 1 is not fully active, so only
    # its low-entropy mask commits, and block 0 (fully active) commits its one mask.
    got = d3llm.d3llm_select(entropy, cand, gen, s, keeps_lowest=False)
    assert got.tolist() == [[False, False, True, True, False, False, False]]
    block = mx.array([[5, 7, 2, 7, 4, 1, 3]])
    filled = d3llm.fill_after_eos(block, gen, {2})
    assert filled.tolist() == [[5, 7, 2, 2, 2, 2, 2]]
    assert d3llm.fill_after_eos(block, gen, {99}).tolist() == block.tolist()


def test_one_completion_through_serve(family):
    """The sampler and its settings as request fields: the answer equals the same call here."""
    from openai import OpenAI

    from mlx_dllm_models.server import make_server, shutdown

    form, model, tok, _, _ = family
    path = PATHS[form]
    server = make_server(lambda: load(path), host="127.0.0.1", port=0, model_id=form)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key="x")
        kw = dict(sampler="d3llm", block_size=8, threshold=0.5)
        answer = client.completions.create(
            model=form, prompt="abc", max_tokens=16, temperature=0, extra_body=kw
        )
        want = batch_generate_diffusion(model, tok, ["abc"], max_tokens=16, temperature=0, **kw)
        assert answer.choices[0].text == want.texts[0]
        # The fields are read: the family's default sampler answers otherwise.
        other = batch_generate_diffusion(model, tok, ["abc"], max_tokens=16, temperature=0)
        assert other.tokens[0] != want.tokens[0]
    finally:
        shutdown(server)
