"""`mlx_dllm serve` as a process: its flags, the HTTP server over the scheduler's thread, the
ranks of a sharded server, and shutdown.

The flags follow `mlx_lm.server` (`--model`, `--host`, `--port`, `--adapter-path`,
`--chat-template-args`, `--decode-concurrency`, `--temp`), with the loading flags of every command
(cli_common.add_loading_flags) and one flag per decoding setting (settings.SETTINGS) whose value is
the server's default.

Safe by default, for a server started on a laptop: loopback only (a warning for any other host),
no cross-origin access from web pages (`--cors-origin`), requests that name another host than
the server's refused (`--allowed-host`: DNS rebinding), images only as data URLs
(`--allowed-image-dir`, `--allow-remote-images`) within pixel limits read from their header
(`--max-image-pixels`, `--max-images-per-request`, `--max-request-pixels`), bodies of at most 32 MiB
(`--max-body-bytes`), no client chat template (`--allow-client-chat-template`), connections
bounded in time and number (`--header-timeout`, `--body-timeout`, `--idle-timeout`,
`--max-connections`); `--api-key` (or MLX_DLLM_API_KEY) asks /v1 requests for a bearer key.
Flags out of range are one-line errors. SIGTERM and Ctrl-C shut down in order: the listening socket
closes, the requests in flight get a 503 at the next denoising step, the worker thread is joined
(its MLX work done: a process that exits under a running MLX thread aborts), then exit status 0.

Sharded (`mlx.launch -n N ... serve`): every rank loads its shard and runs the scheduler; rank 0
alone serves HTTP (its scheduler hands the other ranks what it saw at each step, as mlx_lm.server
shares its requests across ranks). Rank 0 stops every rank (SIGTERM / Ctrl-C); a rank that dies
stops the others with distributed.py's one-line error.
"""

import logging
import signal
import threading
import time
from typing import Callable, Optional

from ..cli_common import chosen_settings, load_for_cli
from ..distributed import launch_group
from ..request import checkpoint_settings
from ..settings import resolve_settings
from ..vision import text_tokenizer
from .api import Service
from .app import build_app
from .flags import check_args, loopback, parser
from .guards import DEFAULT_MAX_BODY_BYTES, HostCheck
from .images import ImagePolicy
from .prompt_cache import PromptCache
from .scheduler import Scheduler
from .transport import HTTPServer, Limits, fit_open_files

logger = logging.getLogger(__name__)


def make_server(
    load_model: Callable[[], tuple],
    host: str = "127.0.0.1",
    port: int = 8080,
    model_id: str = "default_model",
    defaults: Optional[dict] = None,
    chat_template_args: Optional[dict] = None,
    cors_origins=(),
    max_batch: int = 32,
    group=None,
    prompt_cache_size: int = 10,
    prompt_cache_bytes: Optional[int] = None,
    image_policy: ImagePolicy = ImagePolicy(),
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    allowed_hosts=(),
    api_keys=(),
    allow_client_chat_template: bool = False,
    limits: Limits = Limits(),
):
    """An HTTP server (not yet serving), its Service as `server.service`, and the scheduler
    thread, which has loaded the model with `load_model()` -> (model, tokenizer) (its errors are
    raised here). `server.serve_forever()` serves; `shutdown(server)` stops both. `group`: rank 0
    of a sharded server (the other ranks run `follow`). `prompt_cache_size` entries (0: off) of
    at most `prompt_cache_bytes` in all keep finished requests' K/V (server/prompt_cache.py).
    `cors_origins`: the web pages' origins that may call it (`*`: any; none by default);
    `image_policy`: where image URLs may point besides data URLs (images.py); `max_body_bytes`:
    larger request bodies get a 413; `allowed_hosts`: names a request's Host header may give
    besides the loopback names and `host` (guards.HostCheck; `*`: any); `api_keys`: the bearer
    keys /v1 requests must carry (none: no key asked); `allow_client_chat_template`: whether a
    request's own chat template is rendered (templates.py); `limits`: the connections' timeouts
    and their most (transport.Limits)."""
    scheduler = Scheduler.on_thread(
        load_model,
        max_batch=max_batch,
        group=group,
        prompt_cache=prompt_cache(prompt_cache_size, prompt_cache_bytes),
        gather=GATHER_SECONDS,
    )
    model, tokenizer = scheduler.model, scheduler.tokenizer
    service = Service(
        model,
        tokenizer,
        scheduler,
        model_id,
        defaults,
        chat_template_args,
        cors_origins=cors_origins,
        image_policy=image_policy,
        max_body_bytes=max_body_bytes,
        hosts=HostCheck(host, allowed_hosts),
        api_keys=api_keys,
        allow_client_chat_template=allow_client_chat_template,
    )
    try:
        server = HTTPServer(build_app(service, limits), host, port, limits)
    except OSError:
        scheduler.stop()
        raise
    server.service = service
    if group is not None:
        # A sharded scheduler that fails (a rank died) ends the serving too: main() then exits
        # with its error. (shutdown() may come before serve_forever starts: it then returns at
        # once.)
        def stop_serving():
            scheduler.finished.wait()
            if scheduler.error is not None:
                server.shutdown()

        threading.Thread(target=stop_serving, name="mlx_dllm-watch", daemon=True).start()
    return server


