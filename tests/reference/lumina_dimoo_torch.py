"""Torch transcriptions of Lumina-DiMOO's text-to-image path (Alpha-VLLM/Lumina-DiMOO), for the
parity tests.

* `t2i_prompt`: scripts/inference_t2i.py's sequence (utils/prompt_utils.py's
  generate_text_to_image_prompt, utils/image_utils.py's add_break_line, the answer and image
  markers) and its unconditional prompt ids.
* `generate_image`: generators/image_generation_generator.py's generate_image (batch 1, no cache)
  with utils/generation_utils.py's cosine_schedule, gumbel_max_sample and mask_by_random_topk.
  torch's generator cannot be reproduced, so a step's uniforms are inputs:
  `draws(step) -> (u_sample (N, C), u_gumbel (N,))` over every image position; as the reference
  draws them over the masked positions only, the masked positions' rows are taken, in order.
  Returns the final codes and every step's (sampled codes of every position, masking).
  The model is called unpadded, cond and uncond apart, as the reference calls it.
* `i2i_prompt` / `generate_i2i`: scripts/inference_i2i.py's sequences for an "edit_*" type
  (utils/prompt_utils.py's generate_image_to_image_prompt, encode_img_with_breaks) and
  generators/image_to_image_generator.py's generate_i2i (text and image guidance, three
  forwards a step), draws as generate_image's.
* `vq_encode`: diffusers' VQModel encode (Encoder of DownEncoderBlock2D, quant_conv) and
  VectorQuantizer's argmin of torch.cdist, of NCHW pixels in [0, 1].
* `VQDecoder`: diffusers' VQModel decode (force_not_quantize=True with lookup_from_codebook:
  the codebook look-up, post_quant_conv, the VAE Decoder of UpDecoderBlock2D / UNetMidBlock2D /
  ResnetBlock2D / Attention), NCHW, functional over the state dict.
"""

import math

import numpy as np
import torch
import torch.nn.functional as F

TEMPLATE = "<system>Generate an image according to the text prompt.</system><user>{}</user>"
UNCOND = (
    "<system>Generate an image according to the text prompt.</system><user><uncondition></user>"
)


def numpy_draws(batch, n_tokens, codebook_size, seed=0):
    """The uniforms both sides take in the parity tests: per row and step, (N, C) for the
    gumbel-max sample and (N,) for mask_by_random_topk's noise (float32)."""

    def draws(step):
        rng = np.random.default_rng([seed, step])
        return (
            rng.random((batch, n_tokens, codebook_size), dtype=np.float32),
            rng.random((batch, n_tokens), dtype=np.float32),
        )

    return draws


def add_break_line(sequence, H, W, new_number):
    out = []
    for i in range(H):
        out.extend(sequence[i * W : (i + 1) * W] + [new_number])
    return out


def t2i_prompt(tokenizer, text, H, W, ids, mask_id):
    """(prompt_ids (1, L), uncon_ids (1, T), code_start) as inference_t2i.py builds them."""
    con = tokenizer(TEMPLATE.format(text))["input_ids"]
    uncon = tokenizer(UNCOND)["input_ids"]
    image = add_break_line([mask_id] * (H * W), H, W, ids["newline_token"])
    pred = [ids["answer_start"], ids["boi"]] + image + [ids["eoi"], ids["answer_end"]]
    return torch.tensor([con + pred]), torch.tensor([uncon]), len(con) + 2


EDIT_SYSTEM = (
    "Generate an image applying the following editing instruction based on the original image."
)


def i2i_prompt(tokenizer, text, codes, H, W, ids, mask_id, offset):
    """(con_input (1, L), uncon_input_text, uncon_input_image, code_start) for an edit type."""
    input_prompt = "<system>" + EDIT_SYSTEM + "</system>" + "<user>" + text + "</user>"
    uncon_prompt = "<system>" + EDIT_SYSTEM + "</system>" + "<user>" + "<uncondition>" + "</user>"
    prompt_ids = tokenizer(input_prompt)["input_ids"]
    uncon_text_ids = tokenizer(uncon_prompt)["input_ids"]
    img = add_break_line([int(c) + offset for c in codes], H, W, ids["newline_token"])
    img = [ids["boi"]] + img + [ids["eoi"]]
    con = prompt_ids[:-1] + img + prompt_ids[-1:]
    uncon_text = uncon_text_ids[:-1] + img + uncon_text_ids[-1:]
    grid = add_break_line([mask_id] * (H * W), H, W, ids["newline_token"])
    pred = [ids["answer_start"], ids["boi"]] + grid + [ids["eoi"], ids["answer_end"]]
    code_start = len(con) + 2
    return (
        torch.tensor([con + pred]),
        torch.tensor([uncon_text]),
        torch.tensor([prompt_ids]),
        code_start,
    )


def cosine_schedule(t):
    return torch.cos(0.5 * math.pi * t)


def gumbel_noise(u):
    return -torch.log(-torch.log(u + 1e-20) + 1e-20)


