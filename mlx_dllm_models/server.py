"""`mlx_dllm serve`: an OpenAI-compatible HTTP server whose concurrent requests share forwards.

Endpoints and flags follow `mlx_lm.server` (`/v1/chat/completions`, `/v1/completions`,
`/v1/models`, `/health`; `--model`, `--host`, `--port`, `--adapter-path`, `--chat-template-args`,
`--allowed-origins`, `--decode-concurrency`, `--temp`), plus one flag per decoding setting
(settings.SETTINGS) whose value is the server's default; a request overrides any of them with a
body field of the same name (`block_length`, `steps`, `sampler`, `threshold`, family settings) or
the OpenAI one (`max_tokens` / `max_completion_tokens`, `temperature`, `top_p`, `seed`, `stop`).

What comes from mlx-lm's server, and what cannot:

* Reused: its HTTP handler (`APIHandler`: body parsing and the malformed-body errors, CORS and
  stream headers, the response packets `generate_response` / `completion_usage_response`,
  `/health`), its request records (`CompletionRequest`), its chat helpers (`convert_chat` for a
  tokenizer without a template, `process_message_content`, data-URL image decoding).
* Not reused: its `ResponseGenerator` and `BatchGenerator`, which decode token by token (an AR
  loop with a per-token KV cache, per-token logprobs and a per-token stop-sequence state machine).
  Here the unit is a committed block: the scheduler below decodes blocks, a streamed chunk is a
  block's text, and stop words are matched on the text as blocks arrive (a stop string can appear
  anywhere in a freshly committed block, not only at its end). Its argument validation is replaced
  by the settings table's (settings.resolve_settings), whose messages name what each family
  understands; sampling arguments mlx-lm accepts that diffusion decoding has no use for
  (logprobs, penalties, min_p, logit_bias, tools, draft models) are refused, never ignored.

Scheduling (continuous batching at block granularity). One worker thread owns the model (every
MLX call happens there). Each request's settings are resolved as `generate_diffusion` resolves
them; requests whose resolved settings agree (all but `max_tokens`) form a group that shares one
decoder run, so one forward serves every row; groups with different settings (block length,
sampler, family settings, temperature, seed...) take turns block by block. Within a group:

* A row leaves when it finishes (EOS or its max_tokens), or at the next block boundary after its
  client disconnects (or its stop string appeared): the decoder drops it like a finished row.
* Requests that arrive while a group decodes join it at the next block boundary. The engine keeps
  rows independent, so joining is a restart of the group's run over [survivors ; newcomers], where
  a survivor's prompt is its prompt followed by the tokens it has committed and its budget what is
  left of its max_tokens (engine/masked.py `run(prompts, budgets=...)`). For a masked block decoder
  over bidirectional (full recompute) or block-causal attention this is exact: the tokens, positions and attention
  a row sees in the restarted run are those of its own run at the same block (left padding is
  never attended; a bidirectional row never attends past its own last column; block-causal
  padding is a multiple of the block length, so blocks stay on their absolute positions); the
  prefix cache of block-causal families re-encodes the survivors' committed blocks, K/V that
  equal those it had cached. Causal-prefix blocks (Nemotron) join the same way when max_tokens is
  a whole number of blocks: the restart's causal prefill of [prompt ; committed] writes the K/V
  and the AR seed that the run's per-block causal forwards would have (their blocks are counted
  from the prompt's end and attend within the block, so a row whose last block were partial would
  see a longer row's columns there). So at temperature 0 each request's tokens equal a single
  `generate_diffusion` call with the same prompt and settings. Fast-dLLM's approximate caches
  (bidirectional `cache="prefix"` / `"dual"`) refresh their K/V on their own schedule, which a
  restart would move: their requests batch at arrival.
* Other decoders batch at arrival: the requests waiting when a group's run starts share it, later
  ones wait for the next run: causal-prefix requests whose max_tokens is not a multiple of the
  block length, or with causal_context=False or a thinking budget (a restart would encode the
  committed blocks with the prompt, and count the budget from there); DiffusionGemma's canvases, which draw each row's noise from its own seeded stream
  that a restart would start over (rows with and without images batch together); self-speculation,
  which decodes row by row. For these groups `max_tokens` is part of the settings that must agree,
  and a cancelled row of a canvas or self-speculative run keeps its place until the run ends (the
  masked decoder drops it).

At temperature > 0 a batched row's draws depend on its batch-mates (the masked decoder draws one
batch-wide key per step), as with any batched sampler: `seed` reproduces a request served alone.

Sharded (`mlx.launch -n N ... serve`): every rank loads its shard and runs the scheduler; rank 0
alone serves HTTP, and each step begins with rank 0 handing the others what it saw since the last
one (Scheduler docstring), as mlx_lm.server shares its requests across ranks. Rank 0 stops every
rank (SIGTERM / Ctrl-C); a rank that dies stops the others with distributed.py's one-line error.
"""

