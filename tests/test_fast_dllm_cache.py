"""Fast-dLLM's approximate caches (cache="prefix" / "dual") for LLaDA, LLaDA-MoE and Dream: token
parity at temperature 0 with plain transcriptions of Fast-dLLM's generators on transformers'
forward of the same weights; a cache refreshed at every step is full recompute; every shared
sampler, left-padded batches, guidance and infilling; errors. And the masked loop's host
synchronisations per step (issue #14 section 3)."""

import mlx.core as mx
import pytest

from fixtures import build_once
from fixtures.dream import build as build_dream
from fixtures.llada import CHECKPOINTS as LLADA_CHECKPOINTS
from fixtures.sdar import build_sdar
from helpers import decoded, load_fixture, spy_forwards
from mlx_dllm_models.engine import make_decoder
from mlx_dllm_models.engine.fast_dllm import ApproxPrefixCache, DualCache
from mlx_dllm_models.request import checkpoint_settings
from mlx_dllm_models.settings import SettingsError, resolve_settings
from mlx_dllm_models.spec import SHARED_SAMPLERS
from reference import fast_dllm_torch as fast

PROMPTS = [[40, 41, 42, 43, 44, 45, 46], [100, 7, 7, 200, 13], [33] * 12]
# Dream's transcription commits whatever it proposes, the mask token included (it then loops
# forever); the engine never proposes it. On this fixture the dual cache proposes it after
# PROMPTS[0], so Dream's parity runs over prompts where it does not.
DREAM_PROMPTS = [[100, 7, 7, 200, 13], [33] * 12, [121, 131, 193, 243, 8]]
# Dream's fixture ships Dream's sampling defaults (temperature 0.2, top_p 0.95): greedy here.
GREEDY = {"dream": {"temperature": 0.0, "top_p": 1.0}}
BACKENDS = {"prefix": ApproxPrefixCache, "dual": DualCache}


@pytest.fixture(scope="module")
def models(fixture_dir):
    built = {}
    for name, build in [*LLADA_CHECKPOINTS.items(), ("dream", build_dream), ("sdar", build_sdar)]:
        path = build_once(fixture_dir / f"fast_dllm_{name}", build)
        built[name] = (path, *load_fixture(path))
    return built


def decode(model, prompts, backend=None, eos=(), suffix=(), **kw):
    """Each row's tokens (cut at `eos`) and the forward count; `backend` replaces the registry's."""
    spec = model.diffusion_spec
    s = resolve_settings(spec, kw, checkpoint_settings(model, spec))
    decoder = make_decoder(model, s, eos_token_ids=eos, suffix=suffix)
    if backend is not None:
        decoder.backend_cls = backend
    return decoded(decoder, prompts)


def refreshed(cls):
    return type(f"Refreshed{cls.__name__}", (cls,), {"refresh": 1})


def widths(model, run):
    """The input widths of every forward `run()` makes."""
    seen = []
    with spy_forwards(model, lambda inputs, *_: seen.append(inputs.shape[1])):
        result = run()
    return result, seen


# ----------------------------------------------------------------------------- reference parity


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LLADA_CHECKPOINTS))
@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("threshold", [None, 0.9])
def test_llada_matches_fast_dllm(models, name, cache, threshold):
    path, model, _ = models[name]
    reference = fast.llada_model(path)
    generate = {
        "prefix": fast.generate_with_prefix_cache,
        "dual": fast.generate_with_dual_cache,
    }[cache]
    sampler = {"sampler": "quota"} if threshold is None else {"sampler": "threshold"}
    for prompt in PROMPTS:
        x, nfe = generate(
            reference,
            [prompt],
            steps=32,
            gen_length=32,
            block_length=8,
            mask_id=model.diffusion_spec.mask_token_id,
            threshold=threshold,
        )
        (got, ours_nfe), seen = widths(
            model,
            lambda: decode(
                model,
                [prompt],
                cache=cache,
                max_tokens=32,
                block_length=8,
                threshold=threshold,
                **sampler,
            ),
        )
        assert got[0] == x[0, len(prompt) :].tolist()
        assert ours_nfe == nfe
        full = len(prompt) + 32
        assert seen.count(full) == 4, "one full forward per block"
        assert max(w for w in seen if w != full) <= (32 if cache == "prefix" else 8)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("threshold", [0.9, 0.6])
def test_dream_matches_fast_dllm_block_sample(models, cache, threshold):
    path, model, _ = models["dream"]
    reference = fast.dream_model(path)
    for prompt in DREAM_PROMPTS:
        x, nfe = fast.dream_block_sample(
            reference,
            [prompt],
            32,
            32,
            mask_token_id=model.diffusion_spec.mask_token_id,
            block_length=8,
            threshold=threshold,
            dual_cache=cache == "dual",
        )
        got, ours_nfe = decode(
            model,
            [prompt],
            cache=cache,
            max_tokens=32,
            block_length=8,
            sampler="threshold",
            threshold=threshold,
            **GREEDY["dream"],
        )
        assert got[0] == x[0, len(prompt) :].tolist()
        assert ours_nfe == nfe


def test_the_caches_are_approximations(models):
    """On these random fixtures the stale K/V change tokens: the caches are not full recompute in
    disguise (what the parity tests above could not tell apart on a too-easy fixture)."""
    _, model, _ = models["llada"]
    kw = dict(max_tokens=32, block_length=8, sampler="threshold", threshold=0.9)
    exact, _ = decode(model, PROMPTS, cache="none", **kw)
    for cache in ("prefix", "dual"):
        assert decode(model, PROMPTS, cache=cache, **kw)[0] != exact


