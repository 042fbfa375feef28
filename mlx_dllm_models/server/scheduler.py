"""The server's scheduler: continuous batching at block granularity.

One worker thread owns the model (every MLX call happens there). Each request arrives prepared
(request.prepare: settings resolved, prompt encoded, on the HTTP handler's thread); requests whose
resolved settings agree (all but `max_tokens`, and `logprobs`, which changes no token) form a group
that shares one decoder run, so one forward serves every row; groups with different settings
(block length, sampler, family settings, temperature, seed...) take turns block by block. Within a
group:

* A row leaves when it finishes (EOS or its max_tokens). A row whose client disconnected (or whose
  stop string appeared) leaves at the next denoising step: the decoder drops it from its state and
  its K/V (`run(cancelled=)`, which every decoder takes: engine.Batching.drops_rows), and the
  other rows decode on as a smaller batch, their tokens unchanged (a row's decoding reads its own
  row only); a run left with no live row ends there. (A block can take a minute at thousands of
  positions on a CPU: a cancelled row no longer rides along to its end.)
* Requests that arrive while a group decodes join it at the next block boundary when the engine
  says such a join is exact (engine.join_policy: the decoder restarts rows over [prompt ;
  committed] with per-row budgets, `MaskedBlockDecoder.run(prompts, budgets=...)`, and the backend
  declares `joins_exactly(settings)`). For full recompute (bidirectional or block-causal) and the
  block-causal prefix cache this is exact: the tokens, positions and attention a row sees in the
  restarted run are those of its own run at the same block (left padding is never attended; a
  bidirectional row never attends past its own last column; block-causal padding is a multiple of
  the block length, so blocks stay on their absolute positions); the prefix cache re-encodes the
  survivors' committed blocks, K/V that equal those it had cached. Causal-prefix blocks (Nemotron)
  join the same way when max_tokens is a whole number of blocks, with causal context and no
  thinking budget (engine/causal_prefix.py says why). Self-speculation's rows (Nemotron's
  mode="self_spec", which share each forward) join at the next round without a thinking budget:
  each row is AR decoding, which a restart over [prompt ; returned tokens] continues token for
  token (the decoder declares `joins_exactly` itself). So at temperature 0 each request's tokens
  equal a single `generate_diffusion` call with the same prompt and settings. Fast-dLLM's
  approximate caches refresh their K/V on their own schedule, which a restart would move.
* Other runs batch at arrival: the requests waiting when a group's run starts share it, later ones
  wait for the next run (DiffusionGemma's canvases, which draw each row's noise from its own seeded
  stream that a restart would start over; self-speculation with a thinking budget; the cases
  above). For these groups `max_tokens` is part of the settings that must agree (a cancelled row
  leaves them at the next step as above; one of a decoder that could not drop rows would keep its
  place until the run ends).

At temperature > 0 the masked decoder's and the canvas decoder's rows draw from streams of their
own seeds (Batching.row_seeds): requests with different seeds share a run, each with the tokens it
gets alone, unless it was restarted by a join (its stream then starts over at the restart). The
other decoders draw batch-wide, as any batched sampler: `seed` reproduces a request served alone.

Sharded (`mlx.launch -n N ... serve`): every rank loads its shard and runs the scheduler; rank 0
alone takes the requests, and each step begins with rank 0 handing the others what it saw since the
last one (Scheduler docstring).
"""

import itertools
import json
import logging
import queue
import threading
import time
from collections import Counter
from dataclasses import replace
from typing import Callable, Dict, List, Optional

from ..distributed import lost_rank, lost_rank_exits, share
from ..engine import Batching, join_policy, make_decoder
from ..request import Request, prepare
from ..settings_fields import ResolvedSettings
from .image_jobs import ImageQueue
from .prompt_cache import PromptCache
from .worker import on_worker_thread

logger = logging.getLogger(__name__)

SHUTTING_DOWN = "the server is shutting down; send the request again once it is back"


