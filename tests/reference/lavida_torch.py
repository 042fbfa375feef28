"""Independent torch reference for LaViDa-LLaDA (tests only), transcribed from jacklishufan/LaViDa.

* `image_features(ckpt, pixel_values, image_size_wh)`: `prepare_inputs_labels_for_multimodal` for
  one anyres image (base tile first), image_aspect_ratio "anyres", spatial_unpad: the SigLIP tower
  (transformers' `SiglipVisionModel`, its last layer deleted and its head an Identity, as
  siglip_encoder.py's load_model does) -> `hidden_states[-1]` -> `mm_projector` (mlp2x_gelu) ->
  `get_2dPool` of every tile (ALWASY_DO_2DPOOL; bilinear: F.interpolate to ceil(side / 2);
  average: avg_pool2d 2) -> the base tile's pooled features, then the tiles' grid unpadded to the
  image's aspect (unpad_image with the PIL (width, height)), a newline per row. Returned with the
  tower features and the projector output.
* `embed_prompt(ckpt, ids_before, features, ids_after)`: the prompt's inputs_embeds.
* `prefix_cache(ckpt, embeds)` / `answer_logits(ckpt, cache, ids)`: LLaDAModel's forward with
  prefix_lm: the prompt alone (use_cache=True), then the answer's embeddings against a copy of its
  K/V at positions after it, attending to every key (its SDPA runs with no mask). The body is LLaDA
  8B's Llama block under OLMo names: transformers' `LlamaForCausalLM` on renamed weights, with an
  explicit all-zeros 4-D additive mask (eager attention uses it as given).
* LaViDa-Dream (`model_type` llava_dream): the same vision path; the language model is Dream's
  (transformers' `Qwen2ForCausalLM`, q/k/v biases, under the same all-zeros mask), whose
  `DreamPrefixLMCache` keeps the prompt's K/V as the prefill left them (never extended).
  `dream_generate(...)`: dream/generation_utils.py's `_sample` with prefix_lm=True at temperature 0
  (top_p None): the prefill's last logit's argmax seeds the answer's first column, then `steps`
  forwards of the answer against the cache, logits shifted right by one
  (`cat([logits[:, :1], logits[:, :-1]])`), Dream's quota int(masks * (1 - s / t)) (all the masks
  at the last step) over timesteps linspace(1, eps, steps + 1), confidence by `alg`
  (maskgit_plus: the top probability; topk_margin: top1 - top2; entropy: sum p log(p + 1e-10)).
* prefix_lm=False (`full_logits`, the `prefix_lm` argument of both generates): every step one
  forward over [prompt; answer] attending everywhere, no cache, no seed (Dream's answer's first
  column is then predicted from the prompt's last hidden state).
* `generate(...)`: llada/generate.py's `generate` with prefix_lm=True at temperature 0 (greedy),
  low_confidence remasking, schedule None (get_num_transfer_tokens) or shift / logit_normal /
  linear (getnum_transfer_tokens_sch), cfg 0:
  steps = max_new_tokens split over the blocks (or step_per_block / step_ratio), x0_p past the
  block -inf. Returns the answer's tokens (the whole canvas; the caller cuts at its stop ids).
"""

import copy
import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .hf_body import qwen2_from
from .llada_torch import olmo_llama
from .llada_v_torch import select_best_resolution, spliced_embeds, unpad_image, vision_path

_MODELS = {}


def _tensor(v):
    return torch.from_numpy(np.asarray(v, dtype=np.float32))


def _dream_language_model(config, w):
    names = ("model.layers", "model.embed_tokens", "model.norm", "lm_head")
    state = {k: _tensor(v) for k, v in w.items() if k.startswith(names)}
    return qwen2_from(dict(config, tie_word_embeddings=False), state)


def load(ckpt):
    key = str(Path(ckpt).resolve())
    if key not in _MODELS:
        from safetensors.numpy import load_file

        path = Path(ckpt)
        config = json.loads((path / "config.json").read_text())
        w = load_file(str(path / "model.safetensors"))
        dream = config["model_type"] == "llava_dream"
        if dream:
            lm = _dream_language_model(config, w)
        else:  # LLaDA 8B's OLMo-named language model
            names = {k: v for k, v in w.items() if k.startswith("model.transformer.")}
            lm = olmo_llama(config, names)[0]
        vision = vision_path(config, w, config["hidden_size" if dream else "d_model"])
        _MODELS[key] = (config, *vision, lm)
    return _MODELS[key]


def _pool(feats, side, mode):
    """llava_arch.get_2dPool with stride 2 over (tiles, side * side, C)."""
    n, _, dim = feats.shape
    x = feats.view(n, side, side, -1).permute(0, 3, 1, 2).contiguous()
    if mode == "average":
        x = F.avg_pool2d(x, 2)
    elif mode == "bilinear":
        x = F.interpolate(x, size=[math.ceil(side / 2), math.ceil(side / 2)], mode="bilinear")
    else:
        raise ValueError(mode)
    return x.permute(0, 2, 3, 1).reshape(n, -1, dim)


