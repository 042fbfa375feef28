"""`Model.shard(group)` in one process: every family's method runs over a group of one rank and
changes nothing, a group that cannot split the checkpoint is refused before any weight is touched,
and a sharded load refuses what it cannot do. The runs over two processes are in
tests/test_distributed.py."""

import importlib

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from fixtures import diffusion_gemma, dream, llada, llada2, nemotron, sdar
from helpers import Ranks
from mlx_dllm_models import SettingsError, load
from mlx_dllm_models.models import sharding
from mlx_dllm_models.tiny import build_tiny_llada

CONFIGS = {
    "llada": llada.llada_config,
    "llada_moe": llada.llada_moe_config,
    "dream": dream.config,
    "sdar": lambda: sdar.sdar_config(moe=False),
    "sdar_moe": lambda: sdar.sdar_config(moe=True),
    "llada2_moe": llada2.config,
    "nemotron": nemotron.config,
    "nemotron_tied": lambda: nemotron.config(tied=True),
    "diffusion_gemma": lambda: {
        "model_type": "diffusion_gemma",
        "text_config": dict(diffusion_gemma.TEXT_CONFIG),
    },
}


def _model(name):
    config = CONFIGS[name]()
    # The module mlx_lm.load finds for the model_type (the package registers it under mlx_lm.models).
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("name", CONFIGS)
def test_shard_over_one_rank_keeps_the_logits(name):
    model = _model(name)
    ids = mx.array([[5, 6, 7, 8, 9]])
    before = model(ids)
    model.shard(mx.distributed.init())  # the single-process group
    after = model(ids)
    np.testing.assert_allclose(np.array(after), np.array(before), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", CONFIGS)
def test_a_group_that_cannot_split_the_checkpoint_is_refused(name):
    model = _model(name)
    weights = dict(tree_flatten(model.parameters()))
    with pytest.raises(SettingsError, match="cannot split the checkpoint over 3 ranks") as e:
        model.shard(Ranks(3))
    assert "Launch a number of ranks that divides" in str(e.value)
    # Refused before anything was split.
    after = dict(tree_flatten(model.parameters()))
    assert {k: v.shape for k, v in after.items()} == {k: v.shape for k, v in weights.items()}


def test_quantized_layers_must_split_into_whole_groups():
    # Fixture dims: o_proj has 64 inputs, quantized in groups of 64: two ranks would get half a
    # group each. Groups of 32 split.
    model = _model("llada")
    nn.quantize(model, group_size=64, bits=4)
    with pytest.raises(SettingsError, match="quantized in groups of 64 along its 64 inputs"):
        model.shard(Ranks(2))
    model = _model("llada")
    nn.quantize(model, group_size=32, bits=4)
    sharding.check_divisible("llada", Ranks(2), {}, model=model)


def test_sharded_load_refuses_options_it_cannot_honour(tmp_path):
    path = build_tiny_llada(tmp_path / "llada")
    with pytest.raises(SettingsError, match="does not take adapter_path"):
        load(path, group=Ranks(2), adapter_path=str(tmp_path))
