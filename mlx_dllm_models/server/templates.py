"""A request's `chat_template_kwargs`: the arguments a chat template may take from a client, and a
client's own template (`chat_template`), which runs only where the operator allows it.

A chat template is a program: a client's template of two nested loops of 100000 pinned a core
until the server restarted, and went on after the client left. So a client's template is refused
unless the server was started with `--allow-client-chat-template`, and then it runs in a process
of its own (render_child.py: jinja2's sandbox, as transformers renders templates) that is killed
at CLIENT_TEMPLATE_SECONDS, may map CLIENT_TEMPLATE_BYTES of memory and write
CLIENT_TEMPLATE_CHARS of text. The arguments the server passes to the template itself (the
messages, add_generation_prompt, tokenize, ...) cannot be given again by a client: a 400 rather
than the template call's TypeError.
"""

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Optional, Tuple

from .fields import RequestError

# The template call's own arguments (transformers' apply_chat_template), never a client's.
RESERVED_TEMPLATE_ARGS = frozenset(
    {
        "messages",
        "conversation",
        "tokenize",
        "add_generation_prompt",
        "continue_final_message",
        "return_dict",
        "return_tensors",
        "return_assistant_tokens_mask",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
        "tools",
        "documents",
    }
)
CLIENT_TEMPLATE_SECONDS = 2.0
CLIENT_TEMPLATE_BYTES = 512 * 1024 * 1024
CLIENT_TEMPLATE_CHARS = 1_000_000
# The longest template source taken from a client (the largest checkpoints' are ~20 KB).
CLIENT_TEMPLATE_SOURCE_CHARS = 256 * 1024
# Client templates rendered at once (each may take a core for its budget); a request that cannot
# start one within RENDER_WAIT_SECONDS gets a 429 rather than holding a worker thread longer.
CLIENT_TEMPLATE_RENDERS = 4
RENDER_WAIT_SECONDS = 2 * CLIENT_TEMPLATE_SECONDS
RENDERS = threading.BoundedSemaphore(CLIENT_TEMPLATE_RENDERS)
CHILD = Path(__file__).with_name("render_child.py")


def read_template_kwargs(kwargs, allow_client_template: bool) -> Tuple[dict, Optional[str]]:
    """(the arguments for the template, the client's template or None) of a request's
    `chat_template_kwargs`, or a 400."""
    if kwargs is None:
        return {}, None
    if not isinstance(kwargs, dict):
        raise RequestError("chat_template_kwargs must be an object", param="chat_template_kwargs")
    taken = sorted(RESERVED_TEMPLATE_ARGS.intersection(kwargs))
    if taken:
        raise RequestError(
            f"chat_template_kwargs may not set {', '.join(taken)}: the server passes "
            "these to the chat template itself (leave them out)",
            param="chat_template_kwargs",
        )
    args = dict(kwargs)
    source = args.pop("chat_template", None)
    if source is None:
        return args, None
    if not allow_client_template:
        raise RequestError(
            "chat_template_kwargs.chat_template is refused: this server renders its own chat "
            "template (a client's template runs only on a server started with "
            "--allow-client-chat-template)",
            param="chat_template_kwargs.chat_template",
        )
    if not isinstance(source, str) or len(source) > CLIENT_TEMPLATE_SOURCE_CHARS:
        raise RequestError(
            f"chat_template_kwargs.chat_template must be a template text of at most "
            f"{CLIENT_TEMPLATE_SOURCE_CHARS} characters",
            param="chat_template_kwargs.chat_template",
        )
    return args, source


def _run_child(data: str) -> str:
    """render_child.py's answer to one job, or a 400 when it ran past CLIENT_TEMPLATE_SECONDS."""
    proc = subprocess.Popen(
        [sys.executable, "-I", str(CHILD)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        return proc.communicate(data, timeout=CLIENT_TEMPLATE_SECONDS)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise RequestError(
            f"the client's chat template ran past its budget of {CLIENT_TEMPLATE_SECONDS:g} s "
            "and was stopped",
            param="chat_template_kwargs.chat_template",
        )


def render_client_template(source: str, messages: list, args: dict, tokens: dict) -> str:
    """A client's template over the messages, in a process of its own within the budgets; a 400
    that names the budget it ran past, or the template's own error."""
    job = {
        "template": source,
        "messages": messages,
        "args": dict(tokens, add_generation_prompt=True, **args),
        "max_chars": CLIENT_TEMPLATE_CHARS,
        "max_bytes": CLIENT_TEMPLATE_BYTES,
    }
    try:
        data = json.dumps(job)
    except (TypeError, ValueError) as e:
        raise RequestError(f"chat_template_kwargs must hold JSON values ({e})")
    if not RENDERS.acquire(timeout=RENDER_WAIT_SECONDS):
        raise RequestError(
            f"{CLIENT_TEMPLATE_RENDERS} client chat templates are being rendered; send the "
            "request again shortly",
            429,
            param="chat_template_kwargs.chat_template",
        )
    try:
        out = _run_child(data)
    finally:
        RENDERS.release()
    try:
        answer = json.loads(out)
    except ValueError:  # killed by its memory bound
        answer = {"error": "memory"}
    if "text" in answer:
        return answer["text"]
    why = {
        "size": f"wrote more than its budget of {CLIENT_TEMPLATE_CHARS} characters",
        "memory": f"needed more than its budget of {CLIENT_TEMPLATE_BYTES >> 20} MiB of memory",
    }.get(answer["error"], f"failed: {str(answer.get('message'))[:300]}")
    if answer["error"] == "template":  # raise_exception: the template's own words
        why = f"refused the messages: {str(answer.get('message'))[:300]}"
    raise RequestError(
        f"the client's chat template {why}", param="chat_template_kwargs.chat_template"
    )
