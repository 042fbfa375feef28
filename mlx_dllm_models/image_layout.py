"""The `system_user_grid` prompt layout of text-to-image (Lumina-DiMOO's inference_t2i.py).

A conditional row is the tokenized `text_template` with the user's prompt in it
(`<system>Generate an image according to the text prompt.</system><user>PROMPT</user>`), then
`<answer_start> <boi>`, the h x w image tokens row by row with the newline token closing every
row (add_break_line), then `<eoi> <answer_end>`. The unconditional row is the tokenized
`uncond_text` followed by the same image part. The reference runs each alone; here every text
part (conditional and unconditional) is left-padded to the batch's widest, the padding masked
off, so that the rows share their forwards (RoPE sees only relative positions, so a padded row's
logits are its unpadded ones).

Editing (scripts/inference_i2i.py, edit types "edit_*"): the input image is cropped as
utils/image_utils.py's var_center_crop does (the crop size of at most 512 x 512 in 32-pixel
patches nearest the image's aspect, halvings by BOX, a bicubic resize, then the crop; the
reference places the crop at random, here at the centre) and encoded (encode_img_with_breaks:
`<boi>` codes with row ends `<eoi>`); the conditional row is the editing prompt's ids with that
image part before its last token, the text-unconditional row the `<uncondition>` prompt's with the
same image part, the image-unconditional row the editing prompt alone; all are followed by the
answer grid, which has the input's token shape.
"""

from typing import Dict, List, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .image_spec import ImageSpec

# The image part's special tokens, by the names of the reference's config.py SPECIAL_TOKENS.
GRID_TOKENS = ("answer_start", "boi", "newline_token", "eoi", "answer_end")


def grid_part(ids: Dict[str, int], rows: int, cols: int, mask_id: int) -> Tuple[List[int], list]:
    """(the image part's ids, the positions of its image tokens within it)."""
    part = [ids["answer_start"], ids["boi"]]
    columns = []
    for _ in range(rows):
        columns.extend(range(len(part), len(part) + cols))
        part.extend([mask_id] * cols + [ids["newline_token"]])
    return part + [ids["eoi"], ids["answer_end"]], columns


def grid_rows(
    tok, spec: ImageSpec, ids: Dict[str, int], texts: Sequence[str], shape: Tuple[int, int]
):
    """(cond ids (B, L), cond pads, uncond text prefix (B, T), uncond pads, text width T, image
    columns) of the prompts, every row's image tokens masked."""
    cond = [list(tok(spec.text_template.format(t))["input_ids"]) for t in texts]
    blank = list(tok(spec.uncond_text)["input_ids"])
    width = max(len(blank), *(len(c) for c in cond))
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    part, columns = grid_part(ids, *shape, spec.mask_token_id)

    def padded(text: List[int]) -> List[int]:
        return [pad_id] * (width - len(text)) + text

    rows = mx.array([padded(c) + part for c in cond], dtype=mx.int32)
    pads = [width - len(c) for c in cond]
    uncond = mx.array([padded(blank)] * len(texts), dtype=mx.int32)
    uncond_pads = [width - len(blank)] * len(texts)
    return rows, pads, uncond, uncond_pads, width, [width + c for c in columns]


def crop_sizes(num_patches: int, patch: int, max_ratio: float = 4.0) -> List[Tuple[int, int]]:
    """generate_crop_size_list: (width, height) of up to `num_patches` patches, aspect <= 4."""
    out, wp, hp = [], num_patches, 1
    while wp > 0:
        if max(wp, hp) / min(wp, hp) <= max_ratio:
            out.append((wp * patch, hp * patch))
        if (hp + 1) * wp <= num_patches:
            hp += 1
        else:
            wp -= 1
    return out


def edit_picture(image, side: int = 512, patch: int = 32):
    """var_center_crop(image, generate_crop_size_list((side // patch) ** 2, patch)), the crop
    centred."""
    from PIL import Image

    w, h = image.size
    sizes = crop_sizes((side // patch) ** 2, patch)
    fit = [min(cw / w, ch / h) / max(cw / w, ch / h) for cw, ch in sizes]
    cw, ch = sorted(zip(fit, sizes), reverse=True)[0][1]
    while image.size[0] >= 2 * cw and image.size[1] >= 2 * ch:
        image = image.resize(tuple(x // 2 for x in image.size), resample=Image.BOX)
    scale = max(cw / image.size[0], ch / image.size[1])
    image = image.resize(tuple(round(x * scale) for x in image.size), resample=Image.BICUBIC)
    left, top = (image.size[0] - cw) // 2, (image.size[1] - ch) // 2
    return image.crop((left, top, left + cw, top + ch))


def edit_pixels(image) -> np.ndarray:
    """(1, H, W, 3) float32 in [0, 1] (VaeImageProcessor.preprocess, do_normalize=False)."""
    return (np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0)[None]


def image_part(ids: Dict[str, int], codes: Sequence[int], rows: int, cols: int, offset: int):
    """encode_img_with_breaks' ids: <boi>, each row's codes then the newline, <eoi>."""
    part = [ids["boi"]]
    for r in range(rows):
        part.extend(int(c) + offset for c in codes[r * cols : (r + 1) * cols])
        part.append(ids["newline_token"])
    return part + [ids["eoi"]]


def edit_rows(tok, spec: ImageSpec, ids: Dict[str, int], texts, parts, shape: Tuple[int, int]):
    """(cond ids, cond pads, [(uncond prefix, pads) for the text- and the image-unconditional
    rows], text width, image columns) of editing prompts; `parts` are the input images' ids
    (image_part)."""
    prompts = [list(tok(spec.edit_template.format(t))["input_ids"]) for t in texts]
    blank = list(tok(spec.edit_uncond_text)["input_ids"])
    cond = [p[:-1] + part + p[-1:] for p, part in zip(prompts, parts)]
    no_text = [blank[:-1] + part + blank[-1:] for part in parts]
    width = max(len(r) for r in cond + no_text + prompts)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    grid, columns = grid_part(ids, *shape, spec.mask_token_id)

    def padded(rows):
        text = mx.array([[pad_id] * (width - len(r)) + r for r in rows], dtype=mx.int32)
        return text, [width - len(r) for r in rows]

    text, pads = padded(cond)
    rows = mx.concatenate([text, mx.array([grid] * len(cond), dtype=mx.int32)], axis=1)
    return rows, pads, [padded(no_text), padded(prompts)], width, [width + c for c in columns]
