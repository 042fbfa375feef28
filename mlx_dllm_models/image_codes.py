"""An input image and an inpainting mask as the image columns of a text-to-image prompt.

The image is prepared as MMaDA's app.py `image_transform` does before `get_code` (torchvision's
Resize of the shorter side, bicubic, then CenterCrop, ToTensor, Normalize(0.5, 0.5)) and encoded
by the VQ model; the mask (white = repaint) marks a token to decode when any pixel of its cell is
set. MMaDA's t2i_generate keeps every image column that is not the mask token and decodes the
others, so inpainting is its own loop over a partly given canvas.
"""

from typing import Any, List, Optional, Sequence

import mlx.core as mx
import numpy as np

from .errors import SettingsError
from .vision import read_images


def resized_crop(image, width: int, height: int):
    """torchvision's Resize (shorter side, bicubic, the longer side truncated) and CenterCrop."""
    from PIL import Image

    w0, h0 = image.size
    if w0 * height >= h0 * width:  # the height is the side that fills
        size = (max(width, int(w0 * height / h0)), height)
    else:
        size = (width, max(height, int(h0 * width / w0)))
    if image.size != size:
        image = image.resize(size, Image.BICUBIC)
    left = int(round((size[0] - width) / 2.0))
    top = int(round((size[1] - height) / 2.0))
    return image.crop((left, top, left + width, top + height))


def pixels(image, width: int, height: int) -> mx.array:
    """(1, height, width, 3) float32 in [-1, 1]."""
    arr = np.asarray(resized_crop(image, width, height), dtype=np.float32) / 255.0
    return mx.array(((arr - 0.5) / 0.5)[None])


def repaint_cells(mask, rows: int, cols: int, cell: int) -> np.ndarray:
    """(rows * cols,) True where the token's cell holds a repainted (non-black) pixel."""
    from PIL import Image

    if not isinstance(mask, Image.Image):
        arr = np.asarray(mask)
        if arr.dtype == bool:
            arr = arr.astype(np.uint8) * 255
        mask = Image.fromarray(np.asarray(arr, dtype=np.uint8))
    grey = np.asarray(resized_crop(mask.convert("L"), cols * cell, rows * cell)) > 127
    return grey.reshape(rows, cell, cols, cell).any(axis=(1, 3)).reshape(-1)


def start_codes(
    vq, images: Sequence[Any], masks: Sequence[Any], rows: int, cols: int
) -> Optional[np.ndarray]:
    """(B, N) codes the canvas starts from, -1 where decoded; None without any image."""
    if all(image is None for image in images):
        if any(mask is not None for mask in masks):
            raise SettingsError("a mask without an image: give the image to inpaint")
        return None
    ds = vq.downsample
    out: List[np.ndarray] = []
    for image, mask in zip(images, masks):
        if image is None:
            out.append(np.full(rows * cols, -1, dtype=np.int64))
            continue
        if mask is None:
            raise SettingsError(
                "an image without a mask: MMaDA inpaints (mask= marks the region to repaint in "
                "white); it has no text-guided editing of a whole image"
            )
        (picture,) = read_images([image])
        codes = np.array(vq.get_code(pixels(picture, cols * ds, rows * ds)))[0].astype(np.int64)
        repaint = repaint_cells(mask, rows, cols, ds)
        if not repaint.any():
            raise SettingsError("the mask repaints nothing: mark the region to repaint in white")
        out.append(np.where(repaint, -1, codes))
    return np.stack(out)


def aligned(values, n: int, name: str) -> List[Any]:
    if values is None:
        return [None] * n
    values = list(values)
    if len(values) != n:
        raise SettingsError(f"{len(values)} {name} for {n} prompts")
    return values


def grid_tokens(codes: Optional[np.ndarray], row: int, n: int, offset: int, mask_id: int):
    """A row's image columns: the given codes as vocabulary ids, the mask id elsewhere."""
    if codes is None:
        return [mask_id] * n
    return [int(c) + offset if c >= 0 else mask_id for c in codes[row]]
