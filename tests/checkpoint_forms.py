"""A model in the narrow forms its checkpoint is published or converted in: bfloat16 ("bf16"),
and mlx-lm's quantization to 4 or 8 bits of the bfloat16 weights ("q4", "q8") or of the float32
ones ("q4_f32")."""

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path


def to_bf16(model):
    keep = getattr(model, "cast_predicate", lambda key: True)  # LLaDA2's expert_bias

    def cast(key, v):
        return v.astype(mx.bfloat16) if mx.issubdtype(v.dtype, mx.floating) and keep(key) else v

    model.update(tree_map_with_path(cast, model.parameters()))


def narrow(model, form):
    """The model in `form`, as mlx-lm's convert would write it (its quant_predicate honoured)."""
    if form != "q4_f32":
        to_bf16(model)
    if form == "bf16":
        return model
    own = getattr(model, "quant_predicate", None)

    def predicate(path, module):
        if not hasattr(module, "to_quantized") or module.weight.shape[-1] % 32:
            return False
        return own(path, module) if own else True

    nn.quantize(model, group_size=32, bits=8 if form == "q8" else 4, class_predicate=predicate)
    return model
