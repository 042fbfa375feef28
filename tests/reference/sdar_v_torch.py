"""Independent torch reference for SDAR-VL (tests only), transcribed from JetAstra/SDAR-VL @ cc77ef7a
`training/llama_factory_sdar/inference/sdar_v_8b/modeling_llava_onevision.py` (eval branch of
`LlavaOnevisionModel.forward`):

* `image_features(ckpt, pixel_values, image_size)`: `get_image_features` (the SigLIP tower,
  transformers' `SiglipVisionModel` as `AutoModel.from_config(vision_config)` builds it ->
  `hidden_states[vision_feature_layer]` -> `multi_modal_projector`: linear_1, exact GELU, linear_2)
  then `pack_image_features` with `image_newline` and `vision_aspect_ratio` (the remote file's copy
  is transformers' LlavaOnevisionModel.pack_image_features line for line; that one is called).
* `logits(ckpt, ids, features, keep)`: `inputs_embeds.masked_scatter` of the features where `ids`
  hold image_token_index, then the SDAR language model (Qwen3's math, modeling_sdar.py) under the
  caller's (L, L) keep mask as a 4-D additive one, positions 0..L-1, then lm_head.
* `forward(ckpt, features)`: that as the `forward(ids, keep)` of reference/sdar_generate.py, whose
  block_diffusion_generate is SDAR-VL's generate.py's (the same loop; generate.py also halts on a
  20-fold tail repetition, never reached here, and passes pixel_values only to the prefill, which
  holds the image whenever text follows it in a whole block).
"""

import functools
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

torch.set_num_threads(1)


def _tensor(v):
    return torch.from_numpy(np.asarray(v, dtype=np.float32))


@functools.lru_cache(maxsize=2)
def load(ckpt):
    from safetensors.numpy import load_file
    from transformers import Qwen3Config, Qwen3ForCausalLM, SiglipVisionConfig, SiglipVisionModel

    path = Path(ckpt)
    cfg = json.loads((path / "config.json").read_text())
    w = load_file(str(path / "model.safetensors"))
    t = cfg["text_config"]
    keys = (
        "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads "
        "num_key_value_heads head_dim max_position_embeddings rms_norm_eps"
    ).split()
    text_cfg = Qwen3Config(
        **{k: t[k] for k in keys},
        tie_word_embeddings=cfg["tie_word_embeddings"],
        rope_parameters={"rope_type": "default", "rope_theta": t["rope_theta"]},
    )
    text_cfg._attn_implementation = "eager"
    text = Qwen3ForCausalLM(text_cfg).float().eval()
    prefix = "language_model."
    text.load_state_dict(
        {k[len(prefix) :]: _tensor(v) for k, v in w.items() if k.startswith(prefix)}
    )

    v = dict(cfg["vision_config"])
    v.pop("model_type", None)
    v.pop("vision_use_head", None)
    tower = SiglipVisionModel(SiglipVisionConfig(**v, attn_implementation="eager")).eval()
    body = getattr(tower, "vision_model", tower)
    body.head = torch.nn.Identity()  # vision_use_head False: no pooling head
    prefix = "vision_tower." if body is not tower else "vision_tower.vision_model."
    state = {k[len(prefix) :]: _tensor(x) for k, x in w.items() if k.startswith(prefix)}
    missing, unexpected = tower.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all("position_ids" in k or ".head." in k for k in missing), missing
    d, H = v["hidden_size"], t["hidden_size"]
    projector = torch.nn.Sequential(torch.nn.Linear(d, H), torch.nn.GELU(), torch.nn.Linear(H, H))
    m = "multi_modal_projector.linear_"
    projector.load_state_dict(
        {
            f"{0 if k[len(m)] == '1' else 2}.{k[len(m) + 2 :]}": _tensor(x)
            for k, x in w.items()
            if k.startswith(m)
        }
    )
    return SimpleNamespace(
        cfg=cfg, text=text, tower=tower, projector=projector, newline=_tensor(w["image_newline"])
    )


@torch.no_grad()
def image_features(ckpt, pixel_values, image_size):
    """(n, hidden) packed features of one image: `pixel_values` (tiles, 3, S, S), `image_size`
    (height, width)."""
    from transformers.models.llava_onevision.modeling_llava_onevision import (
        LlavaOnevisionModel,
    )

    r = load(str(ckpt))
    cfg = r.cfg
    out = r.tower(_tensor(pixel_values), output_hidden_states=True)
    selected = out.hidden_states[cfg["vision_feature_layer"]]
    feats = r.projector(selected)
    owner = SimpleNamespace(
        config=SimpleNamespace(
            vision_config=SimpleNamespace(**cfg["vision_config"]),
            image_grid_pinpoints=cfg["image_grid_pinpoints"],
        )
    )
    packed, _ = LlavaOnevisionModel.pack_image_features(
        owner,
        [feats],
        torch.tensor([list(image_size)]),
        image_newline=r.newline,
        vision_aspect_ratio=cfg["vision_aspect_ratio"],
    )
    # The remote copy concatenates the images' features; transformers 5 returns them as a list.
    return torch.cat(list(packed), dim=0) if isinstance(packed, (list, tuple)) else packed


@torch.no_grad()
def logits(ckpt, ids, features, keep):
    """float32 logits (1, L, V) of `ids` (image_token_index where the features go) under `keep`."""
    r = load(str(ckpt))
    x = torch.as_tensor(np.asarray(ids)).long().reshape(1, -1)
    embeds = r.text.get_input_embeddings()(x)
    if features is not None:
        where = (x == r.cfg["image_token_index"]).unsqueeze(-1).expand_as(embeds)
        assert int(where[..., 0].sum()) == features.shape[0]
        embeds = embeds.masked_scatter(where, features.to(embeds.dtype))
    L = x.shape[1]
    additive = torch.zeros(1, 1, L, L).masked_fill(~keep, torch.finfo(torch.float32).min)
    out = r.text(
        inputs_embeds=embeds,
        attention_mask=additive,
        position_ids=torch.arange(L)[None],
        use_cache=False,
    )
    return out.logits.float()


def forward(ckpt, features):
    """reference/sdar_generate.py's `forward(ids, keep)` over prompts holding one image."""
    return lambda ids, keep: logits(ckpt, ids, features, keep)


def reference_logits(ckpt, input_ids, causal=False):
    """float32 logits (B, L, V) of text-only ids under every key (or the causal reading)."""
    x = np.asarray(input_ids)
    L = x.shape[1]
    keep = torch.ones(L, L, dtype=torch.bool)
    keep = (torch.tril(keep) if causal else keep)[None, None]
    return np.concatenate([logits(ckpt, row, None, keep).numpy() for row in x])