def gumbel_max_sample(logits, tau, u):
    if tau == 0.0:
        return logits.argmax(dim=-1)
    return (logits / tau + gumbel_noise(u)).argmax(dim=-1)


def mask_by_random_topk(mask_len, probs, temperature, u):
    confidence = torch.log(probs.clamp_min(1e-20)) + temperature * gumbel_noise(u)
    sorted_conf = torch.sort(confidence, dim=-1).values
    k = mask_len.long().unsqueeze(1).clamp_(0, probs.size(1) - 1)
    cut_off = torch.gather(sorted_conf, 1, k)
    return confidence < cut_off


def generate_image(
    forward,
    prompt,
    *,
    seq_len,
    timesteps,
    mask_token_id,
    newline_id,
    temperature,
    cfg_scale,
    uncon_ids,
    code_start,
    codebook_size,
    draws,
    cfg_img=None,
    uncon_image=None,
):
    """`forward(ids (1, L)) -> float32 logits (1, L, V)`; the text vocabulary is inferred as the
    reference does (the logits' width less the codebook). With `cfg_img` (and `uncon_image`), the
    step's logits are generate_i2i's."""
    x = prompt.clone()
    B = 1
    vq_mask = x == mask_token_id
    unknown_cnt = vq_mask.sum(dim=1, keepdim=True)
    vq_len = unknown_cnt
    image_cols = torch.nonzero(vq_mask[0])[:, 0]
    vocab_offset = forward(torch.zeros(1, 1, dtype=torch.long)).size(-1) - codebook_size
    steps = []
    for step in range(timesteps):
        if unknown_cnt.item() == 0:
            break
        if step < timesteps - 1:
            frac = cosine_schedule(torch.tensor([(step + 1) / timesteps]))
            keep_n = (vq_len.float() * frac).floor().clamp_min(1).long()
        else:
            keep_n = torch.zeros_like(unknown_cnt)
        u_sample, u_gumbel = (torch.as_tensor(a) for a in draws(step))
        at = torch.isin(image_cols, torch.nonzero(vq_mask[0])[:, 0])  # the masked among them
        u_sample, u_gumbel = u_sample[at][None], u_gumbel[at][None]
        window = slice(vocab_offset, vocab_offset + codebook_size)
        if cfg_img is not None:
            logits = i2i_logits(
                forward, x, vq_mask, window, uncon_ids, uncon_image, code_start, cfg_scale, cfg_img
            )
        elif cfg_scale > 0:
            uncond = torch.cat((uncon_ids, x[:, code_start - 2 :]), axis=1)
            uncond_vq_mask = torch.cat(
                (
                    torch.zeros((1, uncon_ids.size()[1]), dtype=torch.bool),
                    vq_mask[:, code_start - 2 :],
                ),
                axis=1,
            )
            cond_logits = forward(x)[..., window]
            cond_mask_logits = cond_logits[vq_mask].view(B, -1, codebook_size)
            uncond_logits = forward(uncond)[..., window]
            uncond_mask_logits = uncond_logits[uncond_vq_mask].view(B, -1, codebook_size)
            logits = (1 + cfg_scale) * cond_mask_logits - cfg_scale * uncond_mask_logits
        else:
            logits = forward(x)[:, vq_mask[0], window]
        sampled = gumbel_max_sample(logits, temperature, u_sample)
        sampled_full = sampled + vocab_offset
        probs = torch.softmax(logits, dim=-1)
        conf = probs.gather(-1, sampled.unsqueeze(-1)).squeeze(-1)
        flat_idx = vq_mask.nonzero(as_tuple=False)[:, 1]
        x.view(-1)[flat_idx] = sampled_full.view(-1)
        mask_sel = mask_by_random_topk(keep_n.squeeze(1), conf, temperature, u_gumbel)
        x.view(-1)[flat_idx[mask_sel.view(-1)]] = mask_token_id
        vq_mask = x == mask_token_id
        unknown_cnt = vq_mask.sum(dim=1, keepdim=True)
        codes = x[0, image_cols] - vocab_offset
        steps.append((codes.clone(), vq_mask[0, image_cols].clone()))
    vq_ids = x[0, code_start:-2]
    vq_ids = vq_ids[vq_ids != newline_id].view(1, seq_len)
    return vq_ids - vocab_offset, steps


def i2i_logits(forward, x, vq_mask, window, uncon_text, uncon_image, code_start, cfg, cfg_img):
    """generate_i2i's guided logits of a step."""
    if not (cfg > 0 or cfg_img > 0):
        return forward(x)[:, vq_mask[0], window]
    tail, tail_mask = x[:, code_start - 2 :], vq_mask[:, code_start - 2 :]
    uncond_text = torch.cat((uncon_text, tail), dim=1)
    text_mask = torch.cat((torch.zeros((1, uncon_text.size(1)), dtype=torch.bool), tail_mask), 1)
    uncond_img = torch.cat((uncon_image, tail), dim=1)
    img_mask = torch.cat((torch.zeros((1, uncon_image.size(1)), dtype=torch.bool), tail_mask), 1)
    cond = forward(x)[:, vq_mask[0], window]
    u_text = forward(uncond_text)[:, text_mask[0], window]
    u_img = forward(uncond_img)[:, img_mask[0], window]
    return cond + cfg * (cond - u_text) + cfg_img * (cond - u_img)


