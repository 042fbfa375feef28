"""Stable-DiffCoder (ByteDance-Seed/Stable-DiffCoder-8B-Base, -8B-Instruct): Seed-Coder-8B's Llama
body after block-diffusion continued pretraining. model_type "stable_diffcoder" is this package's
name for it, not the checkpoint's.

Reproduces the checkpoints' remote `modeling_stable_diffcoder.py`: `StableDiffcoderForCausalLM`
subclasses transformers' LlamaForCausalLM and adds only decoding (`generate_block`), so the forward
is Llama's, with the weight names of mlx-lm's llama, under the mask the caller gives:
`_make_block_causal_mask` (blocks of `block_length` on absolute positions, bidirectional inside a
block, every earlier block in view). Logits at position i predict token i (`shift=False`).

Why a model_type of its own: config.json says model_type "llama" (with architectures
StableDiffcoderForCausalLM and an auto_map to the remote code), and this package never takes plain
llama over from mlx-lm. `mlx_dllm convert --hf-path <stable-diffcoder> --model-type
stable_diffcoder` writes this model_type into the converted config, with the tokenizer's mask id
(<[MASK_TOKEN]>, generate_block's `mask_id=5`), after which `mlx_lm.load` and `mlx_dllm generate`
build this model.

Decoding: generate_block's. The prompt's whole blocks are prefilled; the generated region is cut on
absolute multiples of block_length (the first block shares the prompt's tail); each block splits
its mask count over steps // (gen_length // block_length) steps (LLaDA's get_num_transfer_tokens:
the engine's `steps` is that per-block count), commits the top-quota confidences (float64 softmax
of the raw logits at the Gumbel-max proposal, "low_confidence"), or with `threshold` every
candidate at or above it and always the most confident; a finished block holding the EOS ends the
run.
"""

from dataclasses import dataclass
from typing import List, Optional, Union

from mlx_lm.models import llama

from ..spec import BLOCK_CAUSAL, SHARED_SAMPLERS, DiffusionSpec
from .common import build_spec, cached_spec, check_special_ids
from .mlx_lm_body import MaskedBody

FAMILY = "stable_diffcoder"
SETTINGS = ()

# generate_block's `mask_id` default: <[MASK_TOKEN]> in Seed-Coder's vocabulary.
STABLE_DIFFCODER_MASK_TOKEN_ID = 5
# generate_block's `block_length` default and the model card's call (the block size of its
# block-diffusion continued pretraining).
STABLE_DIFFCODER_BLOCK_LENGTH = 4

# The model card's call: model.generate(input_ids, steps=512, gen_length=512, block_length=4,
# temperature=0., remasking='low_confidence', shift=False, threshold=None, eos_id=...): one token a
# step (steps unset follows block_length: 512 / (512 / 4) = 4 a block), greedy, by quota.
# generate_block's own `threshold` default, 0.95, is the threshold sampler's.
REFERENCE_DEFAULTS = {
    "block_length": STABLE_DIFFCODER_BLOCK_LENGTH,
    "sampler": "quota",
    "temperature": 0.0,
    "threshold": 0.95,
    "max_tokens": 512,
}
CONFIG_KEYS = "num_hidden_layers, hidden_size, intermediate_size, head counts, head_dim, vocab_size"


@dataclass
class ModelArgs(llama.ModelArgs):
    # Seed-Coder-8B's head is its own (tie_word_embeddings false in the published config).
    tie_word_embeddings: bool = False
    mask_token_id: Optional[int] = None
    eos_token_id: Union[int, List[int], None] = None
    pad_token_id: Optional[int] = None
    bos_token_id: Optional[int] = None

    def __post_init__(self):
        super().__post_init__()
        check_special_ids(self, mask_default=STABLE_DIFFCODER_MASK_TOKEN_ID)


class Model(MaskedBody, llama.Model):
    """StableDiffcoderForCausalLM: mlx-lm's llama read under the caller's mask."""

    family = FAMILY
    layout = "Llama's layout (e.g. 'model.layers.0.self_attn.q_proj.weight', no biases)"
    config_keys = CONFIG_KEYS

    def plain_mask(self, length: int):
        # Its forward is LlamaForCausalLM's, causal when no mask is passed; only generate_block
        # passes the block-causal one.
        return "causal"

    @cached_spec
    def diffusion_spec(self) -> DiffusionSpec:
        return build_spec(
            self.args,
            FAMILY,
            BLOCK_CAUSAL,
            settings=SETTINGS,
            # _get_transfer_index: Gumbel-max proposal at the temperature, confidence the softmax
            # of the untempered logits (LLaDA's form).
            confidence="raw",
            quota_base="masks",
            # `confidence[...] < threshold` drops a candidate: the threshold itself is kept.
            strict_threshold=False,
            samplers=SHARED_SAMPLERS,
            defaults=dict(REFERENCE_DEFAULTS),
            trained_block_length=STABLE_DIFFCODER_BLOCK_LENGTH,
            # generate_block's canvas is prompt + gen_length: a prompt off the block grid leaves
            # its last block the prompt's remainder of positions.
            last_block_at_max_tokens=True,
            vocab_size=self.args.vocab_size,
        )