import argparse
import base64
import itertools
import json
import logging
import queue
import select
import signal
import socket
import threading
import time
import uuid
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional
from urllib.request import urlopen

from mlx_lm import server as lm_server

from .cli_common import add_setting_flags, chosen_settings, load_for_cli
from .distributed import launch_group, lost_rank, lost_rank_exits, share
from .engine import FullRecompute, MaskedBlockDecoder, make_decoder
from .engine.block_cache import PrefixCache
from .engine.causal_prefix import CausalPrefixCache, CausalPrefixRecompute
from .engine.registry import select_backend, select_decoder
from .generate import _Detokenizer, _eos_ids, _prepare, checkpoint_settings
from .settings import SettingsError, resolve_settings
from .vision import is_processor, text_tokenizer

logger = logging.getLogger(__name__)

# Body fields of the OpenAI API that the handler reads itself; every other field is a setting.
REQUEST_FIELDS = {
    "model",
    "messages",
    "prompt",
    "stream",
    "stream_options",
    "stop",
    "max_tokens",
    "max_completion_tokens",
    "chat_template_kwargs",
    "role_mapping",
    "n",
    "user",
}
# Fields mlx-lm's server (or OpenAI) accepts that diffusion decoding has no use for: refused when
# given a value that would change anything, rather than ignored.
UNSUPPORTED_FIELDS = {
    "logprobs": "diffusion decoding commits whole blocks and returns no per-token log-probabilities",
    "top_logprobs": "diffusion decoding returns no per-token log-probabilities",
    "logit_bias": "the diffusion samplers take no logit bias",
    "min_p": "the diffusion samplers take temperature, top_p and top_k",
    "repetition_penalty": "the diffusion samplers take no repetition penalty",
    "presence_penalty": "the diffusion samplers take no presence penalty",
    "frequency_penalty": "the diffusion samplers take no frequency penalty",
    "xtc_probability": "the diffusion samplers take no XTC sampling",
    "tools": "tool calls are not parsed by this server",
    "draft_model": "diffusion models need no draft model",
    "num_draft_tokens": "diffusion models need no draft model",
    "adapters": "adapters are chosen when the server starts (--adapter-path)",
}
_NEUTRAL = (None, False, 0, 0.0, 1.0, -1, "", [], {})


class RequestError(ValueError):
    """A bad request: answered with `status` and the message, and the server keeps serving."""

    def __init__(self, message, status=400):
        super().__init__(message)
        self.status = status


# ------------------------------------------------------------------------------------- scheduler


class Job:
    """One request's generation, shared by its HTTP handler thread and the scheduler thread.

    The scheduler posts to `events`: ("accepted", prompt_tokens), ("error", message), or
    ("block", tokens, finished, eos) per committed block. The handler sets `cancelled` (client
    gone, stop string met) at any time; the scheduler reads it once per step, into `dropped`
    (the value every rank of a sharded server acts on), and drops the row at the next block
    boundary."""

    def __init__(self, prompt, overrides: dict, images=None):
        self.prompt = prompt
        self.overrides = overrides
        self.images = images
        self.events: "queue.Queue" = queue.Queue()
        self.cancelled = False
        self.dropped = False
        self.uid: Optional[int] = None  # the admission order: the same on every rank
        self.done = False
        self.ids: List[int] = []
        self.pixel_values = None
        self.settings: Dict[str, Any] = {}
        self.tokens: List[int] = []  # committed so far
        self.nfe = 0  # forwards of the runs this row took part in


class _NoEvents:
    """The events of a request that rank 0 answers, on another rank: nothing reads them."""

    def put(self, event):
        pass


class Group:
    """Requests whose settings let them share forwards, and their current decoder run."""

    def __init__(self, settings: dict, mergeable: bool, masked: bool, free_join: bool = False):
        self.settings = settings
        self.mergeable = mergeable  # rows may join a running batch at a block boundary
        self.free_join = free_join  # a join re-encodes nothing (full recompute)
        self.masked = masked  # the masked block decoder: it drops cancelled rows
        self.waiting: List[Job] = []
        self.jobs: List[Job] = []  # rows of the current run, by row index
        self.run = None
        self.decoder = None
        self.cancelled: set = set()  # row indices the current run drops at its next block
        self.nfe_seen = 0

    @property
    def idle(self) -> bool:
        return self.run is None and not self.waiting


