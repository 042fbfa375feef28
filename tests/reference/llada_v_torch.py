"""Independent torch reference for LLaDA-V (tests only), transcribed from ML-GSAI/LLaDA-V's train/llava.

* `image_features(ckpt, pixel_values)`: one image given as a single tile, as
  `prepare_inputs_labels_for_multimodal` reads it: the SigLIP tower (transformers'
  `SiglipVisionModel`, built with the checkpoint's layer count plus the one siglip_encoder.py deletes,
  which it then deletes, with the head replaced by Identity) -> `hidden_states[-1]` (the last kept
  layer, before post_layernorm) -> `mm_projector` (`mlp2x_gelu`: Linear, nn.GELU(), Linear) -> the
  single-image branch of `spatial_unpad`: the 729-style patch features then `image_newline`.
  Returned as (tower features, projector output, image features).
* `logits(ckpt, embeds)`: `LlavaLLaDAModelLM` over `inputs_embeds`: LLaDA-V's Llama-named body with
  `is_causal = False` (transformers' `LlamaForCausalLM` under an all-zeros 4-D additive mask, eager).
* `embed_prompt(ckpt, ids_before, features, ids_after)`: what `prepare_inputs_labels_for_multimodal`
  builds for one image: the text embeddings with the image features between them.
* `generate_with_embeds(...)`: `LLaDAModelLM.generate_with_embeds` at temperature 0 with
  low_confidence remasking, the logits of the four suppressed ids -inf at masks, stopping at
  `stop_ids` (its stopping_criteria) and returning the tokens before the stop (no suffix, no cfg).
"""

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

_MODELS = {}


def _read(ckpt):
    from safetensors.numpy import load_file

    path = Path(ckpt)
    config = json.loads((path / "config.json").read_text())
    return config, load_file(str(path / "model.safetensors"))


def _tensor(v):
    return torch.from_numpy(np.asarray(v, dtype=np.float32))


def vision_path(config, w, hidden):
    """The vision path of a LLaVA-style checkpoint (LLaDA-V's, LaViDa's): the SigLIP tower, the
    mm_projector into the language model's width `hidden`, and the image newline."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    v = config["vision_tower_config"]
    vcfg = SiglipVisionConfig(
        hidden_size=v["hidden_size"],
        intermediate_size=v["intermediate_size"],
        num_hidden_layers=v["num_hidden_layers"],
        num_attention_heads=v["num_attention_heads"],
        image_size=v["image_size"],
        patch_size=v["patch_size"],
        layer_norm_eps=v["layer_norm_eps"],
        hidden_act="gelu_pytorch_tanh",
        attn_implementation="eager",
    )
    tower = SiglipVisionModel(vcfg)
    # transformers 5 keeps the transformer at the top (no `vision_model` level); the checkpoint
    # names it as LLaDA-V's SigLipVisionModel does (`vision_model.*`).
    body = getattr(tower, "vision_model", tower)
    # siglip_encoder.py's load_model: the last layer and the pooling head go.
    del body.encoder.layers[-1:]
    body.head = torch.nn.Identity()
    prefix = "model.vision_tower.vision_tower."
    if body is tower:
        prefix += "vision_model."
    state = {k[len(prefix) :]: _tensor(x) for k, x in w.items() if k.startswith(prefix)}
    missing, unexpected = tower.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all("position_ids" in k or ".head." in k for k in missing), missing
    tower.eval()
    H, mm = hidden, config["mm_hidden_size"]
    projector = torch.nn.Sequential(torch.nn.Linear(mm, H), torch.nn.GELU(), torch.nn.Linear(H, H))
    projector.load_state_dict(
        {k[len("model.mm_projector.") :]: _tensor(x) for k, x in w.items() if "mm_projector" in k}
    )
    return tower, projector, _tensor(w["model.image_newline"])


def _build(ckpt):
    from transformers import LlamaConfig, LlamaForCausalLM

    config, w = _read(ckpt)
    H = config["hidden_size"]
    tower, projector, newline = vision_path(config, w, H)

    lcfg = LlamaConfig(
        vocab_size=config["vocab_size"],
        hidden_size=H,
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        head_dim=H // config["num_attention_heads"],
        rms_norm_eps=config["rms_norm_eps"],
        rope_parameters={"rope_type": "default", "rope_theta": config["rope_theta"]},
        max_position_embeddings=config["max_position_embeddings"],
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        attn_implementation="eager",
    )
    lm = LlamaForCausalLM(lcfg)
    lm.load_state_dict(
        {
            k: _tensor(x)
            for k, x in w.items()
            if k.startswith(("model.layers", "model.embed", "model.norm", "lm_head"))
        },
        strict=True,
    )
    return config, tower, projector, newline, lm.eval()


def load(ckpt):
    key = str(Path(ckpt).resolve())
    if key not in _MODELS:
        _MODELS[key] = _build(ckpt)
    return _MODELS[key]


@torch.no_grad()
def image_features(ckpt, pixel_values):
    """pixel_values (1, 3, S, S) -> (tower features, projector output, image features), numpy."""
    _, tower, projector, newline, _ = load(ckpt)
    x = torch.as_tensor(np.asarray(pixel_values, dtype=np.float32))
    out = tower(x, output_hidden_states=True)
    feats = out.hidden_states[-1]
    projected = projector(feats)
    image = torch.cat([projected[0], newline[None]], dim=0)  # the single-image spatial_unpad branch
    return feats.numpy(), projected.numpy(), image.numpy()


def embed_prompt(ckpt, ids_before, features, ids_after):
    return spliced_embeds(load(ckpt)[4], ids_before, features, ids_after)


@torch.no_grad()
def spliced_embeds(lm, ids_before, features, ids_after):
    """(1, L, H) inputs_embeds of a LLaVA-style prompt: the language model `lm`'s embeddings of
    the ids before and after an image with the image's features between them."""
    emb = lm.model.embed_tokens
    parts = [
        emb(torch.tensor(ids_before, dtype=torch.long)),
        torch.as_tensor(np.asarray(features, dtype=np.float32)),
        emb(torch.tensor(ids_after, dtype=torch.long)),
    ]
    return torch.cat(parts, dim=0)[None]


