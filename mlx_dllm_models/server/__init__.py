"""`mlx_dllm serve`: an OpenAI-compatible server whose concurrent requests share forwards.

scheduler.py batches the requests (continuous batching at block granularity), api.py and
respond.py speak OpenAI's HTTP API, app.py is the Starlette application, transport.py serves it on
uvicorn, process.py is the command: flags, ranks, shutdown.
"""

from .api import Service, StopWords
from .app import build_app
from .fields import RequestError
from .images import read_image
from .process import follow, main, make_server, shutdown
from .scheduler import Job, Scheduler

__all__ = [
    "Job",
    "RequestError",
    "Scheduler",
    "Service",
    "StopWords",
    "build_app",
    "follow",
    "main",
    "make_server",
    "read_image",
    "shutdown",
]
