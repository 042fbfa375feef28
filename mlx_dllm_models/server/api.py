"""The OpenAI-compatible HTTP side of `mlx_dllm serve`: request bodies in, committed blocks out.

Endpoints follow `mlx_lm.server` (`/v1/chat/completions`, `/v1/completions`, `/v1/models`,
`/health`); a request overrides any decoding setting with a body field of the same name
(`block_length`, `steps`, `sampler`, `threshold`, family settings) or the OpenAI one (`max_tokens` /
`max_completion_tokens`, `temperature`, `top_p`, `seed`, `stop`).

What comes from mlx-lm's server, and what cannot:

* Reused: its HTTP handler (`APIHandler`: body parsing and the malformed-body errors, CORS and
  stream headers, the response packets `generate_response` / `completion_usage_response`,
  `/health`), its request records (`CompletionRequest`), its chat helpers (`convert_chat` for a
  tokenizer without a template, `process_message_content`).
* Not reused: its `ResponseGenerator` and `BatchGenerator`, which decode token by token (an AR
  loop with a per-token KV cache, per-token logprobs and a per-token stop-sequence state machine).
  Here the unit is a committed block: the scheduler (scheduler.py) decodes blocks, a streamed chunk
  is a block's text, and stop words are matched on the text as blocks arrive (a stop string can
  appear anywhere in a freshly committed block, not only at its end). Its argument validation is
  replaced by the settings table's (request.prepare), whose messages name what each family
  understands; sampling arguments mlx-lm accepts that diffusion decoding has no use for
  (penalties, min_p, logit_bias, tools, draft models) are refused, never ignored. logprobs are
  each token's at the step that committed it, in OpenAI's shapes (logprobs.py).
"""

import argparse
import base64
import io
import json
import logging
import queue
import select
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import List, Optional
from urllib.request import urlopen

import numpy as np
from mlx_lm import server as lm_server

from ..request import Detokenizer, Request, prepare
from ..vision import is_processor, text_tokenizer
from .logprobs import Logprobs
from .logprobs import read_fields as read_logprobs
from .scheduler import Job, Scheduler

logger = logging.getLogger(__name__)

FINGERPRINT = lm_server.get_system_fingerprint()

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
    "logprobs",  # these two: logprobs.read_fields
    "top_logprobs",
}
# Fields mlx-lm's server (or OpenAI) accepts that diffusion decoding has no use for: refused when
# given a value that would change anything, rather than ignored.
UNSUPPORTED_FIELDS = {
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


class RequestError(ValueError):
    """A bad request: answered with `status` and the message, and the server keeps serving."""

    def __init__(self, message, status=400):
        super().__init__(message)
        self.status = status


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


def neutral(name, value) -> bool:
    """A value of an unsupported field that asks for nothing (what OpenAI clients send by
    default)."""
    if value is None or value is False:
        return True
    if isinstance(value, bool):
        return False
    if name == "repetition_penalty":
        return value in (0, 1)
    return value in (0, "", [], {})


def image_url(part: dict) -> Optional[str]:
    """The URL of an image content part (OpenAI's `image_url`, and the `input_image` / `image`
    spellings mlx-lm's server takes), or None for other parts."""
    if part.get("type") not in ("image_url", "input_image", "image"):
        return None
    url = part.get("image_url", part.get("image"))
    return url.get("url") if isinstance(url, dict) else url


def decode_image_bytes(data: bytes) -> np.ndarray:
    """An RGB uint8 image from encoded bytes (PNG, JPEG, ...)."""
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def decode_data_url(url: str) -> np.ndarray:
    """An RGB uint8 image from a data URL (data:image/png;base64,...)."""
    return decode_image_bytes(base64.b64decode(url.partition(",")[2]))


def read_image(url: str):
    """An image of an `image_url` part: a data URL (decoded as mlx-lm's server does), an http(s)
    URL (fetched; refused with a clear message when the server cannot reach it), or a local file
    path / file:// URL, as mlx-vlm's server allows."""
    if url.startswith("data:"):
        try:
            return decode_data_url(url)
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
        return decode_image_bytes(data)
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
        self.preparing = threading.Lock()
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
        """The decoding settings of a request body over the server's defaults (the settings table
        validates them when the request is prepared); the OpenAI fields checked here."""
        overrides = dict(self.defaults)
        for name, value in body.items():
            if name in REQUEST_FIELDS:
                continue
            if name in UNSUPPORTED_FIELDS:
                if not neutral(name, value):
                    raise RequestError(f"{name} is not supported: {UNSUPPORTED_FIELDS[name]}")
                continue
            overrides[name] = value
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is not None:
            overrides["max_tokens"] = max_tokens
        read_logprobs(body, overrides)
        if body.get("n") not in (None, 1):
            raise RequestError(f"n must be 1 (one completion per request), got {body['n']!r}")
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise RequestError('stream_options must be an object, e.g. {"include_usage": true}')
        stop = body.get("stop")
        if stop is not None and not isinstance(stop, str):
            if not isinstance(stop, list) or not all(isinstance(w, str) for w in stop):
                raise RequestError("stop must be a string or a list of strings")
        return overrides

    def prepare(self, prompt, overrides: dict, images=None) -> Request:
        """The request's settings resolved and its prompt encoded (request.prepare), here on the
        handler's thread: a bad setting or prompt is answered before the request is queued, and
        the scheduler's thread only decodes. One request at a time: a fast tokenizer is not safe
        to call from several threads at once."""
        with self.preparing:
            return prepare(
                self.model,
                self.tokenizer,
                [prompt],
                overrides,
                images=None if images is None else [images],
            )

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
                url = image_url(part) if isinstance(part, dict) else None
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
        super().__init__(service, *args, system_fingerprint=FINGERPRINT, **kwargs)

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
            prepared = service.prepare(prompt, self.overrides, images)
        except (ValueError, TypeError) as e:
            return self._error(str(e), getattr(e, "status", 400))
        job = service.scheduler.submit(Job(prompt, self.overrides, images, request=prepared))
        event = self._next_event(job)
        if event is None:
            return
        if event[0] == "error":
            return self._error(event[1])
        prompt_tokens = event[1]
        stopper = StopWords(stop_words)
        detok = Detokenizer(text_tokenizer(service.tokenizer))
        logprobs = Logprobs.of(prepared.settings, detok.tokenizer, self.object_type)
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
                _, toks, finished, eos, entries = event
                completion_tokens += len(toks)
                if logprobs is not None:
                    logprobs.add(entries)
                new = detok.add(toks) + (detok.flush() if finished else "")
                new, hit = stopper.feed(new, final=finished)
                if hit:
                    finish = "stop"
                    job.cancelled = True  # its row leaves the batch at the next block
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
            if logprobs is not None:
                logprobs.attach(packet, completion_tokens)
            body = json.dumps(packet).encode()
            self._set_completion_headers(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            job.cancelled = True
