"""What the server checks before a request costs it anything: the Host a request names, the
body's size, encoding and nesting, the origin of a browser's request, the shape of the messages,
and a prompt's length against the model's context before the tokenizer sees it.

Anyone who can reach the port (and, through a browser, any web page the user opens) can send a
request, so these answers come first and cost little: a request naming a host the server does not
serve is a 403 (DNS rebinding: a page on evil.example that points its own name at 127.0.0.1 makes
the browser's requests same-origin, where CORS no longer applies, but they still name
evil.example); a body over `--max-body-bytes` is a 413 read in chunks and dropped, never held; a
page from another origin gets a 403 and no CORS header unless `--cors-origin` names it; a prompt
longer than the context could hold in any tokenization is a 400 before it is tokenized.
"""

import asyncio
import ipaddress
import json
import logging
from typing import Optional, Sequence

from jinja2 import TemplateError
from starlette.requests import ClientDisconnect

from ..prompts import render_chat
from .fields import RequestError
from .limits import DEFAULT_MAX_BODY_BYTES, host_name  # noqa: F401  (used by api.py)

logger = logging.getLogger(__name__)

# A request body's default bound: a long prompt and a few images as data URLs fit; the 50 MB
# prompt that once held the server for minutes does not.
# How much of a refused body is read (and dropped) so that the client, still sending, reads the
# 413 rather than a reset connection; a larger one is cut off.
DRAIN_BYTES = 256 * 1024 * 1024
DRAIN_SECONDS = 5.0
# Python's json parser recurses once per level; far below the interpreter's recursion limit.
MAX_NESTING = 64


def shorten(text: str, limit: int = 120) -> str:
    """A client's value quoted in an error or a log line, cut to `limit` characters."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


async def receive_body(request, limit: int, timeout: float) -> dict:
    """The JSON object of a POST's body (a Starlette request), or a RequestError: no or a bad
    Content-Length (411 / 400), over `limit` bytes (413), not all sent within `timeout` seconds
    (408), not UTF-8, not JSON, nested deeper than MAX_NESTING, not an object (400)."""
    length = request.headers.get("content-length")
    size = int(length) if length is not None and length.strip().isdigit() else None
    if size is None:
        if length is None:
            raise RequestError("Content-Length header is required", 411)
        raise RequestError("Invalid Content-Length header")
    if size > limit:
        await _drain(request, size)
        raise RequestError(
            f"the request body has {size} bytes, more than this server takes ({limit}); send a "
            "shorter prompt, or start the server with a larger --max-body-bytes",
            413,
        )
    chunks, got = [], 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                chunks.append(chunk)
                got += len(chunk)
                if got >= size:
                    break
    except TimeoutError:
        raise RequestError(
            f"the request body did not arrive within {timeout:g} s (the server's --body-timeout)",
            408,
        )
    except ClientDisconnect:
        raise RequestError("the client went away before sending its body", 400)
    return parse_body(b"".join(chunks)[:size])


def parse_body(raw: bytes) -> dict:
    """A request body's JSON object, or a 400 saying what is wrong with it."""
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


async def _drain(request, size: int):
    """Read and drop up to DRAIN_BYTES of a refused body (DRAIN_SECONDS at most) in chunks, so
    that the client, still sending, reads the 413 rather than a reset connection."""
    if size > DRAIN_BYTES:
        return
    try:
        async with asyncio.timeout(DRAIN_SECONDS):
            async for _ in request.stream():
                pass
    except (TimeoutError, ClientDisconnect):
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


# The names of this machine's loopback that a local client may put in its Host header.
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
# Binds that listen on every address: a client names whichever address reached the server.
WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostCheck:
    """Which Host headers the server answers: this machine's loopback names (localhost,
    127.0.0.1, [::1]) and the host it listens on, any port; the names `--allowed-host` adds (a
    reverse proxy's, a LAN name; `*`: any); on a wildcard bind (0.0.0.0, ::), any IP address too
    (a page served from an address is that address's own: no name to rebind). A request without
    a Host header comes from no browser (HTTP/1.0 clients): answered."""

    def __init__(self, bind: str = "127.0.0.1", allowed: Sequence[str] = ()):
        names = {host_name(n) for n in (*LOOPBACK_NAMES, bind, *allowed)}
        self.any = "*" in names
        self.any_address = host_name(bind) in WILDCARD_HOSTS
        self.names = frozenset(n for n in names if n and n != "*")

    def allows(self, header: Optional[str]) -> bool:
        if header is None or self.any:
            return True
        name = host_name(header)
        return name in self.names or (self.any_address and _is_address(name))

    def refusal(self, header: Optional[str]) -> Optional[str]:
        """The 403's message for a request with this Host header; None when it is answered."""
        if self.allows(header):
            return None
        return (
            f"the Host header names {shorten(header, 100)!r}, not a host this server answers to "
            "(a web page that points its own name at this machine is refused); start the server "
            "with --allowed-host NAME to serve that name"
        )


def origin_allowed(origin: Optional[str], allowed: Sequence[str]) -> bool:
    """Whether a request's Origin header may drive the server: none (not a browser's
    cross-origin request), or one `--cors-origin` named (`*`: any)."""
    return origin is None or "*" in allowed or origin in allowed


def origin_refusal(origin: Optional[str], allowed: Sequence[str]) -> Optional[str]:
    """The 403's message for a request with this Origin header; None when it is answered (a
    browser sends the page's Origin; curl and OpenAI's clients send none)."""
    if origin_allowed(origin, allowed):
        return None
    return (
        f"requests from web pages of other origins ({shorten(origin, 100)}) are refused; start "
        "the server with --cors-origin ORIGIN to allow that origin"
    )


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


# The roles a chat template is given (OpenAI's, less `tool` and `function`: no tool calls here).
CHAT_ROLES = ("system", "developer", "user", "assistant")


def check_messages(messages) -> None:
    """A chat request's messages: a non-empty list of objects, each with a role (one of
    CHAT_ROLES) and a content that is a string or a list of parts (null only in an assistant's
    message)."""
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
        if role not in CHAT_ROLES:
            why = (
                "tool messages answer tool calls, which this server does not make"
                if role == "tool"
                else "not a chat role"
            )
            raise RequestError(
                f"messages[{i}].role is {shorten(role, 40)!r} ({why}); send system, developer, "
                "user or assistant messages",
                param=f"messages[{i}].role",
            )
        content = message.get("content")
        if content is None and role != "assistant":
            raise RequestError(
                f"messages[{i}].content is null: a {role} message needs a content (a string "
                "or a list of content parts)",
                param=f"messages[{i}].content",
            )
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


def check_prompt_ids(prompt, context: int) -> None:
    """Refuse a prompt of token ids longer than the context before anything reads them (a
    million ids took seconds to check one by one, only to be refused after)."""
    if isinstance(prompt, list) and len(prompt) > context:
        raise RequestError(
            f"the prompt has {len(prompt)} token ids, more than the model's context of {context} "
            "tokens can hold; shorten the prompt",
            param="prompt",
        )


def apply_template(tokenizer, messages, args: dict) -> str:
    """The chat template over a request's messages. A template that raises on them (a role order
    it refuses through raise_exception, a field it needs) is the request's fault: a 400 with its
    words; any other failure of the template a 500 that says where it failed."""
    try:
        return render_chat(tokenizer, messages, args)
    except TemplateError as e:
        raise RequestError(f"the chat template refused the messages: {shorten(e, 300)}")
    except Exception as e:
        raise RequestError(
            f"the chat template failed on the messages ({type(e).__name__}: {shorten(e, 300)})",
            500,
        )
