"""A family's facts live in its model file, and shared modules never name a family.

Each model module of registry.MODEL_TYPES declares its settings family (FAMILY) and the rows it
adds (SETTINGS; UNUSED_SETTINGS where it has shared settings it has no use for), and its spec
carries exactly those; the settings table (settings.SETTINGS) is collected from them. The
package's modules outside models/ (and the registry's one list) hold no family name or model type
as a string literal, except the names of samplers and decoders, a vocabulary of their own (the
`sampler` setting's values and DiffusionSpec.decoder) that reuses some references' names.

The specs are those of the fixture checkpoints (tests/fixtures), one per model type, built from
their config.json as mlx-lm builds a model (ModelArgs, then Model; no weights are read).
"""

import ast
import dataclasses
import importlib
import json
from pathlib import Path

import pytest

from fixtures import all_checkpoints
from mlx_dllm_models import settings
from mlx_dllm_models.registry import MODEL_TYPES

PACKAGE = Path(settings.__file__).parent
BUILDERS = all_checkpoints()

# String literals outside models/ that spell a family or model type but name a sampler (the
# `sampler` setting's values: decoding.samplers.COMMIT_RULES, WeDLMDecoder.samplers, the server's
# draws_noise) or a decoder (engine.registry.DECODERS): module -> those names, each once.
SAMPLER_AND_DECODER_NAMES = {
    "decoding/samplers.py": ["bd3lm", "dimple", "dream", "rnd1"],
    "engine/registry.py": ["gidd", "wedlm"],
    "engine/wedlm.py": ["wedlm"],
    "server/fields.py": ["dream"],
}


def _module(config):
    return importlib.import_module(f"mlx_dllm_models.models.{MODEL_TYPES[config['model_type']]}")


@pytest.fixture(scope="module")
def declared(tmp_path_factory):
    """Fixture name -> (its model module, the DiffusionSpec of its model)."""
    root = tmp_path_factory.mktemp("family_declarations")
    out = {}
    for name, build in BUILDERS.items():
        config = json.loads((build(root / name) / "config.json").read_text())
        module = _module(config)
        out[name] = module, module.Model(module.ModelArgs.from_dict(config)).diffusion_spec
    return out


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_a_spec_carries_its_model_files_declarations(declared, name):
    module, spec = declared[name]
    assert spec.family == module.FAMILY
    assert spec.settings == module.SETTINGS
    assert dict(spec.unused_settings) == vars(module).get("UNUSED_SETTINGS", {})
    shared = set(settings.SHARED_SETTINGS)
    assert not shared & {row.name for row in spec.settings}, "a family row shadows a shared one"
    assert set(spec.unused_settings) <= shared and set(spec.own_readings) <= shared
    assert not set(spec.unused_settings) & set(spec.own_readings)


def test_the_modules_of_one_settings_family_declare_the_same_rows():
    """The table and the messages group rows by family: every module of a family adds the same."""
    rows = {}
    for module_name in set(MODEL_TYPES.values()):
        module = importlib.import_module(f"mlx_dllm_models.models.{module_name}")
        assert rows.setdefault(module.FAMILY, module.SETTINGS) == module.SETTINGS, module_name
    for family, declared_rows in rows.items():
        assert set(settings.family_settings(family)) == {row.name for row in declared_rows}


def test_the_table_computes_families_and_unused_from_the_declarations():
    table = settings.SETTINGS
    assert [row.name for row in table[: len(settings.SHARED_ROWS)]] == list(
        settings.SHARED_SETTINGS
    )
    assert len({row.name for row in table}) == len(table)
    family_rows = settings.FAMILY_SETTINGS
    assert family_rows and all(row.families for row in family_rows)
    assert settings.BY_NAME["alg"].families == ("dream", "coda", "open_dcoder")
    assert settings.BY_NAME["block_size"].families == ("llada", "dream")  # d3llm's, shared rows
    assert "wedlm" in settings.BY_NAME["steps"].unused
    assert "diffusion_gemma" in settings.BY_NAME["top_k"].unused
    # The rows in the model files name no family: the table writes them. Families that share a
    # setting share its row (one help text, one validator).
    for module_name in set(MODEL_TYPES.values()):
        module = importlib.import_module(f"mlx_dllm_models.models.{module_name}")
        for row in module.SETTINGS:
            assert not row.families and not row.unused, (module_name, row.name)
            in_table = settings.BY_NAME[row.name]
            assert row == dataclasses.replace(in_table, families=()), (module_name, row.name)
            assert module.FAMILY in in_table.families


def _family_names(declared):
    names = set(MODEL_TYPES)
    for module_name in set(MODEL_TYPES.values()):
        names.add(importlib.import_module(f"mlx_dllm_models.models.{module_name}").FAMILY)
    return names | {spec.family for _, spec in declared.values()}


def test_no_shared_module_names_a_family(declared):
    names = _family_names(declared)
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("models/") or rel == "registry.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if node.value in names:
                    found.setdefault(rel, []).append(node.value)
    assert {rel: sorted(values) for rel, values in found.items()} == SAMPLER_AND_DECODER_NAMES
