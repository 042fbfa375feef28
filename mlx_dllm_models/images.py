"""Text-to-image generation of the unified families (MMaDA, Lumina-DiMOO): `generate_image`,
`stream_generate_image` and `batch_generate_image`.

The image spec's `layout` says how a prompt is laid out. `t2i_gen_prompt` (MMaDA's
UniversalPrompting): `[iPAD]... <|t2i|> <bos> text <eos> <|soi|> image tokens <|eoi|>`, the text
part left-padded with [iPAD] to `max_text_len + 1` columns (longer text is cut to leave its
<eos>), attention masked off the padding; under guidance each row has an unconditional twin whose
text is ''. `system_user_grid` (Lumina-DiMOO): image_layout.py. The image columns start masked
and engine.maskgit decodes them with the spec's `rule`; the VQ model of the spec's `vq_kind`
(models/magvitv2.py or models/vqmodel.py, the checkpoint's `vq_subfolder` unless given) turns
the codebook indices into pixels.

Settings left as None take the model's `image_spec` defaults (the reference's: guidance 3.5, 15
steps, temperature 1.0 for MMaDA). The server and CLI call these functions as they are.
"""

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import numpy as np

from .engine.maskgit import STEP_RULES, Draws, ImageDecoder, ImageRows, Unconditional, seeded_draws
from .errors import SettingsError
from .image_codes import aligned, grid_tokens, start_codes
from .image_layout import GRID_TOKENS, edit_picture, edit_pixels, edit_rows, grid_rows, image_part
from .image_spec import ImageSpec
from .models import magvitv2, vqmodel
from .vision import read_images, text_tokenizer

# ImageSpec.vq_kind -> (its module: load, to_uint8; its model class; the upstream it reads)
VQ_KINDS = {
    "magvitv2": (magvitv2, magvitv2.MAGVITv2, "showlab/magvitv2"),
    "vqmodel": (vqmodel, vqmodel.VQModel, "diffusers' VQModel"),
}
_VQ_MODELS: Dict[str, Any] = {}


@dataclass
class ImageResponse:
    """A streamed step: the image decoded from every position's current sample (the last step's
    is the final image), with the step count and the codebook indices."""

    step: int
    steps: int
    image: Any  # PIL.Image.Image
    tokens: List[int]
    nfe: int


def image_spec_of(model) -> ImageSpec:
    spec = getattr(model, "image_spec", None)
    if spec is None:
        name = getattr(getattr(model, "args", None), "model_type", type(model).__name__)
        raise SettingsError(
            f"{name} cannot generate images: image generation needs a unified multimodal model "
            "that writes images as tokens (MMaDA, Lumina-DiMOO)"
        )
    return spec


def load_vq_model(path, kind: str = "magvitv2"):
    """The VQ model (of `kind`, an ImageSpec.vq_kind) of folder `path`, loaded once per
    process."""
    key = str(Path(path).resolve())
    if key not in _VQ_MODELS:
        _VQ_MODELS[key] = VQ_KINDS[kind][0].load(path)
    return _VQ_MODELS[key]


def resolve_vq_model(processor, spec: ImageSpec, vq_model=None):
    """`vq_model` (a VQ model of the spec's kind, or a folder), else the checkpoint folder's
    `spec.vq_subfolder`."""
    module, cls, upstream = VQ_KINDS[spec.vq_kind]
    if isinstance(vq_model, cls):
        vq = vq_model
    else:
        if vq_model is None:
            tok = hf_tokenizer(processor)
            root = Path(getattr(tok, "name_or_path", "") or ".")
            vq_model = root / spec.vq_subfolder
        if not (Path(vq_model) / "config.json").exists():
            raise SettingsError(
                f"{spec.family}: no VQ model at {vq_model}: put the image tokenizer's folder "
                f"({upstream}: config.json and weights) there, or pass vq_model=PATH"
            )
        vq = load_vq_model(vq_model, spec.vq_kind)
    if vq.codebook_size != spec.codebook_size:
        raise SettingsError(
            f"{spec.family}: the VQ model's codebook has {vq.codebook_size} entries, the model's "
            f"config.json says codebook_size {spec.codebook_size}"
        )
    return vq


def hf_tokenizer(processor):
    tok = text_tokenizer(processor)
    return getattr(tok, "_tokenizer", tok)


