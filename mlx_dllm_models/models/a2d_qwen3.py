"""dllm's A2D Qwen3 (model_type "a2d-qwen3"): a Qwen3 body without its causal mask, the MDLM and
BD3LM checkpoints of ZHZisZZ/dllm (dllm-hub/Qwen3-0.6B-diffusion-mdlm-v0.1 and -bd3lm-v0.1, both
converted from Qwen/Qwen3-0.6B by the same script).

Reproduces `dllm/pipelines/a2d/models/qwen3/modeling_qwen3.py` (A2DQwen3LMHeadModel): transformers'
Qwen3 layers and weights unchanged, with the causal mask replaced by a padding-only one, so every
position sees every other; the head predicts position i from hidden state i (no shift: the MDLM
sampler's `right_shift_logits` is off in its recipe). `dllm/pipelines/a2d/convert.py` writes the
source Qwen3 config with model_type "a2d-qwen3" and without auto_map: Qwen3-0.6B's tied head and its
ids (EOS <|im_end|>, pad / BOS <|endoftext|>) carry over. The mask token is the one dllm's
`get_tokenizer` adds to Qwen's tokenizer, "<|mask|>", which config.json does not name.

Decoding is dllm's MDLMSampler (dllm/core/samplers/mdlm.py, LLaDA's generate.py reworked): blocks
from the prompt's end, each step commits the block's most confident masks (softmax of the raw
logits at the argmax), as many as dllm's linear-alpha schedule gives (decoding.dllm): sampler
"mdlm", the default. Sampler "bd3lm" is BD3LMSampler (dllm/core/samplers/bd3lm.py), the same rule
under block-causal attention whose blocks end at the prompt's end, for the BD3LM checkpoints: their
config.json is the MDLM one's, so only the sampler tells them apart. Both samplers' example
recipes (examples/a2d/{mdlm,bd3lm}/sample.py) are the same numbers.
"""

from dataclasses import dataclass
from typing import Optional, Sequence, Union

from mlx_lm.models import qwen3

from ..decoding.dllm import dllm_commit
from ..spec import BLOCK_CAUSAL, SHARED_SAMPLERS
from .common import check_special_ids
from .mlx_lm_body import MaskedBody

# The settings family of dllm's A2D specs (Qwen3 and Qwen2 bodies); it adds no setting of its own.
FAMILY = "a2d"
SETTINGS = ()
# BD3LMSampler: MDLMSampler's rule (the shared "mdlm") run over block-causal blocks, which the
# spec's sampler_spec brings.
SAMPLERS = {"bd3lm": dllm_commit}

# dllm's get_tokenizer adds "<|mask|>" to Qwen3's tokenizer as a new special token: it takes the
# next id after Qwen3's last added token (</think>, 151668). config.json does not name it.
A2D_MASK_TOKEN_ID = 151669
QWEN3_EOS_TOKEN_ID = 151645  # <|im_end|>, Qwen3-0.6B's eos_token_id and dllm's eot_token

# examples/a2d/mdlm/sample.py's SamplerConfig (bd3lm/sample.py's is the same): 128 new tokens
# in blocks of 32, 128 steps in all (dllm's steps are total: ceil(128 / 4) = 32 per block, this
# package's `steps` is per block), temperature 0, remasking "low_confidence". Its cfg_scale 0 (no
# guidance) is the only value here: guidance is not offered for this family.
REFERENCE_DEFAULTS = {
    "sampler": "mdlm",
    "block_length": 32,
    "steps": 32,
    "max_tokens": 128,
    "temperature": 0.0,
}
# The source Qwen3 generation_config.json carries AR sampling defaults (temperature 0.6, top_p,
# top_k) that dllm's samplers never read: their settings come from the sampler config only.
IGNORED_GENERATION_CONFIG_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k")


@dataclass
class ModelArgs(qwen3.ModelArgs):
    mask_token_id: Optional[int] = None
    eos_token_id: Optional[Union[int, Sequence[int]]] = QWEN3_EOS_TOKEN_ID
    pad_token_id: Optional[int] = None
    bos_token_id: Optional[int] = None

    def __post_init__(self):
        check_special_ids(self, mask_default=A2D_MASK_TOKEN_ID)


class A2DBody(MaskedBody):
    """What A2D's Qwen3 and Qwen2 conversions share: their checkpoint check and spec (the body is
    the mlx-lm Model after this mixin)."""

    layout = "Qwen's layout (e.g. 'model.layers.0.self_attn.q_proj.weight')"
    config_keys = (
        "num_hidden_layers, hidden_size, intermediate_size, head counts, head_dim, "
        "vocab_size, tie_word_embeddings"
    )

    @property
    def family(self):
        return self.args.model_type  # a2d-qwen3, or a2d-qwen2 (models.a2d_qwen2)

    spec_family = FAMILY

    def spec_fields(self) -> dict:
        return dict(
            confidence="raw",  # MDLMSampler: softmax of the unprocessed logits at the argmax
            quota_base="masks",
            # "mdlm" is MDLMSampler's low_confidence remasking on dllm's schedule, "bd3lm" the
            # same rule as BD3LMSampler runs it; the shared samplers read the MDLM way.
            samplers=("mdlm", "bd3lm") + SHARED_SAMPLERS,
            commit_rules=SAMPLERS,
            # config.json is the same for dllm's MDLM and BD3LM conversions: the sampler says
            # which it is. BD3LMSampler attends block-causally, blocks ending at the prompt.
            sampler_spec={"bd3lm": {"attention": BLOCK_CAUSAL, "blocks_end_at_prompt": True}},
            defaults=dict(REFERENCE_DEFAULTS),
            ignored_generation_config_keys=IGNORED_GENERATION_CONFIG_KEYS,
            vocab_size=self.args.vocab_size,
        )


class Model(A2DBody, qwen3.Model):
    """A2DQwen3LMHeadModel: mlx-lm's Qwen3 read under the caller's mask."""

    shard_name = "A2D-Qwen3"
