"""Dream 7B (Dream-org/Dream-v0-Base-7B, Dream-v0-Instruct-7B): a Qwen2.5 body read bidirectionally.

Reproduces the Hugging Face remote code `modeling_dream.py` (copies in NVlabs/Fast-dLLM `dream/model/`
and ZHZisZZ/dllm `dllm/pipelines/dream/models/`): Qwen2 weights and layer math, attention with
`is_causal=False`, padding expressed as a boolean keep-mask plus explicit positions.

Dream predicts token i from hidden state i-1 (its generator shifts the logits right by one). The model
returns unshifted logits; the spec declares `logit_shift=1` and the engine applies it, once, by choosing
which hidden rows feed the head. `shift_logits` is the reference form of that shift, for tests.
"""

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen2

from ..decoding.dream import DREAM_ALGS, check_alg, check_alg_temp, check_eps  # noqa: F401
from ..spec import BIDIRECTIONAL, SHARED_SAMPLERS, DiffusionSpec

# Dream-v0-Instruct-7B generation_config.json (alg, alg_temp, eps, steps, temperature, top_p, top_k).
# The reference pairs steps=512 with max_new_tokens=512; max_tokens keeps the package-wide 128.
# Its steps count over the whole canvas, which the "dream" sampler decodes as one block; with the
# block-wise shared samplers, steps >= block_length amounts to steps = block_length.
REFERENCE_DEFAULTS = {
    "sampler": "dream",
    "alg": "origin",
    "alg_temp": None,
    "eps": 1e-3,
    "steps": 512,
    "temperature": 0.0,
    "top_p": None,
    "top_k": None,
    "max_tokens": 128,
}


@dataclass
class ModelArgs(qwen2.ModelArgs):
    # Dream's config says false; Qwen2's dataclass defaults to tied.
    tie_word_embeddings: bool = False
    head_dim: Optional[int] = None
    mask_token_id: Optional[int] = None
    eos_token_id: Optional[Union[int, Sequence[int]]] = None
    pad_token_id: Optional[int] = None
    bos_token_id: Optional[int] = None

    def __post_init__(self):
        # Dream's attention (like mlx-lm's Qwen2) derives head_dim from hidden_size / heads.
        if self.head_dim is not None and self.head_dim * self.num_attention_heads != self.hidden_size:
            raise ValueError(
                f"config.json: head_dim={self.head_dim} but hidden_size / num_attention_heads = "
                f"{self.hidden_size} / {self.num_attention_heads}; Dream requires them to agree."
            )


def shift_logits(logits: mx.array) -> mx.array:
    """Dream's logit alignment, `cat([logits[:, :1], logits[:, :-1]], dim=1)` in `_sample`:
    position i takes the logits of position i-1; position 0 keeps its own."""
    return mx.concatenate([logits[:, :1], logits[:, :-1]], axis=1)


class DreamModel(qwen2.Qwen2Model):
    """Qwen2's layers with the attention mask supplied by the caller (None = every key)."""

    def __call__(self, inputs: mx.array, cache=None, mask=None):
        h = self.embed_tokens(inputs)
        if isinstance(mask, mx.array) and mask.dtype != mx.bool_:
            mask = mask.astype(h.dtype)  # SDPA wants an additive mask in the activation dtype
        if cache is None:
            cache = [None] * len(self.layers)
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, c)
        return self.norm(h)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = DreamModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(
        self,
        inputs: mx.array,
        cache=None,
        mask=None,
        rows: Optional[Tuple[int, int]] = None,
    ) -> mx.array:
        h = self.model(inputs, cache, mask)
        if rows is not None:
            h = h[:, rows[0] : rows[1]]
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def sanitize(self, weights):
        weights = {k: v for k, v in weights.items() if "self_attn.rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        elif "lm_head.weight" not in weights:
            raise ValueError(
                "Dream checkpoint has no lm_head.weight but config.json says tie_word_embeddings=false; "
                "add the head's weights or set tie_word_embeddings=true."
            )
        embed = weights.get("model.embed_tokens.weight")
        if embed is not None and embed.shape[0] != self.args.vocab_size:
            raise ValueError(
                f"model.embed_tokens.weight has {embed.shape[0]} rows but config.json vocab_size is "
                f"{self.args.vocab_size}; the config does not belong to these weights."
            )
        if "model.layers.0.self_attn.q_proj.weight" in weights:
            for name in ("q_proj", "k_proj", "v_proj"):
                if f"model.layers.0.self_attn.{name}.bias" not in weights:
                    raise ValueError(
                        f"model.layers.0.self_attn.{name}.bias is missing: Dream (Qwen2 layout) has "
                        "biases on q/k/v; these weights are not a Dream checkpoint."
                    )
        return weights

    @property
    def layers(self):
        return self.model.layers

    @property
    def diffusion_spec(self) -> DiffusionSpec:
        args = self.args
        if args.mask_token_id is None:
            raise ValueError(
                "config.json has no mask_token_id; Dream checkpoints declare it (151666, <|mask|>, "
                "for Dream-v0-*-7B). Add it to config.json."
            )
        eos = args.eos_token_id
        if eos is None:
            eos = ()
        elif isinstance(eos, int):
            eos = (eos,)
        dream_only = ("dream",)
        return DiffusionSpec(
            family="dream",
            attention=BIDIRECTIONAL,
            mask_token_id=int(args.mask_token_id),
            eos_token_ids=tuple(int(e) for e in eos),
            logit_shift=1,
            confidence="sampled",
            quota_base="masks",
            # "dream" is diffusion_generate (its `alg` picks origin / maskgit_plus / topk_margin /
            # entropy); the shared samplers run block-wise, as Fast-dLLM's Dream path does.
            samplers=("dream",) + SHARED_SAMPLERS,
            caches=("none", "prefix", "dual"),
            extra_settings=("alg", "alg_temp", "eps"),
            defaults=dict(REFERENCE_DEFAULTS),
            generation_config_keys={"alg": "alg", "alg_temp": "alg_temp", "eps": "eps", "steps": "steps"},
            sampling_order=("temperature", "top_p", "top_k"),  # Dream's sample_tokens
            sampler_settings={"alg": dream_only, "alg_temp": dream_only, "eps": dream_only},
            sampler_defaults={"dream": {"block_length": None}},  # the whole canvas is one block
            setting_checks={"alg": check_alg, "alg_temp": check_alg_temp, "eps": check_eps},
            max_position_embeddings=args.max_position_embeddings,
        )