# ------------------------------------------------------------------ refresh, samplers, batches


@pytest.mark.parametrize("name", ["llada", "llada_moe", "dream"])
@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_refreshed_every_step_is_full_recompute(models, name, cache):
    _, model, _ = models[name]
    kw = dict(max_tokens=24, block_length=8, sampler="threshold", threshold=0.8)
    kw.update(GREEDY.get(name, {}))
    exact = decode(model, PROMPTS, cache="none", **kw)
    assert decode(model, PROMPTS, backend=refreshed(BACKENDS[cache]), cache=cache, **kw) == exact


@pytest.mark.parametrize("name", ["llada", "dream"])
@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("sampler", SHARED_SAMPLERS)
def test_every_shared_sampler(models, name, cache, sampler):
    _, model, _ = models[name]
    kw = dict(max_tokens=16, block_length=8, sampler=sampler, **GREEDY.get(name, {}))
    got, nfe = decode(model, PROMPTS[:2], cache=cache, **kw)
    mask = model.diffusion_spec.mask_token_id
    assert all(len(row) == 16 and mask not in row for row in got)
    # A sampled run draws its noise through the backend too (Dream's first column).
    sampled, _ = decode(model, PROMPTS[:2], cache=cache, **{**kw, "temperature": 0.7, "seed": 3})
    assert all(len(row) == 16 and mask not in row for row in sampled)


@pytest.mark.parametrize("name", ["llada", "dream"])
@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_left_padded_batch_equals_one_by_one(models, name, cache):
    _, model, _ = models[name]
    kw = dict(max_tokens=24, block_length=8, sampler="threshold", threshold=0.8)
    kw.update(GREEDY.get(name, {}))
    alone = [decode(model, [p], cache=cache, **kw)[0][0] for p in PROMPTS]
    assert decode(model, PROMPTS, cache=cache, **kw)[0] == alone
    # A row that meets an EOS leaves the batch (the backend keeps the others' rows).
    eos = (alone[0][8],)
    cut = [decode(model, [p], cache=cache, eos=eos, **kw)[0][0] for p in PROMPTS]
    assert len(cut[0]) < 24 and max(len(c) for c in cut) > len(cut[0])
    assert decode(model, PROMPTS, cache=cache, eos=eos, **kw)[0] == cut


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_guidance_rows_share_the_forwards(models, cache):
    _, model, _ = models["llada"]
    kw = dict(max_tokens=16, block_length=8, sampler="quota", cfg_scale=1.5)
    exact = decode(model, PROMPTS, cache="none", **kw)
    assert decode(model, PROMPTS, backend=refreshed(BACKENDS[cache]), cache=cache, **kw) == exact
    (got, nfe), seen = widths(model, lambda: decode(model, PROMPTS, cache=cache, **kw))
    assert nfe == exact[1] and all(len(r) == 16 for r in got)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_infilling(models, cache):
    """Masks inside a prompt and a suffix after the canvas: the cached forwards start at the
    first mask left in the prompt, so every candidate reads its own left neighbour."""
    _, model, _ = models["llada"]
    mask = model.diffusion_spec.mask_token_id
    prompts = [[40, 41, mask, 43, 44, mask, 46], [100, 7, 7, 200, 13]]
    suffix = [50, 51, 52]
    kw = dict(max_tokens=16, block_length=8, sampler="quota", suffix=suffix)
    exact = decode(model, prompts, cache="none", **kw)
    assert decode(model, prompts, backend=refreshed(BACKENDS[cache]), cache=cache, **kw) == exact
    (got, _), seen = widths(model, lambda: decode(model, prompts, cache=cache, **kw))
    assert all(mask not in row for row in got)
    width = len(prompts[0]) + 16 + len(suffix)
    # prefix: the first block's cached forwards run from the first prompt mask to the end.
    assert (width - 2 in seen) == (cache == "prefix")


# ------------------------------------------------------------------------------------ errors


def test_errors(models):
    _, dream, _ = models["dream"]
    with pytest.raises(SettingsError, match="shared samplers"):
        decode(dream, PROMPTS, cache="dual", sampler="dream")
    _, sdar, _ = models["sdar"]
    with pytest.raises(SettingsError, match="not available for the sdar family"):
        decode(sdar, PROMPTS, cache="dual")


# -------------------------------------------------------------------- host syncs (section 3)


def test_one_host_sync_per_step(models, monkeypatch):
    """The masked loop reads the device (`.item()` / `.tolist()`, each a host synchronisation) at
    most once per denoising step, on the block-causal prefix cache: two runs over the same blocks
    that differ only in their steps per block differ by at most one read per extra forward."""
    _, model, _ = models["sdar"]
    calls = []
    for name in ("item", "tolist"):
        real = getattr(mx.array, name)
        monkeypatch.setattr(mx.array, name, lambda a, _r=real: calls.append(1) or _r(a))

    def reads(steps):
        calls.clear()
        _, nfe = decode(
            model, PROMPTS[:2], max_tokens=32, block_length=4, sampler="quota", steps=steps
        )
        return len(calls), nfe

    few, many = reads(2), reads(4)
    extra_forwards = many[1] - few[1]
    assert extra_forwards >= 16  # two more steps in each of the (at least) 8 blocks
    assert many[0] - few[0] <= extra_forwards
    # The rest is a few reads per block (schedule, first candidates, the block's tokens).
    assert many[0] <= many[1] + 3 * 10 + 2
