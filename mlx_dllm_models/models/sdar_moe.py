"""SDAR-30B-A3B (model_type "sdar_moe"): SDAR block diffusion on an exact Qwen3-MoE body.

Same attention contract as `sdar`: the caller passes the block-causal mask.
"""

from dataclasses import dataclass
from typing import List, Optional, Union

import mlx.core as mx
from mlx_lm.models import qwen3_moe

from ..spec import DiffusionSpec
from . import sdar, sharding
from .common import (
    cached_spec,
    check_special_ids,
    check_weights,
    masked_forward,
    refuse_autoregressive_tools,
    sanitize_experts,
)
from .sdar import (
    SDAR_BLOCK_SIZE,
    SDAR_CONFIG_KEYS,
    SDAR_MASK_TOKEN_ID,
    SDAR_SPECIAL_IDS,
    sdar_spec,
)

# SDAR's settings family and rows.
FAMILY = sdar.FAMILY
SETTINGS = sdar.SETTINGS


@dataclass
class ModelArgs(qwen3_moe.ModelArgs):
    block_size: int = SDAR_BLOCK_SIZE
    mask_token_id: Optional[int] = None
    eos_token_id: Union[int, List[int], None] = None
    pad_token_id: Optional[int] = None

    def __post_init__(self):
        check_special_ids(self, SDAR_SPECIAL_IDS, mask_default=SDAR_MASK_TOKEN_ID)


class Model(qwen3_moe.Model):
    """SDARMoeForCausalLM: qwen3_moe.Model whose forward takes the attention mask from the caller."""

    # mlx-lm's AR tools call make_cache first: they stop there with a pointer to mlx_dllm.
    make_cache = refuse_autoregressive_tools

    def __call__(self, inputs: mx.array, cache=None, mask=None, head_span=None) -> mx.array:
        return masked_forward(self, self.model.embed_tokens, inputs, cache, mask, head_span)

    def sanitize(self, weights):
        weights = sanitize_experts(super().sanitize, weights, "sdar_moe", self.args.num_experts)
        layout = "Qwen3-MoE's layout (e.g. 'model.layers.0.mlp.experts.0.gate_proj.weight')"
        keys = f"{SDAR_CONFIG_KEYS}, num_experts, moe_intermediate_size"
        return check_weights(self, weights, "sdar_moe", layout, keys)

    def shard(self, group: Optional[mx.distributed.Group] = None):
        """mlx-lm's qwen3_moe.Model.shard (attention heads and dense MLPs split over `group`, the
        experts split over their intermediate dimension, the router replicated), after a readable
        check that the group divides them."""
        group = sharding.checked_group(
            self, group, "sdar_moe", "moe_intermediate_size", "intermediate_size"
        )
        super().shard(group)

    @cached_spec
    def diffusion_spec(self) -> DiffusionSpec:
        return sdar_spec(self.args)
