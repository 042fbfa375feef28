"""`mlx_dllm serve`: an OpenAI-compatible server whose concurrent requests share forwards.

scheduler.py batches the requests (continuous batching at block granularity), api.py and
respond.py speak OpenAI's HTTP API, app.py is the Starlette application, transport.py serves it on
uvicorn, process.py is the command: flags, ranks, shutdown.
"""

import importlib

# Resolved on first use: `mlx_dllm serve` reads its flags (server.flags) before these load mlx-lm.
_EXPORTS = {
    "Service": "api",
    "StopWords": "api",
    "build_app": "app",
    "RequestError": "fields",
    "read_image": "images",
    "follow": "process",
    "main": "process",
    "make_server": "process",
    "shutdown": "process",
    "Job": "scheduler",
    "Scheduler": "scheduler",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
