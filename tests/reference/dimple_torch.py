"""Independent torch reference for Dimple (tests only), transcribed from yu-rp/Dimple
training-code/models/modeling_dimple.py and generation_utils.py (read with the code index).

* `vision(ckpt, pixel_values, grid_thw)`: DimpleVisionTransformerPretrainedModel.forward: the Conv3d
  patch embedding, the 2-D rotary table (`rot_pos_emb`), the window reordering (`get_window_index`),
  blocks attending within windows or, at `fullatt_block_indexes`, within the whole image (the eager
  attention's additive mask), the patch merger (RMSNorm, view by four, Linear, exact GELU, Linear)
  and the inverse reordering.
* `project(ckpt, features)`: DimpleMultiModalProjector (Linear, ACT2FN["silu"], Linear).
* `rope_index(ckpt, input_ids, grid_thw, attention_mask)`: DimpleModel.get_rope_index.
* `logits(ckpt, input_ids, pixel_values, grid_thw, attention_mask)`: DimpleModel.forward: text
  embeddings with the projected image features scattered at `image_token_id`, Dream's Qwen2 layers
  with apply_multimodal_rotary_pos_emb over the rope index, the full attention mask
  (full_attn_mask=True: pad x pad keep, plus the diagonal), RMSNorm, lm_head.
* `generate(...)`: DimpleGenerationMixin.diffusion_generate / _sample of one row at temperature 0
  (sample_tokens' argmax): decoding_pipeline "dim" (use_original_confidence: the model's own
  probabilities; alg maskgit_plus, entropy or autoregressive; alg_p_threshold; the loop ends when no mask is left)
  or "dream" (maskgit_plus on the top-p filtered probabilities, Dream's schedule); use_cache=False
  (every step over the whole sequence) or True (prepare_inputs_for_generation's prefilling: the
  first step's K/V of the prompt but its last column, cropped and kept; later steps run from that
  column at positions continuing past the images, `rope_deltas`).
"""

import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .dream_torch import top_p_logits  # Dimple's generation_utils copies Dream's

torch.set_num_threads(1)
_CACHE = {}


def _load(ckpt):
    key = str(ckpt)
    if key not in _CACHE:
        from safetensors.numpy import load_file

        path = Path(ckpt)
        cfg = json.loads((path / "config.json").read_text())
        w = {
            k: torch.from_numpy(np.array(v, dtype=np.float32))
            for k, v in load_file(str(path / "model.safetensors")).items()
        }
        _CACHE[key] = (cfg, w)
    return _CACHE[key]


def _rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


# ------------------------------------------------------------------------------------ vision