# How long a run that takes no rows once started (DiffusionGemma's canvases, self-speculation,
# Fast-dLLM's caches) waits after its first request for requests sent at the same moment
# (Scheduler.gather); requests that may join a running batch never wait.
GATHER_SECONDS = 0.05


def prompt_cache(size: int, nbytes: Optional[int]) -> Optional[PromptCache]:
    return PromptCache(size, nbytes) if size > 0 else None


def follow(
    load_model: Callable[[], tuple],
    group,
    max_batch: int = 32,
    prompt_cache_size: int = 10,
    prompt_cache_bytes: Optional[int] = None,
) -> Scheduler:
    """A rank other than 0 of a sharded server: the scheduler thread (loading this rank's shard
    with `load_model()`) that makes rank 0's decisions on it, until rank 0 stops (`thread` ends;
    `error` says why when it failed)."""
    cache = prompt_cache(prompt_cache_size, prompt_cache_bytes)
    return Scheduler.on_thread(load_model, max_batch=max_batch, group=group, prompt_cache=cache)


def shutdown(server, serving: bool = True, timeout: Optional[float] = None):
    """Stop a server made by make_server, in order: stop accepting connections (the listening
    socket closes); the scheduler stops at its next denoising step, answering the requests in
    flight with a 503, and its thread is joined (up to `timeout` seconds; None: until it ends);
    the requests being answered get up to HANDLERS_SECONDS to write those answers; then
    (`serving`: its serve_forever has run) the HTTP server ends, its connections closed."""
    server.server_close()
    service = server.service
    service.scheduler.stop(timeout=timeout)
    deadline = time.monotonic() + HANDLERS_SECONDS
    while service.handlers and time.monotonic() < deadline:
        time.sleep(0.01)
    if serving:
        server.shutdown()


