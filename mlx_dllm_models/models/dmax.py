"""DMax (Zigeng/DMax-Math-16B, Zigeng/DMax-Coder-16B, Zigeng/DMax-16B): LLaDA2.0-mini fine-tuned
for soft parallel decoding. model_type "dmax" is this package's name for it, not the checkpoint's.

The weights and the forward are LLaDA2.0-mini's (models/llada2_moe.py, block-causal over blocks of
32); what differs is the decoding (engine/dmax.py): the authors' dInfer `BlockDiffusionLLM` with
`ThresholdParallelDecoder.decode_uniform` (czg1225/DMax, dInfer/python/dinfer/decoding/
generate_uniform.py and parallel_strategy.py), which the paper's evaluation scripts run
(dInfer/evaluations/eval_llada_dmax_math.sh: threshold 0.5, block 32, 2048 tokens, temperature 0).

Why a model_type of its own: config.json says llada2_moe (with an auto_map to the checkpoint's
modeling_llada2_moe.py, whose `generate_spd` is DMax's decoding), exactly as LLaDA2.0-mini's does,
so a plain conversion decodes it as LLaDA2.0. `mlx_dllm convert --hf-path <dmax> --model-type dmax`
writes this model_type, after which `mlx_lm.load` and `mlx_dllm generate` decode it as DMax.
"""

from dataclasses import dataclass

import mlx.core as mx

from ..engine.dmax import DMaxDecoder
from ..spec import BLOCK_CAUSAL, DiffusionSpec
from . import llada2_moe
from .common import cached_spec, own_loop_spec

# The loop this family registers (its spec's `decoder` names it): dInfer's soft parallel decoding.
DECODERS = {"dmax": DMaxDecoder}

FAMILY = "dmax"
SETTINGS = ()

# dInfer's block size for LLaDA2 (the checkpoints' training block).
DMAX_BLOCK_LENGTH = 32
# dInfer/evaluations/eval_llada_dmax_math.sh and eval_llada_dmax_code.sh: the decoder's values.
REFERENCE_DEFAULTS = {
    "block_length": DMAX_BLOCK_LENGTH,
    "sampler": "threshold",
    "threshold": 0.5,
    "temperature": 0.0,
    "max_tokens": 2048,
}
_ONE_RULE = "DMax commits the masks left of the first one proposed below threshold; set threshold"
# The shared settings its decoding has no use for.
UNUSED_SETTINGS = {
    "steps": "a block iterates until its proposals settle (at most block_length forwards); there "
    "is no step budget",
    "factor": _ONE_RULE,
    "entropy_bound": _ONE_RULE,
    "top_p": "DMax decodes greedily (temperature 0)",
    "top_k": "DMax decodes greedily (temperature 0)",
    "cache": "DMax keeps the prefix K/V of its blocks itself (dInfer's prefix cache)",
    "logprobs": "DMax rewrites decoded tokens at every step; no step's distribution is final",
}


@dataclass
class ModelArgs(llada2_moe.ModelArgs):
    """LLaDA2MoeConfig's fields: the checkpoints are LLaDA2.0-mini fine-tunes."""


class Model(llada2_moe.Model):
    """LLaDA2MoeModelLM's forward under the DMax decoding recipe."""

    def embed(self, ids: mx.array) -> mx.array:
        """(B, L, H) the input embeddings of `ids`: what the dmax decoder mixes into soft ones."""
        return self.model.word_embeddings(ids)

    @cached_spec
    def diffusion_spec(self) -> DiffusionSpec:
        return own_loop_spec(
            self.args,
            FAMILY,
            BLOCK_CAUSAL,
            DECODERS,
            SETTINGS,
            UNUSED_SETTINGS,
            REFERENCE_DEFAULTS,
            samplers=("threshold",),
            trained_block_length=DMAX_BLOCK_LENGTH,
        )
