"""What the server's flags bound, and the parsers of their values: standard library only, so that
`mlx_dllm serve` checks its flags before the server's modules (and the model) load."""

import re
from dataclasses import dataclass

# A request body's bytes at most (--max-body-bytes).
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
# Image limits (--max-image-pixels, --max-images-per-request, --max-request-pixels).
MAX_IMAGE_PIXELS = 4096 * 4096
MAX_IMAGES_PER_REQUEST = 16
MAX_REQUEST_PIXELS = 4 * MAX_IMAGE_PIXELS

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Limits:
    """What one connection may take (the `mlx_dllm serve` flags of the same names)."""

    header_timeout: float = 10.0
    body_timeout: float = 60.0
    idle_timeout: float = 5.0
    max_connections: int = 1024


def parse_size(text: str) -> int:
    """Bytes of a size as mlx_lm.server takes it: a number of bytes, or with a unit (KB, MB, GB,
    TB, powers of 1000; KiB... powers of 1024)."""
    match = _SIZE.match(str(text))
    if match is None:
        raise ValueError(f"expected a size such as 8GB or 500MB, got {text!r}")
    number, unit = float(match.group(1)), match.group(2).lower()
    base = 1024 if "i" in str(text).lower() else 1000
    return int(number * base ** " kmgt".index(unit or " "))


def host_name(value: str) -> str:
    """The host of a Host header or a host flag, without its port, brackets, case or final dot:
    "LocalHost:8080" -> "localhost", "[::1]:8080" -> "::1"."""
    value = value.strip().lower()
    if value.startswith("["):  # an IPv6 literal, maybe followed by :port
        value = value[1:].split("]", 1)[0]
    elif value.count(":") == 1:  # name:port (an IPv6 address has more than one colon)
        value = value.split(":", 1)[0]
    return value.rstrip(".")
