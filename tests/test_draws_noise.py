"""Whether a run draws from its seed's stream, as the commit rule and the loop declare it
(decoding.rule.CommitRule.draws, engine.contracts.Decoder.draws, engine.registry.draws_noise): a
request that names no seed and draws gets a fresh one from the server (server/api.py's
Service.prepare); one that draws nothing keeps sharing a batch with the others."""

from pathlib import Path

import pytest

from fixtures import build_once
from fixtures.dimple import build as build_dimple
from mlx_dllm_models import load
from mlx_dllm_models.decoding.llada import random_commit
from mlx_dllm_models.decoding.samplers import COMMIT_RULES
from mlx_dllm_models.engine.registry import draws_noise
from mlx_dllm_models.models import dimple, dream
from mlx_dllm_models.server.api import Service
from mlx_dllm_models.server.scheduler import Scheduler
from mlx_dllm_models.settings_fields import ResolvedSettings
from mlx_dllm_models.spec import BIDIRECTIONAL, ENCODER_CANVAS, DiffusionSpec

GREEDY = dict(temperature=0.0, alg_temp=None)


def resolved(**values):
    return ResolvedSettings.from_dict(values)


def spec_of(samplers, **fields):
    return DiffusionSpec(
        "test", fields.pop("attention", BIDIRECTIONAL), 3, commit_rules=samplers, **fields
    )


@pytest.mark.parametrize(
    "settings, draws",
    [
        (dict(alg="maskgit_plus"), False),
        (dict(alg="entropy", alg_temp=0.0), False),
        (dict(alg="entropy", alg_temp=0.1), True),
        (dict(alg="origin"), True),
    ],
)
def test_dreams_rule_draws_for_origin_and_a_ranking_temperature(settings, draws):
    s = resolved(**dict(GREEDY, sampler="dream", **settings))
    assert dream.SAMPLERS["dream"].draws(s) is draws
    assert draws_noise(spec_of(dream.SAMPLERS), s) is draws


@pytest.mark.parametrize(
    "settings, draws",
    [
        (dict(alg="maskgit_plus"), False),
        (dict(alg="maskgit_plus", alg_temp=0.5), True),
        (dict(alg="entropy", alg_temp=0.5), True),
        (dict(alg="autoregressive", alg_temp=0.5), False),  # ranks by column alone
        (dict(alg="origin"), True),
        (dict(alg="origin-ratio"), True),
    ],
)
def test_dimples_rule_draws_for_its_random_orders_and_a_ranking_temperature(settings, draws):
    s = resolved(**dict(GREEDY, sampler="dimple", **settings))
    assert draws_noise(spec_of(dimple.SAMPLERS), s) is draws


def test_the_shared_rules_draw_only_for_random_remasking():
    s = resolved(**GREEDY, alg="origin")  # another sampler's setting changes nothing here
    assert COMMIT_RULES["random"] is random_commit and random_commit.draws(s)
    for name in ("quota", "threshold", "sequential", "mdlm", "p2"):
        assert not COMMIT_RULES[name].draws(s), name
        assert not draws_noise(spec_of({}), resolved(**GREEDY, alg="origin", sampler=name)), name
        assert draws_noise(
            spec_of({}), resolved(**dict(GREEDY, temperature=0.5), alg="origin", sampler=name)
        ), name


def test_a_canvas_starts_from_noise():
    canvas = spec_of({}, attention=ENCODER_CANVAS, decoder="canvas", vocab_size=16)
    assert draws_noise(canvas, resolved(**GREEDY, sampler="entropy"))


@pytest.mark.slow
def test_a_dimple_request_with_a_ranking_temperature_gets_a_fresh_seed(fixture_dir):
    """alg_temp > 0 draws Dimple's positions from the seed's stream: without a seed of its own, the
    request gets a fresh one (as one at temperature > 0 does), while the greedy ranking keeps none."""
    model, tok = load(build_once(Path(fixture_dir) / "dimple", build_dimple))
    service = Service(model, tok, Scheduler(model, tok), "dimple")
    base = dict(max_tokens=4, temperature=0.0, alg="maskgit_plus", sampler="dimple")
    seeds = []
    for _ in range(2):
        overrides = dict(base, alg_temp=0.5)
        request = service.prepare("hi", overrides)
        assert overrides["seed"] == request.settings.seed
        seeds.append(overrides["seed"])
    assert seeds[0] != seeds[1], "the same fresh seed twice"
    overrides = dict(base, alg_temp=0.0)
    request = service.prepare("hi", overrides)
    assert overrides.get("seed") is None and request.settings.seed == 0
