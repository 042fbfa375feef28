"""CoDA-1.7B (Salesforce/CoDA-v0-Instruct, model_type "CoDA"): a Qwen3-1.7B body read bidirectionally.

Reproduces `CoDALanguageModel/modeling_coda.py` of SalesforceAIResearch/CoDA (the Hugging Face
class of the checkpoint): Qwen3's weights and layer math (q/k RMSNorm per head, RoPE, SwiGLU MLP),
and attention through `attention.py`'s `AttentionModule`, which calls scaled_dot_product_attention
with `is_causal=False` and no mask at all (the causal mask `CoDAModel.forward` builds is never passed
on), so every position sees every other.

Like Dream (whose `generation_utils.py` CoDA's is a copy of), the prediction for position i comes
from hidden state i-1: the spec declares `logit_shift=1` and the engine applies it.
"""

from dataclasses import dataclass
from typing import Optional, Sequence, Union

from mlx_lm.models import qwen3

from ..spec import SHARED_SAMPLERS
from . import dream
from .common import (
    check_special_ids,
)
from .mlx_lm_body import MaskedBody

# CoDAConfig's defaults (CoDALanguageModel/model_config.py): config.json leaves these out.
# The settings family this module's spec belongs to, and the rows it adds: Dream's
# diffusion_generate's (CoDA's "dream" sampler is a copy of it).
FAMILY = "coda"
SETTINGS = dream.DIFFUSION_GENERATE_SETTINGS
SAMPLERS = dream.SAMPLERS

CODA_MASK_TOKEN_ID = 151669  # <|mask|>
CODA_EOS_TOKEN_ID = 151645  # <|im_end|>

# The repository's deployment recipe (README "Generation hyperparameters", the defaults of
# serving/fast-api/app/core/config.py, which the service passes to Dream's diffusion_generate):
# max_tokens 256, steps 128, temperature 0, no top-p / top-k, alg "entropy", alg_temp 0.1. (Its
# BLOCK_LENGTH 32 is accepted by the service but never passed on: diffusion_generate decodes the
# whole canvas as one block.) eps is diffusion_generate's default.
REFERENCE_DEFAULTS = {
    "sampler": "dream",
    "alg": "entropy",
    "alg_temp": 0.1,
    "eps": 1e-3,
    "temperature": 0.0,
    "top_p": None,
    "top_k": None,
    "max_tokens": 256,
}
# The checkpoint's generation_config.json (alg "original", which diffusion_generate does not know,
# diffusion_steps 10, alg_temp 0.2) is never read by the reference: diffusion_generate starts from
# DLMGenerationConfig.from_model_config(config.json). None of its keys is read here either.
IGNORED_GENERATION_CONFIG_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k")


@dataclass
class ModelArgs(qwen3.ModelArgs):
    # Absent from the published config.json; forced false below in any case.
    tie_word_embeddings: bool = False
    mask_token_id: Optional[int] = None
    eos_token_id: Optional[Union[int, Sequence[int]]] = CODA_EOS_TOKEN_ID
    pad_token_id: Optional[int] = None
    bos_token_id: Optional[int] = None

    def __post_init__(self):
        # CoDALanguageModel has its own lm_head and defines no get_output_embeddings, so
        # transformers never ties it to the embedding, whatever config.json's tie_word_embeddings
        # (absent from the published file; CoDAConfig's default is true). The head is read from
        # lm_head.weight always.
        self.tie_word_embeddings = False
        check_special_ids(self, mask_default=CODA_MASK_TOKEN_ID)


class Model(MaskedBody, qwen3.Model):
    """CoDALanguageModel: mlx-lm's Qwen3 with its own head (ModelArgs forces it untied), read
    under the caller's mask."""

    family = "CoDA"
    layout = "Qwen3's layout with its own head (e.g. 'model.layers.0.self_attn.q_norm.weight')"
    config_keys = (
        "num_hidden_layers, hidden_size, intermediate_size, head counts, head_dim, vocab_size"
    )

    spec_family = FAMILY
    missing_mask = f"add it to config.json ({CODA_MASK_TOKEN_ID}, <|mask|>, for CoDA-v0-Instruct)."

    def spec_fields(self) -> dict:
        return dict(
            **dream.DREAM_READING,
            # "dream" is CoDA's diffusion_generate (a copy of Dream's; `alg` picks the
            # algorithm); the shared samplers run block-wise.
            samplers=("dream",) + SHARED_SAMPLERS,
            commit_rules=SAMPLERS,
            defaults=dict(REFERENCE_DEFAULTS),
            ignored_generation_config_keys=IGNORED_GENERATION_CONFIG_KEYS,
            sampling_order=("temperature", "top_p", "top_k"),  # sample_tokens' order
            # The whole canvas is one block, over the recipe's 128 steps (the shared samplers keep
            # their steps = block_length).
            sampler_defaults={"dream": {"block_length": None, "steps": 128}},
            vocab_size=self.args.vocab_size,
            settings=SETTINGS,
            relations=(dream.ALG_RELATION,),
        )
