"""SDAR (JetLM/SDAR-*-Chat) and TraDo: block-diffusion LMs with an exact Qwen3 body.

Only the attention pattern differs from Qwen3: blocks of `block_size` tokens, aligned on absolute
positions, attend bidirectionally inside the block and to every earlier block. The model never builds
that mask itself; the engine passes `mlx_dllm_models.masks.block_causal_mask` (or a cache-aware one).
Logits at position i predict token i (no shift).
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3

from ..spec import BLOCK_CAUSAL, SHARED_SAMPLERS, DiffusionSpec

# The id SDAR/TraDo checkpoints use for <|MASK|>; their HF config.json does not carry it.
SDAR_MASK_TOKEN_ID = 151669
SDAR_BLOCK_SIZE = 4
# JetAstra/SDAR generate.py: `confidence_threshold` default of both the function and the CLI.
SDAR_THRESHOLD = 0.85

# Suffixes of tensors that quantized layers add next to their `.weight`.
_QUANT_SUFFIXES = ("scales", "biases", "global_scale")


def resolve_mask_token_id(mask_token_id: Optional[int], default: int, vocab_size: int, family: str) -> int:
    mask_token_id = default if mask_token_id is None else int(mask_token_id)
    if not 0 <= mask_token_id < vocab_size:
        raise ValueError(
            f"{family}: mask_token_id {mask_token_id} is outside the vocabulary (vocab_size {vocab_size}). "
            f"Set `mask_token_id` in config.json to the id of the checkpoint's mask token."
        )
    return mask_token_id


def eos_token_ids(value: Union[int, Sequence[int], None]) -> Tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def drop_unused_buffers(weights: dict) -> dict:
    # Some exports carry RoPE's non-persistent buffer; it is recomputed here.
    return {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}


def check_weight_names(model, weights: dict, family: str, example: str) -> dict:
    """Raise a readable error for weights the model has no place for (instead of mlx's generic one)."""
    expected = {k for k, _ in tree_flatten(model.parameters())}

    def known(key):
        if key in expected:
            return True
        base, _, suffix = key.rpartition(".")
        return suffix in _QUANT_SUFFIXES and f"{base}.weight" in expected

    unknown = sorted(k for k in weights if not known(k))
    if unknown:
        raise ValueError(
            f"{family}: {len(unknown)} weight(s) do not belong to this architecture, e.g. {unknown[:4]}. "
            f"Expected the Hugging Face layout (e.g. {example!r}); check that config.json's model_type "
            f"matches the checkpoint and that num_hidden_layers / num_experts agree with the weights."
        )
    return weights


def run_layers(model, h: mx.array, cache, mask):
    if isinstance(mask, mx.array) and mask.dtype != mx.bool_:
        mask = mask.astype(h.dtype)  # SDPA wants an additive mask in the activation dtype
    if cache is None:
        cache = [None] * len(model.layers)
    for layer, c in zip(model.layers, cache):
        h = layer(h, mask, c)
    return h


def select_rows(h: mx.array, rows) -> mx.array:
    return h if rows is None else h[:, rows[0] : rows[1]]


def masked_forward(model, embed, inputs, cache, mask, rows) -> mx.array:
    """The protocol's forward of the mlx-lm bodies reused here (qwen3, qwen3_moe, bailing_moe):
    their layers under the caller's mask, the final norm and head over the requested rows only."""
    h = run_layers(model, embed(inputs), cache, mask)
    h = model.model.norm(select_rows(h, rows))
    if model.args.tie_word_embeddings:
        return embed.as_linear(h)
    return model.lm_head(h)


def sanitize_experts(parent_sanitize, weights, family: str, num_experts: int) -> dict:
    """mlx-lm's sanitize of an MoE body (stacks per-expert weights), with a readable error for a
    checkpoint that has fewer experts than its config says."""
    try:
        return parent_sanitize(drop_unused_buffers(weights))
    except KeyError as e:
        raise ValueError(
            f"{family}: expert weight {e} is missing; config.json says num_experts="
            f"{num_experts}, the checkpoint has fewer."
        ) from None


def sdar_spec(args) -> DiffusionSpec:
    block = int(args.block_size)
    return DiffusionSpec(
        family="sdar",
        attention=BLOCK_CAUSAL,
        mask_token_id=args.mask_token_id,
        eos_token_ids=eos_token_ids(args.eos_token_id),
        confidence="sampled",
        quota_base="block",
        # generate.py: low_confidence_dynamic keeps tokens with probability > threshold.
        strict_threshold=True,
        # sample_with_temperature_topk_topp: temperature, then top-k, then top-p.
        sampling_order=("temperature", "top_k", "top_p"),
        # low_confidence_static = "quota", low_confidence_dynamic = "threshold", sequential.
        samplers=SHARED_SAMPLERS + ("sequential",),
        caches=("none", "prefix"),
        defaults={
            "block_length": block,
            # The reference splits a block over `denoising_steps`; README/TraDo use steps == block.
            # generate.py's `low_confidence_dynamic` = threshold with the per-step quota as fallback.
            "sampler": "threshold",
            "threshold": SDAR_THRESHOLD,
            # The reference samples at temperature 1.0 by default; greedy is the deterministic
            # default here (the README evaluates with greedy decoding).
            "temperature": 0.0,
            "max_tokens": 128,
        },
        # generation_config.json holds Qwen3's AR sampling defaults (temperature 0.6, top_k 20,
        # top_p 0.95) that SDAR's diffusion generate.py never reads.
        ignored_generation_config_keys=("temperature", "top_k", "top_p"),
        trained_block_length=block,
        max_position_embeddings=args.max_position_embeddings,
    )


@dataclass
class ModelArgs(qwen3.ModelArgs):
    block_size: int = SDAR_BLOCK_SIZE
    mask_token_id: Optional[int] = None
    eos_token_id: Union[int, List[int], None] = None

    def __post_init__(self):
        super().__post_init__()
        self.mask_token_id = resolve_mask_token_id(
            self.mask_token_id, SDAR_MASK_TOKEN_ID, self.vocab_size, self.model_type
        )


class Model(qwen3.Model):
    """SDARForCausalLM: qwen3.Model whose forward takes the attention mask from the caller."""

    def __call__(self, inputs: mx.array, cache=None, mask=None, rows=None) -> mx.array:
        return masked_forward(self, self.model.embed_tokens, inputs, cache, mask, rows)

    def sanitize(self, weights):
        weights = super().sanitize(drop_unused_buffers(weights))
        return check_weight_names(self, weights, "sdar", "model.layers.0.self_attn.q_norm.weight")

    @property
    def diffusion_spec(self) -> DiffusionSpec:
        return sdar_spec(self.args)