@torch.no_grad()
def logits(ckpt, embeds):
    _, _, _, _, lm = load(ckpt)
    embeds = torch.as_tensor(embeds)
    B, L, _ = embeds.shape
    mask = torch.zeros(B, 1, L, L, dtype=torch.float32)  # is_causal = False: every key
    return lm(inputs_embeds=embeds, attention_mask=mask).logits.float()


@torch.no_grad()
def generate_with_embeds(
    ckpt, inputs_embeds, *, steps, gen_length, block_length, mask_id, suppressed, stop_ids
):
    """Transcription of generate_with_embeds (temperature 0, low_confidence, cfg 0, no suffix)."""
    _, _, _, _, lm = load(ckpt)
    emb = lm.model.embed_tokens
    P = inputs_embeds.shape[1]
    total = P + gen_length
    masked_embed = emb(torch.tensor([mask_id]))
    x_embeds = masked_embed.repeat(1, total, 1)
    x_embeds[:, :P] = inputs_embeds.clone()
    x = torch.full((1, total), mask_id, dtype=torch.long)
    assert gen_length % block_length == 0
    num_blocks = gen_length // block_length
    assert steps % num_blocks == 0
    steps = steps // num_blocks
    stop_position, found = P + gen_length, False
    for b in range(num_blocks):
        start, end = P + b * block_length, P + (b + 1) * block_length
        if found and stop_position <= start:
            break
        block_mask = torch.all(torch.abs(x_embeds[:, start:end] - masked_embed) < 1e-5, dim=2)
        mask_num = block_mask.sum(dim=1, keepdim=True)
        quota = (mask_num // steps).expand(-1, steps).clone()
        quota[torch.arange(steps)[None] < mask_num % steps] += 1
        for i in range(steps):
            mask_index = torch.all(torch.abs(x_embeds - masked_embed) < 1e-5, dim=2)
            if found and not mask_index[0, P:stop_position].any():
                break
            if not mask_index[0, start:end].any():
                break
            out = logits(ckpt, x_embeds)
            for t in suppressed:
                out[:, :, t] = torch.where(mask_index, -float("inf"), out[:, :, t])
            x0 = torch.argmax(out, dim=-1)
            p = F.softmax(out.to(torch.float64), dim=-1)
            x0_p = torch.gather(p, -1, x0[..., None])[..., 0]
            if found:
                x0_p[:, stop_position:] = -np.inf
            else:
                x0_p[:, end:] = -np.inf
            x0_embeds = torch.where(mask_index[..., None], emb(x0), x_embeds)
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, torch.tensor(-np.inf, dtype=torch.float64))
            transfer = torch.zeros_like(x0, dtype=torch.bool)
            _, idx = torch.topk(confidence[0], k=int(quota[0, i]))
            transfer[0, idx] = True
            x_embeds[transfer] = x0_embeds[transfer]
            x[transfer] = x0[transfer]
            generated = x[0, P : P + gen_length]
            for s in range(generated.shape[0]):
                if int(generated[s]) in stop_ids:
                    if not found or P + s < stop_position:
                        stop_position, found = P + s, True
                    break
    return x[0, P:stop_position].tolist()


