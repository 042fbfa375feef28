"""Checkpoints at a real config's width, in the Hugging Face layout, with random weights.

A real config.json of tests/data with some keys overridden (fewer layers, narrow MLPs), its weight
names (the real weight index's for the layers kept, or this package's module names), each shaped as
the family's model built lazily at that config expects, and random bfloat16 weights: norms near 1,
matrices at 1/sqrt(fan-in), the output head scaled (confident predictions), the mask token's
embedding small, as in the fixtures. The weights are written straight as bfloat16 bit patterns
(sign, one exponent, random mantissa): generating and converting a vocabulary x hidden table
through float32 costs seconds each on two cores.
"""

import json
import re
import struct

import numpy as np
from mlx.utils import tree_flatten

from real_checkpoints import hf_shape, load_json, model_module


def _bf16_bits(rng, shape, scale):
    """Random bfloat16 values as their uint16 bit patterns: a random sign and mantissa under the
    exponent of `scale`, so |w| lies in [scale, 2 scale)."""
    n = int(np.prod(shape))
    # Drawn as 64-bit integers: numpy's rng.bytes is about 14x slower (7 s for a 1 GB table).
    words = rng.integers(0, 2**64 - 1, size=-(-n // 4), dtype=np.uint64, endpoint=True)
    bits = words.view(np.uint16)[:n].reshape(shape)
    exponent = (127 + int(np.floor(np.log2(scale)))) << 7
    return (bits & np.uint16(0x807F)) | np.uint16(exponent)


def _bf16_of(values):
    """float32 values -> bfloat16 bit patterns (round to nearest even)."""
    u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _write_safetensors(path, tensors):
    """tensors: name -> (dtype tag, array of its bytes); written as safetensors, in order."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (dtype, array) in tensors.items():
        shape = list(array.shape)
        header[name] = {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, array in tensors.values():
            f.write(np.ascontiguousarray(array).data)


def random_tensors(shapes, rng, head, embed, mask_id):
    """HF name -> (dtype, bytes) for `shapes`: norms near 1, matrices at 1/sqrt(fan-in), the head
    `head` times larger (confident predictions), the mask token's embedding row small."""
    out = {}
    for name, shape in shapes.items():
        if name.endswith("expert_bias"):  # a float32 buffer in the real checkpoints
            values = 0.5 * rng.standard_normal(shape).astype(np.float32)
            out[name] = ("F32", values)
        elif len(shape) == 1 or name.endswith(("layer_scalar", "router.scale")):
            out[name] = ("BF16", _bf16_of(1 + 0.2 * rng.standard_normal(shape)))
        else:
            scale = shape[-1] ** -0.5 * (head if name in (embed[1],) else 1.0)
            bits = _bf16_bits(rng, shape, scale)
            if name == embed[0] and mask_id is not None:
                bits[mask_id] = _bf16_bits(rng, shape[1:], 0.05 * scale)
            out[name] = ("BF16", bits)
    return out


def config_with(data, overrides):
    config = load_json(data, "config.json")
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return config


def mlx_shapes(config):
    module = model_module(config)
    model = module.Model(module.ModelArgs.from_dict(config))  # lazy: nothing is allocated
    return {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}


def index_names(data, layers):
    """The real weight index's names, for the first `layers` layers."""
    keep = []
    for name in load_json(data, "model.safetensors.index.json")["weight_map"]:
        m = re.search(r"\.(?:layers|blocks)\.(\d+)\.", name)
        if m is None or int(m[1]) < layers:
            keep.append(name)
    return keep


def write_checkpoint(path, config, tensors, tokens, roles, generation_config=None):
    """An HF-layout checkpoint folder: config, weights, a byte-level tokenizer with the family's
    special tokens at their real ids (those above the 256 bytes; the spec reads the ids from the
    config), and generation_config.json when given."""
    from mlx_dllm_models.tiny import build_tokenizer

    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config, indent=2))
    _write_safetensors(path / "model.safetensors", tensors)
    build_tokenizer(path, {k: v for k, v in tokens.items() if v >= 256}, **roles)
    return path


def from_index(tmp, data, layers, overrides, embed, head, tokens, roles, rename=lambda k: k):
    config = config_with(data, overrides)
    expected = mlx_shapes(config)
    shapes = {n: hf_shape(n, expected, rename) for n in index_names(data, layers)}
    mask = config.get("mask_token_id")
    tensors = random_tensors(shapes, np.random.default_rng(0), head, embed, mask)
    return write_checkpoint(tmp / "hf", config, tensors, tokens, roles), config


def from_model(tmp, data, overrides, embed, head, tokens, roles):
    """Families whose HF names are this package's module names (no index was found)."""
    config = config_with(data, overrides)
    shapes = mlx_shapes(config)
    mask = config.get("mask_token_id")
    tensors = random_tensors(shapes, np.random.default_rng(0), head, embed, mask)
    return write_checkpoint(tmp / "hf", config, tensors, tokens, roles), config
