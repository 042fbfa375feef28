"""BD3-LM (kuleshov-group/bd3lm-owt-block_size4 / 8 / 16, model_type "bd3lm"): the block-diffusion
DiT of kuleshov-group/bd3lms (models/hf/modeling_bd3lm.py, `BD3LM` / `DITBackbone`), about 110M
parameters over the GPT-2 tokenizer plus one mask token (vocab_size 50258, mask id 50257).

The body: a learned embedding, `n_blocks` DDiT blocks (LayerNorm without bias, one fused q/k/v
projection, rotate-half RoPE on q and k, attention, a GELU-tanh MLP; adaLN modulation of both
sub-layers), and an adaLN-modulated final LayerNorm and linear head (with bias). The published
checkpoints have `time_conditioning=False`: the backbone zeroes sigma, so the adaLN conditioning
is silu(sigma_map(0)), one vector per checkpoint, computed here from the weights at each call.

Attention is the caller's: at sampling upstream reads the x0 half of its training mask (block
`block_size` blocks aligned on position 0, each attending to itself and to every block before it),
or its KV cache of finished blocks with the open block's queries, which is the engine's
block-causal layout (spec.BLOCK_CAUSAL) and its exact prefix cache. Logits at position i predict
token i (no shift). Decoding (`_semi_ar_sampler` with first_hitting and `_nucleus_sample`) is the
engine's sampler "random" (one uniformly drawn masked position a step) over proposals drawn from
BD3-LM's nucleus (decoding.bd3lm.top_p_within), after the BOS at position 0 (spec.prompt_prefix).
"""

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_linear
from mlx_lm.models.base import BaseModelArgs, scaled_dot_product_attention

from ..masks import block_causal_mask
from ..spec import BLOCK_CAUSAL, SHARED_SAMPLERS, DiffusionSpec
from . import sharding
from .common import (
    build_spec,
    cached_spec,
    check_context_length,
    check_special_ids,
    check_weights,
    refuse_autoregressive_tools,
    select_span,
)

# The settings family of BD3-LM's spec; it adds no setting of its own.
FAMILY = "bd3lm"
SETTINGS = ()

# TimestepEmbedder's frequency_embedding_size.
FREQUENCY_EMBEDDING_SIZE = 256

# The published sampling recipe (scripts/gen_ppl/genppl_bd3lm.sh with configs/config.yaml):
# nucleus_p 0.9, first_hitting (one token a step, a uniformly drawn masked position: steps ==
# block_size), no temperature. Its length, model.length 1024 (BOS + 1023), is the context; the
# default here is shorter so that a text prompt fits as well (max_tokens=1023 is the recipe's).
REFERENCE_DEFAULTS = {
    "sampler": "random",
    "temperature": 1.0,
    "top_p": 0.9,
    "max_tokens": 256,
}


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str = "bd3lm"
    block_size: int = 1
    vocab_size: int = 50258
    model_length: int = 1024
    cross_attn: bool = True
    adaln: bool = True
    attn_backend: str = "flex"
    causal: bool = False
    hidden_dim: int = 768
    cond_dim: int = 129
    n_blocks: int = 12
    n_heads: int = 12
    time_conditioning: bool = False
    mask_token_id: Optional[int] = None
    eos_token_id: Optional[Union[int, List[int]]] = None
    bos_token_id: Optional[int] = None
    pad_token_id: Optional[int] = None
    # The context, for the engine: model_length (set from it).
    max_position_embeddings: Optional[int] = None

    def __post_init__(self):
        family = self.model_type
        if self.time_conditioning:
            raise ValueError(
                f"{family}: config.json has time_conditioning=true: such a checkpoint reads the "
                "noise level at every step, which this package does not pass (the published "
                "BD3-LM checkpoints have time_conditioning=false)"
            )
        if self.causal:
            raise ValueError(f"{family}: config.json's causal=true (an AR DiT) is not supported")
        if self.hidden_dim % self.n_heads:
            raise ValueError(
                f"{family}: hidden_dim {self.hidden_dim} is not a multiple of n_heads "
                f"{self.n_heads}"
            )
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(
                f"{family}: block_size must be a positive integer, got {self.block_size!r}"
            )
        check_context_length(family, "model_length", self.model_length)
        self.max_position_embeddings = self.model_length
        # Diffusion.__init__: the GPT-2 tokenizer has no mask token, so the mask is the id after
        # its vocabulary, the model's last row (50257), and <|endoftext|> the one before (50256):
        # the BOS `_semi_ar_sampler` puts at position 0 and the EOS between documents. The
        # published config.json names none of them (push_to_hf.py sets no token ids).
        if self.eos_token_id is None:
            self.eos_token_id = self.vocab_size - 2
        if self.bos_token_id is None:
            self.bos_token_id = self.vocab_size - 2
        check_special_ids(self, mask_default=self.vocab_size - 1)