# --- anyres (mm_utils.process_anyres_image, llava_arch's spatial_unpad / anyres_max packing) ---


def _preprocess(image, size):
    """SigLipImageProcessor.preprocess with PIL and numpy: bicubic resize, /255, (x - .5) / .5."""
    from PIL import Image

    x = np.asarray(image.convert("RGB").resize((size, size), Image.BICUBIC), dtype=np.float64)
    return ((x / 255 - 0.5) / 0.5).transpose(2, 0, 1)


def select_best_resolution(original_size, possible_resolutions):
    original_width, original_height = original_size
    best_fit, max_effective, min_wasted = None, 0, float("inf")
    for width, height in possible_resolutions:
        scale = min(width / original_width, height / original_height)
        dw, dh = int(original_width * scale), int(original_height * scale)
        effective = min(dw * dh, original_width * original_height)
        wasted = width * height - effective
        if effective > max_effective or (effective == max_effective and wasted < min_wasted):
            max_effective, min_wasted, best_fit = effective, wasted, (width, height)
    return best_fit


def process_anyres_image(image, size, grid_pinpoints):
    """(tiles, 3, size, size) float64: the resized image, then the padded image's tiles."""
    import math

    from PIL import Image

    best = select_best_resolution(image.size, grid_pinpoints)
    ow, oh = image.size
    tw, th = best
    if tw / ow < th / oh:
        nw, nh = tw, min(math.ceil(oh * tw / ow), th)
    else:
        nh, nw = th, min(math.ceil(ow * th / oh), tw)
    padded = Image.new("RGB", (tw, th), (0, 0, 0))
    padded.paste(image.resize((nw, nh)), ((tw - nw) // 2, (th - nh) // 2))
    patches = []
    for i in range(0, th, size):
        for j in range(0, tw, size):
            patches.append(padded.crop((j, i, j + size, i + size)))
    tiles = [image.resize((size, size))] + patches
    return np.stack([_preprocess(t, size) for t in tiles])


def unpad_image(tensor, original_size):
    original_width, original_height = original_size
    current_height, current_width = tensor.shape[1:]
    if original_width / original_height > current_width / current_height:
        new_height = int(original_height * (current_width / original_width))
        padding = (current_height - new_height) // 2
        return tensor[:, padding : current_height - padding, :]
    new_width = int(original_width * (current_height / original_height))
    padding = (current_width - new_width) // 2
    return tensor[:, :, padding : current_width - padding]


@torch.no_grad()
def anyres_image_features(ckpt, pixel_values, image_size_wh):
    """The features prepare_inputs_labels_for_multimodal builds for one anyres image (base tile
    first), with config.json's image_aspect_ratio anyres_max_N and spatial_unpad."""
    import math
    import re

    config, tower, projector, newline, _ = load(ckpt)
    x = torch.as_tensor(np.asarray(pixel_values, dtype=np.float32))
    feats = projector(tower(x, output_hidden_states=True).hidden_states[-1])
    base, tiles = feats[0], feats[1:]
    side = (
        config["vision_tower_config"]["image_size"] // config["vision_tower_config"]["patch_size"]
    )
    tile = config["vision_tower_config"]["image_size"]
    w, h = select_best_resolution(image_size_wh, config["image_grid_pinpoints"])
    npw, nph = w // tile, h // tile
    max_num = int(re.match(r"anyres_max_(\d+)", config["image_aspect_ratio"]).group(1))
    t = tiles.view(nph, npw, side, side, -1)
    unit = t.shape[2]
    t = t.permute(4, 0, 2, 1, 3).contiguous().flatten(1, 2).flatten(2, 3)
    t = unpad_image(t, image_size_wh)
    c, hh, ww = t.shape
    times = math.sqrt(hh * ww / (max_num * unit**2))
    if times > 1.1:
        t = F.interpolate(t[None], [int(hh // times), int(ww // times)], mode="bilinear")[0]
    t = torch.cat((t, newline[:, None, None].expand(*t.shape[:-1], 1)), dim=-1)
    t = t.flatten(1, 2).transpose(0, 1)
    return torch.cat((base, t), dim=0).numpy()