HANDLERS_SECONDS = 5.0


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    check_args(args)
    logging.basicConfig(
        level=getattr(logging, args.log_level), format="%(asctime)s - %(levelname)s - %(message)s"
    )
    if not loopback(args.host):
        logger.warning(
            "listening on %s: other machines that can reach it can use the model, %s; --host "
            "127.0.0.1 serves this machine only",
            args.host,
            "with the API key" if args.api_keys else "with no authentication (see --api-key)",
        )
    fit_open_files(args.max_connections)
    if args.log_level != "DEBUG":  # uvicorn's start and stop lines: this server logs its own
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
    defaults = chosen_settings(args)
    # Under `mlx.launch -n N` every rank loads its shard and runs the scheduler; rank 0 serves.
    group = launch_group()
    if group is not None and group.rank() != 0:
        return _follow_main(args, defaults, group)
    try:
        # Loaded as `mlx_dllm generate` loads (its errors are one-line SystemExits), on the
        # scheduler's thread.
        server = make_server(
            lambda: load_for_cli(args),
            host=args.host,
            port=args.port,
            model_id=str(args.model or "default_model"),
            defaults=defaults,
            chat_template_args=args.chat_template_args,
            cors_origins=args.cors_origins,
            max_batch=args.decode_concurrency,
            group=group,
            prompt_cache_size=args.prompt_cache_size,
            prompt_cache_bytes=args.prompt_cache_bytes,
            image_policy=ImagePolicy(
                args.allowed_image_dir,
                args.allow_remote_images,
                args.max_image_pixels,
                args.max_images_per_request,
                args.max_request_pixels,
            ),
            max_body_bytes=args.max_body_bytes,
            allowed_hosts=args.allowed_hosts,
            api_keys=args.api_keys,
            allow_client_chat_template=args.allow_client_chat_template,
            limits=Limits(
                args.header_timeout, args.body_timeout, args.idle_timeout, args.max_connections
            ),
        )
    except ValueError as e:  # CheckpointError, SettingsError
        raise SystemExit(f"error: {e}")
    except OSError as e:  # the port is taken, the host unknown
        raise SystemExit(f"error: cannot listen on {args.host}:{args.port}: {e}")
    service = server.service
    if args.chat_template is not None:
        text_tokenizer(service.tokenizer).chat_template = args.chat_template
    try:  # the server flags' defaults, checked once rather than on every request
        _check_flags(service.model, defaults)
    except ValueError as e:  # SettingsError, RequestError
        shutdown(server, serving=False)
        raise SystemExit(f"error: {e}")
    logger.info("serving %s on http://%s:%d", service.model_id, args.host, server.server_address[1])
    previous = _sigterm_interrupts()
    # uvicorn serves on a thread of its own: this one keeps the signals (SIGTERM, Ctrl-C) and
    # the order of the shutdown.
    serving = threading.Thread(target=server.serve_forever, name="mlx_dllm-http", daemon=True)
    serving.start()
    try:
        while serving.is_alive():
            serving.join(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        shutdown(server)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if service.scheduler.error is not None:
        raise SystemExit(service.scheduler.error)
    return 0


def _check_flags(model, defaults: dict):
    """The server flags' settings, checked as a request's (DiffusionGemma's --temp scales its
    schedule, as a request's temperature does)."""
    spec = model.diffusion_spec
    resolve_settings(spec, defaults, checkpoint_settings(model, spec))


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _sigterm_interrupts():
    """SIGTERM stops the server as Ctrl-C does (a sharded server's rank 0 then tells the other
    ranks to stop). Returns the previous handler, None when not on the main thread (where Python
    takes no signal handlers)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _interrupt)


def _follow_main(args, defaults: dict, group) -> int:
    """`mlx_dllm serve` on a rank other than 0: no HTTP server, the scheduler loop on this rank's
    shard until rank 0 stops. Ctrl-C reaches every rank of `mlx.launch`: rank 0 alone decides when
    they stop (it tells the others), so this rank ignores it."""
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        try:
            scheduler = follow(
                lambda: load_for_cli(args),
                group,
                args.decode_concurrency,
                args.prompt_cache_size,
                args.prompt_cache_bytes,
            )
        except ValueError as e:  # CheckpointError, SettingsError
            raise SystemExit(f"error: {e}")
        try:  # the same check as rank 0's, which then stops every rank
            _check_flags(scheduler.model, defaults)
        except ValueError as e:  # SettingsError, RequestError
            scheduler.stop()
            raise SystemExit(f"error: {e}")
        scheduler.finished.wait()
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    if scheduler.error is not None:
        raise SystemExit(scheduler.error)
    return 0
