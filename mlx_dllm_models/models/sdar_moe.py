"""SDAR-30B-A3B (model_type "sdar_moe"): SDAR block diffusion on an exact Qwen3-MoE body.

Same attention contract as `sdar`: the caller passes the block-causal mask.
"""

from dataclasses import dataclass
from typing import List, Optional, Union

import mlx.core as mx
from mlx_lm.models import qwen3_moe

from ..spec import DiffusionSpec
from .sdar import (
    SDAR_BLOCK_SIZE,
    SDAR_MASK_TOKEN_ID,
    check_weight_names,
    masked_forward,
    resolve_mask_token_id,
    sanitize_experts,
    sdar_spec,
)


@dataclass
class ModelArgs(qwen3_moe.ModelArgs):
    block_size: int = SDAR_BLOCK_SIZE
    mask_token_id: Optional[int] = None
    eos_token_id: Union[int, List[int], None] = None

    def __post_init__(self):
        self.mask_token_id = resolve_mask_token_id(
            self.mask_token_id, SDAR_MASK_TOKEN_ID, self.vocab_size, self.model_type
        )


class Model(qwen3_moe.Model):
    """SDARMoeForCausalLM: qwen3_moe.Model whose forward takes the attention mask from the caller."""

    def __call__(self, inputs: mx.array, cache=None, mask=None, rows=None) -> mx.array:
        return masked_forward(self, self.model.embed_tokens, inputs, cache, mask, rows)

    def sanitize(self, weights):
        weights = sanitize_experts(super().sanitize, weights, "sdar_moe", self.args.num_experts)
        return check_weight_names(self, weights, "sdar_moe", "model.layers.0.mlp.experts.0.gate_proj.weight")

    @property
    def diffusion_spec(self) -> DiffusionSpec:
        return sdar_spec(self.args)
