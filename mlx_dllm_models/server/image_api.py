"""OpenAI's Images API on `mlx_dllm serve`: `POST /v1/images/generations` (a JSON body) and
`POST /v1/images/edits` (a multipart form: inpainting), for a model that writes images as tokens
(MMaDA).

Fields: `prompt`; `n` (1..MAX_N images of it); `size` ("WxH", each a multiple of the VQ model's
cell; default the size the model was trained on); `response_format` "b64_json" (the default; "url"
is refused: the server keeps no files to link to); `seed` (image i draws from seed + i; none: a
fresh one); the package's own `steps`, `guidance_scale`, `temperature` (default the model's, from
the reference's script); `model` (checked as for completions), `user` (ignored). An edit takes
`image` and `mask`: the mask's transparent pixels mark the region to repaint, as OpenAI's; a mask
without transparency marks it in white (MMaDA's own convention); without a mask, the image's own
transparent pixels do. The answer is `{"created", "data": [{"b64_json": PNG}, ...]}`.

The handler checks the request on its thread and hands an image_jobs.ImageJob to the scheduler's
worker, which owns the model; it then waits for the job's event.
"""

import base64
import io
import queue
import re
import secrets
import time
from typing import Any, Dict, Optional

from starlette.concurrency import run_in_threadpool

from .fields import RequestError
from .image_jobs import ImageJob

MAX_N = 8
OPTIONS = {
    "steps": int,
    "guidance_scale": float,
    "temperature": float,
    "image_guidance_scale": float,
    "edit_side": int,
}
FIELDS = {"prompt", "n", "size", "response_format", "seed", "model", "user", *OPTIONS}
EDIT_FILES = ("image", "image[]", "mask")
SIZE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


def image_queue(service):
    """The scheduler's image queue, or a 400 saying why this server makes no images."""
    images = service.scheduler.images
    if images.refusal is not None:
        raise RequestError(images.refusal)
    return images


def read_size(value, images) -> Dict[str, int]:
    """`size` as width and height (none: the model's own)."""
    width, height = images.default_size
    if value is not None and value != "auto":
        found = SIZE.match(value) if isinstance(value, str) else None
        if found is None:
            raise RequestError(f"size must be 'WIDTHxHEIGHT', got {value!r}", param="size")
        width, height = int(found[1]), int(found[2])
    cell = images.vq.downsample
    if not (width >= cell and height >= cell and width % cell == 0 and height % cell == 0):
        raise RequestError(
            f"size {value!r}: width and height must be multiples of {cell} pixels (one image "
            f"token covers {cell}x{cell}); the model was trained on "
            f"{images.default_size[0]}x{images.default_size[1]}",
            param="size",
        )
    return {"width": width, "height": height}


def number(fields: dict, name: str, kind):
    """A field as `kind` (a form sends text), or None; a 400 naming it when it is not one."""
    value = fields.get(name)
    if value is None:
        return None
    try:
        if isinstance(value, bool) or (isinstance(value, float) and kind is int):
            raise ValueError
        return kind(value)
    except (TypeError, ValueError):
        raise RequestError(f"{name} must be {kind.__name__}, got {value!r}", param=name) from None


def read_job(service, fields: dict, image=None, mask=None) -> ImageJob:
    """The ImageJob of a request's fields (a 400 for a bad one)."""
    images = image_queue(service)
    unknown = sorted(set(fields) - FIELDS - set(EDIT_FILES))
    if unknown:
        raise RequestError(
            f"{unknown[0]} is not supported by this server's images endpoints (it takes "
            f"{', '.join(sorted(FIELDS))})",
            param=unknown[0],
        )
    service.check_model(fields.get("model"))
    prompt = fields.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise RequestError("prompt is required: the text of the image", param="prompt")
    fmt = fields.get("response_format")
    if fmt not in (None, "b64_json"):
        why = "this server keeps no files to link to" if fmt == "url" else "it is not one"
        raise RequestError(
            f"response_format {fmt!r} is not supported ({why}); ask for 'b64_json'",
            param="response_format",
        )
    n = number(fields, "n", int)
    n = 1 if n is None else n
    if not 1 <= n <= MAX_N:
        raise RequestError(f"n must be between 1 and {MAX_N}, got {n}", param="n")
    seed = number(fields, "seed", int)
    seed = secrets.randbelow(2**31) if seed is None else seed
    options = read_size(fields.get("size"), images)
    if image is not None and mask is None and fields.get("size") in (None, "auto"):
        options.update(width=None, height=None)  # an edited image keeps its input's crop size
    options.update({k: number(fields, k, kind) for k, kind in OPTIONS.items()})
    return ImageJob(prompt, [seed + i for i in range(n)], options, image, mask)