class Scheduler:
    """Continuous batching at block granularity (see the module docstring). `step()` admits new
    requests and advances one group by one block, on the thread that built the model;
    `Scheduler.on_thread(load_model)` runs it on a worker thread that builds the model.

    Sharded over `group` (mlx.launch): every rank runs this scheduler on its shard; rank 0 takes
    the requests. At the start of each step rank 0 hands every rank what it saw since the last
    one (new requests, cancellations, a stop: `distributed.share`) before any of them acts on it.
    Everything else the scheduler decides follows from that and from the decoders' outputs,
    which are bitwise the same on every rank, so all ranks make the same forwards in the same
    order. The other ranks' jobs post their events nowhere."""

    def __init__(self, model, tokenizer, max_batch: int = 32, group=None):
        self.group = group
        self.rank = 0 if group is None else group.rank()
        self.model, self.tokenizer = model, tokenizer
        self.spec = model.diffusion_spec
        self.eos = _eos_ids(model, tokenizer, self.spec)
        self.max_batch = max_batch
        self.inbox: "queue.Queue[Job]" = queue.Queue()
        self.groups: Dict[str, Group] = {}
        self.thread: Optional[threading.Thread] = None
        self.stopped = threading.Event()  # asked to stop (rank 0 shares it at the next step)
        self.ended = False  # the step that every rank stops at has run
        self.error: Optional[str] = None  # why a sharded scheduler stopped serving, if it failed
        self._uids = itertools.count()
        # Counters the tests and the benchmark read.
        self.joins = 0  # runs restarted to take in rows that arrived while a batch decoded
        self.blocks = 0
        self.forwards = 0
        self.max_rows = 0  # largest batch a forward served

    # -- submission (any thread)

    def submit(self, job: Job) -> Job:
        self.inbox.put(job)
        return job

    # -- the worker

    @classmethod
    def on_thread(
        cls, load_model: Callable[[], tuple], max_batch: int = 32, group=None
    ) -> "Scheduler":
        """A scheduler whose worker thread first loads the model (`load_model()` -> (model,
        tokenizer)), then serves. MLX streams belong to a thread, and the arrays a model builds
        lazily (RoPE frequencies, masks) can only be evaluated on the thread that built them: the
        model is built where it runs, as mlx-lm's server loads in its generation thread. A load
        error is raised here."""
        box, ready = {}, threading.Event()

        def work():
            try:
                scheduler = cls(*load_model(), max_batch=max_batch, group=group)
                box["scheduler"] = scheduler
            except BaseException as e:  # raised again in the caller's thread
                box["error"] = e
                ready.set()
                return
            scheduler.thread = threading.current_thread()
            ready.set()
            scheduler._loop()

        threading.Thread(target=work, name="mlx_dllm-scheduler", daemon=True).start()
        ready.wait()
        if "error" in box:
            raise box["error"]
        return box["scheduler"]

    def stop(self):
        self.stopped.set()
        if self.thread is not None:
            self.thread.join(timeout=30)

    @property
    def healthy(self) -> bool:
        return self.thread is not None and self.thread.is_alive() and not self.stopped.is_set()

    def _loop(self):
        try:
            with lost_rank_exits(self.group):
                while not self.ended:
                    try:
                        self.step(wait=0.05)
                    except Exception as e:
                        # A bug must not take the server down with every request in it. Across
                        # ranks it must: the ranks could no longer agree on their collectives.
                        if self.group is not None or lost_rank(e):
                            raise
                        logger.exception("scheduler step failed")
                        self._fail_all("internal error in the decoding loop (see the server log)")
        except SystemExit as e:  # lost_rank_exits: another rank died
            self._end(str(e))
        except Exception:
            logger.exception("scheduler step failed")
            self._end(
                f"error: rank {self.rank} of {self.group.size()}: the decoding loop failed (see "
                "the traceback above); the ranks can no longer agree on their forwards, so all stop"
            )

    def _end(self, message: str):
        """A sharded scheduler stops serving: its requests get the error, and the process exits
        with it (server.main), which ends the other ranks too (their next collective fails)."""
        self.error = message
        self._fail_all(message)

    def _fail_all(self, message):
        for group in self.groups.values():
            for job in group.jobs + group.waiting:
                if not job.done:
                    job.done = True
                    job.events.put(("error", message))
        self.groups.clear()

    def step(self, wait: float = 0.0) -> bool:
        """Admit what arrived (waiting up to `wait` seconds for it when no group has work), apply
        the cancellations, then advance the next group with work by one block. Returns whether a
        block was decoded."""
        busy = any(not g.idle for g in self.groups.values())
        news = self._news(None if busy else wait)
        if news is not None:
            jobs, cancelled, stop = news
            self._admit(jobs)
            for job in self._live():
                job.dropped = job.dropped or job.uid in cancelled
            if stop:
                self.ended = True
                return False
        for key in list(self.groups):
            group = self.groups[key]
            if group.idle:
                del self.groups[key]
                continue
            # Round robin: the group goes to the back of the order after its block.
            self.groups[key] = self.groups.pop(key)
            self._advance(group)
            return True
        return False

    def _live(self):
        for group in self.groups.values():
            yield from (job for job in group.jobs + group.waiting if not job.done)

    def _news(self, wait: Optional[float]):
        """(new jobs, uids of the jobs cancelled since the last step, stop) as rank 0 saw them,
        the same on every rank; None when nothing happened. Rank 0 waits for requests on its
        inbox for up to `wait` seconds (idle); the other ranks wait in the collective, which
        polls (the ring backend keeps about a third of a core busy while it waits), so an idle
        rank sleeps most of rank 0's wait before it enters it."""
        if self.rank != 0:
            if wait:
                time.sleep(0.8 * wait)
            shared = share(None, self.group)
            if shared is None:
                return None
            requests, cancelled, stop = shared
            jobs = [Job(*request) for request in requests]
            for job in jobs:
                job.events = _NoEvents()
            return jobs, set(cancelled), stop
        jobs = []
        try:
            jobs.append(self.inbox.get(timeout=wait) if wait else self.inbox.get_nowait())
            while True:
                jobs.append(self.inbox.get_nowait())
        except queue.Empty:
            pass
        jobs = [job for job in jobs if not job.cancelled]
        cancelled = {job.uid for job in self._live() if job.cancelled and not job.dropped}
        stop = self.stopped.is_set()
        if not (jobs or cancelled or stop):
            share(None, self.group)
            return None
        if self.group is not None:
            requests = [(job.prompt, job.overrides, job.images) for job in jobs]
            share((requests, sorted(cancelled), stop), self.group)
        return jobs, cancelled, stop

    def _admit(self, jobs: List[Job]):
        for job in jobs:
            job.uid = next(self._uids)
            try:
                images = None if job.images is None else [job.images]
                spec, s, ids, pixel_values = _prepare(
                    self.model, self.tokenizer, [job.prompt], job.overrides, images
                )
                masked = select_decoder(spec, s) is MaskedBlockDecoder
                backend = select_backend(spec, s) if masked else None
            except (ValueError, TypeError) as e:
                job.done = True
                job.events.put(("error", str(e)))
                continue
            job.ids, job.settings = ids[0], s
            job.pixel_values = pixel_values[0] if pixel_values is not None else None
            mergeable = masked and (
                backend in (FullRecompute, PrefixCache)
                # Causal-prefix blocks are counted from the prompt's end and attend within the
                # block: only whole blocks keep every row's window its own. A restart's prefill
                # of [prompt ; committed] would encode the committed blocks with the prompt under
                # causal_context=False (not block by block), and would count a thinking budget
                # from the restart: those batch at arrival.
                or (
                    backend in (CausalPrefixCache, CausalPrefixRecompute)
                    and s["max_tokens"] % s["block_length"] == 0
                    and s.get("causal_context", True)
                    and s.get("end_think_token_id") is None
                )
            )
            shared = {k: v for k, v in s.items() if k != "max_tokens" or not mergeable}
            key = json.dumps([mergeable, sorted(shared.items())], default=repr)
            group = self.groups.get(key)
            if group is None:
                group = self.groups[key] = Group(s, mergeable, masked, backend is FullRecompute)
            group.waiting.append(job)
            job.events.put(("accepted", len(job.ids)))

    def _start(self, group: Group):
        for job in group.jobs + group.waiting:
            if job.dropped:
                job.done = True
        live = [j for j in group.jobs if not j.done]
        group.waiting = [j for j in group.waiting if not j.done]
        room = max(self.max_batch - len(live), 0)
        new, group.waiting = group.waiting[:room], group.waiting[room:]
        if live and new:
            self.joins += 1
        jobs = live + new
        if not jobs:
            group.run, group.jobs = None, []
            return
        budgets = [j.settings["max_tokens"] - len(j.tokens) for j in jobs]
        settings = dict(group.settings, max_tokens=max(budgets))
        images = None
        if any(j.pixel_values is not None for j in jobs):
            images = [j.pixel_values for j in jobs]
        decoder = make_decoder(self.model, settings, self.eos, images=images)
        prompts = [j.ids + j.tokens for j in jobs]
        group.cancelled = set()
        if group.mergeable:
            group.run = decoder.run(prompts, budgets=budgets, cancelled=group.cancelled)
        elif group.masked:
            group.run = decoder.run(prompts, cancelled=group.cancelled)
        else:
            group.run = decoder.run(prompts)
        group.decoder, group.jobs, group.nfe_seen = decoder, jobs, 0

    def _advance(self, group: Group):
        if group.run is None or self._should_join(group):
            self._start(group)
            if group.run is None:
                return
        if group.masked:
            # The masked decoder drops these rows when it resumes, before its next block.
            for row, job in enumerate(group.jobs):
                if job.dropped and not job.done:
                    group.cancelled.add(row)
                    job.done = True
        event = None
        try:
            while event is None or not hasattr(event, "finished"):
                event = next(group.run)
        except StopIteration:
            group.run = None
            for job in group.jobs:  # rows the run dropped without a final event (cancelled)
                job.done = True
            return
        nfe = group.decoder.nfe
        delta, group.nfe_seen = nfe - group.nfe_seen, nfe
        self.blocks += 1
        self.forwards += delta
        self.max_rows = max(self.max_rows, len(event.rows))
        for row, toks, eos, finished in zip(event.rows, event.tokens, event.eos, event.finished):
            job = group.jobs[row]
            if job.done:
                continue
            job.tokens.extend(toks)
            job.nfe += delta
            if job.dropped:
                job.done = True
                continue
            job.done = finished
            job.events.put(("block", list(toks), finished, eos))
        if all(j.done for j in group.jobs):
            group.run = None

    def _should_join(self, group: Group) -> bool:
        """Whether the waiting requests join the running batch at this block boundary. Full
        recompute keeps no K/V, so a join costs nothing: always. A backend with a K/V cache
        re-encodes the survivors' prompts and committed blocks on a join: it joins once the
        newcomers are at least as many as the survivors (else they wait for more arrivals or for
        the run's end), which bounds that re-encoding by the newcomers' own prefill."""
        if not (group.mergeable and group.waiting):
            return False
        live = sum(not j.done and not j.dropped for j in group.jobs)
        if live >= self.max_batch:
            return False
        return group.free_join or len(group.waiting) >= live


