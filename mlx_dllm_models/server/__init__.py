"""`mlx_dllm serve`: an OpenAI-compatible server whose concurrent requests share forwards.

scheduler.py batches the requests (continuous batching at block granularity), api.py and
respond.py speak OpenAI's HTTP API, app.py is the Starlette application, transport.py serves it on
uvicorn, process.py is the command: flags, ranks, shutdown.
"""

from .. import lazy_exports

# Resolved on first use: `mlx_dllm serve` reads its flags (server.flags) before these load mlx-lm.
_EXPORTS = {
    name: f"{__name__}.{module}"
    for module, names in {
        "api": ("Service", "StopWords"),
        "app": ("build_app",),
        "fields": ("RequestError",),
        "images": ("read_image",),
        "process": ("follow", "main", "make_server", "shutdown"),
        "scheduler": ("Job", "Scheduler"),
    }.items()
    for name in names
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(globals(), _EXPORTS)