def special_ids(tok, spec: ImageSpec) -> Dict[str, int]:
    """The prompt's special ids by name in the tokenizer, else the reference's fixed ids."""
    out = {}
    for name in spec.prompt_tokens:
        idx = tok.convert_tokens_to_ids(name)
        if idx is None or (idx == tok.unk_token_id and name != tok.unk_token):
            idx = spec.special_tokens[name]
        out[name] = int(idx)
    return out


def grid(spec: ImageSpec, vq, width, height) -> Tuple[int, int]:
    """(rows, columns) of image tokens for a width x height image."""
    side = math.isqrt(spec.num_vq_tokens) * vq.downsample
    width = side if width is None else width
    height = side if height is None else height
    ds = vq.downsample
    for name, value in (("width", width), ("height", height)):
        if not isinstance(value, int) or value < ds or value % ds:
            raise SettingsError(
                f"{spec.family}: {name} {value!r} is not a multiple of {ds} pixels (one image "
                f"token covers {ds}x{ds}); the model was trained on {side}x{side}"
            )
    return height // ds, width // ds


def text_part(tok, spec: ImageSpec, ids: Dict[str, int], text: str) -> Tuple[List[int], int]:
    """(the text columns of one row, its left padding) as t2i_gen_prompt builds them."""
    bos, eos = tok.bos_token_id, tok.eos_token_id
    text_ids = list(tok(text)["input_ids"])
    if not text_ids:
        text_ids = [bos]
    elif text_ids[0] != bos:
        text_ids = [bos] + text_ids
    row = [ids["<|t2i|>"]] + text_ids + [eos]
    width = spec.max_text_len + 1
    if len(row) > width:
        return row[: width - 1] + [eos], 0
    return [ids["[iPAD]"]] * (width - len(row)) + row, width - len(row)


def t2i_rows(processor, spec: ImageSpec, texts: Sequence[str], n_tokens: int, codes=None, offset=0):
    """(ids (B, L), left paddings) of the prompts with their image columns masked (or, with
    `codes`, holding the given codes where they are not -1)."""
    tok = hf_tokenizer(processor)
    ids = special_ids(tok, spec)
    rows, pads = [], []
    for i, text in enumerate(texts):
        part, pad = text_part(tok, spec, ids, text)
        image = grid_tokens(codes, i, n_tokens, offset, spec.mask_token_id)
        rows.append(part + [ids["<|soi|>"]] + image + [ids["<|eoi|>"]])
        pads.append(pad)
    return mx.array(rows, dtype=mx.int32), pads


def codebook_offset(processor, spec: ImageSpec) -> int:
    offset = spec.image_token_offset
    if offset is None:
        offset = len(hf_tokenizer(processor)) + spec.num_new_special_tokens
    rows = spec.vocab_rows
    if offset + spec.codebook_size > rows:
        raise SettingsError(
            f"{spec.family}: image tokens {offset}..{offset + spec.codebook_size - 1} (after the "
            f"tokenizer's {offset} ids) exceed the model's {rows} vocabulary rows"
        )
    return offset


def seeds_of(seed, n: int) -> List[int]:
    if isinstance(seed, int):
        return [seed + i for i in range(n)]
    seeds = [int(s) for s in seed]
    if len(seeds) != n:
        raise SettingsError(f"{len(seeds)} seeds for {n} prompts")
    return seeds


def checked_settings(spec: ImageSpec, prompts, steps, guidance_scale, images, masks):
    editing = spec.edits and any(image is not None for image in images)
    default = spec.edit_guidance_scale if editing else spec.guidance_scale
    steps = spec.steps if steps is None else steps
    guidance_scale = default if guidance_scale is None else guidance_scale
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise SettingsError(f"steps must be a positive integer, got {steps!r}")
    if not isinstance(guidance_scale, (int, float)) or not guidance_scale >= 0:
        raise SettingsError(f"guidance_scale must be a number >= 0, got {guidance_scale!r}")
    if not prompts:
        raise SettingsError("no prompts: give at least one")
    if not spec.inpaints and any(mask is not None for mask in masks):
        raise SettingsError(
            f"{spec.family}: no inpainting here (its released code has none): give the image "
            "alone, which the prompt edits"
        )
    if not (spec.inpaints or spec.edits) and any(image is not None for image in images):
        raise SettingsError(f"{spec.family}: no image input here: generate from text alone")
    if editing and any(image is None for image in images):
        raise SettingsError(f"{spec.family}: a batch edits an image in every row or in none")
    return steps, guidance_scale, editing


