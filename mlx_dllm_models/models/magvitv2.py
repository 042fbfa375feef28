"""MAGVIT-v2, MMaDA's image tokenizer (showlab/magvitv2; Gen-Verse/MMaDA models/modeling_magvitv2.py).

A VQGAN encoder / decoder (taming-transformers' blocks: GroupNorm(32) + swish ResNet blocks,
single-head attention, nearest 2x upsampling, stride-2 downsampling after a (0, 1, 0, 1) pad) around
a look-up-free quantizer: code k is the `codebook_dim` bits of k, most significant first, as -1 / +1.
Images are NHWC here (the reference's NCHW weights are transposed on load); pixels are in [-1, 1].

The checkpoint is a folder of its own (config.json and the weights). The reference's `MAGVITv2()`
takes no arguments: its sizes are VQGANEncoder's / VQGANDecoder's / LFQuantizer's defaults, so the
released config.json carries none. This module reads optional `encoder` / `decoder` (the classes'
keyword arguments) and `codebook_dim` keys, defaulting to those values; tiny test folders use them.
A converted MMaDA folder carries this folder as its `vq_model/` subfolder (conversion copies it).
"""

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .common import ImageTokenizer

# The defaults the encoder's and the decoder's configs share, then each one's own.
TOWER_DEFAULTS = {"ch": 128, "attn_resolutions": [5], "resolution": 256, "z_channels": 13}
ENCODER_DEFAULTS = dict(
    TOWER_DEFAULTS, ch_mult=[1, 2, 2, 4, 4], num_res_blocks=[4, 3, 4, 3, 4], in_ch=3
)
DECODER_DEFAULTS = dict(
    TOWER_DEFAULTS, ch_mult=[1, 1, 2, 2, 4], num_res_blocks=[4, 4, 3, 4, 3], out_ch=3
)
CODEBOOK_DIM = 13
# The reference's file names (its modeling_utils: SAFETENSORS_WEIGHTS_NAME, WEIGHTS_NAME).
WEIGHT_FILES = ("pytorch_model.safetensors", "model.safetensors", "pytorch_model.bin")


@dataclass
class VQConfig:
    encoder: Dict[str, Any] = field(default_factory=dict)
    decoder: Dict[str, Any] = field(default_factory=dict)
    codebook_dim: int = CODEBOOK_DIM

    def __post_init__(self):
        self.encoder = _checked("encoder", ENCODER_DEFAULTS, self.encoder)
        self.decoder = _checked("decoder", DECODER_DEFAULTS, self.decoder)
        for part in (self.encoder, self.decoder):
            if part["z_channels"] != self.codebook_dim:
                raise ValueError(
                    f"magvitv2: z_channels {part['z_channels']} differs from codebook_dim "
                    f"{self.codebook_dim} (the quantizer's bits are the latent's channels)"
                )

    @classmethod
    def from_dict(cls, config: Dict[str, Any]) -> "VQConfig":
        return cls(
            encoder=config.get("encoder") or {},
            decoder=config.get("decoder") or {},
            codebook_dim=config.get("codebook_dim", CODEBOOK_DIM),
        )

    @property
    def codebook_size(self) -> int:
        return 2**self.codebook_dim

    @property
    def downsample(self) -> int:
        """Pixels per image token along each side."""
        return 2 ** (len(self.decoder["ch_mult"]) - 1)


def _checked(part: str, defaults: Dict[str, Any], given: Dict[str, Any]) -> Dict[str, Any]:
    unknown = sorted(set(given) - set(defaults) - {"dropout", "double_z", "in_ch", "out_ch"})
    if unknown:
        raise ValueError(f"magvitv2: unknown {part} config keys {unknown}")
    out = dict(defaults, **given)
    if out.get("double_z"):
        raise ValueError("magvitv2: double_z=True is not supported (MAGVIT-v2 uses False)")
    if len(out["num_res_blocks"]) != len(out["ch_mult"]):
        raise ValueError(f"magvitv2: {part} num_res_blocks and ch_mult differ in length")
    return out


def swish(x):
    return x * mx.sigmoid(x)


def group_norm(channels: int) -> nn.GroupNorm:
    # torch's channel grouping (pytorch_compatible) with the reference's 32 groups and eps.
    return nn.GroupNorm(32, channels, eps=1e-6, affine=True, pytorch_compatible=True)


