"""Dream 7B (Dream-org/Dream-v0-Base-7B, Dream-v0-Instruct-7B): a Qwen2.5 body read bidirectionally.

Reproduces the Hugging Face remote code `modeling_dream.py` (copies in NVlabs/Fast-dLLM `dream/model/`
and ZHZisZZ/dllm `dllm/pipelines/dream/models/`): Qwen2 weights and layer math, attention with
`is_causal=False`, padding expressed as a boolean keep-mask plus explicit positions.

Dream predicts token i from hidden state i-1 (its generator shifts the logits right by one). The model
returns unshifted logits; the spec declares `logit_shift=1` and the engine applies it, once, by choosing
which hidden rows feed the head. `shift_logits` is the reference form of that shift, for tests.
"""

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.models import qwen2

from ..spec import BIDIRECTIONAL, SHARED_SAMPLERS, DiffusionSpec
from .common import build_spec, cached_spec, check_special_ids
from .mlx_lm_body import MaskedBody

# The recipe of Dream's README (DreamLM/Dream, Dream-v0-Instruct-7B usage example and model card):
# diffusion_generate(max_new_tokens=512, steps=512, temperature=0.2, top_p=0.95, alg="entropy",
# alg_temp=0.), i.e. steps = the number of new tokens, one token per step. steps stays unset here,
# so that it follows max_tokens (the "dream" sampler's block is the whole canvas, and steps
# default to the block's length, settings.resolve_settings); max_tokens keeps the package-wide
# 128. Dream's schedule commits int(m * (1 - s/t)) tokens a step, 0 on some steps: the engine
# skips those without a forward, so a request of N tokens costs at most N forwards.
REFERENCE_DEFAULTS = {
    "sampler": "dream",
    "alg": "entropy",
    "alg_temp": 0.0,
    "eps": 1e-3,
    "temperature": 0.2,
    "top_p": 0.95,
    "top_k": None,
    "max_tokens": 128,
}
# Dream-v0-*-7B's generation_config.json is DreamGenerationConfig with its class defaults
# (alg "origin", steps 512, temperature 0.0, top_p null): not a recipe (the README's calls pass
# their own), and steps 512 whatever max_tokens is would cost 512 forwards for 16 tokens with
# "origin". These keys are not read from it; eps and alg_temp are.
IGNORED_GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k")
# d3LLM's recipe for its distilled d3LLM_Dream / d3LLM_Dream_Coder (chat/chat_d3llm_dream.py:
# generate_multi_block(max_new_tokens=256, temperature=0, alg="entropy_threshold", threshold=0.5,
# block_size=32, block_add_threshold=0.1, decoded_token_threshold=0.95, early_stop=True)), no
# top-p / top-k (its _sample_multi_block reads neither). Its whole canvas is the engine's block.
D3LLM_DEFAULTS = {
    "block_length": None,
    "max_tokens": 256,
    "block_size": 32,
    "threshold": 0.5,
    "block_add_threshold": 0.1,
    "decoded_token_threshold": 0.95,
    "early_stop": True,
    "temperature": 0.0,
    "top_p": None,
    "top_k": None,
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
        if (
            self.head_dim is not None
            and self.head_dim * self.num_attention_heads != self.hidden_size
        ):
            raise ValueError(
                f"config.json: head_dim={self.head_dim} but hidden_size / num_attention_heads = "
                f"{self.hidden_size} / {self.num_attention_heads}; Dream requires them to agree."
            )
        # A missing mask id is an error only when decoding asks for it (diffusion_spec).
        check_special_ids(self, mask_absent=(None,))


def shift_logits(logits: mx.array) -> mx.array:
    """Dream's logit alignment, `cat([logits[:, :1], logits[:, :-1]], dim=1)` in `_sample`:
    position i takes the logits of position i-1; position 0 keeps its own."""
    return mx.concatenate([logits[:, :1], logits[:, :-1]], axis=1)


class Model(MaskedBody, qwen2.Model):
    """Dream's model: mlx-lm's Qwen2 (q/k/v biases) read under the caller's mask."""

    family = "dream"
    # q/k/v biases are what tells a Qwen2 (Dream) checkpoint from a Llama-like one.
    layout = "Qwen2's layout, with q/k/v biases (e.g. 'model.layers.0.self_attn.k_proj.bias')"
    config_keys = "num_hidden_layers, hidden_size, intermediate_size, head counts, vocab_size"

    @cached_spec
    def diffusion_spec(self) -> DiffusionSpec:
        return build_spec(
            self.args,
            "dream",
            BIDIRECTIONAL,
            "add it to config.json (151666, <|mask|>, for Dream-v0-*-7B).",
            logit_shift=1,
            confidence="sampled",
            quota_base="masks",
            # "dream" is diffusion_generate (its `alg` picks origin / maskgit_plus / topk_margin /
            # entropy); the shared samplers run block-wise, as Fast-dLLM's Dream path does.
            samplers=("dream", "d3llm") + SHARED_SAMPLERS,
            defaults=dict(REFERENCE_DEFAULTS),
            generation_config_keys={"alg_temp": "alg_temp", "eps": "eps"},
            ignored_generation_config_keys=IGNORED_GENERATION_CONFIG_KEYS,
            sampling_order=("temperature", "top_p", "top_k"),  # Dream's sample_tokens
            # DiffuCoder (apple/DiffuCoder-7B-*, Dream's model_type and code): its instruct models
            # pad the canvas with <|dlm_pad|> after <|im_end|>, and its README's answer is the text
            # before the first one (generations[0].split('<|dlm_pad|>')[0]).
            eos_token_names=("<|dlm_pad|>",),
            # The whole canvas is one block ("d3llm": d3LLM's multi-block decoding, decoding/d3llm).
            sampler_defaults={"dream": {"block_length": None}, "d3llm": dict(D3LLM_DEFAULTS)},
        )