class Job:
    """One request's generation, shared by its HTTP handler thread and the scheduler thread.

    The scheduler posts to `events`: ("accepted", prompt_tokens), ("error", message), or
    ("block", tokens, finished, eos, logprobs) per committed block (logprobs: the tokens'
    TokenLogprobs when the request asked for them, else None), or ("error", message, status) when
    it fails or the server stops. The handler sets `cancelled` (client gone, stop string met) at
    any time; the scheduler reads it at every step's start and between denoising steps, into
    `dropped` (the value every rank of a sharded server acts on), and the row leaves its run
    before the next denoising step (see the module docstring)."""

    def __init__(
        self,
        prompt,
        overrides: dict,
        images=None,
        request: Optional[Request] = None,
        fresh_seed: bool = False,
    ):
        self.prompt = prompt
        self.overrides = overrides
        self.images = images
        # The seed was drawn for this request (it named none): it need not match a batch-mate's.
        self.fresh_seed = fresh_seed
        # The prepared request (settings resolved, prompt encoded): the HTTP handler prepares it
        # on its own thread; a job without one (another rank's copy, a direct submit) is
        # prepared at admission.
        self.request = request
        self.events: "queue.Queue" = queue.Queue()
        self.cancelled = False
        self.dropped = False
        self.uid: Optional[int] = None  # the admission order: the same on every rank
        self.done = False
        self.tokens: List[int] = []  # committed so far
        self.nfe = 0  # forwards of the runs this row took part in
        self.cached_tokens = 0  # prompt tokens whose K/V came from the prompt cache

    @property
    def ids(self) -> List[int]:
        return self.request.ids[0]

    @property
    def settings(self) -> ResolvedSettings:
        return self.request.settings

    @property
    def pixel_values(self):
        pixels = self.request.pixel_values
        return None if pixels is None else pixels[0]


def _most_logprobs(jobs: List[Job]) -> Optional[int]:
    """The logprobs setting of a run: the most alternatives its rows ask for (None: none asks)."""
    asked = [j.settings.logprobs for j in jobs if j.settings.logprobs is not None]
    return max(asked) if asked else None


def _row_logprobs(event, i: int, job: Job):
    """Row i's TokenLogprobs with the alternatives its job asked for; None when it asked none."""
    k = job.settings.logprobs
    if k is None or event.logprobs is None:
        return None
    return [entry._replace(top=entry.top[:k]) for entry in event.logprobs[i]]


class _NoEvents:
    """The events of a request that rank 0 answers, on another rank: nothing reads them."""

    def put(self, event):
        pass


