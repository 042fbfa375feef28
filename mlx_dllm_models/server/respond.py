"""One completion request over HTTP, from its body to its last byte: the plan (the body's fields
checked, the prompt built, the request prepared: `plan`, on a worker thread), then the answer
(`CompletionResponse`, on the event loop): the scheduler's events for the job, as one JSON answer
or as server-sent events, one chunk per committed block, with `: keep-alive` comments while a
stream waits, and the job cancelled when the client goes away or a stop string is met.

The packets are mlx-lm's server's (`generate_response`, `completion_usage_response`) in OpenAI's
shapes, with `usage.nfe` and `usage.tokens_per_forward` added; an empty answer's content is "",
as OpenAI's.
"""

import asyncio
import json
import queue
import time
import uuid
from dataclasses import dataclass
from typing import List, Optional

from mlx_lm import server as lm_server

from ..request import Detokenizer, Request
from ..vision import text_tokenizer
from .api import FINGERPRINT, StopWords, tokens_before
from .fields import error_body
from .logprobs import Logprobs
from .scheduler import Job
from .schema import read_body_fields


class EventQueue(queue.Queue):
    """A job's events, put by the scheduler's thread, awaited on the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        super().__init__()
        self.loop = loop
        self.ready = asyncio.Event()

    def put(self, item, block=True, timeout=None):
        super().put(item, block, timeout)
        try:
            self.loop.call_soon_threadsafe(self.ready.set)
        except RuntimeError:  # the loop has ended (the server stopped): nobody awaits it
            pass

    async def next(self, timeout: Optional[float]):
        """The next event, or None after `timeout` seconds (or a `ready.set()`) without one."""
        for _ in range(2):
            try:
                return self.get_nowait()
            except queue.Empty:
                pass
            self.ready.clear()  # then look again: an event put just before the clear stays seen
        try:
            await asyncio.wait_for(self.ready.wait(), timeout)
        except TimeoutError:
            return None
        try:
            return self.get_nowait()
        except queue.Empty:
            return None


@dataclass
class Plan:
    """What a completion request asks for, checked and prepared before it is queued."""

    chat: bool
    stream: bool
    include_usage: bool
    model: str
    stop: List[str]
    prompt: object
    images: Optional[list]
    prepared: Request
    overrides: dict
    fresh_seed: bool
    request_id: str
    created: int

    @property
    def object_type(self) -> str:
        if not self.chat:
            return "text_completion"
        return "chat.completion.chunk" if self.stream else "chat.completion"


def plan(service, body: dict, chat: bool) -> Plan:
    """A request body checked, its prompt built and its settings resolved (a ValueError says what
    is wrong). Runs on a worker thread: templates, images and the tokenizer take time."""
    read_body_fields(body, chat)
    service.check_model(body.get("model"))
    overrides = service.request_settings(body)
    if chat:
        request = lm_server.CompletionRequest(
            "chat", "", body["messages"], None, body.get("role_mapping")
        )
    else:
        request = lm_server.CompletionRequest("text", body["prompt"], [], None, None)
    prompt, images = service.build_prompt(request, body.get("chat_template_kwargs"))
    named = overrides.get("seed") is not None
    prepared = service.prepare(prompt, overrides, images)
    stop = body.get("stop") or []
    options = body.get("stream_options") or {}
    return Plan(
        chat=chat,
        stream=bool(body.get("stream", False)),
        include_usage=bool(options.get("include_usage")),
        model=body.get("model", "default_model"),
        stop=[stop] if isinstance(stop, str) else stop,
        prompt=prompt,
        images=images,
        prepared=prepared,
        overrides=overrides,
        fresh_seed=not named and overrides.get("seed") is not None,
        request_id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4()}",
        created=int(time.time()),
    )


def submit(service, plan: Plan) -> Job:
    """The plan's job, queued, its events awaitable on the running loop."""
    job = Job(plan.prompt, plan.overrides, plan.images, plan.prepared, plan.fresh_seed)
    job.events = EventQueue(asyncio.get_running_loop())
    return service.scheduler.submit(job)


def packet(plan: Plan, text: str, finish, counts=None) -> dict:
    """A response (or stream chunk) in OpenAI's shape; `counts`: (prompt, completion, cached)
    tokens for a whole answer's usage."""
    choice = {"index": 0, "finish_reason": finish}
    out = {
        "id": plan.request_id,
        "system_fingerprint": FINGERPRINT,
        "object": plan.object_type,
        "model": plan.model,
        "created": plan.created,
        "choices": [choice],
    }
    if counts is not None:
        out["usage"] = usage(*counts)
    if plan.chat:
        message = choice["delta" if plan.stream else "message"] = {"role": "assistant"}
        if not plan.stream or text:
            message["content"] = text
    else:
        choice["text"] = text
    return out


def usage(prompt: int, completion: int, cached: int) -> dict:
    out = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if cached is not None and cached >= 0:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


