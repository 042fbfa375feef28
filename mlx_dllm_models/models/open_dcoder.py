"""Open-dCoder (fredzzp/open-dcoder-0.5B, pengzhangzhi/Open-dLLM): Qwen2.5-Coder-0.5B trained as a
masked diffusion model. model_type "open_dcoder" is this package's name for it, not the checkpoint's.

Reproduces veomni/models/transformers/qwen2/modeling_qwen2.py (Qwen2ForCausalLM with
MDMGenerationMixin): transformers' Qwen2 layers and weight names, which `_mdm_sample` calls with
`is_causal=False` and no attention mask, so every position sees every other (SDPA / flash
attention; the checkpoint has no pad_token_id, so `gen_attention_mask` is None). Like Dream it
predicts token i from hidden state i-1 (`_mdm_sample` shifts the logits right by one): the model
returns unshifted logits, the spec declares `logit_shift=1`. Its extras (representation alignment
against a teacher, "tropical" attention, sequence parallelism) are training-time only.

Why a model_type of its own: veomni saves the checkpoint as transformers' Qwen2ForCausalLM, so its
config.json says model_type "qwen2", like every autoregressive Qwen2; nothing in it tells the two
apart, and this package never takes plain qwen2 over from mlx-lm. `mlx_dllm convert --hf-path
<open-dcoder> --model-type open_dcoder` writes this model_type into the converted config (with the
tokenizer's mask id), after which `mlx_lm.load` and `mlx_dllm generate` build this model.

Decoding: sample.py's recipe (sampler "p2", decoding/p2.py: every step re-masks the least
confident generated positions, committed ones included), and `_mdm_sample`'s other algorithms,
which are Dream's (sampler "dream", `alg` origin / maskgit_plus / topk_margin / entropy, alg_temp
as a Gumbel top-k over the confidences).
"""

from dataclasses import dataclass
from typing import Optional, Sequence, Union

from mlx_lm.models import qwen2

from ..spec import SHARED_SAMPLERS
from . import dream
from .common import (
    check_special_ids,
)
from .dream import Model as DreamModel

# The training script (tasks/train_torch.py) adds "<M>" as the tokenizer's mask token when it has
# none: the next id after Qwen2.5's last added token (<|file_sep|>, 151664). config.json does not
# name it; `mlx_dllm convert --model-type open_dcoder` writes the tokenizer's id.
# The settings family this module's spec belongs to, and the rows it adds: Dream's
# diffusion_generate's (its "dream" sampler).
FAMILY = "open_dcoder"
SETTINGS = dream.DIFFUSION_GENERATE_SETTINGS
SAMPLERS = dream.SAMPLERS

OPEN_DCODER_MASK_TOKEN_ID = 151665

# sample.py: MDMGenerationConfig(max_new_tokens=128, steps=128, temperature=0.5, top_k=200,
# alg="p2", alg_temp=0.5). steps stays unset so that it follows max_tokens (p2's block is the
# whole canvas; steps default to the block's length): 128 at the default max_tokens, as there.
# alg_temp is read by the "dream" sampler only (p2 ignores it, as _mdm_sample does); alg and eps
# are MDMGenerationConfig's defaults, for sampler "dream".
REFERENCE_DEFAULTS = {
    "sampler": "p2",
    "max_tokens": 128,
    "temperature": 0.5,
    "top_k": 200,
    "top_p": None,
    "alg": "entropy",
    "alg_temp": 0.5,
    "eps": 1e-3,
}
# The checkpoint's generation_config.json, if any, is Qwen2.5-Coder's autoregressive one
# (max_new_tokens 2048, sampling defaults) that _mdm_sample never reads.
IGNORED_GENERATION_CONFIG_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k")


@dataclass
class ModelArgs(qwen2.ModelArgs):
    mask_token_id: Optional[int] = None
    eos_token_id: Optional[Union[int, Sequence[int]]] = None
    pad_token_id: Optional[int] = None
    bos_token_id: Optional[int] = None

    def __post_init__(self):
        check_special_ids(self, mask_default=OPEN_DCODER_MASK_TOKEN_ID)


class Model(DreamModel):
    """Dream's model (Qwen2's body under the caller's mask, untouched logits) under its own name,
    head tied as Qwen2.5-Coder-0.5B's; the spec is Open-dCoder's."""

    family = "open_dcoder"

    def plain_mask(self, length: int):
        # veomni's Qwen2ForCausalLM.forward takes is_causal=True unless told otherwise (_mdm_sample
        # passes False; the engine passes its own mask), as transformers' Qwen2 does.
        return "causal"

    spec_family = FAMILY
    missing_mask = None  # the mask id has a default (OPEN_DCODER_MASK_TOKEN_ID)

    def spec_fields(self) -> dict:
        return dict(
            # sample_tokens: the probability of x0 after temperature and top-k is the confidence.
            **dream.DREAM_READING,
            samplers=("p2", "dream") + SHARED_SAMPLERS,
            commit_rules=SAMPLERS,
            defaults=dict(REFERENCE_DEFAULTS),
            generation_config_keys={"alg_temp": "alg_temp", "eps": "eps"},
            ignored_generation_config_keys=IGNORED_GENERATION_CONFIG_KEYS,
            sampling_order=("temperature", "top_p", "top_k"),  # sample_tokens' order
            # _mdm_sample's canvas is one block.
            sampler_defaults={"p2": {"block_length": None}, "dream": {"block_length": None}},
            vocab_size=self.args.vocab_size,
            settings=SETTINGS,
            relations=(dream.ALG_RELATION,),
        )
