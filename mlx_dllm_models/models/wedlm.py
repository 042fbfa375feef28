"""WeDLM (Tencent; tencent/WeDLM-7B-Base, -7B-Instruct, -8B-Base, -8B-Instruct, model_type "wedlm"):
a Qwen2.5 or Qwen3 body, unchanged, decoded by diffusion under ordinary causal attention.

The checkpoint's class (hf_compat/modeling_wedlm.py of github.com/Tencent/WeDLM) is Qwen's decoder
with two switches in config.json: `attention_bias` (q/k/v biases, Qwen2.5) and `qk_norm` (per-head
q/k RMSNorm, Qwen3). WeDLM-7B is the Qwen2.5 body (bias, no norm), WeDLM-8B the Qwen3 one (norm, no
bias); those are the two combinations mlx-lm has layers for, and so the two this module builds.
Attention is causal (`is_causal = True`) with RoPE on the given position ids, and logits are read
at the masked position itself (no shift: wedlm/engine/wedlm_decoder.py takes the logits of the mask
rows).

What makes it a diffusion model is the decoding loop (engine/wedlm.py): a sliding window of masks
after the committed tokens, whose filled positions are moved before its masks ("topological
reordering") so that a causal forward lets every mask see every filled token. The model knows
nothing of that: the engine gives it the mask that the reordered causal attention implies over the
window in place (RoPE reads the positions, attention is permutation-equivariant given its mask), and
mlx-lm's cache protocol for the K/V.

A plain Qwen2 / Qwen3 checkpoint is never captured: mlx-lm picks the module by config.json's
model_type, and WeDLM's is "wedlm" (configuration_wedlm.py's WeDLMConfig.model_type; architectures
["WeDLMForCausalLM"]), which no autoregressive Qwen checkpoint writes.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

import mlx.nn as nn
from mlx_lm.models import qwen2, qwen3
from mlx_lm.models.base import BaseModelArgs

from ..engine.wedlm import WeDLMDecoder
from ..settings_families import Setting
from ..spec import CAUSAL_WINDOW, GENERATION_CONFIG_KEYS, DiffusionSpec
from ..validators import cli_optional_float, number, optional
from .common import (
    QWEN_BODY_FIELDS,
    cached_spec,
    check_special_ids,
    config_fields,
    own_loop_spec,
)
from .mlx_lm_body import MaskedBody


class Decoder(WeDLMDecoder):
    """WeDLM's window decoding (engine.wedlm) under this family's names: the loop and its one rule
    (decoding.wedlm.wedlm_commit), the `sampler` setting's "wedlm"."""

    samplers = ("wedlm",)


# The loop this family registers (its spec's `decoder` names it).
DECODERS = {"wedlm": Decoder}

# The settings family of WeDLM's spec, and the rows it adds: its SamplingParams
# (wedlm/sampling_params.py); its window is block_length.
FAMILY = "wedlm"
SETTINGS = (
    Setting(
        "entropy_threshold",
        None,
        "WeDLM: fill every mask whose entropy plus the position penalty is below this, at least "
        "one (wedlm_entropy_threshold; 0: one mask a step, the least, as the reference's None)",
        cli_optional_float,
        optional(number(0, what=" (nats)")),
        samplers=("wedlm",),
    ),
    Setting(
        "pos_penalty_factor",
        None,
        "WeDLM: added to a mask's entropy per position after the window's first mask "
        "(wedlm_pos_penalty_factor)",
        float,
        number(0, finite=True),
        samplers=("wedlm",),
    ),
)
_THRESHOLD = "its one threshold is on entropy: set entropy_threshold (and pos_penalty_factor)"
# The shared settings its window decoding has no use for.
UNUSED_SETTINGS = {
    "steps": "a step fills every mask of the window whose entropy (plus the position penalty) is "
    "below entropy_threshold, at least one, so there is no step budget; set entropy_threshold",
    "threshold": _THRESHOLD,
    "factor": _THRESHOLD,
    "entropy_bound": _THRESHOLD,
}

