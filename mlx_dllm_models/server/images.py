"""The images of a request's `image_url` content parts: data URLs, http(s) URLs and local files."""

import base64
import io
from pathlib import Path
from typing import Optional
from urllib.request import urlopen

import numpy as np

from .fields import RequestError


def image_url(part: dict) -> Optional[str]:
    """The URL of an image content part (OpenAI's `image_url`, and the `input_image` / `image`
    spellings mlx-lm's server takes), or None for other parts."""
    if part.get("type") not in ("image_url", "input_image", "image"):
        return None
    url = part.get("image_url", part.get("image"))
    return url.get("url") if isinstance(url, dict) else url


def decode_image_bytes(data: bytes) -> np.ndarray:
    """An RGB uint8 image from encoded bytes (PNG, JPEG, ...)."""
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def decode_data_url(url: str) -> np.ndarray:
    """An RGB uint8 image from a data URL (data:image/png;base64,...)."""
    return decode_image_bytes(base64.b64decode(url.partition(",")[2]))


def read_image(url: str):
    """An image of an `image_url` part: a data URL (decoded as mlx-lm's server does), an http(s)
    URL (fetched; refused with a clear message when the server cannot reach it), or a local file
    path / file:// URL, as mlx-vlm's server allows."""
    if url.startswith("data:"):
        try:
            return decode_data_url(url)
        except Exception as e:
            raise RequestError(f"the image data URL could not be read as an image ({e})")
    if url.startswith(("http://", "https://")):
        try:
            with urlopen(url, timeout=10) as response:
                data = response.read()
        except OSError as e:  # URLError, timeouts, refused connections
            raise RequestError(
                f"could not fetch the image at {url} ({getattr(e, 'reason', e)}); this server may "
                "be offline: send the image inline as a data URL (data:image/png;base64,...) or "
                "as a local file path"
            )
        return decode_image_bytes(data)
    path = Path(url[len("file://") :] if url.startswith("file://") else url)
    if not path.is_file():
        raise RequestError(
            f"image_url {url!r} is neither a data URL, an http(s) URL nor a local file: send the "
            "image as a data URL (data:image/png;base64,...)"
        )
    return str(path)
