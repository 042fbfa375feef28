"""I-DLM (yifanyu/I-DLM-8B, yifanyu/I-DLM-32B; Qwen3-8B / -32B converted to introspective
diffusion): SDAR's Qwen3 body read causally, decoded by Introspective Strided Decoding. model_type
"idlm" is this package's name for it, not the checkpoint's.

The checkpoints are SDARForCausalLM (config.json: model_type "sdar", auto_map to the remote
modeling_sdar.py, block_size 1, mask_token_id 151669 in the repository's training copy). What makes
them I-DLM is how they are read (the model card: strict causal masking over clean and masked tokens,
and the logit shift: hidden state i predicts token i + 1) and decoded: the authors' SGLang algorithm
`IDLMBlockN` (thuEcstasy/I-DLM @ 3342a17, inference/sglang/sglang/srt/dllm/algorithm/idlm_blockN.py)
runs every decode forward with `dllm_force_causal`, verifying the previous drafts and drafting the
next ones in one forward (engine/idlm.py).

Why a model_type of its own: a plain conversion keeps "sdar" and decodes it as SDAR (block
diffusion, unshifted). `mlx_dllm convert --hf-path <i-dlm> --model-type idlm` writes this
model_type, after which `mlx_lm.load` and `mlx_dllm generate` decode it as I-DLM.

The LoRA release (yifanyu/I-DLM-8B-lora-r128, a PEFT adapter on Qwen/Qwen3-8B, served by SGLang's
--lora-paths; the released configs leave IDLMBlockN's `conditional_lora`, the adapter on mask
positions only, off) is not covered: its base says qwen3 with no mask id, and no merged copy was
tested here.
"""

from dataclasses import dataclass

from ..engine.idlm import IDLMDecoder
from ..spec import CAUSAL_PREFIX, DiffusionSpec
from . import sdar
from .common import cached_spec, own_loop_spec


class Decoder(IDLMDecoder):
    """I-DLM's strided decoding (engine.idlm) under this family's names: the `sampler` setting's
    "idlm" (its one rule, decoding.idlm)."""

    samplers = ("idlm",)


# The loop this family registers (its spec's `decoder` names it).
DECODERS = {"idlm": Decoder}

FAMILY = "idlm"
SETTINGS = ()

# inference/configs/idlm_blockN4_config.yaml, the configuration the model cards and the inference
# README recommend for both checkpoints: gen_block_size 4 (block_size 2N - 1 = 7 positions a
# forward), top_k 50, top_p 0.95, spec verification on. Its temperature is 1.0; greedy is the
# deterministic default here (at temperature 0 the tokens are the causal model's greedy ones), and
# temperature=1.0 gives the authors' sampled recipe. max_tokens: the README's request.
GEN_BLOCK_SIZE = 4
REFERENCE_DEFAULTS = {
    "block_length": GEN_BLOCK_SIZE,
    "sampler": "idlm",
    "temperature": 0.0,
    "top_k": 50,
    "top_p": 0.95,
    "max_tokens": 512,
}
_ONE_RULE = "I-DLM keeps a draft while the causal model agrees with it; there is no commit rule"
# The shared settings its decoding has no use for.
UNUSED_SETTINGS = {
    "steps": "a forward returns the kept drafts and one token; there is no step budget",
    "threshold": _ONE_RULE,
    "factor": _ONE_RULE,
    "entropy_bound": _ONE_RULE,
}


@dataclass
class ModelArgs(sdar.ModelArgs):
    """SDARConfig's fields: the checkpoints are saved as SDAR's."""


class Model(sdar.Model):
    """SDARForCausalLM under I-DLM's causal reading."""

    family = FAMILY

    def plain_mask(self, length: int):
        # I-DLM's forward is causal everywhere (training and decoding).
        return "causal"

    @cached_spec
    def diffusion_spec(self) -> DiffusionSpec:
        return own_loop_spec(
            self.args,
            FAMILY,
            CAUSAL_PREFIX,
            DECODERS,
            SETTINGS,
            UNUSED_SETTINGS,
            REFERENCE_DEFAULTS,
            # Hidden state i predicts token i + 1.
            logit_shift=1,
            samplers=("idlm",),
            # _batched_sample: logits / temperature, then top-k, then top-p.
            sampling_order=("temperature", "top_k", "top_p"),
            # The reference reads its algorithm config alone, never generation_config.json.
            ignored_generation_config_keys=("temperature", "top_k", "top_p"),
        )
