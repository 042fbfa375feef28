"""`mlx_dllm serve`'s flags and their checks, apart from the server so that a wrong flag is refused
before the server's modules and the model load."""

import ipaddress
import json
import os
import socket

from ..cli_common import Parser, add_loading_flags, add_setting_flags
from .limits import (
    DEFAULT_MAX_BODY_BYTES,
    MAX_IMAGE_PIXELS,
    MAX_IMAGES_PER_REQUEST,
    MAX_REQUEST_PIXELS,
    Limits,
    host_name,
    parse_size,
)


def parser():
    p = Parser(
        prog="mlx_dllm serve",
        description="An OpenAI-compatible server for a diffusion language model "
        "(/v1/chat/completions, /v1/completions, /v1/models, /health). Concurrent requests "
        "share forwards. The setting flags set the defaults that a request's body fields of the "
        "same name override.",
    )
    add_loading_flags(p)
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="host to listen on (default: 127.0.0.1, this machine only; see --api-key)",
    )
    p.add_argument("--port", type=int, default=8080, help="port, 0-65535 (default: 8080)")
    p.add_argument(
        "--cors-origin",
        "--allowed-origins",
        dest="cors_origins",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a web page origin (e.g. http://localhost:3000; comma-separated or repeated; * for "
        "any) whose pages may call the server from a browser (default: none)",
    )
    p.add_argument(
        "--allowed-host",
        dest="allowed_hosts",
        action="append",
        default=[],
        metavar="NAME",
        help="a host name or address that requests may name in their Host header, for a reverse "
        "proxy or LAN use (comma-separated or repeated; * for any). Default: localhost, "
        "127.0.0.1, [::1] and the --host itself (on 0.0.0.0 / ::, any IP address); others get a "
        "403, which stops web pages that point their own name at this machine (DNS rebinding)",
    )
    p.add_argument(
        "--allowed-image-dir",
        default=None,
        metavar="DIR",
        help="let image_url name local files under DIR (default: data URLs only)",
    )
    p.add_argument(
        "--allow-remote-images",
        action="store_true",
        help="let image_url be an http(s) URL the server fetches; hosts that resolve to "
        "loopback, link-local or private addresses are refused (default: data URLs only)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=parse_size,
        default=DEFAULT_MAX_BODY_BYTES,
        help="largest request body, e.g. 64MB; larger ones get a 413 (default: 32MiB)",
    )
    add_http_flags(p)
    p.add_argument("--chat-template", default=None, help="a chat template replacing the model's")
    p.add_argument(
        "--chat-template-args",
        type=json.loads,
        default={},
        help="JSON arguments for the chat template, e.g. '{\"enable_thinking\": false}'",
    )
    p.add_argument(
        "--decode-concurrency",
        type=int,
        default=32,
        help="most requests decoded in one batch (default: 32)",
    )
    p.add_argument(
        "--prompt-cache-size",
        type=int,
        default=10,
        help="most finished requests whose K/V are kept for later requests that continue their "
        "prompt (block-causal and causal-prefix families; 0 turns the cache off; default: 10)",
    )
    p.add_argument(
        "--prompt-cache-bytes",
        type=parse_size,
        default=None,
        help="most bytes of K/V the prompt cache keeps, e.g. 8GB (default: no bound)",
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
    )
    add_setting_flags(p)
    return p


def add_http_flags(p) -> None:
    """The flags of the HTTP side: API keys, client templates, image limits, connections."""
    p.add_argument(
        "--api-key",
        dest="api_keys",
        action="append",
        default=[],
        metavar="KEY",
        help="a key that requests to /v1 must send as 'Authorization: Bearer KEY' (repeated for "
        f"several; default: the {API_KEY_ENV} environment variable, else none asked)",
    )
    p.add_argument(
        "--allow-client-chat-template",
        action="store_true",
        help="render a request's own chat_template_kwargs.chat_template (in a sandboxed process, "
        "within a time, memory and size budget; default: refused)",
    )
    for flag, default, what in [
        ("--max-image-pixels", MAX_IMAGE_PIXELS, "most pixels of one image"),
        ("--max-images-per-request", MAX_IMAGES_PER_REQUEST, "most images in one request"),
        ("--max-request-pixels", MAX_REQUEST_PIXELS, "most pixels of a request's images"),
        ("--max-connections", Limits.max_connections, "most open connections"),
    ]:
        p.add_argument(flag, type=int, default=default, help=f"{what} (default: {default})")
    for flag, default, what in [
        ("--header-timeout", Limits.header_timeout, "seconds a request's headers may take"),
        ("--body-timeout", Limits.body_timeout, "seconds a request's body may take"),
        ("--idle-timeout", Limits.idle_timeout, "seconds an idle keep-alive connection is kept"),
    ]:
        p.add_argument(flag, type=float, default=default, help=f"{what} (default: {default:g})")


API_KEY_ENV = "MLX_DLLM_API_KEY"


def check_args(args) -> None:
    """The server flags' ranges, before anything loads: a one-line SystemExit for each."""
    checks = [
        (
            0 <= args.port <= 65535,
            f"--port must be from 0 to 65535 (0: any free port), got {args.port}",
        ),
        (
            args.decode_concurrency >= 1,
            "--decode-concurrency must be at least 1 (the most requests decoded in one batch), "
            f"got {args.decode_concurrency}",
        ),
        (
            args.prompt_cache_size >= 0,
            f"--prompt-cache-size must be 0 (off) or more, got {args.prompt_cache_size}",
        ),
        (
            args.prompt_cache_bytes is None or args.prompt_cache_bytes > 0,
            f"--prompt-cache-bytes must be more than 0, got {args.prompt_cache_bytes}; turn the "
            "cache off with --prompt-cache-size 0",
        ),
        (
            args.max_body_bytes >= MIN_BODY_BYTES,
            f"--max-body-bytes must be at least {MIN_BODY_BYTES} (a chat request's size), got "
            f"{args.max_body_bytes}",
        ),
    ]
    for name in ("max_image_pixels", "max_images_per_request", "max_request_pixels"):
        value = getattr(args, name)
        flag = "--" + name.replace("_", "-")
        checks.append((value >= 1, f"{flag} must be at least 1, got {value}"))
    checks.append(
        (
            args.max_connections >= 1,
            f"--max-connections must be at least 1, got {args.max_connections}",
        )
    )
    for name in ("header_timeout", "body_timeout", "idle_timeout"):
        value = getattr(args, name)
        flag = "--" + name.replace("_", "-")
        checks.append((value > 0, f"{flag} must be more than 0 seconds, got {value}"))
    for ok, message in checks:
        if not ok:
            raise SystemExit(f"error: {message}")
    folder = args.allowed_image_dir
    if folder is not None and not os.path.isdir(folder):
        raise SystemExit(f"error: --allowed-image-dir {folder!r} is not a folder")
    args.cors_origins = [o.strip() for a in args.cors_origins for o in a.split(",") if o.strip()]
    args.allowed_hosts = [h.strip() for a in args.allowed_hosts for h in a.split(",") if h.strip()]
    if not args.api_keys and os.environ.get(API_KEY_ENV):
        args.api_keys = [os.environ[API_KEY_ENV]]
    for name in args.allowed_hosts:
        if name != "*" and (not host_name(name) or any(c in name for c in "/@ \t")):
            raise SystemExit(
                f"error: --allowed-host takes a host name or address (e.g. myhost.lan, "
                f"192.168.1.5), got {name!r}"
            )


MIN_BODY_BYTES = 1024


def loopback(host: str) -> bool:
    """Whether every address `host` names is this machine's loopback."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)
