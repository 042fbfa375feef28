"""What the server checks before a request costs it anything: the body's size, encoding and
nesting, the origin of a browser's request, the shape of the messages, and a prompt's length
against the model's context before the tokenizer sees it.

Anyone who can reach the port (and, through a browser, any web page the user opens) can send a
request, so these answers come first and cost little: a body over `--max-body-bytes` is a 413
read in chunks and dropped, never held; a page from another origin gets a 403 and no CORS header
unless `--cors-origin` names it; a prompt longer than the context could hold in any tokenization
is a 400 before it is tokenized.
"""

import json
import logging
from typing import Optional, Sequence

from jinja2 import TemplateError

from .fields import RequestError

logger = logging.getLogger(__name__)

# A request body's default bound: a long prompt and a few images as data URLs fit; the 50 MB
# prompt that once held the server for minutes does not.
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
# How much of a refused body is read (and dropped) so that the client, still sending, reads the
# 413 rather than a reset connection; a larger one is cut off.
DRAIN_BYTES = 256 * 1024 * 1024
DRAIN_SECONDS = 5.0
CHUNK = 1 << 16
# Python's json parser recurses once per level; far below the interpreter's recursion limit.
MAX_NESTING = 64


def shorten(text: str, limit: int = 120) -> str:
    """A client's value quoted in an error or a log line, cut to `limit` characters."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def read_body(handler, limit: int) -> dict:
    """The JSON object of a POST's body, or a RequestError: no or a bad Content-Length (411 /
    400), over `limit` bytes (413), not UTF-8, not JSON, nested deeper than MAX_NESTING, not an
    object (400)."""
    length = handler.headers.get("Content-Length")
    size = int(length) if length is not None and length.strip().isdigit() else None
    if size is None:
        handler.close_connection = True  # a body of unknown length is left unread
        if length is None:
            raise RequestError("Content-Length header is required", 411)
        raise RequestError("Invalid Content-Length header")
    if size > limit:
        handler.close_connection = True
        _drain(handler, size)
        raise RequestError(
            f"the request body has {size} bytes, more than this server takes ({limit}); send a "
            "shorter prompt, or start the server with a larger --max-body-bytes",
            413,
        )
    raw = handler.rfile.read(size)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(
            f"the request body is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset "
            f"{e.start}); send JSON encoded as UTF-8"
        )
    try:
        body = json.loads(text)
        deep = _too_deep(body)
    except json.JSONDecodeError as e:
        raise RequestError(f"Invalid JSON in request body: {e}")
    except RecursionError:  # the parser's own bound, far deeper than MAX_NESTING
        deep = True
    if deep:
        raise RequestError(
            f"the request body nests objects and lists more than {MAX_NESTING} deep; no OpenAI "
            "request does"
        )
    if not isinstance(body, dict):
        raise RequestError("Request should be a JSON dictionary")
    return body


def _drain(handler, size: int):
    """Read and drop up to DRAIN_BYTES of a refused body (DRAIN_SECONDS at most) in chunks."""
    if size > DRAIN_BYTES:
        return
    try:
        handler.connection.settimeout(DRAIN_SECONDS)
        left = size
        while left > 0:
            got = handler.rfile.read(min(CHUNK, left))
            if not got:
                break
            left -= len(got)
    except OSError:
        pass


def _too_deep(value) -> bool:
    """Whether a parsed JSON value nests objects and lists more than MAX_NESTING deep (walked
    without recursion: what follows, json.dumps and repr among it, recurses)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > MAX_NESTING:
                return True
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return False


def origin_allowed(origin: Optional[str], allowed: Sequence[str]) -> bool:
    """Whether a request's Origin header may drive the server: none (not a browser's
    cross-origin request), or one `--cors-origin` named (`*`: any)."""
    return origin is None or "*" in allowed or origin in allowed


def cors_headers(origin: Optional[str], allowed: Sequence[str]) -> list:
    """The CORS headers of an answer to `origin`: none unless `--cors-origin` allows it (a
    browser then keeps the answer from the page)."""
    if origin is None or not origin_allowed(origin, allowed):
        return []
    headers = [("Access-Control-Allow-Origin", "*" if "*" in allowed else origin)]
    if "*" not in allowed:
        headers.append(("Vary", "Origin"))
    headers.append(("Access-Control-Allow-Methods", "GET, POST, OPTIONS"))
    headers.append(("Access-Control-Allow-Headers", "Content-Type, Authorization"))
    return headers


def check_messages(messages) -> None:
    """A chat request's messages: a non-empty list of objects, each with a role (a string) and a
    content that is a string, a list of parts or null."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise RequestError("messages must be a list of objects with a role and a content")
    if not messages:
        raise RequestError("messages is empty: send at least one message")
    for i, message in enumerate(messages):
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise RequestError(
                f"messages[{i}] has no role: each message needs a role (system, user or "
                "assistant) and a content",
                param=f"messages[{i}].role",
            )
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise RequestError(
                f"messages[{i}].content must be a string or a list of content parts, got "
                f"{type(content).__name__}",
                param=f"messages[{i}].content",
            )


def most_token_chars(tokenizer) -> int:
    """The most characters one token of `tokenizer` stands for (its longest vocabulary entry;
    byte-level and SentencePiece entries spell at least as many characters as they decode to), so
    that a text longer than context x this cannot fit in the context, whatever its tokenization."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # a tokenizer without a vocabulary listing: no bound from it
        return 0
    return max((len(t) for t in vocab), default=0)


def check_prompt_chars(prompt: str, context: int, per_token: int) -> None:
    """Refuse a text prompt that cannot fit in `context` tokens before it is tokenized
    (tokenizing megabytes takes minutes and gigabytes, only to be refused after)."""
    if per_token <= 0 or len(prompt) <= context * per_token:
        return
    raise RequestError(
        f"the prompt has {len(prompt)} characters, more than the model's context of {context} "
        f"tokens can hold (at most {context * per_token} characters: {per_token} a token at most "
        "with this tokenizer); shorten the prompt"
    )


def apply_template(tokenizer, messages, args: dict) -> str:
    """The chat template over a request's messages. A template that raises on them (a role order
    it refuses through raise_exception, a field it needs) is the request's fault: a 400 with its
    words; any other failure of the template a 500 that says where it failed."""
    try:
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **args
        )
    except TemplateError as e:
        raise RequestError(f"the chat template refused the messages: {shorten(e, 300)}")
    except Exception as e:
        raise RequestError(
            f"the chat template failed on the messages ({type(e).__name__}: {shorten(e, 300)})",
            500,
        )
