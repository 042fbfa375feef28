"""Nemotron-Labs-Diffusion (NVIDIA): a Ministral-3 body that runs causally (AR) or bidirectionally.

Reproduces the HF remote code `modeling_nemotron_labs_diffusion.py`: the Ministral-3 decoder under
`encoder.*`, YaRN RoPE, the Llama-4 query scaling after RoPE, and an untied `diffusion_head`. Logits
are not shifted: logits[i] predict position i. The same weights serve both attention modes; the
caller chooses one per forward:

* `mask=None` attends to every key, i.e. bidirectionally over [cache ; inputs] (a plain `model(ids)`
  is the reference's bidirectional full-sequence forward), and `mask="causal"` is the AR forward.
* mlx-lm's own generation (`mlx_lm.generate`, batch generation, quantized or saved prompt caches)
  calls `model(inputs, cache=cache)` with caches of mlx-lm's classes and never passes a mask. So a
  cache whose class comes from `mlx_lm.models.cache`, with no mask given, means "AR use": the
  forward is causal. Caches of any other origin (this package's diffusion caches) keep the
  protocol's bidirectional default; an explicit mask always wins.

The checkpoint may ship `linear_spec_lora/`, the LoRA draft adapter of the remote code's
`linear_spec_generate` (a PEFT adapter: `adapter_config.json` and `adapter_model.safetensors`);
`load_draft_adapter` puts it on its target layers, switched off, and self-speculation switches it on
for its draft forwards only (`set_draft_adapter`).
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import ministral3
from mlx_lm.models.base import create_attention_mask

from ..settings_families import DIFFUSION_MODE, Setting
from ..spec import CAUSAL_PREFIX, DiffusionSpec
from ..validators import (
    choice,
    cli_bool,
    cli_optional_float,
    int_at_least,
    number,
    optional,
    true_or_false,
)
from . import sharding
from .common import (
    build_spec,
    cached_spec,
    check_special_ids,
    check_weights,
    drop_tied_head,
    drop_unused_buffers,
    project,
    run_layers,
)

# The settings family of Nemotron-Labs-Diffusion's specs (the text and VLM checkpoints), and the
# rows it adds.
FAMILY = "nemotron"
SETTINGS = (
    Setting(
        "mode",
        None,
        "Nemotron: diffusion | self_spec (lossless self-speculation)",
        str,
        choice(("diffusion", "self_spec"), " for the nemotron family"),
    ),
    Setting(
        "draft_threshold",
        None,
        "Nemotron self_spec: linear_spec_generate's threshold: drafts over several forwards, each "
        "revealing the masks whose confidence reaches it (none: one draft forward)",
        cli_optional_float,
        optional(number(0, 1, low_open=True, what=" (linear_spec_generate's threshold)")),
        modes=("self_spec",),
    ),
    # NVIDIA's chat_utils.generate_with_prefix_cache_block_diff (the remote code's
    # generate_diffusion), read by the causal-prefix backend (engine/causal_prefix.py).
    Setting(
        "causal_context",
        None,
        "Nemotron: true: the context (prompt, finished blocks) is causal and the AR head seeds "
        "each block; false: the prompt and each finished block attend bidirectionally within "
        "themselves and to what precedes them, and blocks start as masks",
        cli_bool,
        true_or_false,
        modes=DIFFUSION_MODE,
    ),
    Setting(
        "max_thinking_tokens",
        None,
        "Nemotron: thinking budget: a row that has not produced end_think_token_id within this "
        "many new tokens gets it at that position (with end_think_token_id)",
        int,
        optional(int_at_least(0, " (new tokens before end_think_token_id is forced)")),
        requires="end_think_token_id",
    ),
    Setting(
        "end_think_token_id",
        None,
        "Nemotron: the token that ends thinking (e.g. the id of </think>), forced at "
        "max_thinking_tokens",
        int,
        optional(int_at_least(0, " (a token id)")),
        requires="max_thinking_tokens",
        token_id=True,
    ),
)


@dataclass
class ModelArgs(ministral3.ModelArgs):
    max_position_embeddings: Optional[int] = 262144
    tie_word_embeddings: bool = False
    rope_theta: float = 1000000.0
    rope_scaling: Optional[dict] = None
    hidden_act: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False
    mask_token_id: Optional[int] = None
    bos_token_id: Optional[int] = 1
    eos_token_id: Any = 2
    pad_token_id: Optional[int] = None
    block_size: int = 32

    def __post_init__(self):
        super().__post_init__()
        # No mask id (null or -1) leaves an AR-only checkpoint; diffusion_spec says so when asked.
        check_special_ids(self, mask_absent=(None, -1))
        if self.attention_bias or self.mlp_bias or self.hidden_act != "silu":
            raise ValueError(
                "nemotron_labs_diffusion: only bias-free SiLU checkpoints are supported "
                f"(attention_bias={self.attention_bias}, mlp_bias={self.mlp_bias}, "
                f"hidden_act={self.hidden_act!r})."
            )
        if any(t != "full_attention" for t in self.layer_types):
            raise ValueError(
                "nemotron_labs_diffusion: sliding-window layers are not supported "
                f"(layer_types={self.layer_types})."
            )
        # Older configs carry `rope_scaling` and a top-level `rope_theta`; ministral3's layers read
        # everything from `rope_parameters`. Without a Llama-4 beta the query scale is 1.
        rope = dict(self.rope_parameters or self.rope_scaling or {})
        rope.setdefault("rope_type", rope.get("type", "default"))
        rope.setdefault("rope_theta", self.rope_theta)
        rope.setdefault("llama_4_scaling_beta", 0.0)
        # HF's YaRN falls back to max_position_embeddings; mlx-lm's YarnRoPE would use 4096.
        rope.setdefault("original_max_position_embeddings", self.max_position_embeddings)
        self.rope_parameters = rope


def query_scale(length: int, offset, beta: float, original_max: int) -> mx.array:
    """Llama-4 query scale `1 + beta * log(1 + floor(pos / original_max))`, shaped to multiply
    (B or 1, heads, length, head_dim) queries; `offset` is an int or a (B,) array.

    ministral3's helper, except that negative positions (left padding, where a row's first real
    token is position 0) get scale 1: log(1 + floor(neg / M)) is -inf or NaN there, and NaN in pad
    rows reaches real rows through 0 * NaN in the next layer's attention.
    """
    if isinstance(offset, mx.array) and offset.ndim > 0:
        offset = offset[:, None]
    pos = mx.maximum(mx.arange(length) + offset, 0)
    scale = 1 + beta * mx.log(1 + mx.floor(pos / original_max))
    return scale[:, None, :, None] if scale.ndim == 2 else scale[:, None]


_NAME = "nemotron_labs_diffusion"


def _is_mlx_lm_cache(c) -> bool:
    return type(c).__module__ == "mlx_lm.models.cache"


class Encoder(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [ministral3.TransformerBlock(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class DraftLoRALinear(nn.Module):
    """A linear layer carrying the `linear_spec_lora` delta, applied only while `active`:
    y = base(x) + scale (x A^T) B^T, in PEFT's layout (A (r, in), B (out, r), scale = lora_alpha / r),
    as the remote code's PEFT LoRA with its adapters toggled on for drafts (mlx-lm's port:
    `SpecLoRALinear`). Switched off, it is the base layer, bit for bit."""

    def __init__(self, base: nn.Module, lora_a: mx.array, lora_b: mx.array, scale: float):
        super().__init__()
        self.base = base
        self.lora_a = lora_a
        self.lora_b = lora_b
        self.scale = scale
        self.active = False

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        if not self.active:
            return y
        delta = (x @ self.lora_a.T.astype(x.dtype)) @ self.lora_b.T.astype(x.dtype)
        return y + (self.scale * delta).astype(y.dtype)


def _layer_module(layer, path: str):
    parent = layer
    *parents, name = path.split(".")
    for part in parents:
        parent = getattr(parent, part, None)
    return parent, name, getattr(parent, name, None) if parent is not None else None


def load_draft_adapter(model, path) -> int:
    """Put the PEFT adapter in `path` (linear_spec_lora/) on `model`'s layers, switched off.
    Its tensors are `...layers.<i>.<module path>.lora_A.weight` / `lora_B.weight`; returns how many
    layers it wraps. A file that matches no layer is an error, not a silent no-op."""
    path = Path(path)
    config = json.loads((path / "adapter_config.json").read_text())
    try:
        scale = float(config["lora_alpha"]) / int(config["r"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        raise ValueError(
            f"{path / 'adapter_config.json'} needs PEFT's r (> 0) and lora_alpha"
        ) from None
    weights = mx.load(str(path / "adapter_model.safetensors"))
    pairs = {}
    for key, value in weights.items():
        for part in ("lora_A", "lora_B"):
            marker = f".{part}."
            if marker in key and ".layers." in key:
                where = key.split(".layers.", 1)[1].split(marker)[0]  # "<i>.<module path>"
                index, module = where.split(".", 1)
                pairs.setdefault((int(index), module), {})[part] = value
    wrapped = 0
    for (index, module), ab in sorted(pairs.items()):
        if index >= len(model.layers) or set(ab) != {"lora_A", "lora_B"}:
            raise ValueError(f"{path}: adapter tensors for layer {index} {module} do not fit")
        parent, name, base = _layer_module(model.layers[index], module)
        if base is None:
            raise ValueError(f"{path}: the model has no layers.{index}.{module} to adapt")
        setattr(parent, name, DraftLoRALinear(base, ab["lora_A"], ab["lora_B"], scale))
        wrapped += 1
    if not wrapped:
        raise ValueError(f"{path}: adapter_model.safetensors holds no lora_A / lora_B tensors")
    return wrapped


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.encoder = Encoder(args)
        if not args.tie_word_embeddings:
            self.diffusion_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def embed(self, inputs: mx.array) -> mx.array:
        """Token embeddings (the VLM's subclass also reads image feature ids here)."""
        return self.encoder.embed_tokens(inputs)

    def __call__(self, inputs: mx.array, cache=None, mask=None, head_span=None) -> mx.array:
        h = self.embed(inputs)
        if cache is None:
            cache = [None] * len(self.layers)
        offset = 0 if cache[0] is None else cache[0].offset
        if mask is None and _is_mlx_lm_cache(cache[0]):
            mask = "causal"
        if isinstance(mask, str):
            if mask != "causal":
                raise ValueError(f"mask must be None, 'causal' or an array, got {mask!r}")
            # mlx-lm's helper: None for one row, and the batch caches' left-padding masks.
            mask = create_attention_mask(h, cache[0])

        rope = self.args.rope_parameters
        q_scale = query_scale(
            inputs.shape[1],
            offset,
            rope["llama_4_scaling_beta"],
            rope["original_max_position_embeddings"],
        ).astype(h.dtype)
        h = run_layers(self.layers, h, cache, mask, q_scale)
        head = None if self.args.tie_word_embeddings else self.diffusion_head
        return project(h, head_span, self.encoder.norm, self.encoder.embed_tokens, head)

    def sanitize(self, weights):
        weights = {
            k: v
            for k, v in drop_unused_buffers(weights).items()
            if not k.endswith((".self_attn.k_scale", ".self_attn.v_scale"))
        }
        drop_tied_head(weights, _NAME, self.args.tie_word_embeddings, "diffusion_head.weight")
        # FP8 checkpoints: ministral3 folds weight_scale_inv into the weights.
        weights = ministral3.Model.sanitize(self, weights)
        layout = "the HF layout encoder.* and diffusion_head.weight"
        keys = "num_hidden_layers, vocab_size, hidden_size, intermediate_size, head_dim, heads"
        return check_weights(self, weights, _NAME, layout, keys)

    @property
    def layers(self):
        return self.encoder.layers

    def load_draft_adapter(self, path) -> int:
        """The checkpoint's `linear_spec_lora` draft adapter (see `load_draft_adapter`)."""
        return load_draft_adapter(self, path)

    def draft_adapters(self):
        return [m for _, m in self.named_modules() if isinstance(m, DraftLoRALinear)]

    @property
    def has_draft_adapter(self) -> bool:
        return bool(self.draft_adapters())

    def set_draft_adapter(self, active: bool):
        """Switch the draft adapter on (self-speculation's draft forwards) or off (everything
        else: AR, verification, diffusion mode)."""
        for m in self.draft_adapters():
            m.active = active

    def shard(self, group: Optional[mx.distributed.Group] = None):
        """mlx-lm's ministral3.Model.shard over `encoder.layers`: attention heads and MLP split
        over `group`. The embedding and the diffusion head (tied or not) stay replicated, so both
        attention modes and the AR head read the same full logits on every rank."""
        group = sharding.checked_gqa_group(self, group, _NAME, "intermediate_size")
        for layer in self.layers:
            sharding.shard_attention(layer.self_attn, group)
            sharding.shard_mlp(layer.mlp, group)

    @cached_spec
    def diffusion_spec(self) -> DiffusionSpec:
        a = self.args
        return build_spec(
            a,
            FAMILY,
            CAUSAL_PREFIX,
            "set mask_token_id (100 in NVIDIA's checkpoints; -1 counts as none), or use the "
            "checkpoint as an AR model with mlx_lm.generate.",
            confidence="raw",
            quota_base="masks",
            # Diffusion mode is confidence-thresholded unmasking at 0.9: NVlabs/Nemotron-Labs-
            # Diffusion's README ("dlm: block-diffusion sampling with confidence-thresholded
            # unmasking"), vLLM's nemotron_dllm sampler (confidence_threshold=0.9), the mlx-vlm
            # and dllm ports. The remote code's generate defaults to threshold=None, one token a
            # step: sampler="quota". Blocks are block_size, one step per position at most.
            eos_ends_block=True,  # generate breaks a block's steps at an EOS with no mask before
            defaults={
                "block_length": a.block_size,
                "sampler": "threshold",
                "threshold": 0.9,
                "temperature": 0.0,
                "max_tokens": 128,
                "mode": "diffusion",
                # generate_diffusion's default (chat_utils' own default is False).
                "causal_context": True,
            },
            trained_block_length=a.block_size,
            vocab_size=a.vocab_size,  # range of end_think_token_id
            settings=SETTINGS,
        )
