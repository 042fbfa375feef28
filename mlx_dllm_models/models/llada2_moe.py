"""LLaDA2.x MoE (inclusionAI/LLaDA2.0-mini, LLaDA2.1-flash, ...): block diffusion on the Ling 2.0 body.

Built from mlx-lm's `bailing_moe` (same weight names, fused QKV attention, SwitchGLU experts, shared
experts, first_k_dense_replace dense layers), with the deltas of the Hugging Face
`modeling_llada2_moe.py`:

* the router drops non-selected expert groups with -inf (bailing_moe writes 0, which outranks
  negative bias-corrected scores and so picks experts from dropped groups);
* the router always uses a sigmoid, always adds `expert_bias` (a buffer HF registers unconditionally)
  for selection only, and always renormalises the unbiased top-k weights when top_k > 1;
* the config's `head_dim` is honoured (bailing_moe derives it from hidden_size / heads), and the
  rotary size is `int(head_dim * partial_rotary_factor)` as HF's RoPE init computes it.

LLaDA2.2 (a config with `expert_capacity` and the DELETE / SPLIT ids): block routing
(`block_limited_topk`) and, with editing on, insert/delete edits (engine.editing.LevenshteinEditing,
decoding/levenshtein.py); its editing mode defaults to the reference generate's threshold 0.5,
editing_threshold 0.0.

Attention is block-causal (blocks of 32 aligned on absolute positions); the caller passes the mask.
"""

from dataclasses import dataclass
from typing import List, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_linear, sum_gradients
from mlx_lm.models import bailing_moe
from mlx_lm.models.rope_utils import initialize_rope

from ..settings_families import Setting
from ..spec import BLOCK_CAUSAL, SHARED_SAMPLERS, DiffusionSpec
from ..validators import choice, cli_optional_float, int_at_least, number, optional
from . import sharding
from .common import (
    build_spec,
    cached_spec,
    check_special_ids,
    check_weights,
    masked_forward,
    refuse_autoregressive_tools,
    sanitize_experts,
)

# The settings family of LLaDA2's spec, and the rows it adds: its decoding modes (the spec's
# presets, LLADA2_EDITING_MODES, the one place of their numbers, map a mode to settings; explicit
# settings win over the mode) and LLaDA2.1's token editing.
FAMILY = "llada2"
SETTINGS = (
    Setting(
        "editing_mode",
        None,
        "LLaDA2: quality | speed (the LLaDA2.1 model card's Quality / Speed Mode: threshold and "
        "editing_threshold) | off (2.0's generate, no editing); default: quality for 2.1, speed "
        "for 2.2 (its generate's; DELETE / SPLIT edits on), off for 2.0",
        str,
        choice(("quality", "speed", "off"), " for the llada2 family"),
    ),
    Setting(
        "editing_threshold",
        None,
        "LLaDA2.1: rewrite a committed token when another is proposed above this probability "
        "(none: editing off)",
        cli_optional_float,
        optional(
            number(
                0,
                1,
                what=" (a committed token is rewritten when the model proposes another "
                "one with a probability above it) or None to turn editing off",
            )
        ),
    ),
    Setting(
        "max_post_steps",
        None,
        "LLaDA2.1: editing forwards after a block has no masks left",
        int,
        int_at_least(0, " (editing forwards after a block has no masks left)"),
        requires="editing_threshold",
    ),
)

LLADA2_MASK_TOKEN_ID = 156895  # <|mask|> of the Ling tokenizer
LLADA2_BLOCK_LENGTH = 32

# The editing modes (the `editing_mode` setting's presets), the one place of their numbers. The
# LLaDA2.1-mini model card, Best Practices: "threshold=0.7, editing_threshold=0.5 for Quality Mode
# and threshold=0.5, editing_threshold=0.0 for Speed Mode ... We recommend 16 [max_post_steps] as a
# balanced default" (a default of every mode: LLADA2_MAX_POST_STEPS); "off" is 2.0's generate.
LLADA2_EDITING_MODES = {
    "quality": {"threshold": 0.7, "editing_threshold": 0.5},
    "speed": {"threshold": 0.5, "editing_threshold": 0.0},
    "off": {"threshold": 0.95, "editing_threshold": None},
}
LLADA2_MAX_POST_STEPS = 16


