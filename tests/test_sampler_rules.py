"""Every sampler a family lists in its DiffusionSpec has a rule in the loop that reads it.

Samplers are named in three places: a family's `samplers`, the settings table's validation of the
`sampler` setting (which takes the family's list), and the rules. Nothing else ties a listed name
to a rule, so a family could list one that decoding would only refuse at run time. The loops that
read the setting, and where their rules are:

* MaskedBlockDecoder (LLaDA, LLaDA-MoE, Dream, SDAR, SDAR-MoE, LLaDA2.x, Nemotron's diffusion mode):
  the family's own rules (`spec.commit_rules`, its model file's SAMPLERS), then the shared table
  decoding.samplers.COMMIT_RULES (decoding.samplers.commit_rule);
* CanvasDecoder (DiffusionGemma): its own two rules over the canvas, `CanvasDecoder.samplers`
  ("entropy", "threshold"), not the table;
* Nemotron's self-speculation (mode="self_spec") reads no sampler: the settings table scopes the
  setting to mode "diffusion";
* WeDLM's loop (its spec's `decoders`: models.wedlm.Decoder, an engine.wedlm.WeDLMDecoder): its
  one rule, decoding.wedlm.wedlm_commit, under the name its model file gives it (`samplers`).

The specs are those of the fixture checkpoints (tests/fixtures), one per model type, built from
their config.json as mlx-lm builds a model (ModelArgs, then Model; no weights are read).
"""

import importlib
import json

import pytest

from fixtures import all_checkpoints
from mlx_dllm_models.decoding.samplers import COMMIT_RULES
from mlx_dllm_models.engine import DECODERS, MaskedBlockDecoder
from mlx_dllm_models.engine.canvas import CanvasDecoder
from mlx_dllm_models.registry import MODEL_TYPES
from mlx_dllm_models.settings import BY_NAME, family_settings

BUILDERS = all_checkpoints()


def _module(config):
    return importlib.import_module(f"mlx_dllm_models.models.{MODEL_TYPES[config['model_type']]}")


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """Fixture name -> its config.json."""
    root = tmp_path_factory.mktemp("sampler_rules")
    return {
        name: json.loads((build(root / name) / "config.json").read_text())
        for name, build in BUILDERS.items()
    }


@pytest.fixture(scope="module")
def specs(configs):
    """Fixture name -> the DiffusionSpec of its model."""
    out = {}
    for name, config in configs.items():
        module = _module(config)
        out[name] = module.Model(module.ModelArgs.from_dict(config)).diffusion_spec
    return out


def sampler_loops(spec):
    """The loops that read the `sampler` setting for this family: its default one and, when its
    `mode` setting picks the loop (Nemotron), those of the modes the sampler is scoped to."""
    names = {spec.decoder}
    if "mode" in family_settings(spec.family):
        names |= set(BY_NAME["sampler"].modes)
    table = {**DECODERS, **spec.decoders}
    return [table[name] for name in sorted(names)]


def rules_of(loop, spec):
    """The sampler names a loop has a rule for, in this family."""
    if loop is MaskedBlockDecoder:
        return set(COMMIT_RULES) | set(spec.commit_rules)
    if loop is CanvasDecoder or loop in spec.decoders.values():
        assert loop.samplers, f"{loop.__name__} names no sampler"
        return set(loop.samplers)
    raise AssertionError(f"{loop.__name__} reads the sampler setting: state where its rules are")


def test_the_fixtures_cover_every_model_module(configs):
    assert {_module(c).__name__ for c in configs.values()} == {
        f"mlx_dllm_models.models.{m}" for m in MODEL_TYPES.values()
    }


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_every_listed_sampler_has_a_rule(specs, name):
    spec = specs[name]
    assert spec.samplers, f"{name} lists no sampler"
    for loop in sampler_loops(spec):
        missing = [s for s in spec.samplers if s not in rules_of(loop, spec)]
        assert not missing, f"{name}: {loop.__name__} has no rule for sampler(s) {missing}"


def test_every_rule_of_the_table_is_a_family_sampler(specs):
    """A row no family lists is dead: a sampler removed from its family, or a misspelt name; a
    family's own rule is one it lists, and never shadows a shared one."""
    masked = [spec for spec in specs.values() if MaskedBlockDecoder in sampler_loops(spec)]
    listed = {s for spec in masked for s in spec.samplers}
    own = {s for spec in masked for s in spec.commit_rules}
    assert set(COMMIT_RULES) | own == listed
    for spec in specs.values():
        assert set(spec.commit_rules) <= set(spec.samplers), spec.family
        assert not set(spec.commit_rules) & set(COMMIT_RULES), spec.family


def test_a_missing_rule_is_caught(specs, monkeypatch):
    """The check above can fail: without the table's "random" row, LLaDA's samplers miss one."""
    # This module's name, not the package's table: deleting and restoring an entry of the
    # package's dict would move it to the end, and the CLI index lists the samplers in its order.
    without = {k: rule for k, rule in COMMIT_RULES.items() if k != "random"}
    monkeypatch.setitem(globals(), "COMMIT_RULES", without)
    with pytest.raises(AssertionError, match=r"no rule for sampler\(s\) \['random'\]"):
        test_every_listed_sampler_has_a_rule(specs, "llada")