class LayerNorm(nn.Module):
    """modeling_bd3lm.LayerNorm: F.layer_norm without affine parameters, in float32, then the
    weight (no bias)."""

    def __init__(self, dims: int):
        super().__init__()
        self.weight = mx.ones((dims,))

    def __call__(self, x):
        y = mx.fast.layer_norm(x.astype(mx.float32), None, None, 1e-5)
        return y * self.weight


def modulate(x, shift, scale):
    return x * (1 + scale) + shift


class TimestepEmbedder(nn.Module):
    """sigma_map: the sinusoidal embedding of sigma through Linear, SiLU, Linear (`mlp.0`,
    `mlp.2` in the checkpoint; `mlp.1` here, sanitize renames)."""

    def __init__(self, cond_dim: int):
        super().__init__()
        self.mlp = [nn.Linear(FREQUENCY_EMBEDDING_SIZE, cond_dim), nn.Linear(cond_dim, cond_dim)]

    def __call__(self, sigma):
        half = FREQUENCY_EMBEDDING_SIZE // 2
        freqs = mx.exp(-math.log(10000) * mx.arange(half, dtype=mx.float32) / half)
        args = sigma[:, None].astype(mx.float32) * freqs[None]
        h = mx.concatenate([mx.cos(args), mx.sin(args)], axis=-1)
        return self.mlp[1](nn.silu(self.mlp[0](h)))


class DDiTBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim = args.hidden_dim
        self.n_heads = args.n_heads
        self.head_dim = dim // args.n_heads
        self.norm1 = LayerNorm(dim)
        self.attn_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.attn_out = nn.Linear(dim, dim, bias=False)
        self.norm2 = LayerNorm(dim)
        self.mlp = [nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)]
        if args.adaln:
            self.adaLN_modulation = nn.Linear(args.cond_dim, 6 * dim)
        # Rotary: cat(freqs, freqs) with rotate_half, i.e. the non-traditional layout.
        self.rope = nn.RoPE(self.head_dim, traditional=False, base=10000)

    def attention(self, x, mask, cache):
        B, L, _ = x.shape
        # 'b s (three h d) -> b s three h d': q, k and v each hold every head, head-major.
        q, k, v = mx.split(self.attn_qkv(x), 3, axis=-1)
        q, k, v = (t.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3) for t in (q, k, v))
        offset = 0 if cache is None else cache.offset
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        scale = 1.0 / math.sqrt(self.head_dim)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=scale, mask=mask)
        return self.attn_out(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def __call__(self, x, c, mask, cache):
        if c is None:  # adaln=false: plain pre-norm residual blocks
            x = x + self.attention(self.norm1(x), mask, cache)
            return x + self.mlp[1](nn.gelu_approx(self.mlp[0](self.norm2(x))))
        mods = mx.split(self.adaLN_modulation(c)[:, None], 6, axis=-1)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mods
        h = self.attention(modulate(self.norm1(x), shift_msa, scale_msa), mask, cache)
        x = x + gate_msa * h
        h = modulate(self.norm2(x), shift_mlp, scale_mlp)
        return x + gate_mlp * self.mlp[1](nn.gelu_approx(self.mlp[0](h)))


class FinalLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.norm_final = LayerNorm(args.hidden_dim)
        self.linear = nn.Linear(args.hidden_dim, args.vocab_size)
        if args.adaln:
            self.adaLN_modulation = nn.Linear(args.cond_dim, 2 * args.hidden_dim)

    def __call__(self, x, c):
        if c is None:
            return self.linear(self.norm_final(x))
        shift, scale = mx.split(self.adaLN_modulation(c)[:, None], 2, axis=-1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class DITBackbone(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.vocab_embed = nn.Embedding(args.vocab_size, args.hidden_dim)
        if args.adaln:
            self.sigma_map = TimestepEmbedder(args.cond_dim)
        self.blocks = [DDiTBlock(args) for _ in range(args.n_blocks)]
        self.output_layer = FinalLayer(args)

    def conditioning(self):
        """(1, cond_dim): silu(sigma_map(0)), what the backbone computes from its zeroed sigma
        (time_conditioning=false); None without adaLN."""
        if not self.args.adaln:
            return None
        return nn.silu(self.sigma_map(mx.zeros((1,))))


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.backbone = DITBackbone(args)

    # mlx-lm's AR tools call make_cache first: they stop there with a pointer to mlx_dllm.
    make_cache = refuse_autoregressive_tools

    def __call__(
        self,
        inputs: mx.array,
        cache=None,
        mask=None,
        head_span: Optional[Tuple[int, int]] = None,
    ) -> mx.array:
        backbone = self.backbone
        c = backbone.conditioning()
        h = backbone.vocab_embed(inputs)
        if mask is None and cache is None:
            # The plain call: upstream's forward over L tokens (sample_mode, no KV cache) attends
            # with the x0 half of block_diff_mask, block-causal from position 0.
            mask = block_causal_mask(inputs.shape[1], self.args.block_size)
        if isinstance(mask, mx.array) and mask.dtype != mx.bool_:
            mask = mask.astype(h.dtype)
        for block, layer_cache in zip(backbone.blocks, cache or [None] * len(self.layers)):
            h = block(h, c, mask, layer_cache)
        return backbone.output_layer(select_span(h, head_span), c)

    @property
    def layers(self):
        return self.backbone.blocks

    def shard(self, group: Optional[mx.distributed.Group] = None):
        """Tensor parallelism over `group`, as mlx-lm's models split theirs: each block's fused
        q/k/v by heads (three segments of one weight), its output projection and MLP (4x the
        width) over the group; the embedding, the adaLN modulations and the output layer stay
        replicated, so every rank computes the same logits."""
        group = sharding.group_of(group)
        a = self.args
        sizes = {"n_heads": a.n_heads, "4 * hidden_dim": 4 * a.hidden_dim}
        sharding.check_divisible("bd3lm", group, sizes, model=self)
        for block in self.backbone.blocks:
            block.attn_qkv = shard_linear(block.attn_qkv, "all-to-sharded", segments=3, group=group)
            block.attn_out = shard_linear(block.attn_out, "sharded-to-all", group=group)
            block.n_heads //= group.size()
            first, second = block.mlp
            block.mlp = [
                shard_linear(first, "all-to-sharded", group=group),
                shard_linear(second, "sharded-to-all", group=group),
            ]

    def sanitize(self, weights):
        out = {}
        for key, value in weights.items():
            # Persistent buffers of the HF module: RoPE's inv_freq (recomputed here) and the
            # clipped noise schedule's bounds (training only).
            if "rotary_emb.inv_freq" in key or key in ("sampling_eps_min", "sampling_eps_max"):
                continue
            key = key.replace("vocab_embed.embedding", "vocab_embed.weight")
            key = key.replace(".mlp.2.", ".mlp.1.")
            out[key] = value
        layout = "the BD3LM layout (e.g. 'backbone.blocks.0.attn_qkv.weight')"
        keys = "n_blocks, hidden_dim, n_heads, cond_dim, adaln, vocab_size"
        return check_weights(self, out, "bd3lm", layout, keys)

    @cached_spec
    def diffusion_spec(self) -> DiffusionSpec:
        args = self.args
        return build_spec(
            args,
            FAMILY,
            # The x0 half of block_diff_mask and the KV cache both align blocks on position 0.
            BLOCK_CAUSAL,
            # _subs_parameterization: the mask's logit is -inf before the softmax, so its mass
            # goes to the other tokens before the nucleus is cut.
            logit_suppressed_token_ids=(args.mask_token_id,),
            # _nucleus_sample: the tokens whose cumulative probability stays within top_p, on
            # the model's own distribution (no temperature upstream; one given here divides the
            # filtered logits).
            sampling_order=("top_p_within", "temperature"),
            confidence="sampled",
            quota_base="masks",
            # "random": first_hitting's one uniformly drawn masked position a step.
            samplers=("random",) + SHARED_SAMPLERS,
            # steps default to block_length: first_hitting's one token a step.
            defaults=dict(REFERENCE_DEFAULTS, block_length=args.block_size),
            # _semi_ar_sampler samples every block after the BOS at position 0.
            prompt_prefix=() if args.bos_token_id is None else (args.bos_token_id,),
            whole_block_window=True,
            trained_block_length=args.block_size,
            vocab_size=args.vocab_size,
        )