class Group:
    """Requests whose settings let them share forwards, and their current decoder run."""

    def __init__(self, request: Request, batching: Batching):
        self.settings = request.settings
        self.eos_token_ids = request.eos_token_ids
        self.eot_token_id = request.eot_token_id
        self.suffix = request.suffix  # the family's default suffix (RND1's trailing pad), if any
        self.batching = batching
        self.prior = None  # the prompt cache's entry the current run resumes from
        self.gather_until = 0.0  # a run batched at arrival starts no earlier (Scheduler.gather)
        self.waiting: List[Job] = []
        self.jobs: List[Job] = []  # rows of the current run, by row index
        self.run = None
        self.decoder = None
        self.cancelled: set = set()  # row indices the current run drops before its next step
        self.nfe_seen = 0

    def gathering(self, now: float) -> bool:
        """Whether the group's next run waits for more requests (Scheduler.gather)."""
        return self.run is None and bool(self.waiting) and now < self.gather_until

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

    def __init__(
        self,
        model,
        tokenizer,
        max_batch: int = 32,
        group=None,
        prompt_cache: Optional[PromptCache] = None,
        gather: float = 0.0,
    ):
        self.group = group
        # K/V of finished requests, reused by later ones that continue their tokens (None: off).
        self.prompt_cache = prompt_cache
        # A run that takes no rows once it has started (batched at arrival) waits this long after
        # its first request for others sent at the same moment by concurrent clients, so that
        # they share its forwards rather than queue behind it. Never across ranks: the ranks
        # would not agree on what arrived within it.
        self.gather = gather if group is None else 0.0
        self.rank = 0 if group is None else group.rank()
        self.model, self.tokenizer = model, tokenizer
        self.spec = model.diffusion_spec
        self.max_batch = max_batch
        self.inbox: "queue.Queue[Job]" = queue.Queue()
        self.groups: Dict[str, Group] = {}
        self.images = ImageQueue(model, tokenizer, max_batch, self.gather, group is not None)
        self.thread: Optional[threading.Thread] = None
        self.finished = threading.Event()  # the loop has ended (its thread is then parked)
        self.stopped = threading.Event()  # asked to stop (rank 0 shares it at the next step)
        self.ended = False  # the step that every rank stops at has run
        self.error: Optional[str] = None  # why a sharded scheduler stopped serving, if it failed
        self._uids = itertools.count()
        # Counters the tests and the benchmark read.
        self.joins = 0  # runs restarted to take in rows that arrived while a batch decoded
        self.cut_short = 0  # runs ended mid-block because no live row was left
        self.rows_dropped = 0  # cancelled rows that left a run whose other rows went on
        self.blocks = 0
        self.forwards = 0
        self.max_rows = 0  # largest batch a forward served
        self.batch_rows: Counter = Counter()  # forwards by the number of live rows they served

    # -- submission (any thread)

    def submit(self, job: Job) -> Job:
        self.inbox.put(job)
        return job

    # -- the worker

    @classmethod
    def on_thread(
        cls,
        load_model: Callable[[], tuple],
        max_batch: int = 32,
        group=None,
        prompt_cache: Optional[PromptCache] = None,
        gather: float = 0.0,
    ) -> "Scheduler":
        """A scheduler whose worker thread (worker.py) first loads the model (`load_model()` ->
        (model, tokenizer)), then serves. A load error is raised here."""
        return on_worker_thread(
            lambda: cls(
                *load_model(),
                max_batch=max_batch,
                group=group,
                prompt_cache=prompt_cache,
                gather=gather,
            )
        )

    def stop(self, timeout: Optional[float] = 30):
        """Stop at the next denoising step: the requests still running or waiting get a 503
        (SHUTTING_DOWN), then the loop ends (`finished`, waited for up to `timeout` seconds)."""
        self.stopped.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.finished.wait(timeout=timeout)

    @property
    def healthy(self) -> bool:
        return self.thread is not None and not self.finished.is_set() and not self.stopped.is_set()

    def _loop(self):
        try:
            self._serve()
        finally:
            self.finished.set()

    def _serve(self):
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
            self._fail_all(SHUTTING_DOWN, 503)
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

    def _fail_all(self, message, status: int = 500):
        self.images.fail(message, status)
        for group in self.groups.values():
            if group.run is not None:
                group.run.close()
            for job in group.jobs + group.waiting:
                if not job.done:
                    job.done = True
                    job.events.put(("error", message, status))
        self.groups.clear()
        while True:  # requests that arrived after the last step
            try:
                job = self.inbox.get_nowait()
            except queue.Empty:
                break
            job.done = True
            job.events.put(("error", message, status))

    def step(self, wait: float = 0.0) -> bool:
        """Admit what arrived (waiting up to `wait` seconds for it when no group has work), apply
        the cancellations, then advance the next group with work by one block. Returns whether a
        block was decoded."""
        now = time.monotonic()
        gathering = [g.gather_until - now for g in self.groups.values() if g.gathering(now)]
        busy = any(not g.idle and not g.gathering(now) for g in self.groups.values())
        if gathering:
            wait = min([wait, *gathering])
        if not self._take_news(None if busy else wait):
            return False
        if self.images.run_ready(busy):  # between two blocks, as a group's turn
            return True
        for key in list(self.groups):
            group = self.groups[key]
            if group.idle:
                del self.groups[key]
                continue
            if group.gathering(time.monotonic()):
                continue
            # Round robin: the group goes to the back of the order after its block.
            self.groups[key] = self.groups.pop(key)
            self._advance(group)
            return True
        return False

    def _take_news(self, wait: Optional[float]) -> bool:
        """Admit what arrived and mark the cancelled rows (`_news`); False once asked to stop."""
        news = self._news(wait)
        if news is not None:
            jobs, cancelled, stop = news
            self._admit(jobs)
            for job in self._live():
                job.dropped = job.dropped or job.uid in cancelled
            if stop:
                self.ended = True
        return not self.ended

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
            jobs = [Job(p, o, i, fresh_seed=f) for p, o, i, f in requests]
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
            requests = [(job.prompt, job.overrides, job.images, job.fresh_seed) for job in jobs]
            share((requests, sorted(cancelled), stop), self.group)
        return jobs, cancelled, stop

    def _admit(self, jobs: List[Job]):
        for job in jobs:
            job.uid = next(self._uids)
            try:
                if job.request is None:
                    images = None if job.images is None else [job.images]
                    job.request = prepare(
                        self.model, self.tokenizer, [job.prompt], job.overrides, images
                    )
                batching = join_policy(job.request.spec, job.settings)
            except (ValueError, TypeError) as e:
                job.done = True
                job.events.put(("error", str(e)))
                continue
            # Rows that may join a running batch share a group whatever their max_tokens (each
            # keeps its own budget); the others must agree on it too. The logprobs setting
            # changes no token: a run records the most alternatives any of its rows asks for. The
            # seed need not agree where each row draws from its own (row_seeds), nor for a seed
            # drawn for a request that named none (the run takes its first row's).
            s = job.settings
            own_seed = batching.row_seeds or job.fresh_seed
            shared = {
                k: v
                for k, v in s.as_dict().items()
                if k != "logprobs"
                and (k != "max_tokens" or not batching.joins)
                and (k != "seed" or not own_seed)
            }
            key = json.dumps([batching.joins, sorted(shared.items())], default=repr)
            group = self.groups.get(key)
            if group is None:
                group = self.groups[key] = Group(job.request, batching)
            group.waiting.append(job)
            if self.gather and group.run is None and len(group.waiting) == 1 and not batching.joins:
                group.gather_until = time.monotonic() + self.gather
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
        budgets = [j.settings.max_tokens - len(j.tokens) for j in jobs]
        # The run's seed is its first row's: a group's rows may have seeds of their own (see _admit).
        settings = replace(
            group.settings,
            max_tokens=max(budgets),
            logprobs=_most_logprobs(jobs),
            seed=jobs[0].settings.seed,
        )
        images = None
        if any(j.pixel_values is not None for j in jobs):
            images = [j.pixel_values for j in jobs]
        decoder = make_decoder(
            self.model,
            settings,
            group.eos_token_ids,
            images=images,
            eot_token_id=group.eot_token_id,
            suffix=group.suffix,
            row_seeds=[j.settings.seed for j in jobs] if group.batching.row_seeds else None,
        )
        prompts = [j.ids + j.tokens for j in jobs]
        group.cancelled = set()
        options = {}
        if group.batching.joins:
            options = dict(budgets=budgets, cancelled=group.cancelled)
        elif group.batching.drops_rows:
            options = dict(cancelled=group.cancelled)
        group.prior = self._cached_prior(group, prompts)
        if group.prior is not None:
            options["prior"] = group.prior
        constraints = [(j.request.constraints or [None])[0] for j in jobs]
        if any(c is not None for c in constraints):
            # Structured output: a restarted row's grammar continues after what it returned.
            options.update(constraints=constraints, consumed=[j.tokens for j in jobs])
        group.run = decoder.run(prompts, **options)
        group.decoder, group.jobs, group.nfe_seen = decoder, jobs, 0

    def _cached_prior(self, group: Group, prompts):
        """The prompt cache's entry for a run of one row (a batch's rows are left-padded, which
        the cached columns are not: they recompute), or None."""
        kind = group.batching.kv_kind
        if self.prompt_cache is None or kind is None or len(prompts) != 1:
            return None
        return self.prompt_cache.find(prompts[0], kind)

    def _keep_kv(self, group: Group):
        """A finished run of one row leaves its final K/V to the prompt cache."""
        if self.prompt_cache is None or group.batching.kv_kind is None or len(group.jobs) != 1:
            return
        prior = group.decoder.kv_prefix()
        if prior is not None:
            self.prompt_cache.add(prior)

    def _advance(self, group: Group):
        if group.run is None or self._should_join(group):
            self._start(group)
            if group.run is None:
                return
        self._drop_cancelled(group)
        event = None
        try:
            while event is None or not hasattr(event, "finished"):
                event = next(group.run)
                if not hasattr(event, "finished") and not self._between_steps(group):
                    return
        except StopIteration:
            group.run = None
            self._keep_kv(group)
            for job in group.jobs:  # rows the run dropped without a final event (cancelled)
                job.done = True
            return
        if group.prior is not None:  # the run's prefill has reused what it could
            group.jobs[0].cached_tokens = group.decoder.backend.reused
            group.prior = None
        self._count_forwards(group)
        self.blocks += 1
        self.max_rows = max(self.max_rows, len(event.rows))
        rows = zip(event.rows, event.tokens, event.eos, event.finished)
        for i, (row, toks, eos, finished) in enumerate(rows):
            job = group.jobs[row]
            if job.done:
                continue
            job.tokens.extend(toks)
            if job.dropped:
                job.done = True
                continue
            job.done = finished
            job.events.put(("block", list(toks), finished, eos, _row_logprobs(event, i, job)))
        if all(j.done for j in group.jobs):
            group.run = None
            self._keep_kv(group)

    def _count_forwards(self, group: Group) -> int:
        """The run's forwards since they were last counted, added to its rows' and the total."""
        nfe = group.decoder.nfe
        delta, group.nfe_seen = nfe - group.nfe_seen, nfe
        self.forwards += delta
        live = [job for job in group.jobs if not job.done]
        for job in live:
            job.nfe += delta
        if delta:
            self.batch_rows[len(live)] += delta
        return delta

    def _between_steps(self, group: Group) -> bool:
        """After a denoising step of `group`'s run: what arrived since the last step (as at a
        step's start, the same on every rank), then the cancelled rows, which the decoder drops
        before its next step. False when the run ended here (stopped, or no live row left)."""
        if not self._take_news(None):
            self._end_run(group)
            return False
        if any(j.dropped and not j.done for j in group.jobs) and all(
            j.dropped or j.done for j in group.jobs
        ):
            self._end_run(group)
            self.cut_short += 1
            return False
        self._drop_cancelled(group)
        return True

    def _drop_cancelled(self, group: Group) -> None:
        """The cancelled rows of the group's run go to its decoder's `cancelled` set (it drops
        them before its next denoising step) and are done; a decoder that cannot drop rows
        carries them to the run's end."""
        if group.run is None or not group.batching.drops_rows:
            return
        for row, job in enumerate(group.jobs):
            if job.dropped and not job.done:
                group.cancelled.add(row)
                job.done = True
                self.rows_dropped += 1

    def _end_run(self, group: Group):
        """End the group's run between two steps: its dropped rows are done, the others restart
        from their committed blocks at the group's next turn (or get the stop's 503). Nothing
        goes to the prompt cache: the K/V of a block half decoded is no run's final K/V."""
        group.run.close()
        group.run = None
        self._count_forwards(group)
        for job in group.jobs:
            if job.dropped:
                job.done = True
        # The survivors first in line: the group's next run takes them before the newcomers.
        group.waiting = [j for j in group.jobs if not j.done] + group.waiting
        group.jobs = []

    def _should_join(self, group: Group) -> bool:
        """Whether the waiting requests join the running batch at this block boundary. Full
        recompute keeps no K/V, so a join costs nothing: always. A backend with a K/V cache
        re-encodes the survivors' prompts and committed blocks on a join: it joins once the
        newcomers are at least as many as the survivors (else they wait for more arrivals or for
        the run's end), which bounds that re-encoding by the newcomers' own prefill."""
        if not (group.batching.joins and group.waiting):
            return False
        live = sum(not j.done and not j.dropped for j in group.jobs)
        if live >= self.max_batch:
            return False
        return group.batching.free_join or len(group.waiting) >= live
