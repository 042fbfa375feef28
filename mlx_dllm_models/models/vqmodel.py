"""diffusers' VQModel (the aMUSEd VQ-GAN that Lumina-DiMOO ships as `vqvae/`), its decoder in MLX.

The folder holds diffusers' config.json (`_class_name` "VQModel": block_out_channels,
layers_per_block, latent_channels, num_vq_embeddings, norm_num_groups, mid_block_add_attention,
...) and `diffusion_pytorch_model.safetensors` under diffusers' module names
(`decoder.up_blocks.0.resnets.1.conv1.weight`, `quantize.embedding.weight`, ...), NCHW.

Decoding codes as Lumina-DiMOO's decode_vq_to_image does: `decode(codes, force_not_quantize=True,
shape=(1, h, w, latent_channels))` looks the codes up in the codebook (lookup_from_codebook),
then post_quant_conv and the decoder; the pixels are clipped to [0, 1] and VaeImageProcessor
(do_normalize=False) rounds x255. The downsampling factor is 2 ** (len(block_out_channels) - 1),
16 for aMUSEd's five levels. Encoding an image (editing) as encode_img_with_breaks does:
`encode(x).latents` (the encoder, quant_conv) of pixels in [0, 1], then the quantizer's nearest
codebook entry (VectorQuantizer: the argmin of the Euclidean distance).
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .common import ImageTokenizer

NAME = "vqmodel"
WEIGHT_FILES = ("diffusion_pytorch_model.safetensors", "model.safetensors")
EPS = 1e-6  # diffusers' VAE Encoder / Decoder: every GroupNorm's eps


@dataclass
class VQConfig:
    block_out_channels: Sequence[int] = (128, 256, 256, 512, 768)
    layers_per_block: int = 2
    latent_channels: int = 64
    num_vq_embeddings: int = 8192
    vq_embed_dim: Optional[int] = None
    norm_num_groups: int = 32
    out_channels: int = 3
    mid_block_add_attention: bool = True
    lookup_from_codebook: bool = False
    norm_type: str = "group"
    act_fn: str = "silu"

    @classmethod
    def from_dict(cls, config: Dict[str, Any]) -> "VQConfig":
        known = {k: v for k, v in config.items() if k in cls.__dataclass_fields__}
        args = cls(**known)
        if args.norm_type != "group" or args.act_fn != "silu":
            raise ValueError(
                f"{NAME}: norm_type {args.norm_type!r} / act_fn {args.act_fn!r} is not supported "
                "(aMUSEd's VQModel: 'group' and 'silu')"
            )
        return args

    @property
    def codebook_size(self) -> int:
        return self.num_vq_embeddings

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.block_out_channels) - 1)

    @property
    def embed_dim(self) -> int:
        return self.vq_embed_dim or self.latent_channels


def group_norm(groups: int, channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(groups, channels, eps=EPS, affine=True, pytorch_compatible=True)


def conv(cin: int, cout: int, kernel: int = 3) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel, padding=kernel // 2)


class Resnet(nn.Module):
    """ResnetBlock2D without a time embedding (output_scale_factor 1)."""

    def __init__(self, cin: int, cout: int, groups: int):
        super().__init__()
        self.norm1 = group_norm(groups, cin)
        self.conv1 = conv(cin, cout)
        self.norm2 = group_norm(groups, cout)
        self.conv2 = conv(cout, cout)
        if cin != cout:
            self.conv_shortcut = conv(cin, cout, 1)

    def __call__(self, x):
        h = self.conv1(nn.silu(self.norm1(x)))
        h = self.conv2(nn.silu(self.norm2(h)))
        if "conv_shortcut" in self:
            x = self.conv_shortcut(x)
        return x + h


class Attention(nn.Module):
    """The mid block's single-head self-attention over the pixels (group_norm, residual)."""

    def __init__(self, channels: int, groups: int):
        super().__init__()
        self.group_norm = group_norm(groups, channels)
        self.to_q = nn.Linear(channels, channels)
        self.to_k = nn.Linear(channels, channels)
        self.to_v = nn.Linear(channels, channels)
        self.to_out = [nn.Linear(channels, channels)]

    def __call__(self, x):
        B, H, W, C = x.shape
        h = self.group_norm(x).reshape(B, H * W, C)
        q, k, v = (f(h)[:, None] for f in (self.to_q, self.to_k, self.to_v))
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0 / math.sqrt(C))
        return x + self.to_out[0](out[:, 0]).reshape(B, H, W, C)


class MidBlock(nn.Module):
    def __init__(self, channels: int, groups: int, attention: bool):
        super().__init__()
        self.resnets = [Resnet(channels, channels, groups), Resnet(channels, channels, groups)]
        self.attentions = [Attention(channels, groups)] if attention else []

    def __call__(self, x):
        x = self.resnets[0](x)
        for attn in self.attentions:
            x = attn(x)
        return self.resnets[1](x)


