"""Text-to-image requests on the scheduler's worker thread (the model's owner).

An ImageJob is one `/v1/images/generations` or `/v1/images/edits` request: `n` rows of one
prompt, their seeds, and the options every row of a batch must share (width, height, steps,
guidance_scale, temperature). The ImageQueue holds the jobs that arrived; between two text blocks
the scheduler asks it to run what is ready: every waiting job whose options agree with the oldest
one's (up to the scheduler's `max_batch` rows) shares one `images.stream_batch` call, as text
requests that arrive together share a run. A row draws from its own seed, so a request's images
are those it gets alone. After the first job arrives the queue waits the scheduler's `gather`
seconds for others sent at the same moment.

The VQ model is loaded here, when the scheduler is built on its thread: its arrays belong to that
thread as the model's do. A checkpoint without one still serves text; its image requests are
refused with the reason, as are a sharded server's (rank 0 alone takes them).
"""

import json
import queue
import threading
import time
from typing import Any, Dict, List, Optional

from ..errors import SettingsError
from ..images import resolve_vq_model, stream_batch

# The options of one batch: rows agree on them (the seed is each row's own).
SHARED_OPTIONS = ("width", "height", "steps", "guidance_scale", "temperature")
SHARED_OPTIONS += ("image_guidance_scale", "edit_side")


class ImageJob:
    """One image request. The worker posts one event to `events`: ("images", [PIL images], nfe)
    or ("error", message, status)."""

    def __init__(
        self, prompt: str, seeds: List[int], options: Dict[str, Any], image=None, mask=None
    ):
        self.prompt, self.seeds = prompt, list(seeds)
        self.options = {k: options.get(k) for k in SHARED_OPTIONS}
        self.image, self.mask = image, mask
        self.events: "queue.Queue" = queue.Queue()
        self.cancelled = False  # the client left before its batch began

    @property
    def key(self) -> str:
        # An edit (an image without a mask) and a generation never share a batch.
        edit = self.image is not None and self.mask is None
        return json.dumps(sorted(self.options.items()) + ([["edit", True]] if edit else []))

    def post(self, *event):
        self.events.put(event)


class ImageQueue:
    """The image jobs waiting for the worker, and the worker's VQ model (module docstring)."""

    def __init__(self, model, tokenizer, max_batch=32, gather=0.0, sharded=False):
        self.model, self.tokenizer = model, tokenizer
        self.max_batch, self.gather = max_batch, gather
        self.spec = getattr(model, "image_spec", None)
        self.vq, self.refusal = None, None
        if sharded:  # the other ranks would have to take part in every forward
            self.refusal = "a sharded server generates no images: serve the model on one machine"
        elif self.spec is None:
            name = getattr(getattr(model, "args", None), "model_type", type(model).__name__)
            self.refusal = f"{name} cannot generate images: it writes no image tokens (MMaDA does)"
        else:
            try:
                self.vq = resolve_vq_model(tokenizer, self.spec)
            except SettingsError as e:
                self.refusal = str(e)
        self.lock = threading.Lock()
        self.waiting: List[ImageJob] = []
        self.since = 0.0  # when the oldest waiting job arrived
        self.batches = 0  # stream_batch calls made (the tests read it)
        self.rows = 0  # images made
        self.forwards = 0
        self.ran_last = False  # the worker's last turn was an image batch

    @property
    def default_size(self) -> Optional[tuple]:
        """(width, height) the model was trained on; None when it makes no images."""
        if self.vq is None:
            return None
        side = round(self.spec.num_vq_tokens**0.5) * self.vq.downsample
        return side, side

    def add(self, job: ImageJob) -> ImageJob:
        """From any thread."""
        with self.lock:
            if not self.waiting:
                self.since = time.monotonic()
            self.waiting.append(job)
        return job

    def take(self) -> List[ImageJob]:
        """The jobs of the next batch, once the gathering time has passed."""
        with self.lock:
            self.waiting = [j for j in self.waiting if not j.cancelled]
            if not self.waiting or time.monotonic() < self.since + self.gather:
                return []
            key, rows, batch, rest = self.waiting[0].key, 0, [], []
            for job in self.waiting:
                fits = not batch or rows + len(job.seeds) <= self.max_batch
                if job.key == key and fits:
                    batch.append(job)
                    rows += len(job.seeds)
                else:
                    rest.append(job)
            self.waiting = rest
            self.since = time.monotonic() - self.gather  # the rest waited already
            return batch

    def run_ready(self, text_waiting: bool = False) -> int:
        """Run the next batch when one is ready (on the worker thread); its forwards (0: none).
        With text runs waiting, a batch never follows a batch: the two take turns, as the text
        groups do block by block."""
        if text_waiting and self.ran_last:
            self.ran_last = False
            return 0
        jobs = self.take()
        self.ran_last = bool(jobs)
        if not jobs:
            return 0
        try:
            return self.run(jobs)
        except (ValueError, TypeError) as e:  # SettingsError: the request's fault
            for job in jobs:
                job.post("error", str(e), 400)
        except Exception:
            for job in jobs:
                job.post("error", "internal error in image generation (see the server log)", 500)
            raise
        return 0

    def run(self, jobs: List[ImageJob]) -> int:
        if self.refusal is not None:
            raise SettingsError(self.refusal)
        prompts, seeds, images, masks = [], [], [], []
        for job in jobs:
            prompts += [job.prompt] * len(job.seeds)
            seeds += job.seeds
            images += [job.image] * len(job.seeds)
            masks += [job.mask] * len(job.seeds)
        last = None
        options = {k: v for k, v in jobs[0].options.items() if v is not None}
        for last in stream_batch(
            self.model,
            self.tokenizer,
            prompts,
            seed=seeds,
            images=images,
            masks=masks,
            vq_model=self.vq,
            every=1 << 30,
            **options,
        ):
            pass
        self.batches += 1
        self.rows += len(prompts)
        self.forwards += last[0].nfe
        at = 0
        for job in jobs:
            n = len(job.seeds)
            job.post("images", [r.image for r in last[at : at + n]], last[0].nfe)
            at += n
        return last[0].nfe

    def fail(self, message: str, status: int):
        with self.lock:
            jobs, self.waiting = self.waiting, []
        for job in jobs:
            job.post("error", message, status)