# ----------------------------------------------------------------------------- the VQ decoder


def _conv(w, name, x, padding=1):
    return F.conv2d(x, w[name + ".weight"], w[name + ".bias"], padding=padding)


def _norm(w, name, x, groups):
    return F.group_norm(x, groups, w[name + ".weight"], w[name + ".bias"], eps=1e-6)


def _resnet(w, name, x, groups):
    h = _conv(w, name + ".conv1", F.silu(_norm(w, name + ".norm1", x, groups)))
    h = _conv(w, name + ".conv2", F.silu(_norm(w, name + ".norm2", h, groups)))
    if name + ".conv_shortcut.weight" in w:
        x = _conv(w, name + ".conv_shortcut", x, padding=0)
    return x + h


def _attention(w, name, x, groups):
    B, C, H, W = x.shape
    h = _norm(w, name + ".group_norm", x, groups).view(B, C, H * W).transpose(1, 2)
    q, k, v = (
        F.linear(h, w[f"{name}.{p}.weight"], w[f"{name}.{p}.bias"])
        for p in ("to_q", "to_k", "to_v")
    )
    scores = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(C), dim=-1)
    out = F.linear(scores @ v, w[name + ".to_out.0.weight"], w[name + ".to_out.0.bias"])
    return x + out.transpose(1, 2).reshape(B, C, H, W)


class VQDecoder:
    """diffusers VQModel.decode(codes, force_not_quantize=True, shape=(B, h, w, C)) of a state
    dict (numpy arrays) and its config.json."""

    def __init__(self, config, weights):
        self.config = config
        self.w = {k: torch.from_numpy(v).float() for k, v in weights.items()}

    def __call__(self, codes, h, w_):
        c, w = self.config, self.w
        g = c["norm_num_groups"]
        z = w["quantize.embedding.weight"][codes.long()].view(codes.shape[0], h, w_, -1)
        z = _conv(w, "post_quant_conv", z.permute(0, 3, 1, 2), padding=0)
        x = _conv(w, "decoder.conv_in", z)
        x = _resnet(w, "decoder.mid_block.resnets.0", x, g)
        if c.get("mid_block_add_attention", True):
            x = _attention(w, "decoder.mid_block.attentions.0", x, g)
        x = _resnet(w, "decoder.mid_block.resnets.1", x, g)
        n = len(c["block_out_channels"])
        for i in range(n):
            for j in range(c["layers_per_block"] + 1):
                x = _resnet(w, f"decoder.up_blocks.{i}.resnets.{j}", x, g)
            if i < n - 1:
                x = F.interpolate(x, scale_factor=2.0, mode="nearest")
                x = _conv(w, f"decoder.up_blocks.{i}.upsamplers.0.conv", x)
        x = F.silu(_norm(w, "decoder.conv_norm_out", x, g))
        return _conv(w, "decoder.conv_out", x)


def to_pixels(sample):
    """decode_vq_to_image's .clip(0, 1) and VaeImageProcessor.postprocess (do_normalize=False):
    NHWC uint8 of round(x * 255)."""
    arr = sample.clip(0, 1).permute(0, 2, 3, 1).numpy()
    return (arr * 255).round().astype("uint8")


def _downsample(w, name, x):
    return F.conv2d(F.pad(x, (0, 1, 0, 1)), w[name + ".weight"], w[name + ".bias"], stride=2)


def vq_encode(config, weights, pixels):
    """VQModel.encode(x).latents and quantize(latents)[2][2]: (B, h * w) codes of NCHW `pixels`
    in [0, 1]."""
    w = {k: torch.from_numpy(v).float() for k, v in weights.items()}
    g, n = config["norm_num_groups"], len(config["block_out_channels"])
    x = _conv(w, "encoder.conv_in", pixels)
    for i in range(n):
        for j in range(config["layers_per_block"]):
            x = _resnet(w, f"encoder.down_blocks.{i}.resnets.{j}", x, g)
        if i < n - 1:
            x = _downsample(w, f"encoder.down_blocks.{i}.downsamplers.0.conv", x)
    x = _resnet(w, "encoder.mid_block.resnets.0", x, g)
    if config.get("mid_block_add_attention", True):
        x = _attention(w, "encoder.mid_block.attentions.0", x, g)
    x = _resnet(w, "encoder.mid_block.resnets.1", x, g)
    x = _conv(w, "encoder.conv_out", F.silu(_norm(w, "encoder.conv_norm_out", x, g)))
    z = _conv(w, "quant_conv", x, padding=0)
    B = z.shape[0]
    flat = z.permute(0, 2, 3, 1).reshape(-1, z.shape[1])
    codes = torch.argmin(torch.cdist(flat, w["quantize.embedding.weight"]), dim=1)
    return codes.view(B, -1)
