"""The engine's contracts (engine/contracts.py, decoding/rule.py): every backend, decoder and
commit rule in the tables is of its base type, what a class does not declare is the base's
default, no capability is read as a possibly missing attribute, and a Request carries the spec
its run decodes under."""

import ast
from pathlib import Path

import pytest

from fixtures import build_once
from fixtures.dllm import build
from mlx_dllm_models import load
from mlx_dllm_models.decoding.rule import CommitRule, default_schedule
from mlx_dllm_models.decoding.samplers import COMMIT_RULES
from mlx_dllm_models.engine import (
    BACKENDS,
    DECODERS,
    Backend,
    Decoder,
    DecoderInputs,
    join_policy,
    make_decoder,
)
from mlx_dllm_models.engine import registry as registry_module
from mlx_dllm_models.engine.contracts import Restarts
from mlx_dllm_models.request import Request, prepare
from mlx_dllm_models.settings import SettingsError, resolve_settings
from mlx_dllm_models.settings_fields import ResolvedSettings
from mlx_dllm_models.spec import BIDIRECTIONAL, BLOCK_CAUSAL

PACKAGE = Path(__file__).resolve().parents[1] / "mlx_dllm_models"

# Every capability the registry and the loops read from a backend, decoder or rule.
CAPABILITIES = {
    name
    for base in (Backend, Decoder, Restarts)
    for name in vars(base)
    if not name.startswith("_") and name not in ("run",)
} | {f for f in CommitRule.__dataclass_fields__ if f != "commit"}


def test_the_tables_hold_their_base_types():
    backends = [b for table in BACKENDS.values() for b in table.values()]
    assert backends and all(issubclass(b, Backend) for b in backends)
    assert all(issubclass(d, Decoder) for d in DECODERS.values())
    assert all(isinstance(r, CommitRule) for r in COMMIT_RULES.values())


def test_the_capabilities_cover_the_flags_the_engine_reads():
    assert {
        "guidance",
        "row_steps",
        "joins_exactly",
        "kv_kind",
        "draws_batch_wide",
        "join_reencodes",
        "resumes",
        "kv_prefix",
        "check_settings",
        "seed_log_probs",
        "drops_cancelled_rows",
        "row_seeds",
        "takes_constraints",
        "constraint_alternative",
        "judges_joins",
        "schedule",
        "exact_floor",
        "reopens",
        "fills_after_eos",
        "stats_extras",
    } <= CAPABILITIES


def _getattr_names(path: Path):
    """The attribute names read with getattr(obj, "<literal>", ...) in a module."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr"):
            if len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                yield node.args[1].value


def test_no_capability_is_read_as_a_possibly_missing_attribute():
    found = {
        (str(path.relative_to(PACKAGE)), name)
        for path in PACKAGE.rglob("*.py")
        if "models" not in path.parts
        for name in _getattr_names(path)
        if name in CAPABILITIES
    }
    assert not found, found


def test_an_undeclared_class_gets_the_defaults():
    class Plain(Backend):
        pass

    class Loop(Decoder):
        pass

    assert not (Plain.guidance or Plain.row_steps or Plain.draws_batch_wide or Plain.resumes)
    assert Plain.join_reencodes and not Plain.joins_exactly({}) and Plain.kv_kind({}) is None
    assert Plain.check_settings(None, {}) is None
    assert Plain().kv_prefix(None) is None and Plain().reused == 0
    with pytest.raises(SettingsError, match="keeps no K/V"):
        Plain().resume(None, None)
    assert not (Loop.drops_cancelled_rows or Loop.row_seeds or Loop.takes_constraints)
    assert not (Loop.reads_images or Loop.judges_joins)
    assert Loop.samplers == () and not Loop.draws(None, {})
    assert Loop().kv_prefix() is None and Loop().reused == 0 and Loop().nfe == 0
    rule = CommitRule(lambda stats, cand, ctx: cand)
    assert rule.schedule is default_schedule and not rule.exact_floor({})
    assert not rule.reopens and not rule.fills_after_eos({}) and rule.stats_extras == ()
    assert not rule.draws({})
    assert rule(None, "cand", None) == "cand"


def test_join_policy_reads_the_declarations(monkeypatch):
    """A backend that declares nothing takes no joins and leaves no K/V; one that declares them
    is asked with the run's settings."""

    class Plain(Backend):
        pass

    class Exact(Backend):
        join_reencodes = False

        @classmethod
        def joins_exactly(cls, settings):
            return settings.max_tokens == 8

        @classmethod
        def kv_kind(cls, settings):
            return "kind"

    fields = {"decoder": "masked", "decoders": {}, "blocks_end_at_prompt": False}
    spec = type("Spec", (), fields)()
    monkeypatch.setattr(registry_module, "for_settings", lambda spec, settings: spec)
    for backend, max_tokens, want in (
        (Plain, 8, (False, False, None)),
        (Exact, 8, (True, True, "kind")),
        (Exact, 9, (False, False, "kind")),
    ):
        monkeypatch.setattr(registry_module, "select_backend", lambda spec, s, b=backend: b)
        got = join_policy(spec, ResolvedSettings.from_dict({"max_tokens": max_tokens}))
        assert (got.joins, got.free_join, got.kv_kind) == want
        assert got.drops_rows and got.row_seeds  # the masked decoder's declarations


@pytest.fixture(scope="module")
def a2d(fixture_dir):
    return load(build_once(fixture_dir / "a2d_qwen3", build))


def test_a_request_carries_the_spec_its_run_decodes_under(a2d):
    """A2D's checkpoint is MDLM's (bidirectional); its sampler bd3lm reads it block-causally:
    the Request says so, and its decoder decodes under that spec (computed once, in prepare)."""
    model, tok = a2d
    assert model.diffusion_spec.attention == BIDIRECTIONAL
    kw = dict(max_tokens=8, block_length=4, steps=4)
    request = prepare(model, tok, [[1, 2, 3]], dict(kw, sampler="bd3lm"))
    assert isinstance(request, Request) and isinstance(request, DecoderInputs)
    assert (request.spec.attention, request.spec.blocks_end_at_prompt) == (BLOCK_CAUSAL, True)
    decoder = request.decoder(model)
    assert decoder.spec is request.spec
    assert decoder.backend_cls.__name__ == "PrefixCache"
    mdlm = prepare(model, tok, [[1, 2, 3]], dict(kw, sampler="mdlm"))
    assert mdlm.spec.attention == BIDIRECTIONAL
    assert mdlm.decoder(model).backend_cls.__name__ == "FullRecompute"
    # make_decoder (the settings-only form) builds the same inputs.
    s = resolve_settings(model.diffusion_spec, dict(kw, sampler="bd3lm"), {})
    assert make_decoder(model, s, ()).spec == request.spec


def test_pixel_values_go_only_to_a_decoder_that_reads_them(a2d):
    model, _ = a2d
    s = resolve_settings(model.diffusion_spec, {}, {})
    with pytest.raises(TypeError, match="reads no pixel values"):
        make_decoder(model, s, (), images=[object()])
