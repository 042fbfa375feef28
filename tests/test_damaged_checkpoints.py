"""A damaged copy of a checkpoint fails to load with the package's own error (CheckpointError or
SettingsError, both ValueError), whose message says what is wrong and what to do: one row a
damage, each done to a fresh copy of the tiny LLaDA checkpoint."""

import json

import pytest

from helpers import checkpoint_copy, checkpoint_fixtures, edit_json
from mlx_dllm_models import CheckpointError, load
from mlx_dllm_models.tiny import build_tiny_llada

ckpt, loaded = checkpoint_fixtures("tiny_llada", build_tiny_llada)


def write(name, text):
    return lambda path: (path / name).write_text(text)


def config(fn):
    return lambda path: edit_json(path, fn)


def rename_a_weight(path):
    from safetensors.numpy import load_file, save_file

    w = load_file(str(path / "model.safetensors"))
    w["model.transformer.blocks.0.q_proj_typo.weight"] = w.pop(
        "model.transformer.blocks.0.q_proj.weight"
    )
    save_file(w, str(path / "model.safetensors"))


def lose_a_shard(path):
    (path / "model.safetensors").rename(path / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors"}}
    index["weight_map"]["b"] = "model-00002-of-00002.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def cut_weights(path):
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])


BROKEN_WEIGHTS = "model.safetensors is not a complete.*re-download"
CASES = [
    (write("config.json", "{not json"), ValueError, "not valid JSON", "malformed_config"),
    (config(lambda c: c.pop("model_type")), ValueError, "no model_type", "no_model_type"),
    (
        config(lambda c: c.update(model_type="llama")),
        ValueError,
        "not a diffusion model this package provides.*mlx_lm.load",
        "unknown_model_type",
    ),
    (
        lambda path: (path / "model.safetensors").unlink(),
        ValueError,
        "no \\*.safetensors",
        "no_weight_files",
    ),
    (rename_a_weight, ValueError, "q_proj_typo", "weights_with_wrong_names"),
    (
        config(lambda c: c.update(mlp_hidden_size=c["mlp_hidden_size"] * 2)),
        ValueError,
        "do not match|shape",
        "weights_with_wrong_shapes",
    ),
    (config(lambda c: c.pop("mask_token_id")), ValueError, "mask_token_id", "no_mask_token_id"),
    (
        lambda path: (path / "tokenizer.json").unlink(),
        CheckpointError,
        "no tokenizer files.*copy the tokenizer",
        "missing_tokenizer",
    ),
    (
        lose_a_shard,
        CheckpointError,
        "missing weight shard\\(s\\) model-00002-of-00002",
        "missing_shard",
    ),
    (cut_weights, CheckpointError, BROKEN_WEIGHTS, "truncated_safetensors"),
    (write("model.safetensors", "garbage" * 100), CheckpointError, BROKEN_WEIGHTS, "garbage"),
    (
        write("generation_config.json", "{not json"),
        CheckpointError,
        "generation_config.json is not valid JSON",
        "malformed_generation_config",
    ),
    *[
        (config(lambda c, edit=edit: c.update(edit)), CheckpointError, pattern, f"config_{i}")
        for i, (edit, pattern) in enumerate(
            [
                (dict(model_type=["llada"]), "model_type in .*config.json must be a string"),
                (dict(model_type=7), "model_type in .*config.json must be a string"),
                (dict(n_layers="2"), "n_layers in .*config.json must be an integer, got '2'"),
                (dict(rms_norm_eps="1e-5"), "rms_norm_eps in .*config.json must be a number"),
                (
                    dict(max_sequence_length=0),
                    "max_sequence_length \\(the context length\\) must be",
                ),
            ]
        )
    ],
]


@pytest.mark.parametrize(
    "damage, error, pattern", [c[:3] for c in CASES], ids=[c[3] for c in CASES]
)
def test_a_damaged_checkpoint_is_refused_with_what_to_do(ckpt, tmp_path, damage, error, pattern):
    path = checkpoint_copy(ckpt, tmp_path)
    damage(path)
    with pytest.raises(error, match=pattern):
        load(path)