# ---------------------------------------------------------------------------------- HTTP handler


class StopWords:
    """OpenAI's `stop`: the text ends before the first stop string. Text that may be the start of
    a stop string is held back until the next block shows whether it is."""

    def __init__(self, words: List[str]):
        self.words = [w for w in words if w]
        self.text = ""
        self.emitted = 0

    def feed(self, new: str, final: bool):
        """(text to send now, whether a stop string was met)."""
        self.text += new
        hits = [i for i in (self.text.find(w, self._from(w)) for w in self.words) if i >= 0]
        if hits:
            out, self.emitted = self.text[self.emitted : min(hits)], len(self.text)
            return out, True
        safe = len(self.text)
        if not final:
            for w in self.words:
                for n in range(min(len(w) - 1, len(self.text)), 0, -1):
                    if self.text.endswith(w[:n]):
                        safe = min(safe, len(self.text) - n)
                        break
        safe = max(safe, self.emitted)
        out, self.emitted = self.text[self.emitted : safe], safe
        return out, False

    def _from(self, word):
        return max(0, self.emitted - len(word) + 1)


def _neutral(name, value) -> bool:
    """A value of an unsupported field that asks for nothing (what OpenAI clients send by
    default)."""
    if value is None or value is False:
        return True
    if isinstance(value, bool):
        return False
    if name == "repetition_penalty":
        return value in (0, 1)
    if name == "top_logprobs":
        return value in (0, -1)
    return value in (0, "", [], {})


