"""What the torch references of the families with a transformers body share: transformers' own
model of that body over a checkpoint's weights, and its float32 forward under an explicit additive
mask. A diffusion checkpoint's config.json names a model_type transformers does not know, so the
body is loaded under the config relabelled as the body's."""

import json
import tempfile
from pathlib import Path

import torch


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


def additive_mask(keep):
    """The additive float32 mask of the boolean `keep` (True: attended), as transformers'
    _prepare_4d_attention_mask writes it: 0 or the dtype's minimum."""
    return torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)


def masked_logits(model, x, additive):
    """float32 logits (B, L, V) of `x` at positions 0..L-1 under the additive (B, 1, L, L) mask."""
    B, L = x.shape
    with torch.no_grad():
        out = model(
            input_ids=x,
            attention_mask=additive,
            position_ids=torch.arange(L).expand(B, L),
            use_cache=False,
        )
    return out.logits.float()


def body_logits(model, x, causal=False):
    """masked_logits with every key attended (the bidirectional reading), or causally."""
    B, L = x.shape
    keep = torch.ones(B, 1, L, L, dtype=torch.bool)
    if causal:
        keep = keep & torch.tril(torch.ones(L, L, dtype=torch.bool))
    return masked_logits(model, x, additive_mask(keep))


def qwen2_model(ckpt):
    """qwen2_from of a checkpoint's config.json and safetensors."""
    from safetensors.torch import load_file

    ckpt = Path(ckpt)
    state = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return qwen2_from(json.loads((ckpt / "config.json").read_text()), state)


def qwen2_from(cfg, state):
    """transformers' Qwen2 (eager attention, float32, eval mode) of the sizes the config `cfg`
    gives, without sliding windows, holding the weights `state` (a tied head reads the
    embedding)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tied = cfg.get("tie_word_embeddings", False)
    qcfg = Qwen2Config(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        hidden_act=cfg.get("hidden_act", "silu"),
        max_position_embeddings=cfg["max_position_embeddings"],
        rms_norm_eps=cfg["rms_norm_eps"],
        rope_parameters={"rope_type": "default", "rope_theta": cfg["rope_theta"]},
        tie_word_embeddings=tied,
        use_sliding_window=False,
    )
    qcfg._attn_implementation = "eager"
    model = Qwen2ForCausalLM(qcfg).float().eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if tied else set()), missing
    if tied:
        model.tie_weights()
    return model