def conv(cin: int, cout: int, kernel: int = 3, stride: int = 1, padding: Optional[int] = None):
    pad = kernel // 2 if padding is None else padding
    return nn.Conv2d(cin, cout, kernel, stride=stride, padding=pad)


class ResnetBlock(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.norm1 = group_norm(cin)
        self.conv1 = conv(cin, cout)
        self.norm2 = group_norm(cout)
        self.conv2 = conv(cout, cout)
        if cin != cout:
            self.nin_shortcut = conv(cin, cout, 1)

    def __call__(self, x):
        h = self.conv1(swish(self.norm1(x)))
        h = self.conv2(swish(self.norm2(h)))
        if "nin_shortcut" in self:
            x = self.nin_shortcut(x)
        return x + h


class AttnBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.norm = group_norm(channels)
        self.q = conv(channels, channels, 1)
        self.k = conv(channels, channels, 1)
        self.v = conv(channels, channels, 1)
        self.proj_out = conv(channels, channels, 1)

    def __call__(self, x):
        B, H, W, C = x.shape
        h = self.norm(x)
        q, k, v = (f(h).reshape(B, H * W, C) for f in (self.q, self.k, self.v))
        w = mx.softmax((q @ k.transpose(0, 2, 1)) * (C**-0.5), axis=-1)
        return x + self.proj_out((w @ v).reshape(B, H, W, C))


class Upsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = conv(channels, channels)

    def __call__(self, x):
        x = mx.repeat(mx.repeat(x, 2, axis=1), 2, axis=2)  # nearest, scale 2
        return self.conv(x)


class Downsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = conv(channels, channels, 3, stride=2, padding=0)

    def __call__(self, x):
        return self.conv(mx.pad(x, [(0, 0), (0, 1), (0, 1), (0, 0)]))


class Level(nn.Module):
    """One resolution: its ResNet blocks, their attention blocks, then the resampling."""

    def __init__(self, cin: int, cout: int, n_blocks: int, attention: bool):
        super().__init__()
        self.block = [ResnetBlock(cin if i == 0 else cout, cout) for i in range(n_blocks)]
        self.attn = [AttnBlock(cout) for _ in range(n_blocks)] if attention else []

    def blocks(self, h):
        for i, block in enumerate(self.block):
            h = block(h)
            if self.attn:
                h = self.attn[i](h)
        return h


class Middle(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.block_1 = ResnetBlock(channels, channels)
        self.attn_1 = AttnBlock(channels)
        self.block_2 = ResnetBlock(channels, channels)

    def __call__(self, h):
        return self.block_2(self.attn_1(self.block_1(h)))


class VQGANDecoder(nn.Module):
    def __init__(
        self, ch, ch_mult, num_res_blocks, attn_resolutions, resolution, z_channels, out_ch=3, **_
    ):
        super().__init__()
        n = len(ch_mult)
        block_in = ch * ch_mult[-1]
        res = resolution // 2 ** (n - 1)
        self.post_quant_conv = conv(z_channels, z_channels, 1)
        self.conv_in = conv(z_channels, block_in)
        self.mid = Middle(block_in)
        levels: List[Optional[Level]] = [None] * n
        for i in reversed(range(n)):
            level = Level(block_in, ch * ch_mult[i], num_res_blocks[i], res in attn_resolutions)
            block_in = ch * ch_mult[i]
            if i != 0:
                level.upsample = Upsample(block_in)
                res *= 2
            levels[i] = level
        self.up = levels
        self.norm_out = group_norm(block_in)
        self.conv_out = conv(block_in, out_ch)

    def __call__(self, z):
        h = self.mid(self.conv_in(self.post_quant_conv(z)))
        for level in reversed(self.up):
            h = level.blocks(h)
            if "upsample" in level:
                h = level.upsample(h)
        return self.conv_out(swish(self.norm_out(h)))


class VQGANEncoder(nn.Module):
    def __init__(
        self, ch, ch_mult, num_res_blocks, attn_resolutions, resolution, z_channels, in_ch=3, **_
    ):
        super().__init__()
        n = len(ch_mult)
        res = resolution
        self.conv_in = conv(in_ch, ch)
        levels = []
        in_mult = (1,) + tuple(ch_mult)
        for i in range(n):
            level = Level(
                ch * in_mult[i], ch * ch_mult[i], num_res_blocks[i], res in attn_resolutions
            )
            if i != n - 1:
                level.downsample = Downsample(ch * ch_mult[i])
                res //= 2
            levels.append(level)
        self.down = levels
        block_in = ch * ch_mult[-1]
        self.mid = Middle(block_in)
        self.norm_out = group_norm(block_in)
        self.conv_out = conv(block_in, z_channels)
        self.quant_conv = conv(z_channels, z_channels, 1)

    def __call__(self, x):
        h = self.conv_in(x)
        for level in self.down:
            h = level.blocks(h)
            if "downsample" in level:
                h = level.downsample(h)
        h = self.conv_out(swish(self.norm_out(self.mid(h))))
        return self.quant_conv(h)


class MAGVITv2(ImageTokenizer):
    def __init__(self, config: VQConfig):
        super().__init__(config)
        self.encoder = VQGANEncoder(**config.encoder)
        self.decoder = VQGANDecoder(**config.decoder)
        bits = config.codebook_dim
        self._powers = mx.array([2 ** (bits - 1 - i) for i in range(bits)], dtype=mx.int32)

    def codebook_entry(self, codes: mx.array, shape: Optional[Tuple[int, int]] = None):
        """(B, N) code indices -> (B, h, w, codebook_dim) latents of -1 / +1 (LFQuantizer's
        get_codebook_entry; a square grid unless `shape` gives (h, w))."""
        B, N = codes.shape
        h, w = shape if shape is not None else (math.isqrt(N), math.isqrt(N))
        if h * w != N:
            raise ValueError(f"magvitv2: {N} codes do not fill a {h}x{w} grid")
        bits = (codes.astype(mx.int32)[..., None] // self._powers) % 2
        return (bits.astype(mx.float32) * 2 - 1).reshape(B, h, w, -1)

    def decode_code(self, codes: mx.array, shape: Optional[Tuple[int, int]] = None) -> mx.array:
        """(B, N) code indices -> (B, H, W, 3) pixels in about [-1, 1]."""
        return self.decoder(self.codebook_entry(codes, shape))

    def get_code(self, pixels: mx.array) -> mx.array:
        """(B, H, W, 3) pixels in [-1, 1] -> (B, N) code indices (the encoder's latent signs)."""
        z = self.encoder(pixels)
        return ((z > 0).astype(mx.int32) * self._powers).sum(axis=-1).reshape(z.shape[0], -1)

    def sanitize(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        out = {}
        for key, value in weights.items():
            if key.startswith("quantize."):
                continue  # the codebook and bit weights are recomputed (buffers, not learned)
            if value.ndim == 4:
                value = value.transpose(0, 2, 3, 1)  # torch OIHW -> mlx OHWI
            out[key] = value
        return out


def to_uint8(pixels: mx.array) -> np.ndarray:
    """(B, H, W, 3) pixels in [-1, 1] -> uint8 as the reference converts them (clamp, x255,
    truncation)."""
    scaled = mx.clip((pixels.astype(mx.float32) + 1.0) / 2.0, 0.0, 1.0) * 255.0
    return np.array(scaled).astype(np.uint8)


def read_weights(folder: Path) -> Dict[str, mx.array]:
    for name in WEIGHT_FILES:
        file = folder / name
        if not file.exists():
            continue
        if name.endswith(".bin"):
            try:
                import torch
            except ImportError as e:
                raise ValueError(
                    f"magvitv2: {file} is a PyTorch pickle and torch is not installed; convert it "
                    "to model.safetensors (safetensors.torch.save_file of its state dict)"
                ) from e
            state = torch.load(str(file), map_location="cpu", weights_only=True)
            return {k: mx.array(v.float().numpy()) for k, v in state.items()}
        return dict(mx.load(str(file)))
    raise FileNotFoundError(
        f"magvitv2: no weights in {folder} (looked for {', '.join(WEIGHT_FILES)})"
    )


def load(path) -> MAGVITv2:
    """The VQ model of the folder `path` (config.json and weights, showlab/magvitv2's layout)."""
    folder = Path(path)
    if not (folder / "config.json").exists():
        raise FileNotFoundError(
            f"magvitv2: {folder} has no config.json (a showlab/magvitv2 folder)"
        )
    config = json.loads((folder / "config.json").read_text())
    model = MAGVITv2(VQConfig.from_dict(config))
    weights = model.sanitize(read_weights(folder))
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model
