"""The OpenAI-compatible HTTP side of `mlx_dllm serve`: the Service (a request's settings, prompt
and preparation), stop strings, and the access log.

Endpoints follow `mlx_lm.server` (`/v1/chat/completions`, `/v1/completions`, `/v1/models`,
`/health`), plus `/v1/models/{id}`, `/metrics` and OpenAI's Images API (image_api.py); a request
overrides any decoding setting with a body field of the same name (`block_length`, `steps`,
`sampler`, `threshold`, family settings) or the OpenAI one (`max_tokens` /
`max_completion_tokens`, `temperature`, `top_p`, `seed`, `stop`).
The HTTP stack is Starlette on uvicorn (app.py, transport.py); respond.py answers a completion.

What comes from mlx-lm's server, and what cannot:

* Reused: its request records (`CompletionRequest`), its chat helpers (`convert_chat` for a
  tokenizer without a template, `process_message_content`), its response packets' shapes
  (respond.py). Errors are OpenAI's objects (`{"error": {"message", "type", "param", "code"}}`,
  `error_body`) on every path and method. CORS: no page of another origin unless `--cors-origin`
  names it, and no request that names a host the server does not serve (`--allowed-host`; DNS
  rebinding).
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
  "none"`, a zero penalty, `n: 1`, `echo: false`, `best_of: 1`); others that would change the
  output are refused with a 400.
* DiffusionGemma's canvas sampler follows a temperature schedule (t_max at a canvas's first step
  down to t_min): `temperature` scales it (the family's reading, settings.resolve_settings), 1 is
  the checkpoint's schedule; it draws from the whole distribution, so `top_p` below 1 is refused.
* `max_tokens` past the model's context is lowered to what fits (`prepare(fit_context=True)`):
  the answer then ends with finish_reason "length"; a prompt that fills the context alone is a 400.
* `chat_template_kwargs` reach the chat template, except the arguments the server passes itself
  (a 400), and `chat_template` (a client's own template), refused unless the server was started
  with `--allow-client-chat-template` and then run within a budget (templates.py).
* Streams carry `: keep-alive` comments while they wait (a long prompt's prefill, a slow first
  block); each request leaves one access-log line at INFO.
"""

import json
import logging
import secrets
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import List, Optional

from mlx_lm import server as lm_server

