"""The images of a request's `image_url` content parts: data URLs always; local files and http(s)
URLs only where the server's flags allow them (ImagePolicy).

A request comes from whoever can reach the port, so by default the server opens no file and
fetches no URL on its behalf: a local path could read any file the user can (and two different
errors would tell a client which paths exist), and a URL makes the server a client inside the
user's own network. `--allowed-image-dir DIR` lets paths under DIR be read (resolved, links
followed, before the check); `--allow-remote-images` lets http(s) URLs be fetched when every
address their host resolves to is public (not loopback, link-local, private, multicast or
reserved), and the connection goes to the address that was checked, so that the name cannot
resolve elsewhere between the check and the fetch. Every refused image gets the same message
(REFUSED); the log says why.

A small file can hold a huge image (a 140 KB PNG of 12000 x 12000 grey pixels decodes to 432 MB),
so an image's size is read from its header (PIL reads no pixels until asked) and checked before
it is decoded: pixels per image (`--max-image-pixels`), images per request
(`--max-images-per-request`) and pixels per request (`--max-request-pixels`), each a 400 naming its
limit and flag.
"""

import base64
import http.client
import io
import ipaddress
import logging
import socket
import ssl
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional
from urllib.parse import urlsplit

import numpy as np
from PIL import Image

from .fields import RequestError
from .limits import MAX_IMAGE_PIXELS, MAX_IMAGES_PER_REQUEST, MAX_REQUEST_PIXELS

# The pixel limits below are checked before decoding; PIL's decompression-bomb warning (raised by
# Image.open past 89 M pixels, where ours refuse far sooner) would only add a stray log line.
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)

logger = logging.getLogger(__name__)

REFUSED = (
    "image_url was refused: send the image inline as a data URL (data:image/png;base64,...); "
    "this server reads local files only under its --allowed-image-dir and fetches http(s) URLs "
    "only with --allow-remote-images (public addresses)"
)
# The most bytes an image file or a fetched image may have (a data URL is bounded by the body).
MAX_IMAGE_BYTES = 32 * 1024 * 1024
FETCH_TIMEOUT = 10.0
# The default limits: the largest image a served family reads at full size is well under 4096 x
# 4096 (Qwen2-VL's processor caps an image at 12.8 M pixels, LLaVA-OneVision's anyres grid at
# 2304 x 2304); a request's images together at most four such.


@dataclass(frozen=True)
class ImagePolicy:
    """Where an `image_url` may point besides a data URL: files under `allowed_dir` (None: no
    file), public http(s) URLs when `allow_remote`."""

    allowed_dir: Optional[Path] = None
    allow_remote: bool = False
    max_image_pixels: int = MAX_IMAGE_PIXELS
    max_images: int = MAX_IMAGES_PER_REQUEST
    max_request_pixels: int = MAX_REQUEST_PIXELS

    def __post_init__(self):
        if self.allowed_dir is not None:
            object.__setattr__(self, "allowed_dir", Path(self.allowed_dir).resolve())


def image_url(part: dict) -> Optional[str]:
    """The URL of an image content part (OpenAI's `image_url`, and the `input_image` / `image`
    spellings mlx-lm's server takes), or None for other parts."""
    if part.get("type") not in ("image_url", "input_image", "image"):
        return None
    url = part.get("image_url", part.get("image"))
    return url.get("url") if isinstance(url, dict) else url


class PixelBudget:
    """One request's images against the policy's limits, checked from each image's header before
    it is decoded."""

    def __init__(self, policy: ImagePolicy):
        self.policy = policy
        self.pixels = 0

    def count(self, images: int) -> None:
        """The number of images a request holds, before any is read."""
        most = self.policy.max_images
        if images > most:
            raise RequestError(
                f"the request holds {images} images, more than this server takes in one request "
                f"({most}; the server's --max-images-per-request)"
            )

    def take(self, width: int, height: int) -> None:
        policy, pixels = self.policy, width * height
        if pixels > policy.max_image_pixels:
            raise RequestError(
                f"an image is {width} x {height} = {pixels} pixels, more than this server takes "
                f"in one image ({policy.max_image_pixels}; the server's --max-image-pixels); "
                "send it smaller"
            )
        self.pixels += pixels
        if self.pixels > policy.max_request_pixels:
            raise RequestError(
                f"the request's images hold {self.pixels} pixels in all, more than this server "
                f"takes in one request ({policy.max_request_pixels}; the server's "
                "--max-request-pixels)"
            )


def decode_image_bytes(data: bytes, budget: Optional[PixelBudget] = None) -> np.ndarray:
    """An RGB uint8 image from encoded bytes (PNG, JPEG, ...); its size checked against `budget`
    from the header, before a pixel is decoded."""
    image = Image.open(io.BytesIO(data))
    if budget is not None:
        budget.take(*image.size)
    return np.asarray(image.convert("RGB"))


