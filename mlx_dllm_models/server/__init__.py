"""`mlx_dllm serve`: an OpenAI-compatible server whose concurrent requests share forwards.

scheduler.py batches the requests (continuous batching at block granularity), api.py speaks
OpenAI's HTTP API over mlx-lm's handler, process.py is the command: flags, ranks, shutdown.
"""

from .api import DiffusionAPIHandler, Service, StopWords
from .fields import RequestError
from .images import read_image
from .process import follow, main, make_server, shutdown
from .scheduler import Job, Scheduler

__all__ = [
    "DiffusionAPIHandler",
    "Job",
    "RequestError",
    "Scheduler",
    "Service",
    "StopWords",
    "follow",
    "main",
    "make_server",
    "read_image",
    "shutdown",
]