class Upsampler(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = conv(channels, channels)

    def __call__(self, x):
        x = mx.repeat(mx.repeat(x, 2, axis=1), 2, axis=2)  # nearest, x2
        return self.conv(x)


class UpBlock(nn.Module):
    def __init__(self, cin: int, cout: int, n: int, groups: int, upsample: bool):
        super().__init__()
        self.resnets = [Resnet(cin if j == 0 else cout, cout, groups) for j in range(n)]
        self.upsamplers = [Upsampler(cout)] if upsample else []

    def __call__(self, x):
        for block in self.resnets:
            x = block(x)
        for up in self.upsamplers:
            x = up(x)
        return x


class Decoder(nn.Module):
    def __init__(self, c: VQConfig):
        super().__init__()
        channels = list(reversed(c.block_out_channels))
        g = c.norm_num_groups
        self.conv_in = conv(c.latent_channels, channels[0])
        self.mid_block = MidBlock(channels[0], g, c.mid_block_add_attention)
        blocks, prev = [], channels[0]
        for i, out in enumerate(channels):
            last = i == len(channels) - 1
            blocks.append(UpBlock(prev, out, c.layers_per_block + 1, g, not last))
            prev = out
        self.up_blocks = blocks
        self.conv_norm_out = group_norm(g, channels[-1])
        self.conv_out = conv(channels[-1], c.out_channels)

    def __call__(self, z):
        h = self.mid_block(self.conv_in(z))
        for block in self.up_blocks:
            h = block(h)
        return self.conv_out(nn.silu(self.conv_norm_out(h)))


class Downsampler(nn.Module):
    """Downsample2D with padding 0: a zero row and column after the pixels, a stride-2 conv."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=0)

    def __call__(self, x):
        return self.conv(mx.pad(x, [(0, 0), (0, 1), (0, 1), (0, 0)]))


class DownBlock(nn.Module):
    def __init__(self, cin: int, cout: int, n: int, groups: int, downsample: bool):
        super().__init__()
        self.resnets = [Resnet(cin if j == 0 else cout, cout, groups) for j in range(n)]
        self.downsamplers = [Downsampler(cout)] if downsample else []

    def __call__(self, x):
        for block in self.resnets:
            x = block(x)
        for down in self.downsamplers:
            x = down(x)
        return x


class Encoder(nn.Module):
    def __init__(self, c: VQConfig):
        super().__init__()
        channels, g = list(c.block_out_channels), c.norm_num_groups
        self.conv_in = conv(3, channels[0])
        blocks, prev = [], channels[0]
        for i, out in enumerate(channels):
            last = i == len(channels) - 1
            blocks.append(DownBlock(prev, out, c.layers_per_block, g, not last))
            prev = out
        self.down_blocks = blocks
        self.mid_block = MidBlock(channels[-1], g, c.mid_block_add_attention)
        self.conv_norm_out = group_norm(g, channels[-1])
        self.conv_out = conv(channels[-1], c.latent_channels)

    def __call__(self, x):
        h = self.conv_in(x)
        for block in self.down_blocks:
            h = block(h)
        h = self.mid_block(h)
        return self.conv_out(nn.silu(self.conv_norm_out(h)))


class Quantizer(nn.Module):
    def __init__(self, c: VQConfig):
        super().__init__()
        self.embedding = nn.Embedding(c.num_vq_embeddings, c.embed_dim)


class VQModel(ImageTokenizer):
    def __init__(self, config: VQConfig):
        super().__init__(config)
        self.encoder = Encoder(config)
        self.quant_conv = conv(config.latent_channels, config.embed_dim, 1)
        self.quantize = Quantizer(config)
        self.post_quant_conv = conv(config.embed_dim, config.latent_channels, 1)
        self.decoder = Decoder(config)

    def decode_code(self, codes: mx.array, shape: Optional[Tuple[int, int]] = None) -> mx.array:
        """(B, N) code indices -> (B, H, W, 3) pixels in about [0, 1] (a square grid unless
        `shape` gives (h, w))."""
        B, N = codes.shape
        h, w = shape if shape is not None else (math.isqrt(N), math.isqrt(N))
        if h * w != N:
            raise ValueError(f"{NAME}: {N} codes do not fill a {h}x{w} grid")
        z = self.quantize.embedding(codes.astype(mx.int32)).reshape(B, h, w, -1)
        return self.decoder(self.post_quant_conv(z))

    def get_code(self, pixels: mx.array) -> mx.array:
        """(B, H, W, 3) pixels in [0, 1] -> (B, N) code indices, row by row."""
        z = self.quant_conv(self.encoder(pixels.astype(mx.float32)))
        B = z.shape[0]
        flat = z.reshape(-1, z.shape[-1])
        book = self.quantize.embedding.weight.astype(mx.float32)
        distance = (
            (flat * flat).sum(axis=-1, keepdims=True)
            - 2 * flat @ book.T
            + (book * book).sum(axis=-1)[None]
        )
        return mx.argmin(distance, axis=-1).astype(mx.int32).reshape(B, -1)

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        out = {}
        for key, value in weights.items():
            if value.ndim == 4:
                if "attentions" in key:  # an old diffusers save: 1x1 convs for the projections
                    value = value[:, :, 0, 0]
                else:
                    value = value.transpose(0, 2, 3, 1)  # torch OIHW -> mlx OHWI
            out[key] = value
        return out


def to_uint8(pixels: mx.array) -> np.ndarray:
    """(B, H, W, 3) pixels -> uint8 as decode_vq_to_image makes them: clip to [0, 1], then
    VaeImageProcessor's numpy_to_pil (x255, rounded)."""
    scaled = mx.clip(pixels.astype(mx.float32), 0.0, 1.0) * 255.0
    return np.array(mx.round(scaled)).astype(np.uint8)


def load(path) -> VQModel:
    """The VQ model of the folder `path` (diffusers' VQModel: config.json and weights)."""
    folder = Path(path)
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"{NAME}: {folder} has no config.json (a diffusers VQModel)")
    config = json.loads((folder / "config.json").read_text())
    files = [folder / n for n in WEIGHT_FILES if (folder / n).exists()]
    if not files:
        raise FileNotFoundError(
            f"{NAME}: no weights in {folder} (looked for {', '.join(WEIGHT_FILES)})"
        )
    model = VQModel(VQConfig.from_dict(config))
    weights = model.sanitize(dict(mx.load(str(files[0]))))
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model
