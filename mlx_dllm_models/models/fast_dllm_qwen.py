"""Fast-dLLM v2 (Efficient-Large-Model/Fast_dLLM_v2_1.5B, Fast_dLLM_v2_7B): block diffusion on an
exact Qwen2.5 body (q/k/v biases, RMSNorm, SwiGLU, RoPE).

What differs from Qwen2.5 is the attention pattern and how logits are read, both from the remote
code (modeling.py, `Fast_dLLM_QwenModel.eval_mask` and `Fast_dLLM_QwenForCausalLM.generate`):

* Blocks of `bd_size` (32) tokens on absolute positions attend bidirectionally inside the block and
  to every earlier block (`block_q >= block_kv`); the engine passes that mask
  (masks.block_causal_mask), the model never builds it.
* Token shift: the logits at position i predict token i + 1, as in the AR model it was tuned from.
  So a block's first position is never denoised: once a block is whole, its last logit gives the
  next block's first token by argmax (the remote code's `next_token` after its cache update).
  The spec declares both (`logit_shift=1`, `seeds_block_start=True`).
* Decoding runs over sub-blocks of `small_block_size` (8) positions, left to right: a step commits
  the current sub-block's masks whose probability exceeds `threshold` (0.9), and its most probable
  one in any case (decoding.sub_block, the `sub_block` sampler).
"""

from dataclasses import dataclass
from typing import List, Optional, Union

from mlx_lm.models import qwen2

from ..masks import block_causal_mask
from ..settings_families import Relation, Setting
from ..spec import SHARED_SAMPLERS, DiffusionSpec
from ..validators import positive_int
from .common import cached_spec, check_special_ids, trained_blocks_spec
from .mlx_lm_body import MaskedBody

# The settings family of Fast-dLLM v2's spec, and the row it adds: generate's small_block_size, the
# sub-blocks a block is decoded in.
FAMILY = "fast_dllm_v2"
SETTINGS = (
    Setting(
        "sub_block_length",
        None,
        "Fast-dLLM v2: positions per sub-block of the sub_block sampler (divides block_length)",
        int,
        positive_int,
        samplers=("sub_block",),
    ),
)
RELATIONS = (
    Relation(
        "sub_block_length",
        "block_length",
        lambda sub, block: block % sub == 0,
        "sub_block_length ({sub_block_length}) must divide block_length ({block_length}): a block "
        "is decoded as whole sub-blocks",
    ),
)

# modeling.py / generation_functions.py: FAST_DLLM_MASK_ID, the id of "|<MASK>|" in the Qwen2.5
# tokenizer the checkpoints ship; their config.json does not carry it.
FAST_DLLM_MASK_TOKEN_ID = 151665
# Fast_dLLM_QwenConfig's default bd_size; the published config.json sets 32 too.
FAST_DLLM_BLOCK_SIZE = 32
# The model card's and v2/run_chatbot.py's generate call: small_block_size=8, threshold=0.9 (the
# remote generate's own defaults, threshold=1, decode one token a step); max_new_tokens=512 (the
# card's example; the chatbot asks 2048).
FAST_DLLM_SUB_BLOCK = 8
FAST_DLLM_THRESHOLD = 0.9
FAST_DLLM_MAX_TOKENS = 512
FAST_DLLM_SPECIAL_IDS = ("eos_token_id", "pad_token_id", "bos_token_id")
FAST_DLLM_CONFIG_KEYS = (
    "num_hidden_layers, hidden_size, intermediate_size, head counts, vocab_size, "
    "tie_word_embeddings"
)


def fast_dllm_v2_spec(args) -> DiffusionSpec:
    # sample_with_top_p: the probability of the chosen token under softmax(logits / T) after
    # top-p (at temperature 0 the plain softmax); unmask_idx = x1_p > threshold (BLOCK_READING).
    # The generate call takes its sampling values as arguments; a generation_config.json's AR
    # sampling values (Qwen2.5's) are never read by it.
    return trained_blocks_spec(
        args,
        FAMILY,
        int(args.bd_size),
        settings=SETTINGS,
        relations=RELATIONS,
        # generate: logits = cat([logits[:, :1], logits[:, :-1]]), position i read at i - 1.
        logit_shift=1,
        # ... and a block's first token is the argmax after the previous block is whole.
        seeds_block_start=True,
        samplers=SHARED_SAMPLERS + ("sub_block",),
        sampler_defaults={"sub_block": {"sub_block_length": FAST_DLLM_SUB_BLOCK}},
        # generate stops a block once an EOS has no mask before it (`stop_token` checks).
        eos_ends_block=True,
        defaults={
            "sampler": "sub_block",
            "threshold": FAST_DLLM_THRESHOLD,
            # generate's temperature=0: greedy.
            "temperature": 0.0,
            "max_tokens": FAST_DLLM_MAX_TOKENS,
        },
        vocab_size=args.vocab_size,
    )


@dataclass
class ModelArgs(qwen2.ModelArgs):
    # Fast_dLLM_QwenConfig's defaults where they differ from mlx-lm's qwen2.ModelArgs.
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    bd_size: int = FAST_DLLM_BLOCK_SIZE
    mask_token_id: Optional[int] = None
    eos_token_id: Union[int, List[int], None] = None
    pad_token_id: Optional[int] = None
    bos_token_id: Optional[int] = None

    def __post_init__(self):
        check_special_ids(self, FAST_DLLM_SPECIAL_IDS, mask_default=FAST_DLLM_MASK_TOKEN_ID)
        bd = self.bd_size
        if isinstance(bd, bool) or not isinstance(bd, int) or bd < 1:
            raise ValueError(
                f"{self.model_type}: config.json's bd_size (the diffusion block length) must be "
                f"a positive integer, got {bd!r}; the published checkpoints use 32"
            )


class Model(MaskedBody, qwen2.Model):
    """Fast_dLLM_QwenForCausalLM: mlx-lm's qwen2 read under the caller's mask, returning
    unshifted logits (the engine applies the spec's shift)."""

    family = "fast_dllm_v2"
    layout = "Qwen2's layout (e.g. 'model.layers.0.self_attn.q_proj.bias')"
    config_keys = FAST_DLLM_CONFIG_KEYS

    def plain_mask(self, length: int):
        # Fast_dLLM_QwenModel.forward in eval mode: eval_mask over blocks of its `block_size`
        # argument, 32 unless given (not config.json's bd_size).
        return block_causal_mask(length, 32)

    @cached_spec
    def diffusion_spec(self) -> DiffusionSpec:
        return fast_dllm_v2_spec(self.args)