def read_image(url: str):
    """An image of an `image_url` part: a data URL (decoded as mlx-lm's server does), an http(s)
    URL (fetched; refused with a clear message when the server cannot reach it), or a local file
    path / file:// URL, as mlx-vlm's server allows."""
    if url.startswith("data:"):
        try:
            return lm_server._decode_image(url)
        except Exception as e:
            raise RequestError(f"the image data URL could not be read as an image ({e})")
    if url.startswith(("http://", "https://")):
        try:
            with urlopen(url, timeout=10) as response:
                data = response.read()
        except OSError as e:  # URLError, timeouts, refused connections
            raise RequestError(
                f"could not fetch the image at {url} ({getattr(e, 'reason', e)}); this server may "
                "be offline: send the image inline as a data URL (data:image/png;base64,...) or "
                "as a local file path"
            )
        return lm_server._decode_image("data:;base64," + base64.b64encode(data).decode())
    path = Path(url[len("file://") :] if url.startswith("file://") else url)
    if not path.is_file():
        raise RequestError(
            f"image_url {url!r} is neither a data URL, an http(s) URL nor a local file: send the "
            "image as a data URL (data:image/png;base64,...)"
        )
    return str(path)


class Service:
    """What mlx-lm's APIHandler calls its `response_generator` (its `cli_args` and health), and
    this server's model, prompt building, request settings and scheduler."""

    def __init__(
        self,
        model,
        tokenizer,
        scheduler: Scheduler,
        model_id: str,
        defaults: Optional[dict] = None,
        chat_template_args: Optional[dict] = None,
        allowed_origins=("*",),
    ):
        self.model, self.tokenizer, self.scheduler = model, tokenizer, scheduler
        self.spec = model.diffusion_spec
        self.model_id = model_id
        self.defaults = dict(defaults or {})
        self.chat_template_args = dict(chat_template_args or {})
        self.created = int(time.time())
        names = {None, "default_model", model_id, Path(model_id).name}
        if Path(model_id).exists():
            names.add(str(Path(model_id).resolve()))
        self.model_names = names
        # The attributes mlx-lm's handler reads from its CLI arguments. Request defaults are
        # None: the settings chain (request, server flags, checkpoint, family) decides.
        self.cli_args = argparse.Namespace(
            allowed_origins=list(allowed_origins),
            model=model_id,
            num_draft_tokens=None,
            max_tokens=None,
            temp=None,
            top_p=None,
            top_k=None,
            min_p=None,
            chat_template_args=self.chat_template_args,
        )

    @property
    def is_healthy(self) -> bool:
        return self.scheduler.healthy

    def request_settings(self, body: dict) -> dict:
        """The decoding settings of a request body over the server's defaults, validated."""
        overrides = dict(self.defaults)
        for name, value in body.items():
            if name in REQUEST_FIELDS:
                continue
            if name in UNSUPPORTED_FIELDS:
                if not _neutral(name, value):
                    raise RequestError(f"{name} is not supported: {UNSUPPORTED_FIELDS[name]}")
                continue
            overrides[name] = value
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is not None:
            overrides["max_tokens"] = max_tokens
        if body.get("n") not in (None, 1):
            raise RequestError(f"n must be 1 (one completion per request), got {body['n']!r}")
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise RequestError('stream_options must be an object, e.g. {"include_usage": true}')
        stop = body.get("stop")
        if stop is not None and not isinstance(stop, str):
            if not isinstance(stop, list) or not all(isinstance(w, str) for w in stop):
                raise RequestError("stop must be a string or a list of strings")
        resolve_settings(self.spec, overrides, checkpoint_settings(self.model, self.spec))
        return overrides

    def build_prompt(self, request, template_kwargs=None):
        """(prompt, images or None) of a completion request: a chat goes through the chat
        template (as `mlx_dllm generate` applies it), image parts become the processor's image
        token at their place."""
        if request.request_type == "text":
            prompt = request.prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
                raise RequestError("prompt must be one text or one list of token ids per request")
            return prompt, None
        messages = request.messages
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise RequestError("messages must be a list of objects with a role and a content")
        if not messages:
            raise RequestError("messages is empty: send at least one message")
        if template_kwargs is not None and not isinstance(template_kwargs, dict):
            raise RequestError("chat_template_kwargs must be an object")
        messages = json.loads(json.dumps(messages))  # the template may not see our edits
        vision = is_processor(self.tokenizer)
        images = []
        for message in messages:
            content = message.get("content")
            if not isinstance(content, list):
                continue
            pieces = []
            for part in content:
                url = lm_server._image_url(part) if isinstance(part, dict) else None
                if url is not None:
                    if not vision:
                        raise RequestError(
                            "this model reads no images (its checkpoint has no vision tower); "
                            "send text content only"
                        )
                    images.append(read_image(url))
                    pieces.append(self.tokenizer.image_token)
                elif isinstance(part, dict) and part.get("type") == "text":
                    pieces.append(str(part.get("text", "")))
                else:
                    raise RequestError(
                        f"unsupported content part {part!r}: send 'text' and 'image_url' parts"
                    )
            message["content"] = "".join(pieces)
        lm_server.process_message_content(messages)
        tok = text_tokenizer(self.tokenizer)
        if getattr(tok, "chat_template", None):
            args = dict(self.chat_template_args, **(template_kwargs or {}))
            text = tok.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, **args
            )
        else:
            text = lm_server.convert_chat(messages, request.role_mapping)
        return text, images or None