@torch.no_grad()
def image_features(ckpt, pixel_values, image_size_wh):
    """(tower features, projector output, packed image features), numpy."""
    config, tower, projector, newline, _ = load(ckpt)
    x = torch.as_tensor(np.asarray(pixel_values, dtype=np.float32))
    feats = tower(x, output_hidden_states=True).hidden_states[-1]
    projected = projector(feats)
    v = config["vision_tower_config"]
    pooled = _pool(projected, v["image_size"] // v["patch_size"], config["mm_spatial_pool_mode"])
    base, tiles = pooled[0], pooled[1:]
    side = int(np.sqrt(base.shape[0]))
    if tiles.shape[0] == 0:  # one tile: the features and the newline
        return feats.numpy(), projected.numpy(), torch.cat([base, newline[None]]).numpy()
    w, h = select_best_resolution(image_size_wh, config["image_grid_pinpoints"])
    npw, nph = w // v["image_size"], h // v["image_size"]
    t = tiles.view(nph, npw, side, side, -1)
    t = t.permute(4, 0, 2, 1, 3).contiguous().flatten(1, 2).flatten(2, 3)
    t = unpad_image(t, image_size_wh)
    t = torch.cat((t, newline[:, None, None].expand(*t.shape[:-1], 1)), dim=-1)
    t = t.flatten(1, 2).transpose(0, 1)
    return feats.numpy(), projected.numpy(), torch.cat((base, t), dim=0).numpy()


def embed_prompt(ckpt, ids_before, features, ids_after):
    return spliced_embeds(load(ckpt)[4], ids_before, features, ids_after)


@torch.no_grad()
def prefix_cache(ckpt, embeds, with_logits=False):
    """The prompt's K/V: LLaDAModel(None, input_embeddings=embeds, use_cache=True) (or Dream's
    forward_dream); with its logits when asked (Dream's seed)."""
    lm = load(ckpt)[4]
    B, P, _ = embeds.shape
    mask = torch.zeros(B, 1, P, P)
    out = lm(inputs_embeds=embeds, attention_mask=mask, use_cache=True)
    return (out.cache, out.logits.float()) if with_logits else out.cache


@torch.no_grad()
def answer_logits(ckpt, cache, ids):
    """Logits of the answer `ids` (B, L) against the prompt's K/V (a copy: the forward appends)."""
    lm = load(ckpt)[4]
    ids = torch.as_tensor(np.asarray(ids), dtype=torch.long)
    B, L = ids.shape
    P = cache.get_seq_length()
    mask = torch.zeros(B, 1, L, P + L)
    out = lm(
        inputs_embeds=lm.model.embed_tokens(ids),
        attention_mask=mask,
        cache=copy.deepcopy(cache),
        position_ids=torch.arange(P, P + L)[None],
        use_cache=True,
    )
    return out.logits.float()


@torch.no_grad()
def full_logits(ckpt, prompt_embeds, ids, shift=0):
    """prefix_lm=False: the answer's logits from one forward over [prompt; answer] attending
    everywhere (LLaDA's `model(None, input_embeddings=...)`, Dream's forward_dream with no cache),
    Dream's logits shifted right by one over the whole sequence (the answer's first column reads
    the prompt's last hidden state)."""
    lm = load(ckpt)[4]
    ids = torch.as_tensor(np.asarray(ids), dtype=torch.long)
    embeds = torch.cat([prompt_embeds, lm.model.embed_tokens(ids)], dim=1)
    B, T, _ = embeds.shape
    logits = lm(inputs_embeds=embeds, attention_mask=torch.zeros(B, 1, T, T)).logits.float()
    P = prompt_embeds.shape[1]
    return logits[:, P - shift : T - shift]


def _num_transfer_tokens(mask_index, steps):
    mask_num = mask_index.sum(dim=1, keepdim=True)
    num = torch.zeros(mask_num.size(0), steps, dtype=torch.int64) + mask_num // steps
    for i in range(mask_num.size(0)):
        num[i, : mask_num[i] % steps] += 1
    return num


def num_transfer_tokens_sch(mask_index, steps, schedule, shift):
    """getnum_transfer_tokens_sch for schedule shift / logit_normal / anything else (linear)."""
    mask_num = mask_index.sum(dim=1, keepdim=True)
    steps = int(min(steps, mask_num[0]))
    t = torch.linspace(0, 1, steps + 1)
    if schedule == "logit_normal":
        sigmas = 0.5 * (1 + torch.erf(torch.log(t / (1 - t)) / torch.sqrt(torch.tensor(2.0))))
    elif schedule == "shift":
        sigmas = shift * t / (1 + (shift - 1) * t)
    else:
        sigmas = t
    num = torch.zeros(mask_num.size(0), steps, dtype=torch.int64)
    for i in range(mask_num.size(0)):
        sample = (sigmas * mask_num[i]).to(torch.int64)
        sample = torch.clamp(sample[1:] - sample[:-1], 1, None)
        delta = sample.sum() - mask_num[i]
        assert delta >= 0
        j = 0
        while delta > 0:
            j = j % len(sample)
            if sample[j] == 1:
                j += 1
                continue
            delta -= 1
            sample[j] -= 1
            j += 1
        assert sample.sum() == mask_num[i]
        num[i] = sample
    return num.flip(-1)


@torch.no_grad()
def generate(
    ckpt,
    inputs_embeds,
    *,
    max_new_tokens,
    block_length,
    mask_id,
    step_per_block=None,
    step_ratio=None,
    schedule=None,
    shift=3,
    prefix_lm=True,
):
    """generate(..., prefix_lm=True, temperature=0, remasking='low_confidence'), with
    schedule=None (get_num_transfer_tokens) or a schedule (getnum_transfer_tokens_sch, its
    schedule_kwargs' shift)."""
    steps = max_new_tokens  # the reference ignores its `steps` argument
    gen_length = max_new_tokens
    cache = prefix_cache(ckpt, inputs_embeds) if prefix_lm else None
    bsz = inputs_embeds.shape[0]
    x = torch.full((bsz, gen_length), mask_id, dtype=torch.long)
    assert gen_length % block_length == 0
    num_blocks = gen_length // block_length
    assert steps % num_blocks == 0 or step_per_block is not None
    steps = steps // num_blocks
    if step_per_block:
        steps = min(step_per_block, block_length)
    if step_ratio:
        steps = int(steps * step_ratio)
    nfe = 0
    for b in range(num_blocks):
        lo, hi = b * block_length, (b + 1) * block_length
        block_masks = x[:, lo:hi] == mask_id
        if schedule is None:
            quota = _num_transfer_tokens(block_masks, steps)
        else:
            quota = num_transfer_tokens_sch(block_masks, steps, schedule, shift)
        for i in range(steps):
            mask_index = x == mask_id
            if mask_index[:, lo:hi].sum() == 0:
                continue
            if prefix_lm:
                logits = answer_logits(ckpt, cache, x)
            else:
                logits = full_logits(ckpt, inputs_embeds, x)
            nfe += 1
            x0 = torch.argmax(logits, dim=-1)
            p = F.softmax(logits.to(torch.float64), dim=-1)
            x0_p = torch.gather(p, -1, x0[..., None])[..., 0]
            x0_p[:, hi:] = -np.inf
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, -np.inf)
            transfer = torch.zeros_like(x0, dtype=torch.bool)
            for j in range(confidence.shape[0]):
                _, idx = torch.topk(confidence[j], k=int(quota[j, i]))
                transfer[j, idx] = True
            x[transfer] = x0[transfer]
    return x, nfe