# wedlm/engine/model_runner.py `_init_mask_token`: config.json's mask_token_id, else this id.
WEDLM_MASK_TOKEN_ID = 151665
# The reference engine's recipe: wedlm/config.py (wedlm_window_size 16) and
# wedlm/sampling_params.py (wedlm_entropy_threshold 0.4, wedlm_pos_penalty_factor 0.02, which
# evaluation/evaluation_base.sh and web_demo.py default to as well), with the README's Python API
# call SamplingParams(temperature=0.0, max_tokens=512). (example.py passes threshold 0.6.)
WEDLM_DEFAULTS = {
    "sampler": "wedlm",
    "block_length": 16,
    "entropy_threshold": 0.4,
    "pos_penalty_factor": 0.02,
    "temperature": 0.0,
    "top_p": None,
    "top_k": None,
    "max_tokens": 512,
}
WEDLM_CONFIG_KEYS = (
    "num_hidden_layers, hidden_size, intermediate_size, head counts, head_dim, vocab_size, "
    "attention_bias, qk_norm, tie_word_embeddings"
)


@dataclass
class ModelArgs(BaseModelArgs):
    # WeDLMConfig's fields (hf_compat/configuration_wedlm.py) and its defaults.
    model_type: str
    hidden_size: int = 4096
    num_hidden_layers: int = 32
    intermediate_size: int = 22016
    num_attention_heads: int = 32
    vocab_size: int = 151936
    num_key_value_heads: Optional[int] = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    rope_theta: float = 10000.0
    rope_scaling: Optional[Dict[str, Any]] = None
    tie_word_embeddings: bool = False
    use_sliding_window: bool = False
    attention_bias: bool = True
    qk_norm: bool = False
    head_dim: Optional[int] = None
    mask_token_id: Optional[int] = None
    eos_token_id: Union[int, List[int], None] = None
    pad_token_id: Optional[int] = None
    bos_token_id: Optional[int] = None

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        natural = self.hidden_size // self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = natural
        body = (bool(self.attention_bias), bool(self.qk_norm))
        if body not in ((True, False), (False, True)):
            raise ValueError(
                f"wedlm: config.json has attention_bias={self.attention_bias} and qk_norm="
                f"{self.qk_norm}; the published WeDLM checkpoints are Qwen2.5 bodies "
                "(attention_bias true, qk_norm false) or Qwen3 bodies (false, true), the two this "
                "package builds"
            )
        if not self.qk_norm and self.head_dim != natural:
            raise ValueError(
                f"wedlm: a Qwen2.5-style body (qk_norm false) has head_dim = hidden_size / "
                f"num_attention_heads = {natural}, but config.json says head_dim={self.head_dim}"
            )
        if self.use_sliding_window:
            raise ValueError(
                "wedlm: config.json sets use_sliding_window, which no published WeDLM checkpoint "
                "uses and this package does not implement; set it to false"
            )
        check_special_ids(self, mask_default=WEDLM_MASK_TOKEN_ID)

    def body_args(self):
        """mlx-lm's ModelArgs of the Qwen body this config describes."""
        shared = config_fields(self, QWEN_BODY_FIELDS + ("model_type", "rope_scaling"))
        if self.qk_norm:
            return qwen3, qwen3.ModelArgs(head_dim=self.head_dim, **shared)
        return qwen2, qwen2.ModelArgs(**shared)


def wedlm_spec(args: ModelArgs) -> DiffusionSpec:
    return own_loop_spec(
        args,
        FAMILY,
        CAUSAL_WINDOW,
        DECODERS,
        SETTINGS,
        UNUSED_SETTINGS,
        WEDLM_DEFAULTS,
        # The logits of a mask row predict that row's token (no shift).
        logit_shift=0,
        samplers=("wedlm",),
        # The reference engine takes its sampling values from SamplingParams alone: it never
        # reads generation_config.json.
        ignored_generation_config_keys=tuple(GENERATION_CONFIG_KEYS),
    )


class Model(MaskedBody, qwen3.Model):
    """WeDLMForCausalLM: mlx-lm's Qwen2 or Qwen3 body (config.json's qk_norm decides) read under
    the caller's mask. Qwen3's `sanitize` and `shard` serve both bodies (the same names)."""

    family = "wedlm"
    config_keys = WEDLM_CONFIG_KEYS

    def __init__(self, args: ModelArgs):
        nn.Module.__init__(self)
        self.args = args
        self.model_type = args.model_type
        module, body = args.body_args()
        self.model = module.Qwen2Model(body) if module is qwen2 else module.Qwen3Model(body)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def plain_mask(self, length: int):
        # WeDLMForCausalLM.forward is Qwen's causal one; the decoder passes its window's mask.
        return "causal"

    @property
    def layout(self):
        body = "Qwen3's" if self.args.qk_norm else "Qwen2.5's"
        return f"{body} layout (e.g. 'model.layers.0.self_attn.q_proj.weight')"

    @cached_spec
    def diffusion_spec(self) -> DiffusionSpec:
        return wedlm_spec(self.args)
