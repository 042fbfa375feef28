"""The scheduler's worker thread: built where it runs, and parked, never ended, once its loop is
over."""

import threading
from typing import Callable


def on_worker_thread(build: Callable[[], object], name: str = "mlx_dllm-scheduler"):
    """`build()` on a new daemon thread, then its `_loop()` there; returns what `build` returned
    once it has (its exception raised here instead). The object gets `thread`. MLX streams belong
    to a thread, and the arrays a model builds lazily (RoPE frequencies, masks) can only be
    evaluated on the thread that built them: the model is built where it runs, as mlx-lm's server
    loads in its generation thread."""
    box, ready = {}, threading.Event()

    def work():
        try:
            box["built"] = built = build()
        except BaseException as e:  # raised again in the caller's thread
            box["error"] = e
            built = None
        if built is not None:
            built.thread = threading.current_thread()
        ready.set()
        if built is not None:
            built._loop()
        del built  # the parked thread keeps no model alive
        park()

    threading.Thread(target=work, name=name, daemon=True).start()
    ready.wait()
    if "error" in box:
        raise box.pop("error")
    return box.pop("built")


def park():
    """Where a worker thread ends: never. When a thread that ran MLX's compiled functions exits,
    its thread-local compile cache is destroyed and calls into Python; if the interpreter is
    finalizing then (the process exiting right after the loop ended), that call ends the thread
    inside a C++ destructor: "terminate called without an active exception", status 134. A
    daemon thread blocked here is ended by the process's exit, which runs no such destructor."""
    threading.Event().wait()