@dataclass
class ModelArgs(bailing_moe.ModelArgs):
    # Defaults of LLaDA2MoeConfig where they differ from bailing_moe's.
    use_qk_norm: bool = True
    score_function: str = "sigmoid"
    moe_router_enable_expert_bias: bool = True
    head_dim: Optional[int] = None
    mask_token_id: Optional[int] = None
    eos_token_id: Union[int, List[int], None] = None
    pad_token_id: Optional[int] = None
    block_length: Optional[int] = None
    # LLaDA2.2 (Levenshtein editing) edit-control tokens; absent from 2.0 / 2.1 configs.
    delete_token_id: Optional[int] = None
    split_token_id: Optional[int] = None
    # LLaDA2.2's block routing: the tokens of each `block_size` block of positions choose among
    # the `expert_capacity` experts that score highest over the block (block_limited_topk).
    expert_capacity: Optional[int] = None
    block_size: Optional[int] = None

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        # HF ignores the config's `rotary_dim` and derives it from the factor.
        self.rotary_dim = int(self.head_dim * self.partial_rotary_factor)
        self.num_shared_experts = self.num_shared_experts or 0
        if self.num_experts % self.n_group:
            raise ValueError(
                f"llada2_moe: num_experts {self.num_experts} is not divisible by n_group {self.n_group}."
            )
        ids = ("eos_token_id", "pad_token_id", "delete_token_id", "split_token_id")
        check_special_ids(self, ids, mask_default=LLADA2_MASK_TOKEN_ID)
        if self.eos_token_id is None and self.pad_token_id != -1:
            # Ling uses <|endoftext|> as both pad and EOS; HF generate's eos_id default is that id.
            self.eos_token_id = self.pad_token_id


@mx.compile
def group_limited_topk(logits, expert_bias, top_k, n_group, topk_group, routed_scaling_factor):
    """LLaDA2MoeGate.forward (fp32): sigmoid scores, bias-corrected group-limited top-k selection,
    unbiased weights renormalised (+1e-20) and scaled."""
    scores = mx.sigmoid(logits)
    routing = scores + expert_bias
    dropped_groups = n_group - topk_group
    if n_group > 1 and dropped_groups > 0:
        grouped = mx.unflatten(routing, axis=-1, shape=(n_group, -1))
        group_scores = mx.topk(grouped, 2, axis=-1).sum(axis=-1, keepdims=True)
        dropped = mx.argpartition(group_scores, kth=dropped_groups - 1, axis=-2)[
            ..., :dropped_groups, :
        ]
        grouped = mx.put_along_axis(
            grouped, mx.stop_gradient(dropped), mx.array(-mx.inf, grouped.dtype), axis=-2
        )
        routing = mx.flatten(grouped, -2, -1)
    return top_k_weighted(scores, routing, top_k, routed_scaling_factor)


def top_k_weighted(scores, routing, top_k, routed_scaling_factor):
    """The top_k experts by `routing`, weighted by their unbiased `scores` renormalised (+1e-20,
    when top_k > 1) and scaled: LLaDA2MoeGate's weights, whichever router selected."""
    inds = mx.stop_gradient(mx.argpartition(-routing, kth=top_k - 1, axis=-1)[..., :top_k])
    weights = mx.take_along_axis(scores, inds, axis=-1)
    if top_k > 1:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return inds, weights * routed_scaling_factor


