"""What the references that run transformers' model of a family's body share: its forward over
token ids under a keep mask given explicitly (a 4-D additive mask, which transformers hands to
eager attention as it is), at positions 0..L-1, without a cache."""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file


def keys_in_view(length, causal=False):
    """(L, L) bool: every key, or the causal reading (the AR body's own, which a masked-diffusion
    family reading every key must not match)."""
    keep = torch.ones(length, length, dtype=torch.bool)
    return torch.tril(keep) if causal else keep


def logits_under(model, x, keep):
    """Float32 logits (B, L, V) of ids `x` (B, L) under `keep`, (L, L) or (B, 1, L, L)."""
    B, L = x.shape
    additive = torch.zeros(B, 1, L, L).masked_fill(~keep, torch.finfo(torch.float32).min)
    with torch.no_grad():
        out = model(
            input_ids=x,
            attention_mask=additive,
            position_ids=torch.arange(L).expand(B, L),
            use_cache=False,
        )
    return out.logits.float()


# config.json keys that transformers' dense decoder configs (Llama, Qwen2) take as they are.
BODY_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
)


def build_body(config_cls, model_cls, ckpt, keys=(), strict=True, **fields):
    """transformers' `model_cls` (eager attention, float32) of the checkpoint's config.json (its
    BODY_KEYS and `keys`, RoPE from rope_theta, then `fields`) with the checkpoint's weights
    (`strict=False`: a tied head is the embedding's)."""
    cfg = json.loads((Path(ckpt) / "config.json").read_text())
    config = config_cls(
        **{k: cfg[k] for k in BODY_KEYS + tuple(keys)},
        rope_parameters={"rope_type": "default", "rope_theta": cfg["rope_theta"]},
        **fields,
    )
    config._attn_implementation = "eager"
    model = model_cls(config).float().eval()
    state = {}
    for f in sorted(Path(ckpt).glob("*.safetensors")):
        state.update(load_file(str(f)))
    model.load_state_dict(state, strict=strict)
    return model