from ..prompts import has_chat_template, is_processor, text_tokenizer
from ..request import UNSTATED_CONTEXT, Request, prepare
from .fields import (
    IGNORED_FIELDS,
    REQUEST_FIELDS,
    UNSUPPORTED_FIELDS,
    RequestError,
    draws_noise,
    neutral,
    read_response_format,
)
from .guards import (
    DEFAULT_MAX_BODY_BYTES,
    HostCheck,
    apply_template,
    check_messages,
    check_prompt_chars,
    check_prompt_ids,
    most_token_chars,
    shorten,
)
from .images import ImagePolicy, PixelBudget, image_url, read_image
from .logprobs import read_fields as read_logprobs
from .metrics import Metrics, endpoint
from .scheduler import Scheduler
from .templates import read_template_kwargs, render_client_template

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
    """This server's model, prompt building, request settings and scheduler, and what the HTTP
    side is configured with (origins, hosts, image policy, body bound, API keys, metrics)."""

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
        api_keys=(),
        allow_client_chat_template: bool = False,
    ):
        self.model, self.tokenizer, self.scheduler = model, tokenizer, scheduler
        self.hosts = hosts
        # Origins whose pages may call the server from a browser (`*`: any); none by default.
        self.cors_origins = list(cors_origins)
        self.image_policy = image_policy
        self.max_body_bytes = max_body_bytes
        # Bearer keys a request to /v1 must carry (none: no key asked).
        self.api_keys = [k for k in api_keys if k]
        self.allow_client_chat_template = allow_client_chat_template
        # A text prompt longer than this many characters cannot fit in the context.
        self.context = model.diffusion_spec.max_position_embeddings or UNSTATED_CONTEXT
        self.token_chars = most_token_chars(text_tokenizer(tokenizer))
        self.handlers = 0  # requests being answered (shutdown waits for their last words)
        self.handlers_lock = threading.Lock()
        self.metrics = Metrics()
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
            overrides[name] = value
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is not None:
            overrides["max_tokens"] = max_tokens
        read_logprobs(body, overrides)
        read_response_format(body, overrides)
        if body.get("n") not in (None, 1):
            raise RequestError(
                f"n must be 1 (one completion per request), got {body['n']!r}", param="n"
            )
        return overrides

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
        else:
            check_prompt_ids(prompt, self.context)
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
        overrides["max_tokens"] = s.max_tokens + request.reserved
        if overrides.get("seed") is None and draws_noise(request):
            overrides["seed"] = secrets.randbelow(2**63)
            request.settings = replace(s, seed=overrides["seed"])
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
        args, client_template = read_template_kwargs(
            template_kwargs, self.allow_client_chat_template
        )
        messages = json.loads(json.dumps(messages))  # the template may not see our edits
        images = self._read_images(messages)
        lm_server.process_message_content(messages)
        tok = text_tokenizer(self.tokenizer)
        args = dict(self.chat_template_args, **args)
        if client_template is not None:
            special = getattr(tok, "special_tokens_map", {}) or {}
            tokens = {k: v for k, v in special.items() if isinstance(v, str)}
            text = render_client_template(client_template, messages, args, tokens)
        elif has_chat_template(tok):
            text = apply_template(tok, messages, args)
        else:
            text = lm_server.convert_chat(messages, request.role_mapping)
        return text, images or None

    def _read_images(self, messages) -> list:
        """The images of the messages' image parts, in order (each part then the processor's
        image token, the message's content text); within the image policy's limits."""
        parts = [
            part
            for message in messages
            if isinstance(message.get("content"), list)
            for part in message["content"]
        ]
        budget = PixelBudget(self.image_policy)
        budget.count(sum(isinstance(p, dict) and image_url(p) is not None for p in parts))
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
                    images.append(read_image(url, self.image_policy, budget))
                    pieces.append(self.tokenizer.image_token)
                elif isinstance(part, dict) and part.get("type") == "text":
                    pieces.append(str(part.get("text", "")))
                else:
                    raise RequestError(
                        f"unsupported content part {shorten(repr(part))}: send 'text' and "
                        "'image_url' parts"
                    )
            message["content"] = "".join(pieces)
        return images


class AccessLog:
    """The outermost ASGI layer: one access-log line per answered request (method, path, status,
    tokens, seconds), the metrics' request counts, the count of requests being answered (shutdown
    waits for them), and the last word on a bug: a 500 in OpenAI's shape and one short log line
    (not the client's body in a traceback), where no answer had begun."""

    def __init__(self, app, service: Service, bug_answer):
        self.app, self.service, self.bug_answer = app, service, bug_answer

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, service = time.perf_counter(), self.service
        record = scope["mlx_dllm"] = {"status": None, "tokens": None}

        async def sending(message):
            if message["type"] == "http.response.start":
                record["status"] = message["status"]
            await send(message)

        with service.handlers_lock:
            service.handlers += 1
        try:
            await self.app(scope, receive, sending)
        except Exception as e:
            log_failure(scope, e)
            if record["status"] is None:
                await self.bug_answer(e)(scope, receive, sending)
        finally:
            with service.handlers_lock:
                service.handlers -= 1
            status = record["status"]
            if status is not None:
                path = scope.get("path", "-")
                if scope.get("query_string"):
                    path += "?" + scope["query_string"].decode("latin-1")
                prompt, completion = record["tokens"] or ("-", "-")
                service.metrics.answered(endpoint(scope.get("path", "")), status, record["tokens"])
                logger.info(
                    "%s %s %d prompt_tokens=%s completion_tokens=%s %.3fs",
                    scope.get("method", "-"),
                    path,
                    status,
                    prompt,
                    completion,
                    time.perf_counter() - started,
                )


def log_failure(scope, e: Exception) -> None:
    """A bug's one short ERROR line (its traceback at DEBUG), once per request, written before
    its 500 goes out."""
    record = scope.setdefault("mlx_dllm", {})
    if record.get("failed"):
        return
    record["failed"] = True
    where = f"{scope.get('method', '-')} {scope.get('path', '-')}"
    logger.error("%s failed: %s: %s", where, type(e).__name__, shorten(e, 200))
    logger.debug("the failure's traceback", exc_info=e)
