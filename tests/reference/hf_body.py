"""What the torch references of the families with a transformers body share: transformers' own
model of that body over a checkpoint's weights, and its float32 forward over token ids at
positions 0..L-1, without a cache, under a keep mask given explicitly (a 4-D additive mask, which
transformers hands to eager attention as it is). A diffusion checkpoint's config.json names a
model_type transformers does not know, so the body is either loaded under the config relabelled as
the body's, or built from the config's sizes."""

import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file


def load_relabelled(ckpt, fields, drop=()):
    """transformers' model (eager attention, float32, eval mode) of the checkpoint `ckpt`: its
    weights under its config.json without the keys `drop`, with `fields` set (model_type,
    architectures, ...; or a function of the config that returns them)."""
    from transformers import AutoModelForCausalLM

    ckpt = Path(ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    if callable(fields):
        fields = fields(cfg)
    cfg = {k: v for k, v in cfg.items() if k not in drop}
    cfg.update(fields)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(cfg))
        for f in ckpt.glob("*.safetensors*"):  # a sharded checkpoint's index too
            (Path(tmp) / f.name).symlink_to(f.resolve())
        model = AutoModelForCausalLM.from_pretrained(
            tmp, attn_implementation="eager", dtype=torch.float32
        )
    return model.eval()


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


def checkpoint_state(ckpt):
    """The torch tensors of every safetensors file of the checkpoint `ckpt`, by name."""
    state = {}
    for f in sorted(Path(ckpt).glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


def body_from(config_cls, model_cls, cfg, state, keys=BODY_KEYS, strict=True, **fields):
    """(transformers' `model_cls` (eager attention, float32, eval mode) of the config dict `cfg`'s
    `keys`, RoPE from rope_theta, then `fields`, holding the weights `state`; load_state_dict's
    (missing, unexpected) keys, which `strict` refuses)."""
    config = config_cls(
        **{k: cfg[k] for k in keys},
        rope_parameters={"rope_type": "default", "rope_theta": cfg["rope_theta"]},
        **fields,
    )
    config._attn_implementation = "eager"
    model = model_cls(config).float().eval()
    return model, model.load_state_dict(state, strict=strict)


def build_body(config_cls, model_cls, ckpt, keys=(), strict=True, **fields):
    """body_from of the checkpoint's config.json (its BODY_KEYS and `keys`) and weights
    (`strict=False`: a tied head is the embedding's)."""
    cfg = json.loads((Path(ckpt) / "config.json").read_text())
    state = checkpoint_state(ckpt)
    return body_from(config_cls, model_cls, cfg, state, BODY_KEYS + tuple(keys), strict, **fields)[
        0
    ]


def qwen2_model(ckpt):
    """qwen2_from of a checkpoint's config.json and safetensors."""
    return qwen2_from(json.loads((Path(ckpt) / "config.json").read_text()), checkpoint_state(ckpt))


def qwen2_from(cfg, state):
    """transformers' Qwen2 (eager attention, float32, eval mode) of the sizes the config `cfg`
    gives, without sliding windows, holding the weights `state` (a tied head reads the
    embedding)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tied = cfg.get("tie_word_embeddings", False)
    keys = tuple(k for k in BODY_KEYS if k != "tie_word_embeddings")
    model, (missing, unexpected) = body_from(
        Qwen2Config,
        Qwen2ForCausalLM,
        cfg,
        state,
        keys,
        strict=False,
        hidden_act=cfg.get("hidden_act", "silu"),
        tie_word_embeddings=tied,
        use_sliding_window=False,
    )
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if tied else set()), missing
    if tied:
        model.tie_weights()
    return model


def keys_in_view(length, causal=False):
    """(L, L) bool: every key, or the causal reading (the AR body's own, which a masked-diffusion
    family reading every key must not match)."""
    keep = torch.ones(length, length, dtype=torch.bool)
    return torch.tril(keep) if causal else keep


def logits_under(model, x, keep):
    """Float32 logits (B, L, V) of ids `x` (B, L) under the bool `keep` (True: attended), (L, L)
    or (B, 1, L, L); masked out as transformers' _prepare_4d_attention_mask writes it: the dtype's
    minimum."""
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


def body_logits(model, x, causal=False):
    """logits_under with every key attended (the bidirectional reading), or causally."""
    return logits_under(model, x, keys_in_view(x.shape[1], causal))
