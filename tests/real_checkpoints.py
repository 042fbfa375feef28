"""The real checkpoints' files under tests/data (see its README), and this package's model built
from their config.json without allocating its weights (MLX arrays are lazy)."""

import gzip
import importlib
import json
import re
from functools import lru_cache
from pathlib import Path

import pytest

from mlx_dllm_models.registry import MODEL_TYPES

DATA = Path(__file__).parent / "data"

# Checkpoints of the listed families whose files could not be found (tests/data/README.md says
# where we looked). Kept here so that the report shows them as skipped, with the reason.
NOT_FOUND = {}


def load_json(name, filename):
    """The JSON of a checkpoint file, from `filename` or `filename.gz`; None if absent."""
    path = DATA / name / filename
    if path.exists():
        return json.loads(path.read_text())
    gz = path.with_name(path.name + ".gz")
    if gz.exists():
        return json.loads(gzip.decompress(gz.read_bytes()))
    return None


def require(name, filename=None):
    if name in NOT_FOUND:
        pytest.skip(f"{name}: {NOT_FOUND[name]}")
    if filename is not None and load_json(name, filename) is None:
        pytest.skip(f"{name}: {filename} was not found (tests/data/README.md)")


def model_module(config):
    """This package's module of the family `config` (a config.json's dict) names."""
    return importlib.import_module(f"mlx_dllm_models.models.{MODEL_TYPES[config['model_type']]}")


def build(name):
    config = load_json(name, "config.json")
    module = model_module(config)
    args = module.ModelArgs.from_dict(config)
    return args, module.Model(args)


@lru_cache(maxsize=None)
def built(name):
    args, model = build(name)
    return args, model, model.diffusion_spec


def hf_shape(name, expected, rename):
    """The shape the model expects for HF weight `name` (lazy zeros of it are never evaluated)."""
    for key in (name, rename(name)):
        if key in expected:
            return expected[key]
    m = re.match(r"(.*)\.experts\.\d+\.(\w+)\.weight$", name)
    if m and f"{m[1]}.switch_mlp.{m[2]}.weight" in expected:
        return expected[f"{m[1]}.switch_mlp.{m[2]}.weight"][1:]
    if name.endswith("mlp.gate.weight") and f"{name[:-6]}gate_proj.weight" in expected:
        return expected[f"{name[:-6]}gate_proj.weight"]
    return (1,)