def block_limited_topk(
    logits, expert_bias, first_position, top_k, capacity, block_size, routed_scaling_factor
):
    """LLaDA2.2's block routing (fp32). Positions are grouped in blocks of `block_size` aligned on
    position 0; each expert's score over a block is its largest bias-corrected score there, the
    `capacity` best experts of the block are the only ones its tokens may choose, and each token
    takes its top_k among them (no expert groups). Weights as the per-token router's.

    logits (B, L, E); first_position (B,) the position of each row's first input (negative on
    left padding, whose blocks are then apart from the real tokens'). The rule of sgl-project/
    sglang's block router (pull requests #31743 / #31768) and Akicou/diffuse-cpp's MoE graph; a
    block cut by the input's ends takes the maximum over the tokens present."""
    scores = mx.sigmoid(logits)
    routing = scores + expert_bias
    rows, length, experts = routing.shape
    lead = first_position % block_size  # (B,) slots of each row's first block before its input
    blocks = (length + block_size - 1) // block_size + 1
    slot = mx.arange(blocks * block_size)[None] - lead[:, None]  # (B, N) input index of each slot
    inside = (slot >= 0) & (slot < length)
    gather = mx.broadcast_to(mx.clip(slot, 0, length - 1)[..., None], (*slot.shape, experts))
    laid = mx.where(inside[..., None], mx.take_along_axis(routing, gather, axis=1), -mx.inf)
    best = laid.reshape(rows, blocks, block_size, experts).max(axis=2)  # (B, blocks, E)
    chosen = mx.argpartition(-best, kth=capacity - 1, axis=-1)[..., :capacity]
    allowed = mx.put_along_axis(
        mx.zeros(best.shape, mx.bool_), chosen, mx.array(True), axis=-1
    )  # (B, blocks, E)
    block = (mx.arange(length)[None] + lead[:, None]) // block_size  # (B, L)
    token_allowed = mx.take_along_axis(
        allowed, mx.broadcast_to(block[..., None], (rows, length, experts)), axis=1
    )
    routing = mx.where(token_allowed, routing, -mx.inf)
    return top_k_weighted(scores, routing, top_k, routed_scaling_factor)


def first_positions(cache, rows: int) -> mx.array:
    """(rows,) the position of each row's first input: the caches' `offset` (an int or a (B,)
    array, negative on left padding), 0 without a cache."""
    offset = 0 if cache is None else cache[0].offset
    return mx.broadcast_to(mx.array(offset, dtype=mx.int32), (rows,))


class Gate(bailing_moe.BailingMoeGate):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.expert_bias = mx.zeros((args.num_experts,), dtype=mx.float32)
        self.expert_capacity = args.expert_capacity
        self.block_size = args.block_size or args.block_length or LLADA2_BLOCK_LENGTH
        self.route_from(mx.array([0]))

    def route_from(self, first_position: mx.array):
        """Block routing's (B,) position of each row's first input (Model.__call__ sets it). Kept
        outside nn.Module's parameter tree, where an array attribute would otherwise go."""
        object.__setattr__(self, "first_position", first_position)

    def __call__(self, x):
        logits = self.gate_proj(x.astype(mx.float32)).astype(mx.float32)
        bias = self.expert_bias.astype(mx.float32)
        if self.expert_capacity is not None:
            return block_limited_topk(
                logits,
                bias,
                self.first_position,
                self.top_k,
                self.expert_capacity,
                self.block_size,
                self.routed_scaling_factor,
            )
        return group_limited_topk(
            logits, bias, self.top_k, self.n_group, self.topk_group, self.routed_scaling_factor
        )


class SparseMoeBlock(bailing_moe.BailingMoeSparseMoeBlock):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.gate = Gate(args)
        # Set by Model.shard: routed and shared experts are split over the group, and their
        # summed output is reduced here once (deepseek_v3's MoE in mlx-lm does the same).
        self.sharding_group = None

    def __call__(self, x):
        if self.sharding_group is None:
            return super().__call__(x)
        y = super().__call__(sum_gradients(self.sharding_group)(x))
        return mx.distributed.all_sum(y, group=self.sharding_group)


