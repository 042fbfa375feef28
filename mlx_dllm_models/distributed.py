"""One checkpoint over several processes: MLX's distributed group as `mlx.launch` sets it up
(ring backend over TCP or Thunderbolt, MPI, JACCL), tensor-parallel models (each family's
`Model.shard`, models/sharding.py) and mlx-lm's `sharded_load`.

Every rank runs the same program on the same prompt: the engine is unchanged and each rank holds
the whole canvas. The models' sharded layers end in an all-reduce, whose result is bitwise the
same on every rank (the ring backend reduces each segment once and copies it to the others), and
what follows (norms, the replicated LM head, the decoding statistics, seeded draws) is the same
computation on the same bits. So every commit decision is identical on all ranks without being
broadcast; this holds for ranks that run the same MLX build on the same kind of device.

Conventions for front ends (`mlx_dllm generate`, a server):

* `launch_group()` is the group when launched with more than one process, else None;
  `load(path, group=launch_group())` loads each rank's shard.
* Rank 0 prints (`rank0_prints`) and, for a server, takes the requests: `share(obj, group)` hands
  rank 0's request to every rank so that all of them run the same decoder calls in the same order
  (mlx_lm.server's `_share_object`).
* A rank that dies makes the others' next collective fail; `lost_rank_exits` turns that into a
  one-line error and a non-zero exit instead of a traceback. `mlx.launch` ends the remaining
  ranks with SIGTERM once one exits with an error, often before their next collective fails:
  `launch_group` makes SIGTERM end a rank with the same line (and exit status 1) instead of
  silently (exit -15).
"""

import contextlib
import os
import pickle
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from .errors import SettingsError

# Prefixes of the distributed backends' own error messages (mlx/distributed/*).
_BACKENDS = ("[ring]", "[mpi]", "[jaccl]", "[nccl]")


def launch_group() -> Optional[mx.distributed.Group]:
    """The group `mlx.launch` (or MPI) started this process in, or None for a single process.
    With a group, SIGTERM ends this rank with lost_rank_exits' one-line error (stop_on_sigterm)."""
    group = mx.distributed.init()
    if group.size() <= 1:
        return None
    stop_on_sigterm(group)
    return group


def lost_contact(group: mx.distributed.Group, why: str) -> str:
    """The one-line error of a rank whose run another rank's end cut short."""
    return (
        f"error: rank {group.rank()} of {group.size()} lost contact with another rank ({why}); "
        "every rank must run until the end: see the other ranks' output for why one stopped"
    )


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _exiting() -> None:
    """This rank is ending with its error: a launcher's SIGTERM must not cut the message (or the
    exit status) short, and shutting down may not hang (SIGALRM ends the process after 30 s)."""
    if _main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if hasattr(signal, "alarm"):
            signal.alarm(30)


def stop_on_sigterm(group: mx.distributed.Group) -> None:
    """SIGTERM ends this rank with lost_contact's line and exit status 1. `mlx.launch` sends it to
    the remaining ranks once one has exited with an error, usually while they compute, before
    their next collective fails; without the handler they would end without a word (exit -15).
    The handler runs
    between Python bytecodes of the main thread (a collective already under way fails on the
    dead rank first). Only where SIGTERM still has its default action, from the main thread; the
    server puts its own in place while it serves."""
    if not _main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def stopped(signum, frame):
        _exiting()
        raise SystemExit(
            lost_contact(group, "SIGTERM: the launcher stops the ranks once one exits")
        )

    signal.signal(signal.SIGTERM, stopped)


def sharded_load(path, group: mx.distributed.Group, tokenizer_config: dict, **kwargs):
    """mlx-lm's `sharded_load` (mlx_lm.utils) with tensor parallelism over `group`, for a local
    checkpoint: the model is built with lazy weights, the family's `shard(group)` slices them,
    and only then are they read, so that each rank keeps its own shard (about weights / ranks,
    plus the replicated embeddings, head and norms). The ranks synchronise before returning.

    One difference: the parameters are evaluated one tensor at a time. mlx-lm evaluates them all
    at once, and MLX then reads every full tensor before slicing any, so that the peak while
    loading is the whole checkpoint plus the shard; one at a time it is the shard plus the
    largest tensor."""
    from mlx_lm.utils import load_model, load_tokenizer

    if kwargs:
        raise SettingsError(
            f"load(..., group=...) does not take {', '.join(sorted(kwargs))}: a sharded load "
            "reads the checkpoint as it is (fuse adapters and convert it first, or load it on "
            "one machine)"
        )
    path = Path(path)
    model, config = load_model(path, lazy=True)
    tokenizer = load_tokenizer(path, tokenizer_config, eos_token_ids=config.get("eos_token_id"))
    model.shard(group)
    for _, value in tree_flatten(model.parameters()):
        mx.eval(value)
    # Every rank has its shard before any of them starts (mlx-lm's synchronisation).
    mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu, group=group))
    return model, tokenizer


def rank0_prints(group: Optional[mx.distributed.Group]) -> None:
    """Silence standard output on every rank but 0: all ranks compute the same text, one shows
    it. Errors (standard error) still come from any rank."""
    if group is not None and group.rank() != 0:
        sys.stdout = open(os.devnull, "w")


def share(obj: Any, group: Optional[mx.distributed.Group]) -> Any:
    """Rank 0's `obj` (picklable) on every rank; the other ranks' argument is ignored. Every rank
    must call it at the same point (it is a collective)."""
    if group is None or group.size() == 1:
        return obj
    if group.rank() == 0:
        if obj is None:  # "nothing": one collective, not two (a server's idle tick)
            mx.eval(mx.distributed.all_sum(0, group=group))
            return None
        data = mx.array(memoryview(pickle.dumps(obj)), dtype=mx.uint8)
        mx.eval(mx.distributed.all_sum(data.size, group=group))
        mx.eval(mx.distributed.all_sum(data, group=group))
        return obj
    size = mx.distributed.all_sum(0, group=group).item()
    if size == 0:
        return None
    data = mx.distributed.all_sum(mx.zeros(size, dtype=mx.uint8), group=group)
    return pickle.loads(bytes(memoryview(data)))


def lost_rank(error: BaseException) -> bool:
    """Whether `error` is a distributed backend's failure (another rank died or went away)."""
    return isinstance(error, RuntimeError) and str(error).startswith(_BACKENDS)


@contextlib.contextmanager
def lost_rank_exits(group: Optional[mx.distributed.Group] = None):
    """A collective that fails because another rank died (its connection closed) ends this rank
    with a one-line error naming what happened (SystemExit), rather than a traceback from deep
    inside mlx. `group` None: the launch's group."""
    try:
        yield
    except RuntimeError as e:
        if not lost_rank(e):
            raise
        _exiting()
        raise SystemExit(lost_contact(group or mx.distributed.init(), str(e))) from None
