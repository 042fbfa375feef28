"""The OpenAI-compatible HTTP side of `mlx_dllm serve`: request bodies in, committed blocks out.

Endpoints follow `mlx_lm.server` (`/v1/chat/completions`, `/v1/completions`, `/v1/models`,
`/health`); a request overrides any decoding setting with a body field of the same name
(`block_length`, `steps`, `sampler`, `threshold`, family settings) or the OpenAI one (`max_tokens` /
`max_completion_tokens`, `temperature`, `top_p`, `seed`, `stop`).

What comes from mlx-lm's server, and what cannot:

* Reused: its HTTP handler (`APIHandler`: stream headers, the response packets
  `generate_response` / `completion_usage_response`, `/health`), its request records
  (`CompletionRequest`), its chat helpers (`convert_chat` for a tokenizer without a template,
  `process_message_content`). Its `do_POST` / `do_GET` are replaced: they answer errors with a
  bare string, where OpenAI's clients read `{"error": {"message", "type", "param", "code"}}`
  (`error_body`), and know no `/v1/models/{id}`. Its CORS headers (`*` for every page) are
  replaced by guards.py's: no page of another origin unless `--cors-origin` names it, and no
  request that names a host the server does not serve (`--allowed-host`; DNS rebinding).
* Not reused: its `ResponseGenerator` and `BatchGenerator`, which decode token by token (an AR
  loop with a per-token KV cache, per-token logprobs and a per-token stop-sequence state machine).
  Here the unit is a committed block: the scheduler (scheduler.py) decodes blocks, a streamed chunk
  is a block's text, and stop words are matched on the text as blocks arrive (a stop string can
  appear anywhere in a freshly committed block, not only at its end). Its argument validation is
  replaced by the settings table's (request.prepare), whose messages name what each family
  understands; sampling arguments mlx-lm accepts that diffusion decoding has no use for
  (penalties, min_p, logit_bias, tools, draft models) are refused, never ignored. logprobs are
  each token's at the step that committed it, in OpenAI's shapes (logprobs.py).

What OpenAI's clients send, and what it means here:

* No `seed` (in the body, or `--seed` when the server started): a fresh seed per request that
  draws noise (`draws_noise`), as OpenAI and mlx_lm.server; `seed` reproduces a request.
* Fields that change nothing for this server are accepted and ignored (IGNORED_FIELDS, and the
  neutral values of UNSUPPORTED_FIELDS: `response_format: {"type": "text"}`, `tool_choice:
  "none"`, a zero penalty, `n: 1`); others that would change the output are refused with a 400.
* DiffusionGemma's canvas sampler follows a temperature schedule (t_max at a canvas's first step
  down to t_min): `temperature` scales it (`canvas_temperature`), 1 is the checkpoint's schedule;
  it draws from the whole distribution, so `top_p` below 1 is refused.
* `max_tokens` past the model's context is lowered to what fits (`prepare(fit_context=True)`):
  the answer then ends with finish_reason "length"; a prompt that fills the context alone is a 400.
* Streams carry `: keep-alive` comments while they wait (a long prompt's prefill, a slow first
  block); each request leaves one access-log line at INFO.
"""

import argparse
import json
import logging
import queue
import secrets
import select
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import List, Optional
from urllib.parse import unquote, urlparse

from mlx_lm import server as lm_server

from ..request import UNSTATED_CONTEXT, Detokenizer, Request, prepare
from ..vision import is_processor, text_tokenizer
from .fields import (
    IGNORED_FIELDS,
    REQUEST_FIELDS,
    UNSUPPORTED_FIELDS,
    RequestError,
    canvas_temperature,
    draws_noise,
    error_body,
    neutral,
    read_response_format,
)
from .guards import (
    DEFAULT_MAX_BODY_BYTES,
    HostCheck,
    apply_template,
    check_messages,
    check_prompt_chars,
    cors_headers,
    most_token_chars,
    origin_refusal,
    read_body,
    shorten,
)
from .images import ImagePolicy, image_url, read_image
from .logprobs import Logprobs
from .logprobs import read_fields as read_logprobs
from .scheduler import Job, Scheduler