class Attention(bailing_moe.BailingMoeAttention):
    """bailing_moe's forward (fused QKV split by rows, per-head QK norm, partial RoPE) over the
    config's head_dim."""

    def __init__(self, args: ModelArgs):
        nn.Module.__init__(self)
        self.use_qk_norm = args.use_qk_norm
        self.num_attention_heads = heads = args.num_attention_heads
        self.num_key_value_heads = kv_heads = args.num_key_value_heads
        self.head_dim = head_dim = args.head_dim
        self.scale = head_dim**-0.5
        self.query_key_value = nn.Linear(
            args.hidden_size, (heads + 2 * kv_heads) * head_dim, bias=args.use_qkv_bias
        )
        self.dense = nn.Linear(heads * head_dim, args.hidden_size, bias=args.use_bias)
        if args.use_qk_norm:
            self.query_layernorm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)
            self.key_layernorm = nn.RMSNorm(head_dim, eps=args.rms_norm_eps)
        # Rotating only the first rotary_dim features of each head: the rest pass through.
        self.rope = initialize_rope(
            args.rotary_dim,
            args.rope_theta,
            traditional=False,
            scaling_config=args.rope_scaling,
            max_position_embeddings=args.max_position_embeddings,
        )


class DecoderLayer(bailing_moe.BailingMoeDecoderLayer):
    def __init__(self, args: ModelArgs, layer_idx: int):
        nn.Module.__init__(self)
        self.attention = Attention(args)
        if layer_idx >= args.first_k_dense_replace:
            self.mlp = SparseMoeBlock(args)
        else:
            self.mlp = bailing_moe.BailingMoeMLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class LLaDA2MoeModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.word_embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Model(bailing_moe.Model):
    """LLaDA2MoeModelLM. Reuses bailing_moe's sanitize (expert stacking, gate renaming) and
    cast_predicate (expert_bias stays float32 on conversion)."""

    def __init__(self, args: ModelArgs):
        nn.Module.__init__(self)
        self.args = args
        self.norm_head = args.norm_head
        self.model_type = args.model_type
        self.model = LLaDA2MoeModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    # mlx-lm's AR tools call make_cache first: they stop there with a pointer to mlx_dllm.
    make_cache = refuse_autoregressive_tools

    def __call__(
        self, inputs: mx.array, cache=None, mask=None, head_span=None, input_embeddings=None
    ) -> mx.array:
        """The protocol's forward; `input_embeddings` (B, L, H) replace the embedding of `inputs`
        (DMax's soft embeddings, engine/dmax.py)."""
        if self.args.expert_capacity is not None:
            first = first_positions(cache, inputs.shape[0])
            for layer in self.layers:
                if isinstance(layer.mlp, SparseMoeBlock):
                    layer.mlp.gate.route_from(first)
        embed = self.model.word_embeddings
        return masked_forward(self, embed, inputs, cache, mask, head_span, input_embeddings)

    def sanitize(self, weights):
        weights = sanitize_experts(super().sanitize, weights, "llada2_moe", self.args.num_experts)
        # Routing adds the bias to sigmoid scores in (0, 1): bfloat16 would reorder close experts.
        weights = {
            k: v.astype(mx.float32) if k.endswith("mlp.gate.expert_bias") else v
            for k, v in weights.items()
        }
        layout = "Ling 2.0's layout (e.g. 'model.layers.1.mlp.gate.expert_bias')"
        keys = (
            "num_hidden_layers, first_k_dense_replace, num_experts, num_shared_experts, "
            "hidden_size, intermediate_size, moe_intermediate_size, head counts, head_dim, "
            "vocab_size"
        )
        return check_weights(self, weights, "llada2_moe", layout, keys)

    def shard(self, group: Optional[mx.distributed.Group] = None):
        """Tensor parallelism over `group` in mlx-lm's way: the fused query_key_value split per
        q / k / v segment by heads, `dense` summed over the group; dense MLPs split; routed and
        shared experts split over their intermediate dimension under one all-reduce per MoE
        block. The router (float32 gate and expert_bias) stays replicated, so every rank picks
        the same experts."""
        group = sharding.group_of(group)
        a = self.args
        sizes = sharding.config_sizes(
            a,
            *sharding.HEADS,
            "intermediate_size",
            "moe_intermediate_size",
            "moe_shared_expert_intermediate_size",
        )
        sharding.check_divisible("llada2_moe", group, sizes, model=self)
        n = group.size()
        for layer in self.layers:
            attn = layer.attention
            q_size = attn.num_attention_heads * attn.head_dim
            kv_size = attn.num_key_value_heads * attn.head_dim
            attn.query_key_value = shard_linear(
                attn.query_key_value,
                "all-to-sharded",
                segments=[q_size, q_size + kv_size],
                group=group,
            )
            attn.dense = shard_linear(attn.dense, "sharded-to-all", group=group)
            attn.num_attention_heads //= n
            attn.num_key_value_heads //= n
            if isinstance(layer.mlp, SparseMoeBlock):
                layer.mlp.sharding_group = group
                sharding.shard_mlp_inplace(layer.mlp.switch_mlp, group, "llada2_moe")
                if layer.mlp.shared_experts is not None:
                    sharding.shard_mlp_inplace(layer.mlp.shared_experts, group, "llada2_moe")
            else:
                sharding.shard_mlp(layer.mlp, group)

    @property
    def quant_predicate(self):
        def predicate(path, _):
            # The router decides which experts run; HF keeps it in float32.
            return not path.endswith("mlp.gate.gate_proj")

        return predicate

    def _edit_control_tokens(self):
        args = self.args
        return tuple(t for t in (args.delete_token_id, args.split_token_id) if t is not None)

    def _default_editing_mode(self):
        # LLaDA2.2's generate defaults to threshold 0.5, editing_threshold 0.0 (speed).
        if self.args.expert_capacity is not None:
            return "speed"
        return "quality" if self._edit_control_tokens() else "off"

    @cached_spec
    def diffusion_spec(self) -> DiffusionSpec:
        args = self.args
        trained = int(args.block_length or LLADA2_BLOCK_LENGTH)
        return build_spec(
            args,
            FAMILY,
            BLOCK_CAUSAL,
            settings=SETTINGS,
            confidence="sampled",
            quota_base="block",
            # generate: tokens with probability > threshold, the step's quota as the fallback.
            strict_threshold=True,
            # LLaDA2.2: DELETE / SPLIT are proposed only with editing on (edit_token_ids).
            suppressed_token_ids=self._edit_control_tokens(),
            edit_token_ids=self._edit_control_tokens()
            if args.expert_capacity is not None and len(self._edit_control_tokens()) == 2
            else (),
            # _sample_with_temperature_topk_topp: temperature, then top-k, then top-p.
            sampling_order=("temperature", "top_k", "top_p"),
            samplers=SHARED_SAMPLERS,
            # modeling_llada2_moe.generate defaults (2.0's: editing mode "off"); 2.1 / 2.2
            # default to the model card's Quality Mode (editing_mode, below).
            defaults={
                "block_length": trained,
                "sampler": "threshold",
                **LLADA2_EDITING_MODES["off"],
                "temperature": 0.0,
                "max_post_steps": LLADA2_MAX_POST_STEPS,
                "max_tokens": 128,
                "editing_mode": self._default_editing_mode(),
            },
            presets={"editing_mode": LLADA2_EDITING_MODES},
            # LLaDA2.1's config.json and tokenizer files are byte-identical to 2.0's; its remote
            # code's generate is what differs (it takes editing_threshold). 2.2 is known from
            # config.json (its edit-control token ids).
            remote_generate_settings={"editing_threshold": {"editing_mode": "quality"}},
            trained_block_length=trained,
        )