def grid_layout(processor, spec: ImageSpec, prompts, shape) -> ImageRows:
    """The rows of a system_user_grid batch (image_layout.py)."""
    tok = hf_tokenizer(processor)
    ids = {name: spec.special_tokens[name] for name in GRID_TOKENS}
    rows, pads, uncond, uncond_pads, width, columns = grid_rows(tok, spec, ids, prompts, shape)
    return ImageRows(rows, pads, width, columns, [Unconditional(uncond, uncond_pads)])


def edit_layout(processor, spec, vq, prompts, images, size, offset, image_guidance):
    """(the rows of an editing batch (image_layout.py), its token grid)."""
    pictures = [edit_picture(p, spec.edit_side) for p in read_images(images)]
    sizes = {p.size for p in pictures}
    if len(sizes) > 1 or size not in (None, next(iter(sizes))):
        raise SettingsError(
            f"{spec.family}: an edited image keeps its input's crop size ({sorted(sizes)}): "
            "leave width and height out, and edit images of one aspect in a batch"
        )
    w, h = next(iter(sizes))
    shape = (h // vq.downsample, w // vq.downsample)
    codes = vq.get_code(mx.array(np.concatenate([edit_pixels(p) for p in pictures])))
    ids = {name: spec.special_tokens[name] for name in GRID_TOKENS}
    parts = [image_part(ids, row, *shape, offset) for row in codes.tolist()]
    rows, pads, uncond, width, columns = edit_rows(
        hf_tokenizer(processor), spec, ids, prompts, parts, shape
    )
    (no_text, no_text_pads), (no_image, no_image_pads) = uncond
    twins = [
        Unconditional(no_text, no_text_pads),
        Unconditional(no_image, no_image_pads, image_guidance),
    ]
    return ImageRows(rows, pads, width, columns, twins), shape


def decoder_for(
    model,
    processor,
    prompts,
    spec,
    vq,
    *,
    width=None,
    height=None,
    steps=None,
    guidance_scale=None,
    images=None,
    masks=None,
    image_guidance_scale=None,
):
    """(the ImageDecoder of `prompts`, the (rows, columns) of its grid, the steps and guidance it
    runs with): the settings left None take the spec's."""
    images = aligned(images, len(prompts), "images")
    masks = aligned(masks, len(prompts), "masks")
    steps, guidance_scale, editing = checked_settings(
        spec, prompts, steps, guidance_scale, images, masks
    )
    offset = codebook_offset(processor, spec)
    if editing:
        image_guidance = spec.image_guidance_scale
        if image_guidance_scale is not None:
            image_guidance = image_guidance_scale
        if not isinstance(image_guidance, (int, float)) or not image_guidance >= 0:
            raise SettingsError(
                f"image_guidance_scale must be a number >= 0, got {image_guidance_scale!r}"
            )
        size = None if width is None and height is None else (width, height)
        layout, (rows, cols) = edit_layout(
            processor, spec, vq, prompts, images, size, offset, image_guidance
        )
    elif spec.layout == "system_user_grid":
        rows, cols = grid(spec, vq, width, height)
        layout = grid_layout(processor, spec, prompts, (rows, cols))
    else:
        rows, cols = grid(spec, vq, width, height)
        codes = start_codes(vq, images, masks, rows, cols)
        ids, pads = t2i_rows(processor, spec, prompts, rows * cols, codes, offset)
        blank, uncond_pads = t2i_rows(processor, spec, [""] * len(prompts), rows * cols)
        text_len = spec.max_text_len + 1
        twin = Unconditional(blank[:, :text_len], uncond_pads)
        layout = ImageRows(ids, pads, text_len, uncond=[twin])
    decoder = ImageDecoder(
        model,
        layout,
        n_tokens=rows * cols,
        offset=offset,
        codebook_size=spec.codebook_size,
        mask_token_id=spec.mask_token_id,
        rule=spec.rule,
    )
    return decoder, (rows, cols), steps, guidance_scale


def to_pil(vq, codes: mx.array, shape: Tuple[int, int]) -> list:
    from PIL import Image

    module = next(m for m, cls, _ in VQ_KINDS.values() if isinstance(vq, cls))
    pixels = module.to_uint8(vq.decode_code(codes, shape))
    return [Image.fromarray(p) for p in pixels]


def stream_batch(
    model,
    processor,
    prompts: Sequence[str],
    *,
    width: Optional[int] = None,
    height: Optional[int] = None,
    steps: Optional[int] = None,
    guidance_scale: Optional[float] = None,
    temperature: Optional[float] = None,
    seed: Union[int, Sequence[int]] = 0,
    every: int = 1,
    max_text_len: Optional[int] = None,
    images: Optional[Sequence[Any]] = None,
    masks: Optional[Sequence[Any]] = None,
    image_guidance_scale: Optional[float] = None,
    edit_side: Optional[int] = None,
    vq_model=None,
    draws: Optional[Draws] = None,
    on_step: Optional[Callable[[int, int], None]] = None,
) -> Iterator[List[ImageResponse]]:
    """Every `every` steps (and at the last), each prompt's ImageResponse.

        `seed`: row i draws from `seed + i` (or `seed[i]`); `max_text_len`: the prompt's text columns
        less one (the reference's max_seq_length, 512); `images` / `masks` (one a prompt, None for
    none): inpainting, the image encoded, the tokens under the mask's white cells decoded; for a
        model that edits (image_spec.edits), `images` alone: each image edited by its prompt, with
        `image_guidance_scale` (the guidance against the prompt without the image) and
        `edit_side` (the crops' largest square side, 512; a multiple of 32); `vq_model`: a
        VQ model of the spec's kind or its folder (default: the checkpoint's); `draws`: the step's uniforms instead of seeded ones (tests);
        `on_step(step, steps)`: called after every step (a progress bar), images decoded or not."""
    spec = image_spec_of(model)
    if max_text_len is not None:
        if not isinstance(max_text_len, int) or max_text_len < 1:
            raise SettingsError(f"max_text_len must be a positive integer, got {max_text_len!r}")
        spec = replace(spec, max_text_len=max_text_len)
    if edit_side is not None:
        if not isinstance(edit_side, int) or edit_side < 32 or edit_side % 32:
            raise SettingsError(f"edit_side must be a positive multiple of 32, got {edit_side!r}")
        spec = replace(spec, edit_side=edit_side)
    if not isinstance(every, int) or every < 1:
        raise SettingsError(f"every must be a positive integer, got {every!r}")
    if isinstance(prompts, str):
        raise SettingsError("prompts must be a list of strings (generate_image takes one)")
    vq = resolve_vq_model(processor, spec, vq_model)
    prompts = list(prompts)
    run = dict(width=width, height=height, steps=steps, guidance_scale=guidance_scale)
    edits = dict(images=images, masks=masks, image_guidance_scale=image_guidance_scale)
    decoder, shape, steps, guidance_scale = decoder_for(
        model, processor, prompts, spec, vq, **run, **edits
    )
    if draws is None:
        entries = spec.codebook_size if STEP_RULES[spec.rule][1] else None
        draws = seeded_draws(seeds_of(seed, len(prompts)), decoder.n_tokens, entries)
    temperature = spec.temperature if temperature is None else temperature
    if not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise SettingsError(f"temperature must be a number >= 0, got {temperature!r}")
    for event in decoder.run(
        steps=steps, guidance_scale=guidance_scale, temperature=temperature, draws=draws
    ):
        if on_step is not None:
            on_step(event.step + 1, steps)
        last = event.step == steps - 1
        if not last and (event.step + 1) % every:
            continue
        images = to_pil(vq, event.sampled, shape)
        tokens = event.sampled.tolist()
        yield [
            ImageResponse(event.step + 1, steps, image, row, decoder.nfe)
            for image, row in zip(images, tokens)
        ]


def stream_generate_image(
    model, processor, prompt: str, *, every: int = 1, image=None, mask=None, **kwargs
):
    """generate_image's steps: an ImageResponse every `every` steps, the final image last."""
    for responses in stream_batch(
        model, processor, [prompt], every=every, images=[image], masks=[mask], **kwargs
    ):
        yield responses[0]


def batch_generate_image(model, processor, prompts: Sequence[str], **kwargs) -> list:
    """One image per prompt, the prompts sharing every forward; row i draws from `seed + i` (or
    `seed[i]` when a list), so it equals generate_image(prompts[i], seed=seed + i)."""
    last = None
    for last in stream_batch(model, processor, prompts, every=1 << 30, **kwargs):
        pass
    return [r.image for r in last]


def generate_image(model, processor, prompt: str, *, image=None, mask=None, **kwargs):
    """A PIL image of `prompt` (width, height, steps, guidance_scale, temperature, seed,
    vq_model: see stream_batch); with `image` and `mask`, the image with the mask's white region
    repainted."""
    kwargs.update(images=[image], masks=[mask])
    return batch_generate_image(model, processor, [prompt], **kwargs)[0]