def wait(service, job: ImageJob, poll: float = 1.0):
    """The job's images, once the worker has made them (a RequestError for its error)."""
    while True:
        try:
            event = job.events.get(timeout=poll)
            break
        except queue.Empty:  # the worker may have stopped meanwhile
            if not service.is_healthy:
                raise RequestError("the server is shutting down; send the request again", 503)
    if event[0] == "error":
        raise RequestError(event[1], event[2])
    return event[1]


def png_b64(image) -> str:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode("ascii")


async def answer(service, job: ImageJob) -> dict:
    service.scheduler.images.add(job)
    try:
        pictures = await run_in_threadpool(wait, service, job)
    finally:
        job.cancelled = True  # if the client left before the batch began, it leaves the queue
    return {"created": int(time.time()), "data": [{"b64_json": png_b64(p)} for p in pictures]}


def picture(upload, name: str, data: bytes):
    """An uploaded image as PIL (a 400 naming the field when it is not one)."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError):
        label = getattr(upload, "filename", None) or name
        raise RequestError(f"{name} {label!r} is not an image PIL can read", param=name) from None
    return image


def repaint_mask(mask, image) -> Any:
    """The white-means-repaint mask image_codes reads, from OpenAI's transparent-means-edit mask
    (or a mask without transparency, white already), else from the image's own transparency."""
    source = mask if mask is not None else image
    if "A" in source.getbands() or "transparency" in source.info:
        alpha = source.convert("RGBA").getchannel("A")
        return alpha.point(lambda a: 255 if a == 0 else 0)
    if mask is None:
        raise RequestError(
            "mask is required: a PNG whose transparent (or, without transparency, white) pixels "
            "mark the region to repaint (or an image with transparent pixels there)",
            param="mask",
        )
    return mask.convert("L")


async def edit_fields(request, service) -> tuple:
    """(fields, image, mask) of an edits request's multipart form."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > service.max_body_bytes:
        raise RequestError(
            f"the request body has {length} bytes, more than this server takes "
            f"({service.max_body_bytes}); start the server with a larger --max-body-bytes",
            413,
        )
    try:
        form = await request.form()
    except Exception as e:  # python-multipart's parse errors, a body that is no form
        raise RequestError(f"the body is not a multipart form ({type(e).__name__})") from None
    fields: Dict[str, Any] = {k: v for k, v in form.items() if isinstance(v, str)}
    files: Dict[str, Optional[Any]] = {}
    for name in EDIT_FILES:
        upload = form.get(name)
        if upload is not None and not isinstance(upload, str):
            files[name.rstrip("[]")] = picture(upload, name.rstrip("[]"), await upload.read())
    image = files.get("image")
    if image is None:
        raise RequestError("image is required: the picture to edit, as a file", param="image")
    spec = image_queue(service).spec
    if spec.edits and files.get("mask") is None:
        return fields, image.convert("RGB"), None  # the text edits the whole image
    mask = repaint_mask(files.get("mask"), image)
    return fields, image.convert("RGB"), mask


async def generations(request, service, receive_body, limits) -> dict:
    body = await receive_body(request, service.max_body_bytes, limits.body_timeout)
    return await answer(service, read_job(service, body))


async def edits(request, service) -> dict:
    fields, image, mask = await edit_fields(request, service)
    return await answer(service, read_job(service, fields, image, mask))
