"""Torch transcriptions of MMaDA's text-to-image path (Gen-Verse/MMaDA), for the parity tests.

* `t2i_gen_prompt`: training/prompting_utils.py's UniversalPrompting.t2i_gen_prompt (the token
  layout and attention mask of a text-to-image prompt).
* `t2i_generate`: models/modeling_mmada.py's MMadaModelLM.t2i_generate with models/sampling.py's
  cosine_schedule and mask_by_random_topk. torch's generator cannot be reproduced, so the two
  random draws of a step are inputs: `draws(step) -> (u_sample, u_gumbel)`, the uniforms behind
  torch.multinomial (sampled by inverse CDF) and behind gumbel_noise. Returns the final sampled
  ids and every step's (sampled ids, masking).
* `forward_with_bias`: the LLaDA body (llada_torch's transformers Llama on the OLMo weights) under
  the reference's attention bias `mask[:, :, None] & mask[:, None, :]`, turned into an additive
  bias of float32's min where False, as LLaDAModel.forward does.
* `VQDecoder` / `VQEncoder`: modeling_magvitv2.py's VQGANDecoder / VQGANEncoder (taming's
  ResnetBlock, AttnBlock, Upsample, Downsample) and LFQuantizer's codebook, NCHW.
"""

import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from .llada_torch import load_model

# --------------------------------------------------------------------------------- the prompt