def _rot_pos_emb(grid_thw, head_dim, merge):
    pos_ids = []
    for t, h, w in grid_thw.tolist():
        hpos = torch.arange(h).unsqueeze(1).expand(-1, w)
        hpos = hpos.reshape(h // merge, merge, w // merge, merge).permute(0, 2, 1, 3).flatten()
        wpos = torch.arange(w).unsqueeze(0).expand(h, -1)
        wpos = wpos.reshape(h // merge, merge, w // merge, merge).permute(0, 2, 1, 3).flatten()
        pos_ids.append(torch.stack([hpos, wpos], dim=-1).repeat(t, 1))
    pos_ids = torch.cat(pos_ids, dim=0)
    dim = head_dim // 2  # DimpleVisionRotaryEmbedding(head_dim // 2)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    freqs = torch.outer(torch.arange(int(grid_thw[:, 1:].max()), dtype=torch.float), inv_freq)
    return freqs[pos_ids].flatten(1)


def _window_index(grid_thw, window_size, merge, patch):
    window_index, cu = [], [0]
    offset = 0
    win = window_size // merge // patch
    for t, h, w in grid_thw.tolist():
        lh, lw = h // merge, w // merge
        index = torch.arange(t * lh * lw).reshape(t, lh, lw)
        pad_h, pad_w = win - lh % win, win - lw % win
        nh, nw = (lh + pad_h) // win, (lw + pad_w) // win
        padded = F.pad(index, (0, pad_w, 0, pad_h), "constant", -100)
        padded = padded.reshape(t, nh, win, nw, win).permute(0, 1, 3, 2, 4)
        padded = padded.reshape(t, nh * nw, win, win)
        seqlens = (padded != -100).sum([2, 3]).reshape(-1)
        padded = padded.reshape(-1)
        window_index.append(padded[padded != -100] + offset)
        cu.extend((seqlens.cumsum(0) * merge * merge + cu[-1]).tolist())
        offset += t * lh * lw
    return torch.cat(window_index), cu


def _block_mask(n, cu):
    mask = torch.full([1, n, n], torch.finfo(torch.float32).min)
    for i in range(1, len(cu)):
        mask[..., cu[i - 1] : cu[i], cu[i - 1] : cu[i]] = 0
    return mask


def _vision_block(w, p, x, mask, cos, sin, heads):
    n = x.shape[0]
    h = _rms(x, w[p + "norm1.weight"], 1e-6)
    qkv = F.linear(h, w[p + "attn.qkv.weight"], w[p + "attn.qkv.bias"])
    q, k, v = qkv.reshape(n, 3, heads, -1).permute(1, 0, 2, 3).unbind(0)
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    q, k = q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    att = torch.matmul(q, k.transpose(1, 2)) / math.sqrt(q.shape[-1]) + mask
    out = torch.matmul(F.softmax(att, dim=-1), v).transpose(0, 1).reshape(n, -1)
    x = x + F.linear(out, w[p + "attn.proj.weight"], w[p + "attn.proj.bias"])
    h = _rms(x, w[p + "norm2.weight"], 1e-6)
    gate = F.silu(F.linear(h, w[p + "mlp.gate_proj.weight"], w[p + "mlp.gate_proj.bias"]))
    up = F.linear(h, w[p + "mlp.up_proj.weight"], w[p + "mlp.up_proj.bias"])
    return x + F.linear(gate * up, w[p + "mlp.down_proj.weight"], w[p + "mlp.down_proj.bias"])


def vision(ckpt, pixel_values, grid_thw):
    """(merged patches, out_hidden_size) features of the images in `grid_thw` (k, 3)."""
    cfg, w = _load(ckpt)
    v = cfg["vision_config"]
    merge, patch, tp = v["spatial_merge_size"], v["patch_size"], v["temporal_patch_size"]
    grid_thw = torch.as_tensor(np.asarray(grid_thw)).reshape(-1, 3)
    x = torch.as_tensor(np.asarray(pixel_values, dtype=np.float32))
    x = x.view(-1, v["in_channels"], tp, patch, patch)
    kernel = w["visual.patch_embed.proj.weight"]
    x = F.conv3d(x, kernel, stride=(tp, patch, patch)).view(-1, v["hidden_size"])
    rot = _rot_pos_emb(grid_thw, v["hidden_size"] // v["num_heads"], merge)
    index, cu_win = _window_index(grid_thw, v["window_size"], merge, patch)
    cu_win = torch.unique_consecutive(torch.tensor(cu_win)).tolist()
    n, unit = x.shape[0], merge * merge
    x = x.reshape(n // unit, unit, -1)[index].reshape(n, -1)
    rot = rot.reshape(n // unit, unit, -1)[index].reshape(n, -1)
    emb = torch.cat((rot, rot), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    sizes = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
    cu_full = F.pad(sizes.cumsum(0), (1, 0), value=0).tolist()
    full, windowed = _block_mask(n, cu_full), _block_mask(n, cu_win)
    for i in range(v["depth"]):
        mask = full if i in v["fullatt_block_indexes"] else windowed
        x = _vision_block(w, f"visual.blocks.{i}.", x, mask, cos, sin, v["num_heads"])
    x = _rms(x, w["visual.merger.ln_q.weight"], 1e-6).view(-1, v["hidden_size"] * unit)
    x = F.linear(x, w["visual.merger.mlp.0.weight"], w["visual.merger.mlp.0.bias"])
    x = F.linear(F.gelu(x), w["visual.merger.mlp.2.weight"], w["visual.merger.mlp.2.bias"])
    return x[torch.argsort(index)].numpy()


def project(ckpt, features):
    _, w = _load(ckpt)
    x = torch.as_tensor(np.asarray(features, dtype=np.float32))
    x = F.silu(F.linear(x, w["img_projector.linear_1.weight"], w["img_projector.linear_1.bias"]))
    return F.linear(x, w["img_projector.linear_2.weight"], w["img_projector.linear_2.bias"]).numpy()


# ------------------------------------------------------------------------------- language model


def rope_index(ckpt, input_ids, grid_thw, attention_mask):
    """get_rope_index for images (no video): (3, B, L) positions."""
    cfg, _ = _load(ckpt)
    merge = cfg["vision_config"]["spatial_merge_size"]
    img, start_id = cfg["image_token_id"], cfg["vision_start_token_id"]
    ids_all = torch.as_tensor(input_ids)
    position_ids = torch.ones(3, *ids_all.shape, dtype=torch.long)
    grid = torch.as_tensor(np.asarray(grid_thw)).reshape(-1, 3) if grid_thw is not None else None
    image_index = 0
    for i, ids in enumerate(ids_all):
        ids = ids[attention_mask[i] == 1]
        starts = torch.argwhere(ids == start_id).squeeze(1)
        n_images = int((ids[starts + 1] == img).sum()) if grid is not None else 0
        tokens = ids.tolist()
        parts, st = [], 0
        for _ in range(n_images):
            ed = tokens.index(img, st)
            t, h, w = (int(v) for v in grid[image_index])
            image_index += 1
            gt, gh, gw = t, h // merge, w // merge
            st_idx = parts[-1].max() + 1 if parts else 0
            parts.append(torch.arange(ed - st).view(1, -1).expand(3, -1) + st_idx)
            ti = torch.arange(gt).view(-1, 1).expand(-1, gh * gw).flatten()
            hi = torch.arange(gh).view(1, -1, 1).expand(gt, -1, gw).flatten()
            wi = torch.arange(gw).view(1, 1, -1).expand(gt, gh, -1).flatten()
            parts.append(torch.stack([ti, hi, wi]) + ed - st + st_idx)
            st = ed + gt * gh * gw
        if st < len(tokens):
            st_idx = parts[-1].max() + 1 if parts else 0
            parts.append(torch.arange(len(tokens) - st).view(1, -1).expand(3, -1) + st_idx)
        position_ids[..., i, attention_mask[i] == 1] = torch.cat(parts, dim=1).reshape(3, -1)
    return position_ids


def _mrope(positions, head_dim, theta, section):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    freqs = (inv_freq[None, None, :, None] * positions[:, :, None, :].float()).transpose(2, 3)
    emb = torch.cat((freqs, freqs), dim=-1)
    split = list(section) * 2
    pick = lambda m: torch.cat(  # noqa: E731
        [c[i % 3] for i, c in enumerate(m.split(split, dim=-1))], dim=-1
    ).unsqueeze(1)
    return pick(emb.cos()), pick(emb.sin())


def _embed(ckpt, ids, pixel_values, grid_thw):
    cfg, w = _load(ckpt)
    x = F.embedding(ids, w["model.embed_tokens.weight"])
    if pixel_values is not None:
        feats = torch.as_tensor(project(ckpt, vision(ckpt, pixel_values, grid_thw)))
        where = (ids == cfg["image_token_id"]).unsqueeze(-1).expand_as(x)
        x = x.masked_scatter(where, feats)
    return x


def _layers(ckpt, x, positions, keep, past=None):
    """DimpleBaseModel's layers and norm, then lm_head, over embeddings x (B, L, H) at `positions`
    (3, B, L); `past`: per layer (K, V) of earlier columns (rotated, as DynamicCache keeps them),
    which the columns attend first. Returns (logits, [(K, V)] of these columns)."""
    cfg, w = _load(ckpt)
    B, L, _ = x.shape
    H, KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg["hidden_size"] // H
    cos, sin = _mrope(positions, hd, cfg["rope_theta"], cfg["mrope_section"])
    eps, kept = cfg["rms_norm_eps"], []
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], eps)
        q = F.linear(h, w[p + "self_attn.q_proj.weight"], w[p + "self_attn.q_proj.bias"])
        k = F.linear(h, w[p + "self_attn.k_proj.weight"], w[p + "self_attn.k_proj.bias"])
        v = F.linear(h, w[p + "self_attn.v_proj.weight"], w[p + "self_attn.v_proj.bias"])
        q = q.view(B, L, H, hd).transpose(1, 2)
        k = k.view(B, L, KV, hd).transpose(1, 2)
        v = v.view(B, L, KV, hd).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        kept.append((k, v))
        if past is not None:
            k, v = torch.cat([past[i][0], k], dim=2), torch.cat([past[i][1], v], dim=2)
        k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        x = x + F.linear(out.transpose(1, 2).reshape(B, L, -1), w[p + "self_attn.o_proj.weight"])
        h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        gate = F.silu(F.linear(h, w[p + "mlp.gate_proj.weight"]))
        up = F.linear(h, w[p + "mlp.up_proj.weight"])
        x = x + F.linear(gate * up, w[p + "mlp.down_proj.weight"])
    x = _rms(x, w["model.norm.weight"], eps)
    return F.linear(x, w["lm_head.weight"]), kept


def logits(ckpt, input_ids, pixel_values=None, grid_thw=None, attention_mask=None):
    """(B, L, V) unshifted logits of DimpleModel.forward."""
    ids = torch.as_tensor(input_ids)
    B, L = ids.shape
    am = torch.ones(B, L, dtype=torch.long)
    am = am if attention_mask is None else torch.as_tensor(attention_mask)
    positions = rope_index(ckpt, ids, grid_thw if pixel_values is not None else None, am)
    keep = am.bool()
    keep = keep[:, None, None, :] & keep[:, None, :, None]
    keep = keep | torch.eye(L, dtype=torch.bool)[None, None]
    return _layers(ckpt, _embed(ckpt, ids, pixel_values, grid_thw), positions, keep)[0]


# ----------------------------------------------------------------------------------- decoding


def _fallback_count(num_cur, num_total, i, steps, timesteps):
    ratio = torch.tensor(num_cur) / torch.tensor(num_total)
    valid = (timesteps < ratio).nonzero(as_tuple=True)[0]
    t = ratio
    for s_idx in range(max(valid.min().item(), i + 1), steps + 1):
        s = timesteps[s_idx]
        n = int(torch.tensor(num_cur) * (1 - s / t)) if s > timesteps[-1] else num_cur
        if n >= 1:
            return n
    raise AssertionError("unreachable")


def _step_logits(ckpt, ids, pixel_values, grid_thw, prompt_length, state):
    """One step's shifted logits over the columns the step runs (all of them, or with use_cache
    from prompt_length on), as prepare_inputs_for_generation / forward / _sample do."""
    if state is None:
        out = logits(ckpt, ids, pixel_values, grid_thw)
        return torch.cat([out[:, :1], out[:, :-1]], dim=1), 0
    L = ids.shape[1]
    if not state:  # the first step: the whole sequence; keep the prompt's K/V but its last
        positions = rope_index(ckpt, ids, grid_thw, torch.ones_like(ids))
        state["delta"] = int(positions.max()) + 1 - L
        x = _embed(ckpt, ids, pixel_values, grid_thw)
        out, kv = _layers(ckpt, x, positions, torch.ones(1, 1, L, L, dtype=torch.bool))
        state["past"] = [(k[:, :, :prompt_length], v[:, :, :prompt_length]) for k, v in kv]
        return torch.cat([out[:, :1], out[:, :-1]], dim=1), 0
    window = ids[:, prompt_length:]
    n = window.shape[1]
    positions = (torch.arange(n) + prompt_length + state["delta"]).view(1, 1, -1).expand(3, 1, -1)
    x = _embed(ckpt, window, None, None)
    keep = torch.ones(1, 1, n, L, dtype=torch.bool)
    out, _ = _layers(ckpt, x, positions, keep, past=state["past"])
    return torch.cat([out[:, :1], out[:, :-1]], dim=1), prompt_length


def generate(
    ckpt,
    input_ids,
    pixel_values,
    grid_thw,
    mask_id,
    max_new_tokens,
    steps,
    alg="maskgit_plus",
    alg_p_threshold=None,
    eps=1e-3,
    use_cache=False,
    pipeline="dim",
    top_p=None,
):
    """diffusion_generate / _sample of one row at temperature 0 (decoding_pipeline "dim" or
    "dream"): the generated tokens (max_new_tokens of them)."""
    ids = torch.as_tensor([list(input_ids) + [mask_id] * max_new_tokens])
    timesteps = torch.linspace(1, eps, steps + 1)
    total = int((ids == mask_id).sum())
    state = {} if use_cache else None
    for i in range(steps):
        out, first = _step_logits(ckpt, ids, pixel_values, grid_thw, len(input_ids) - 1, state)
        x = ids[:, first:]
        mask_index = x == mask_id
        mask_logits = out[mask_index]
        probs = torch.softmax(mask_logits, dim=-1)
        if pipeline == "dream" and top_p is not None and top_p < 1:
            # use_original_confidence=False: the confidence is the top-p filtered distribution's.
            probs = torch.softmax(top_p_logits(mask_logits, top_p), dim=-1)
        confidence, x0 = probs.max(dim=-1)
        if alg == "entropy":
            confidence = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
        elif alg not in ("maskgit_plus", "autoregressive"):
            raise ValueError(alg)
        new = torch.full_like(x0, mask_id)
        if pipeline == "dream":
            t, s = timesteps[i], timesteps[i + 1]
            m = mask_index.sum()
            n = int(m * (1 - s / t)) if i < steps - 1 else int(m)
            if n > 0:
                index = torch.topk(confidence, n).indices
                new[index] = x0[index]
            x[mask_index] = new
            continue
        hit = None
        if alg_p_threshold:
            last = i == steps - 1
            hit = torch.ones_like(x0, dtype=torch.bool) if last else confidence > alg_p_threshold
        if hit is not None and hit.sum() > 0:
            new[hit] = x0[hit]
        else:
            n = _fallback_count(int(mask_index.sum()), total, i, steps, timesteps)
            # autoregressive: the row's first mask (`mask_index.max(dim=1)[1]`).
            index = (
                torch.tensor([0]) if alg == "autoregressive" else torch.topk(confidence, n).indices
            )
            new[index] = x0[index]
        x[mask_index] = new
        if not (ids == mask_id).any():
            break
    return ids[0, len(input_ids) :].tolist()