@torch.no_grad()
def dream_generate(
    ckpt, inputs_embeds, *, max_new_tokens, steps, mask_id, alg, eps=1e-3, prefix_lm=True
):
    """LaViDa-Dream's `_sample(..., prefix_lm)` at temperature 0, top_p None, alg_temp 0."""
    steps = min(steps, max_new_tokens)
    x = torch.full((inputs_embeds.shape[0], max_new_tokens), mask_id, dtype=torch.long)
    if prefix_lm:
        cache, prefill = prefix_cache(ckpt, inputs_embeds, with_logits=True)
        x[:, :1] = prefill[:, -1:].argmax(dim=-1)
    timesteps = torch.linspace(1, eps, steps + 1)
    for i in range(steps):
        mask_index = x == mask_id
        if prefix_lm:
            logits = answer_logits(ckpt, cache, x)
            logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        else:
            logits = full_logits(ckpt, inputs_embeds, x, shift=1)
        probs = torch.softmax(logits[mask_index], dim=-1)
        confidence, x0 = probs.max(dim=-1)
        if alg == "topk_margin":
            top = torch.sort(probs, dim=-1, descending=True)[0]
            confidence = top[:, 0] - top[:, 1]
        elif alg == "entropy":
            confidence = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
        elif alg != "maskgit_plus":
            raise ValueError(alg)
        t, s = timesteps[i], timesteps[i + 1]
        masks = mask_index.sum()
        number = int(masks * (1 - s / t)) if i < steps - 1 else int(masks)
        if number > 0:
            _, transfer = torch.topk(confidence, number)
            x0_ = torch.full_like(x0, mask_id)
            x0_[transfer] = x0[transfer]
            x[mask_index] = x0_
    return x