logger = logging.getLogger(__name__)

FINGERPRINT = lm_server.get_system_fingerprint()

# Seconds a stream may stay silent before a `: keep-alive` comment is sent.
KEEPALIVE_SECONDS = 5.0


class StopWords:
    """OpenAI's `stop`: the text ends before the first stop string. Text that may be the start of
    a stop string is held back until the next block shows whether it is."""

    def __init__(self, words: List[str]):
        self.words = [w for w in words if w]
        self.text = ""
        self.emitted = 0
        self.cut: Optional[int] = None  # where the text ends, once a stop string was met

    def feed(self, new: str, final: bool):
        """(text to send now, whether a stop string was met)."""
        self.text += new
        hits = [i for i in (self.text.find(w, self._from(w)) for w in self.words) if i >= 0]
        if hits:
            self.cut = min(hits)
            out, self.emitted = self.text[self.emitted : self.cut], len(self.text)
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


def tokens_before(tokenizer, tokens: List[int], chars: int) -> int:
    """How many of `tokens` the first `chars` characters of their text come from (a token that a
    stop string begins inside counts): the tokens a cut answer returns."""
    lo, hi = 0, len(tokens)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(tokens[:mid]).rstrip("\ufffd")) >= chars:
            hi = mid
        else:
            lo = mid + 1
    return lo


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
        cors_origins=(),
        image_policy: ImagePolicy = ImagePolicy(),
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        hosts: HostCheck = HostCheck(),  # the Host headers it answers (DNS rebinding)
    ):
        self.model, self.tokenizer, self.scheduler = model, tokenizer, scheduler
        self.hosts = hosts
        # Origins whose pages may call the server from a browser (`*`: any); none by default.
        self.cors_origins = list(cors_origins)
        self.image_policy = image_policy
        self.max_body_bytes = max_body_bytes
        # A text prompt longer than this many characters cannot fit in the context.
        self.context = model.diffusion_spec.max_position_embeddings or UNSTATED_CONTEXT
        self.token_chars = most_token_chars(text_tokenizer(tokenizer))
        self.handlers = 0  # requests being answered (shutdown waits for their last words)
        self.handlers_lock = threading.Lock()
        self.spec = model.diffusion_spec
        self.model_id = model_id
        self.defaults = dict(defaults or {})
        self.chat_template_args = dict(chat_template_args or {})
        self.created = int(time.time())
        self.keepalive = KEEPALIVE_SECONDS
        self.preparing = threading.Lock()
        names = {None, "default_model", model_id, Path(model_id).name}
        if Path(model_id).exists():
            names.add(str(Path(model_id).resolve()))
        self.model_names = names
        # The attributes mlx-lm's handler reads from its CLI arguments. Request defaults are
        # None: the settings chain (request, server flags, checkpoint, family) decides.
        self.cli_args = argparse.Namespace(
            allowed_origins=self.cors_origins,
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

    def check_model(self, model):
        """A request's `model` (None: the one served), or a 404 naming the one served."""
        if model not in self.model_names:
            raise RequestError(
                f"model {model!r} is not served here; this server serves {self.model_id!r} "
                "(GET /v1/models)",
                404,
                param="model",
                code="model_not_found",
            )

    def request_settings(self, body: dict) -> dict:
        """The decoding settings of a request body over the server's defaults (the settings table
        validates them when the request is prepared); the OpenAI fields checked here."""
        overrides = dict(self.defaults)
        for name, value in body.items():
            if name in REQUEST_FIELDS or name in IGNORED_FIELDS:
                continue
            if name in UNSUPPORTED_FIELDS:
                if not neutral(name, value):
                    raise RequestError(
                        f"{name} is not supported: {UNSUPPORTED_FIELDS[name]}", param=name
                    )
                continue
            # A nucleus of 1 and a top-k of 0 filter nothing (what clients send by default):
            # dropped unless they override the server's flag.
            if (name, value) in (("top_p", 1), ("top_k", 0)) and name not in self.defaults:
                continue
            overrides[name] = value
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is not None:
            overrides["max_tokens"] = max_tokens
        read_logprobs(body, overrides)
        read_response_format(body, overrides)
        if body.get("n") not in (None, 1):
            raise RequestError(f"n must be 1 (one completion per request), got {body['n']!r}")
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise RequestError('stream_options must be an object, e.g. {"include_usage": true}')
        stop = body.get("stop")
        if stop is not None and not isinstance(stop, str):
            if not isinstance(stop, list) or not all(isinstance(w, str) for w in stop):
                raise RequestError("stop must be a string or a list of strings")
        return canvas_temperature(self.model, overrides)

    def prepare(self, prompt, overrides: dict, images=None) -> Request:
        """The request's settings resolved and its prompt encoded (request.prepare), here on the
        handler's thread: a bad setting or prompt is answered before the request is queued, and
        the scheduler's thread only decodes. One request at a time: a fast tokenizer is not safe
        to call from several threads at once. A max_tokens past the context is lowered to what
        fits; a request that names no seed and draws noise gets a fresh one. Both are written
        into `overrides`, from which another rank of a sharded server prepares the same
        request. A text prompt that cannot fit in the context is refused before it is tokenized."""
        if isinstance(prompt, str):
            check_prompt_chars(prompt, self.context, self.token_chars)
        with self.preparing:
            request = prepare(
                self.model,
                self.tokenizer,
                [prompt],
                overrides,
                images=None if images is None else [images],
                fit_context=True,
            )
        s = request.settings
        # Lowered to what fits, where it did not (with the positions the default suffix takes).
        overrides["max_tokens"] = s["max_tokens"] + request.reserved
        if overrides.get("seed") is None and draws_noise(request):
            overrides["seed"] = s["seed"] = secrets.randbelow(2**63)
        return request

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
        check_messages(messages)
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
                url = image_url(part) if isinstance(part, dict) else None
                if url is not None:
                    if not vision:
                        raise RequestError(
                            "this model reads no images (its checkpoint has no vision tower); "
                            "send text content only"
                        )
                    images.append(read_image(url, self.image_policy))
                    pieces.append(self.tokenizer.image_token)
                elif isinstance(part, dict) and part.get("type") == "text":
                    pieces.append(str(part.get("text", "")))
                else:
                    raise RequestError(
                        f"unsupported content part {shorten(repr(part))}: send 'text' and "
                        "'image_url' parts"
                    )
            message["content"] = "".join(pieces)
        lm_server.process_message_content(messages)
        tok = text_tokenizer(self.tokenizer)
        if getattr(tok, "chat_template", None):
            args = dict(self.chat_template_args, **(template_kwargs or {}))
            text = apply_template(tok, messages, args)
        else:
            text = lm_server.convert_chat(messages, request.role_mapping)
        return text, images or None


class DiffusionAPIHandler(lm_server.APIHandler):
    """mlx-lm's handler with the diffusion generation behind it (see the module docstring)."""

    def __init__(self, service: Service, *args, **kwargs):
        self.service = service
        super().__init__(service, *args, system_fingerprint=FINGERPRINT, **kwargs)

    def log_message(self, format, *args):
        logger.debug("%s - %s", self.address_string(), format % args)

    # -- one access-log line per request

    def handle_one_request(self):
        self.started, self.status, self.tokens = time.perf_counter(), None, None
        self.sent_at = None  # when a stream last wrote (keep-alive comments follow its silence)
        service = self.service
        with service.handlers_lock:
            service.handlers += 1
        try:
            super().handle_one_request()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away: nobody to answer
        except Exception as e:
            # A bug must cost one answer and one log line, not the connection without a word
            # (and the client's body in a traceback).
            self.close_connection = True
            where = f"{getattr(self, 'command', '-')} {getattr(self, 'path', '-')}"
            logger.error("%s failed: %s: %s", where, type(e).__name__, shorten(e, 200))
            logger.debug("the failure's traceback", exc_info=True)
            if self.status is None:
                self._error(f"internal error ({type(e).__name__}); see the server log", 500)
        finally:
            with service.handlers_lock:
                service.handlers -= 1
            if self.status is not None:
                prompt, completion = self.tokens or ("-", "-")
                logger.info(
                    "%s %s %d prompt_tokens=%s completion_tokens=%s %.3fs",
                    self.command or "-",
                    getattr(self, "path", "-"),  # unset when the request line was malformed
                    self.status,
                    prompt,
                    completion,
                    time.perf_counter() - self.started,
                )

    def send_response(self, code, message=None):
        self.status = code
        super().send_response(code, message)

    # -- who may call: requests naming a host it serves, pages of the origins --cors-origin names

    def _refused(self) -> bool:
        """A 403 for a request that names a host the server does not serve (DNS rebinding) or
        comes from a web page of an origin --cors-origin does not name; False when it may go on."""
        message = self.service.hosts.refusal(self.headers.get("Host"))
        message = message or origin_refusal(self.headers.get("Origin"), self.service.cors_origins)
        if message is None:
            return False
        self.close_connection = True  # a POST's body is left unread
        self._error(message, 403)
        return True

    def _set_cors_headers(self):
        for name, value in cors_headers(self.headers.get("Origin"), self.service.cors_origins):
            self.send_header(name, value)

    def do_OPTIONS(self):
        """A browser's preflight: 204 with the CORS headers for an allowed origin, else 403."""
        if self._refused():
            return
        self._set_completion_headers(204)
        self.send_header("Content-Length", "0")
        self.end_headers()

    # -- requests

    def _error(self, message: str, status: int = 400, param=None, code=None):
        self._send_json(error_body(message, status, param, code), status)

    def _refuse(self, e: Exception):
        """The answer to a refused request (a RequestError's status, param and code; 400 else)."""
        status = getattr(e, "status", 400)
        self._error(str(e), status, getattr(e, "param", None), getattr(e, "code", None))

    def _send_json(self, packet: dict, status: int = 200):
        body = json.dumps(packet).encode()
        self._set_completion_headers(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()

    def do_POST(self):
        """mlx-lm's do_POST, with every error in OpenAI's shape."""
        factories = {
            "/v1/completions": self.handle_text_completions,
            "/v1/chat/completions": self.handle_chat_completions,
            "/chat/completions": self.handle_chat_completions,
        }
        if self._refused():
            return
        factory = factories.get(urlparse(self.path).path)
        if factory is None:
            self.close_connection = True  # its body is left unread
            return self._error(f"no such endpoint: POST {self.path}", 404)
        try:
            self.body = read_body(self, self.service.max_body_bytes)
            self.stream = self.body.get("stream", False)
            self.stream_options = self.body.get("stream_options")
            self.requested_model = self.body.get("model", "default_model")
            self.validate_model_parameters()
            request = factory()
        except ValueError as e:  # RequestError, SettingsError, CheckpointError
            return self._refuse(e)
        stop = self.body.get("stop") or []
        self.handle_completion(request, [stop] if isinstance(stop, str) else stop)

    def do_GET(self):
        if self._refused():
            return
        path = urlparse(self.path).path.rstrip("/")
        if path == "/v1/models":
            self._send_json({"object": "list", "data": [self._model_object()]})
        elif path.startswith("/v1/models/"):
            try:
                self.service.check_model(unquote(path[len("/v1/models/") :]))
            except RequestError as e:
                return self._refuse(e)
            self._send_json(self._model_object())
        elif path == "/health":
            self.handle_health_check()
        else:
            self._error(f"no such endpoint: GET {self.path}", 404)

    def _model_object(self) -> dict:
        service = self.service
        return {
            "id": service.model_id,
            "object": "model",
            "created": service.created,
            "owned_by": "mlx_dllm",
        }

    def validate_model_parameters(self):
        """Replaces mlx-lm's checks: the settings table validates every setting (do_POST answers a
        ValueError with 400 and the message)."""
        self._validate("stream", bool)
        self.service.check_model(self.body.get("model"))
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

    # -- generation

    def _client_gone(self) -> bool:
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _next_event(self, job: Job):
        """The job's next event, or None when the client went away (the row is then cancelled).
        A stream that waits longer than the service's `keepalive` seconds gets a comment."""
        while True:
            try:
                return job.events.get(timeout=0.05)
            except queue.Empty:
                if self._client_gone():
                    job.cancelled = True
                    return None
                if self.sent_at is not None:
                    if time.monotonic() - self.sent_at >= self.service.keepalive:
                        self._write(b": keep-alive\n\n")

    def _write(self, data: bytes) -> None:
        self.wfile.write(data)
        self.wfile.flush()
        self.sent_at = time.monotonic()

    def _send_event(self, packet) -> None:
        data = packet if isinstance(packet, str) else json.dumps(packet)
        self._write(f"data: {data}\n\n".encode())

    def _usage(self, job: Job, prompt_tokens: int, completion_tokens: int) -> dict:
        return {
            "nfe": job.nfe,
            "tokens_per_forward": round(completion_tokens / max(job.nfe, 1), 4),
        }

    def handle_completion(self, request, stop_words):
        service = self.service
        try:
            prompt, images = service.build_prompt(request, self.body.get("chat_template_kwargs"))
            named = self.overrides.get("seed") is not None
            prepared = service.prepare(prompt, self.overrides, images)
        except (ValueError, TypeError) as e:
            return self._refuse(e)
        fresh = not named and self.overrides.get("seed") is not None
        job = Job(prompt, self.overrides, images, request=prepared, fresh_seed=fresh)
        job = service.scheduler.submit(job)
        event = self._next_event(job)
        if event is None:
            return
        if event[0] == "error":
            return self._error(*event[1:])
        prompt_tokens = event[1]
        stopper = StopWords(stop_words)
        detok = Detokenizer(text_tokenizer(service.tokenizer))
        logprobs = Logprobs.of(prepared.settings, detok.tokenizer, self.object_type)
        text, completion_tokens, finish = "", 0, None
        try:
            if self.stream:
                self._set_stream_headers(200)
                self.end_headers()
                self.sent_at = time.monotonic()
            while finish is None:
                event = self._next_event(job)
                if event is None:
                    return
                if event[0] == "error":
                    status = event[2] if len(event) > 2 else 500
                    if self.stream:
                        self._send_event(error_body(event[1], status))
                        self._send_event("[DONE]")
                        return
                    return self._error(event[1], status)
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
                if self.stream:  # one chunk per committed block
                    packet = self.generate_response(new, finish)
                    if logprobs is not None:
                        logprobs.attach(packet, completion_tokens)
                    self._send_event(packet)
                else:
                    text += new
            usage = self._usage(job, prompt_tokens, completion_tokens)
            self.tokens = (prompt_tokens, completion_tokens)
            # cached_tokens: prompt tokens whose K/V the prompt cache gave (the scheduler's count).
            counts = (prompt_tokens, completion_tokens, job.cached_tokens)
            if self.stream:
                options = self.stream_options or {}
                if options.get("include_usage"):
                    packet = self.completion_usage_response(*counts)
                    packet["object"] = self.object_type  # mlx-lm's says "chat.completion"
                    packet["usage"].update(usage)
                    self._send_event(packet)
                self._send_event("[DONE]")
                return
            packet = self.generate_response(text, finish, *counts)
            packet["usage"].update(usage)
            if logprobs is not None:
                logprobs.attach(packet, completion_tokens)
            self._send_json(packet)
        except (BrokenPipeError, ConnectionResetError):
            job.cancelled = True