def t2i_gen_prompt(tokenizer, texts, n_tokens, max_text_len, ids, mask_token_id):
    """(input_ids, attention_mask) as UniversalPrompting(max_text_len=...)((texts, image), 't2i_gen')
    builds them; `ids` maps <|t2i|>, <|soi|>, <|eoi|>, [iPAD] to their ids."""
    text_ids = tokenizer(list(texts))["input_ids"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    width = max_text_len + 1
    rows, masks = [], []
    for t in text_ids:
        t = list(t)
        if len(t) == 0:
            t = [bos]
        elif t[0] != bos:
            t = [bos] + t
        temp = [ids["<|t2i|>"]] + t + [eos]
        if width >= len(temp):
            old = len(temp)
            temp = [ids["[iPAD]"]] * (width - old) + temp
            mask = [0] * (width - old) + [1] * (old + n_tokens + 2)
        else:
            temp = temp[: width - 1] + [eos]
            mask = [1] * (len(temp) + n_tokens + 2)
        rows.append(temp + [ids["<|soi|>"]] + [mask_token_id] * n_tokens + [ids["<|eoi|>"]])
        masks.append(mask)
    return torch.tensor(rows), torch.tensor(masks)


def forward_with_bias(ckpt_path):
    model, context = load_model(ckpt_path)

    def forward(input_ids, attention_bias):
        bias = attention_bias.to(torch.float32)
        bias = bias.masked_fill(bias == 0.0, torch.finfo(torch.float32).min)
        bias = bias.masked_fill(bias == 1.0, 0.0)
        with torch.no_grad(), context():
            return model(input_ids=input_ids, attention_mask=bias).logits.float()

    return forward


# ------------------------------------------------------------------------------- the sampling


def log(t, eps=1e-20):
    return torch.log(t.clamp(min=eps))


def gumbel_noise(u):
    return -log(-log(u))


def mask_by_random_topk(mask_len, probs, temperature, u):
    confidence = log(probs) + temperature * gumbel_noise(u)
    sorted_confidence = torch.sort(confidence, dim=-1).values
    cut_off = torch.gather(sorted_confidence, 1, mask_len.long())
    return confidence < cut_off


def cosine_schedule(t):
    return torch.cos(t * math.pi * 0.5)


def multinomial(probs, u):
    """One categorical draw per row of `probs` (R, C) from uniforms `u` (R,): inverse CDF."""
    cdf = torch.cumsum(probs, dim=-1)
    idx = torch.searchsorted(cdf, u[:, None].contiguous(), right=True)[:, 0]
    return idx.clamp(max=probs.shape[-1] - 1)


def t2i_generate(
    forward,
    input_ids,
    uncond_input_ids,
    attention_mask,
    uncond_attention_mask,
    *,
    temperature,
    timesteps,
    guidance_scale,
    seq_len,
    resolution,
    offset,
    codebook_size,
    mask_token_id,
    draws,
):
    input_ids = input_ids.clone()
    num_vq_tokens = seq_len
    img = input_ids[:, -(num_vq_tokens + 1) : -1].clone()
    img = torch.where(img == mask_token_id, mask_token_id, img - offset)
    if uncond_input_ids is not None:
        uncond_prefix = uncond_input_ids[:, : resolution + 1]
    record = []
    for step in range(timesteps):
        if uncond_input_ids is not None and guidance_scale > 0:
            uncond_input_ids = torch.cat([uncond_prefix, input_ids[:, resolution + 1 :]], dim=1)
            model_input = torch.cat([input_ids, uncond_input_ids])
            all_mask = torch.cat([attention_mask, uncond_attention_mask], dim=0).bool()
            bias = (all_mask[:, :, None] & all_mask[:, None, :]).unsqueeze(1)
            logits = forward(model_input, bias)
            cond_logits, uncond_logits = torch.chunk(logits, 2, dim=0)
            logits = (1 + guidance_scale) * cond_logits - guidance_scale * uncond_logits
        else:
            m = attention_mask.bool()
            logits = forward(input_ids, (m[:, :, None] & m[:, None, :]).unsqueeze(1))
        logits = logits[:, -(num_vq_tokens + 1) : -1, offset : offset + codebook_size]
        probs = logits.softmax(dim=-1)
        u_sample, u_gumbel = (torch.as_tensor(np.asarray(d)) for d in draws(step))
        flat = probs.reshape(-1, logits.size(-1))
        sampled_ids = multinomial(flat, u_sample.reshape(-1)).view(*logits.shape[:-1])
        unknown_map = img == mask_token_id
        sampled_ids = torch.where(unknown_map, sampled_ids, img)
        ratio = 1.0 * (step + 1) / timesteps
        mask_ratio = cosine_schedule(torch.tensor(ratio))
        selected = torch.gather(probs, -1, sampled_ids.long()[..., None]).squeeze(-1)
        selected = torch.where(unknown_map, selected, torch.finfo(selected.dtype).max)
        mask_len = (num_vq_tokens * mask_ratio).floor().unsqueeze(0)
        mask_len = torch.max(
            torch.tensor([1]), torch.min(unknown_map.sum(dim=-1, keepdim=True) - 1, mask_len)
        )
        temperature = temperature * (1.0 - ratio)
        masking = mask_by_random_topk(mask_len, selected, temperature, u_gumbel)
        input_ids[:, -(num_vq_tokens + 1) : -1] = torch.where(
            masking, mask_token_id, sampled_ids + offset
        )
        img = torch.where(masking, mask_token_id, sampled_ids)
        record.append((sampled_ids.clone(), masking.clone(), logits.clone()))
    return sampled_ids, record


# ------------------------------------------------------------------------------ the VQ model


def Normalize(c):
    return nn.GroupNorm(num_groups=32, num_channels=c, eps=1e-6, affine=True)


def swish(x):
    return x * torch.sigmoid(x)


class ResnetBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.in_channels, self.out_channels = cin, cout
        self.norm1 = Normalize(cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, 1, 1)
        self.norm2 = Normalize(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1)
        if cin != cout:
            self.nin_shortcut = nn.Conv2d(cin, cout, 1, 1, 0)

    def forward(self, x):
        h = self.conv1(swish(self.norm1(x)))
        h = self.conv2(swish(self.norm2(h)))
        if self.in_channels != self.out_channels:
            x = self.nin_shortcut(x)
        return x + h


class AttnBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.norm = Normalize(c)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(c, c, 1, 1, 0) for _ in range(4))

    def forward(self, x):
        h_ = self.norm(x)
        q, k, v = self.q(h_), self.k(h_), self.v(h_)
        b, c, h, w = q.shape
        q = q.reshape(b, c, h * w).permute(0, 2, 1)
        k = k.reshape(b, c, h * w)
        w_ = torch.bmm(q, k) * (int(c) ** (-0.5))
        w_ = F.softmax(w_, dim=2)
        v = v.reshape(b, c, h * w)
        h_ = torch.bmm(v, w_.permute(0, 2, 1)).reshape(b, c, h, w)
        return x + self.proj_out(h_)


class Upsample(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, 1, 1)

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Downsample(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, 2, 0)

    def forward(self, x):
        return self.conv(F.pad(x, (0, 1, 0, 1), mode="constant", value=0))


def _middle(c):
    mid = nn.Module()
    mid.block_1, mid.attn_1, mid.block_2 = ResnetBlock(c, c), AttnBlock(c), ResnetBlock(c, c)
    return mid


