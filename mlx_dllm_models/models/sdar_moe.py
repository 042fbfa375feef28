"""SDAR-30B-A3B (model_type "sdar_moe"): SDAR block diffusion on an exact Qwen3-MoE body.

Same attention contract as `sdar`: the caller passes the block-causal mask.
"""

from dataclasses import dataclass
from typing import List, Optional, Union

from mlx_lm.models import qwen3_moe

from ..spec import DiffusionSpec
from . import sdar
from .common import (
    cached_spec,
    check_special_ids,
)
from .mlx_lm_body import MaskedBody
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


class Model(MaskedBody, qwen3_moe.Model):
    """SDARMoeForCausalLM: mlx-lm's qwen3_moe read under the caller's mask."""

    family = "sdar_moe"
    layout = "Qwen3-MoE's layout (e.g. 'model.layers.0.mlp.experts.0.gate_proj.weight')"
    config_keys = f"{SDAR_CONFIG_KEYS}, num_experts, moe_intermediate_size"
    shard_widths = ("moe_intermediate_size", "intermediate_size")

    @cached_spec
    def diffusion_spec(self) -> DiffusionSpec:
        return sdar_spec(self.args)