class CompletionResponse:
    """The ASGI answer of a queued job (see the module docstring)."""

    def __init__(self, service, plan: Plan, job: Job):
        self.service, self.plan, self.job = service, plan, job
        self.sent_at = None  # when a stream last wrote (keep-alive comments follow its silence)
        self.gone = asyncio.Event()
        self.finishing = False

    async def __call__(self, scope, receive, send):
        self.send, self.record = send, scope.get("mlx_dllm", {})
        watcher = asyncio.create_task(self._watch(receive))
        try:
            await self._answer()
        finally:
            self.finishing = True
            watcher.cancel()

    async def _watch(self, receive):
        """The client going away cancels the job (its row leaves at the next denoising step)."""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not self.finishing:
                    self.job.cancelled = True
                    self.gone.set()
                    self.job.events.ready.set()
                return

    async def _next(self):
        """The job's next event; None when the client went away. A stream silent for the
        service's `keepalive` seconds gets a comment."""
        keepalive = self.service.keepalive
        while not self.gone.is_set():
            wait = 1.0
            if self.sent_at is not None:
                wait = max(0.0, keepalive - (time.monotonic() - self.sent_at))
            event = await self.job.events.next(wait)
            if event is not None:
                return event
            if self.sent_at is not None and time.monotonic() - self.sent_at >= keepalive:
                await self._write(b": keep-alive\n\n")
        return None

    async def _write(self, data: bytes, more: bool = True):
        await self.send({"type": "http.response.body", "body": data, "more_body": more})
        self.sent_at = time.monotonic()

    async def _event(self, data) -> None:
        text = data if isinstance(data, str) else json.dumps(data)
        await self._write(f"data: {text}\n\n".encode())

    async def _json(self, body: dict, status: int = 200):
        data = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]
        await self.send({"type": "http.response.start", "status": status, "headers": headers})
        self.finishing = True
        await self.send({"type": "http.response.body", "body": data, "more_body": False})

    async def _answer(self):
        plan, job = self.plan, self.job
        event = await self._next()
        if event is None:
            return
        if event[0] == "error":
            status = event[2] if len(event) > 2 else 400
            return await self._json(error_body(event[1], status), status)
        prompt_tokens = event[1]
        stopper = StopWords(plan.stop)
        detok = Detokenizer(text_tokenizer(self.service.tokenizer))
        logprobs = Logprobs.of(plan.prepared.settings, detok.tokenizer, plan.object_type)
        text, completion_tokens, finish = "", 0, None
        if plan.stream:
            headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
            await self.send({"type": "http.response.start", "status": 200, "headers": headers})
            self.sent_at = time.monotonic()
        while finish is None:
            event = await self._next()
            if event is None:
                return
            if event[0] == "error":
                status = event[2] if len(event) > 2 else 500
                if plan.stream:
                    await self._event(error_body(event[1], status))
                    return await self._end()
                return await self._json(error_body(event[1], status), status)
            _, toks, finished, eos, entries = event
            completion_tokens += len(toks)
            if logprobs is not None:
                logprobs.add(entries)
            new = detok.add(toks) + (detok.flush() if finished else "")
            new, hit = stopper.feed(new, final=finished)
            if hit:
                finish = "stop"
                job.cancelled = True  # its row leaves the batch at the next block
                # The tokens returned: the block's tokens after the cut are not.
                completion_tokens = tokens_before(detok.tokenizer, detok.tokens, stopper.cut)
            elif finished:
                finish = "stop" if eos else "length"
            if plan.stream:  # one chunk per committed block
                chunk = packet(plan, new, finish)
                if logprobs is not None:
                    logprobs.attach(chunk, completion_tokens)
                await self._event(chunk)
            else:
                text += new
        self.record["tokens"] = (prompt_tokens, completion_tokens)
        # cached_tokens: prompt tokens whose K/V the prompt cache gave (the scheduler's count).
        counts = (prompt_tokens, completion_tokens, job.cached_tokens)
        extra = {
            "nfe": job.nfe,
            "tokens_per_forward": round(completion_tokens / max(job.nfe, 1), 4),
        }
        if plan.stream:
            if plan.include_usage:
                chunk = packet(plan, "", None, counts)
                chunk["choices"] = []
                chunk["usage"].update(extra)
                await self._event(chunk)
            return await self._end()
        answer = packet(plan, text, finish, counts)
        answer["usage"].update(extra)
        if logprobs is not None:
            logprobs.attach(answer, completion_tokens)
        await self._json(answer)

    async def _end(self):
        self.finishing = True
        await self._write(b"data: [DONE]\n\n", more=False)


def refused(e: Exception, body: Optional[dict] = None):
    """(OpenAI's error object, status) of a refused request: a RequestError's status, param and
    code; a settings error's param is the body field its message begins with."""
    status = getattr(e, "status", 400)
    param = getattr(e, "param", None)
    if param is None and body:
        first = str(e).split(" ", 1)[0]
        param = first if first in body else None
    return error_body(str(e), status, param, getattr(e, "code", None)), status