class VQDecoder(nn.Module):
    def __init__(self, ch, ch_mult, num_res_blocks, attn_resolutions, resolution, z_channels, **_):
        super().__init__()
        self.n, self.num_res_blocks = len(ch_mult), num_res_blocks
        block_in = ch * ch_mult[-1]
        res = resolution // 2 ** (self.n - 1)
        self.conv_in = nn.Conv2d(z_channels, block_in, 3, 1, 1)
        self.mid = _middle(block_in)
        self.up = nn.ModuleList()
        for i in reversed(range(self.n)):
            block, attn = nn.ModuleList(), nn.ModuleList()
            out = ch * ch_mult[i]
            for _ in range(num_res_blocks[i]):
                block.append(ResnetBlock(block_in, out))
                block_in = out
                if res in attn_resolutions:
                    attn.append(AttnBlock(block_in))
            up = nn.Module()
            up.block, up.attn = block, attn
            if i != 0:
                up.upsample = Upsample(block_in)
                res *= 2
            self.up.insert(0, up)
        self.norm_out = Normalize(block_in)
        self.conv_out = nn.Conv2d(block_in, 3, 3, 1, 1)
        self.post_quant_conv = nn.Conv2d(z_channels, z_channels, 1)

    def forward(self, z):
        h = self.conv_in(self.post_quant_conv(z))
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        for i in reversed(range(self.n)):
            for j in range(self.num_res_blocks[i]):
                h = self.up[i].block[j](h)
                if len(self.up[i].attn) > 0:
                    h = self.up[i].attn[j](h)
            if i != 0:
                h = self.up[i].upsample(h)
        return self.conv_out(swish(self.norm_out(h)))


class VQEncoder(nn.Module):
    def __init__(self, ch, ch_mult, num_res_blocks, attn_resolutions, resolution, z_channels, **_):
        super().__init__()
        self.n, self.num_res_blocks = len(ch_mult), num_res_blocks
        self.conv_in = nn.Conv2d(3, ch, 3, 1, 1)
        res, in_mult = resolution, (1,) + tuple(ch_mult)
        self.down = nn.ModuleList()
        for i in range(self.n):
            block, attn = nn.ModuleList(), nn.ModuleList()
            block_in, out = ch * in_mult[i], ch * ch_mult[i]
            for _ in range(num_res_blocks[i]):
                block.append(ResnetBlock(block_in, out))
                block_in = out
                if res in attn_resolutions:
                    attn.append(AttnBlock(block_in))
            down = nn.Module()
            down.block, down.attn = block, attn
            if i != self.n - 1:
                down.downsample = Downsample(block_in)
                res //= 2
            self.down.append(down)
        self.mid = _middle(block_in)
        self.norm_out = Normalize(block_in)
        self.conv_out = nn.Conv2d(block_in, z_channels, 3, 1, 1)
        self.quant_conv = nn.Conv2d(z_channels, z_channels, 1)

    def forward(self, x):
        hs = [self.conv_in(x)]
        for i in range(self.n):
            for j in range(self.num_res_blocks[i]):
                h = self.down[i].block[j](hs[-1])
                if len(self.down[i].attn) > 0:
                    h = self.down[i].attn[j](h)
                hs.append(h)
            if i != self.n - 1:
                hs.append(self.down[i].downsample(hs[-1]))
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(hs[-1])))
        return self.quant_conv(self.conv_out(swish(self.norm_out(h))))


def vq_models(config, weights):
    """(encoder, decoder) with the checkpoint's weights."""
    enc, dec = VQEncoder(**config["encoder"]), VQDecoder(**config["decoder"])
    for prefix, module in (("encoder.", enc), ("decoder.", dec)):
        state = {
            k[len(prefix) :]: torch.from_numpy(np.asarray(v))
            for k, v in weights.items()
            if k.startswith(prefix)
        }
        module.load_state_dict(state, strict=True)
    return enc.eval(), dec.eval()


def codebook_entry(indices, codebook_dim, shape=None):
    """LFQuantizer.get_codebook_entry: (B, N) -> (B, codebook_dim, h, w)."""
    b, n = indices.shape
    h, w = shape if shape is not None else (int(math.sqrt(n)), int(math.sqrt(n)))
    codes = torch.arange(2**codebook_dim)
    bits = (codes.unsqueeze(1) >> torch.arange(codebook_dim - 1, -1, -1)) & 1
    embedding = bits.float() * 2 - 1
    return embedding[indices.reshape(-1)].view(b, h, w, -1).permute(0, 3, 1, 2).contiguous()


def get_indices(z, codebook_dim):
    """LFQuantizer's forward z_q then get_indices: the bits of z > 0, most significant first."""
    power_vals = 2 ** torch.arange(codebook_dim - 1, -1, -1)
    return (power_vals.reshape(1, -1, 1, 1) * (z > 0).float()).sum(1, keepdim=True).long()


def image_transform(image, resolution):
    """app.py's image_transform on a PIL image: torchvision's Resize(resolution) (the shorter side
    to `resolution`, the longer `int(resolution * long / short)`, PIL bicubic), CenterCrop,
    ToTensor, Normalize(0.5, 0.5); (3, resolution, resolution)."""
    from PIL import Image

    w, h = image.size
    if w <= h:
        size = (resolution, int(resolution * h / w))
    else:
        size = (int(resolution * w / h), resolution)
    image = image.resize(size, Image.BICUBIC)
    top = int(round((size[1] - resolution) / 2.0))
    left = int(round((size[0] - resolution) / 2.0))
    image = image.crop((left, top, left + resolution, top + resolution))
    x = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
    return (x - 0.5) / 0.5