class DiffusionAPIHandler(lm_server.APIHandler):
    """mlx-lm's handler with the diffusion generation behind it (see the module docstring)."""

    def __init__(self, service: Service, *args, **kwargs):
        self.service = service
        self.error_status = None
        super().__init__(service, *args, system_fingerprint=_FINGERPRINT, **kwargs)

    def log_message(self, format, *args):
        logger.debug("%s - %s", self.address_string(), format % args)

    def _set_completion_headers(self, status_code: int = 200):
        # mlx-lm answers every validation error with 400; an unknown model is a 404 (OpenAI's).
        if status_code == 400 and self.error_status is not None:
            status_code = self.error_status
        super()._set_completion_headers(status_code)

    def _error(self, message: str, status: int = 400):
        self.error_status = None
        body = json.dumps({"error": message}).encode()
        self._set_completion_headers(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()

    def validate_model_parameters(self):
        """Replaces mlx-lm's checks: the settings table validates every setting (do_POST answers a
        ValueError with 400 and the message)."""
        self._validate("stream", bool)
        model = self.body.get("model")
        if model not in self.service.model_names:
            self.error_status = 404
            raise ValueError(
                f"model {model!r} is not served here; this server serves "
                f"{self.service.model_id!r} (GET /v1/models)"
            )
        self.overrides = self.service.request_settings(self.body)

    def handle_chat_completions(self):
        if not isinstance(self.body.get("messages"), list):
            raise RequestError("a chat completion request needs messages (a list)")
        self.request_id = f"chatcmpl-{uuid.uuid4()}"
        self.object_type = "chat.completion.chunk" if self.stream else "chat.completion"
        return lm_server.CompletionRequest(
            "chat", "", self.body["messages"], None, self.body.get("role_mapping")
        )

    def handle_text_completions(self):
        if "prompt" not in self.body:
            raise RequestError("a completion request needs a prompt")
        return super().handle_text_completions()

    def handle_models_request(self):
        models = [
            {
                "id": self.service.model_id,
                "object": "model",
                "created": self.service.created,
                "owned_by": "mlx_dllm",
            }
        ]
        body = json.dumps({"object": "list", "data": models}).encode()
        self._set_completion_headers(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    # -- generation

    def _client_gone(self) -> bool:
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _next_event(self, job: Job):
        """The job's next event, or None when the client went away (the row is then cancelled)."""
        while True:
            try:
                return job.events.get(timeout=0.05)
            except queue.Empty:
                if self._client_gone():
                    job.cancelled = True
                    return None

    def _send_event(self, packet) -> None:
        data = packet if isinstance(packet, str) else json.dumps(packet)
        self.wfile.write(f"data: {data}\n\n".encode())
        self.wfile.flush()

    def _usage(self, job: Job, prompt_tokens: int, completion_tokens: int) -> dict:
        return {
            "nfe": job.nfe,
            "tokens_per_forward": round(completion_tokens / max(job.nfe, 1), 4),
        }

    def handle_completion(self, request, stop_words):
        service = self.service
        try:
            prompt, images = service.build_prompt(request, self.body.get("chat_template_kwargs"))
        except ValueError as e:
            return self._error(str(e), getattr(e, "status", 400))
        job = service.scheduler.submit(Job(prompt, self.overrides, images))
        event = self._next_event(job)
        if event is None:
            return
        if event[0] == "error":
            return self._error(event[1])
        prompt_tokens = event[1]
        stopper = StopWords(stop_words)
        detok = _Detokenizer(text_tokenizer(service.tokenizer))
        text, completion_tokens, finish = "", 0, None
        try:
            if self.stream:
                self._set_stream_headers(200)
                self.end_headers()
            while finish is None:
                event = self._next_event(job)
                if event is None:
                    return
                if event[0] == "error":
                    if self.stream:
                        self._send_event({"error": event[1]})
                        self._send_event("[DONE]")
                        return
                    return self._error(event[1], 500)
                _, toks, finished, eos = event
                completion_tokens += len(toks)
                new = detok.add(toks) + (detok.flush() if finished else "")
                new, hit = stopper.feed(new, final=finished)
                if hit:
                    finish = "stop"
                    job.cancelled = True  # its row leaves the batch at the next block
                elif finished:
                    finish = "stop" if eos else "length"
                if self.stream:  # one chunk per committed block
                    self._send_event(self.generate_response(new, finish))
                else:
                    text += new
            usage = self._usage(job, prompt_tokens, completion_tokens)
            if self.stream:
                options = self.stream_options or {}
                if options.get("include_usage"):
                    packet = self.completion_usage_response(prompt_tokens, completion_tokens)
                    packet["usage"].update(usage)
                    self._send_event(packet)
                self._send_event("[DONE]")
                return
            packet = self.generate_response(text, finish, prompt_tokens, completion_tokens)
            packet["usage"].update(usage)
            body = json.dumps(packet).encode()
            self._set_completion_headers(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            job.cancelled = True


_FINGERPRINT = lm_server.get_system_fingerprint()


# ---------------------------------------------------------------------------------------- server


def make_server(
    load_model: Callable[[], tuple],
    host: str = "127.0.0.1",
    port: int = 8080,
    model_id: str = "default_model",
    defaults: Optional[dict] = None,
    chat_template_args: Optional[dict] = None,
    allowed_origins=("*",),
    max_batch: int = 32,
    group=None,
):
    """An HTTP server (not yet serving), its Service as `server.service`, and the scheduler
    thread, which has loaded the model with `load_model()` -> (model, tokenizer) (its errors are
    raised here). `server.serve_forever()` serves; `shutdown(server)` stops both. `group`: rank 0
    of a sharded server (the other ranks run `follow`)."""
    scheduler = Scheduler.on_thread(load_model, max_batch=max_batch, group=group)
    model, tokenizer = scheduler.model, scheduler.tokenizer
    service = Service(
        model, tokenizer, scheduler, model_id, defaults, chat_template_args, allowed_origins
    )
    # As mlx-lm's _run_http_server: the address family of the host (IPv6 hosts too).
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, address = info[0]

    class Server(ThreadingHTTPServer):
        address_family = family
        daemon_threads = True

    try:
        server = Server(address, lambda *a, **k: DiffusionAPIHandler(service, *a, **k))
    except OSError:
        scheduler.stop()
        raise
    server.service = service
    if group is not None:
        # A sharded scheduler that fails (a rank died) ends the serving too: main() then exits
        # with its error. (shutdown() may come before serve_forever starts: it then returns at
        # once.)
        def stop_serving():
            scheduler.thread.join()
            if scheduler.error is not None:
                server.shutdown()

        threading.Thread(target=stop_serving, name="mlx_dllm-watch", daemon=True).start()
    return server


def follow(load_model: Callable[[], tuple], group, max_batch: int = 32) -> Scheduler:
    """A rank other than 0 of a sharded server: the scheduler thread (loading this rank's shard
    with `load_model()`) that makes rank 0's decisions on it, until rank 0 stops (`thread` ends;
    `error` says why when it failed)."""
    return Scheduler.on_thread(load_model, max_batch=max_batch, group=group)


def shutdown(server, serving: bool = True):
    """Stop a server made by make_server (`serving`: its serve_forever has run, which
    `shutdown()` waits for)."""
    if serving:
        server.shutdown()
    server.server_close()
    server.service.scheduler.stop()


def _parser():
    p = argparse.ArgumentParser(
        prog="mlx_dllm serve",
        description="An OpenAI-compatible server for a diffusion language model "
        "(/v1/chat/completions, /v1/completions, /v1/models, /health). Concurrent requests "
        "share forwards. The setting flags set the defaults that a request's body fields of the "
        "same name override.",
        allow_abbrev=False,
    )
    p.add_argument("--model", default=None, help="checkpoint folder (default: the embedded model)")
    p.add_argument(
        "--adapter-path",
        default=None,
        help="folder of LoRA adapters (adapter_config.json, adapters.safetensors) as mlx_lm.lora "
        "writes them, applied on the loaded model",
    )
    p.add_argument(
        "--extra-eos-token",
        action="append",
        default=[],
        metavar="TOKEN",
        help="another token (its text or id) that ends generation (repeatable)",
    )
    p.add_argument("--host", default="127.0.0.1", help="host to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default: 8080)")
    p.add_argument(
        "--allowed-origins",
        type=lambda x: x.split(","),
        default=["*"],
        help="allowed CORS origins (default: *)",
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let the tokenizer run the checkpoint's code",
    )
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
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
    )
    add_setting_flags(p)
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level), format="%(asctime)s - %(levelname)s - %(message)s"
    )
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
            allowed_origins=args.allowed_origins,
            max_batch=args.decode_concurrency,
            group=group,
        )
    except ValueError as e:  # CheckpointError, SettingsError
        raise SystemExit(f"error: {e}")
    except OSError as e:  # the port is taken, the host unknown
        raise SystemExit(f"error: cannot listen on {args.host}:{args.port}: {e}")
    service = server.service
    if args.chat_template is not None:
        text_tokenizer(service.tokenizer).chat_template = args.chat_template
    try:  # the server flags' defaults, checked once rather than on every request
        resolve_settings(service.spec, defaults, checkpoint_settings(service.model, service.spec))
    except SettingsError as e:
        shutdown(server, serving=False)
        raise SystemExit(f"error: {e}")
    logger.info("serving %s on http://%s:%d", service.model_id, args.host, server.server_address[1])
    previous = _sigterm_interrupts()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        shutdown(server)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if service.scheduler.error is not None:
        raise SystemExit(service.scheduler.error)
    return 0


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
            scheduler = follow(lambda: load_for_cli(args), group, args.decode_concurrency)
        except ValueError as e:  # CheckpointError, SettingsError
            raise SystemExit(f"error: {e}")
        try:  # the same check as rank 0's, which then stops every rank
            resolve_settings(
                scheduler.spec, defaults, checkpoint_settings(scheduler.model, scheduler.spec)
            )
        except SettingsError as e:
            scheduler.stop()
            raise SystemExit(f"error: {e}")
        scheduler.thread.join()
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    if scheduler.error is not None:
        raise SystemExit(scheduler.error)
    return 0