def decode_data_url(url: str, budget: Optional[PixelBudget] = None) -> np.ndarray:
    """An RGB uint8 image from a data URL (data:image/png;base64,...)."""
    return decode_image_bytes(base64.b64decode(url.partition(",")[2]), budget)


def read_image(url, policy: ImagePolicy = ImagePolicy(), budget: Optional[PixelBudget] = None):
    """The image of an `image_url` part as an RGB array: a data URL, or what `policy` allows;
    its pixels taken from `budget` (a request's; None: a budget of its own)."""
    if not isinstance(url, str):
        raise RequestError("image_url must be a string or an object with a url string")
    budget = budget if budget is not None else PixelBudget(policy)
    if url.startswith("data:"):
        return _decoded(decode_data_url, url, budget, "the image data URL")
    if url.startswith(("http://", "https://")):
        return _decoded(decode_image_bytes, _fetch(url, policy), budget, "the fetched image")
    return _decoded(decode_image_bytes, _read_file(url, policy), budget, "the image file")


def _decoded(decode, data, budget: PixelBudget, what: str):
    try:
        return decode(data, budget)
    except RequestError:
        raise
    except Exception as e:  # PIL's and base64's errors: not an image
        raise RequestError(f"{what} could not be read as an image ({e})")


def _refuse(why: str, url: str):
    logger.info("image_url refused (%s): %.200s", why, url)
    raise RequestError(REFUSED)


def _read_file(url: str, policy: ImagePolicy) -> bytes:
    if policy.allowed_dir is None:
        _refuse("no --allowed-image-dir", url)
    if "\x00" in url:
        _refuse("a NUL character", url)
    path = Path(url[len("file://") :] if url.startswith("file://") else url)
    # Links and `..` resolved first: a path under the folder must stay under it.
    resolved = path.resolve()
    if not (resolved.is_relative_to(policy.allowed_dir) and resolved.is_file()):
        _refuse("outside --allowed-image-dir or not a file", url)
    try:
        with open(resolved, "rb") as f:
            data = f.read(MAX_IMAGE_BYTES + 1)
    except OSError as e:
        _refuse(f"unreadable: {e}", url)
    if len(data) > MAX_IMAGE_BYTES:
        _refuse(f"larger than {MAX_IMAGE_BYTES} bytes", url)
    return data


def public_address(address: str) -> bool:
    """Whether an IP address is on the public internet (not loopback, link-local, private,
    multicast, reserved or unspecified; an IPv4-mapped IPv6 address as its IPv4)."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def _fetch(url: str, policy: ImagePolicy) -> bytes:
    if not policy.allow_remote:
        _refuse("no --allow-remote-images", url)
    parts = urlsplit(url)
    try:
        host, port = parts.hostname, parts.port
    except ValueError:  # a port that is not a number
        _refuse("malformed URL", url)
    if not host:
        _refuse("no host", url)
    https = parts.scheme == "https"
    port = port or (443 if https else 80)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        _refuse("host not resolved", url)
    addresses = [info[4][0] for info in infos]
    if not addresses or not all(public_address(a) for a in addresses):
        _refuse(f"not a public address: {addresses}", url)
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    connection = _PinnedHTTPS if https else _PinnedHTTP
    conn = connection(host, port, addresses[0], timeout=FETCH_TIMEOUT)
    try:
        conn.request("GET", target, headers={"User-Agent": "mlx_dllm", "Accept": "image/*"})
        response = conn.getresponse()
        # Redirects are not followed: their target would need the same checks, and an image
        # URL a client sends can name the final address itself.
        if response.status != 200:
            _refuse(f"HTTP {response.status}", url)
        data = response.read(MAX_IMAGE_BYTES + 1)
    except (OSError, http.client.HTTPException, ssl.SSLError) as e:
        _refuse(f"fetch failed: {e}", url)
    finally:
        conn.close()
    if len(data) > MAX_IMAGE_BYTES:
        _refuse(f"larger than {MAX_IMAGE_BYTES} bytes", url)
    return data


class _PinnedHTTP(http.client.HTTPConnection):
    """An HTTP connection to the address that was checked, with the URL's host in its Host
    header."""

    def __init__(self, host, port, address, timeout):
        super().__init__(host, port, timeout=timeout)
        self.address = address

    def connect(self):
        self.sock = socket.create_connection((self.address, self.port), self.timeout)


class _PinnedHTTPS(http.client.HTTPSConnection):
    """An HTTPS connection to the address that was checked; the certificate is verified against
    the URL's host."""

    def __init__(self, host, port, address, timeout):
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self.address = address

    def connect(self):
        sock = socket.create_connection((self.address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)
