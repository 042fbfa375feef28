"""OpenAI's logprobs for `mlx_dllm serve`: the request fields read into the `logprobs` setting,
and the engine's TokenLogprobs (each returned token's log-probability at the denoising step that
committed it, with that step's best alternatives) in OpenAI's response shapes.

Chat completions ask with `logprobs: true` and `top_logprobs: k`, and get
`choices[0].logprobs.content = [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]`;
text completions ask with `logprobs: k` and get `choices[0].logprobs = {tokens, token_logprobs,
top_logprobs: [{token: logprob}], text_offset}`. A streamed chunk carries the entries of the
tokens of its block; when a stop string cuts the text, the tokens after the cut are left out (as
from usage.completion_tokens). A token that is not whole UTF-8 (part of a character) is written
`bytes:\\xe2\\x80`, as OpenAI writes it; `bytes` holds its bytes.
"""

import codecs
import re
from typing import Optional, Sequence

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer

from ..byte_level import bytes_to_unicode
from ..engine import TokenLogprob
from ..settings import MAX_LOGPROBS
from ..settings_fields import ResolvedSettings

# What OpenAI writes for a log-probability too small to represent (-inf here).
FLOOR = -9999.0


class FieldError(ValueError):
    """A bad logprobs field: a 400 naming the field (`param`, as OpenAI's error object)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_LOGPROBS


def read_fields(body: dict, overrides: dict) -> None:
    """The `logprobs` setting of a request body into `overrides` (a FieldError says what is
    wrong): chat's `logprobs: true` with `top_logprobs: k` (default 0), or a text completion's
    `logprobs: k`; `logprobs: false` turns off a server default."""
    asked, top = body.get("logprobs"), body.get("top_logprobs")
    no_top = top is None
    if not (no_top or _is_count(top)):  # -1 too: OpenAI refuses it, it asks for nothing here
        raise FieldError(
            f"top_logprobs must be an integer from 0 to {MAX_LOGPROBS} (alternatives per "
            f"token), got {top!r}",
            "top_logprobs",
        )
    if asked is None or asked is False:
        if not (no_top or top == 0):
            raise FieldError("top_logprobs needs logprobs: true", "top_logprobs")
        if asked is False:
            overrides.pop("logprobs", None)
        return
    if asked is True:
        k, field = (0 if no_top else top), "top_logprobs"
    elif isinstance(asked, int) and not isinstance(asked, bool):
        if not no_top:
            raise FieldError(
                "give logprobs: true with top_logprobs: k (chat), or logprobs: k (completions)",
                "top_logprobs",
            )
        k, field = asked, "logprobs"
    else:
        raise FieldError(
            f"logprobs must be true or false (chat completions) or a number of alternatives "
            f"(completions), got {asked!r}",
            "logprobs",
        )
    if not _is_count(k):
        raise FieldError(
            f"{field} must be an integer from 0 to {MAX_LOGPROBS} (alternatives per token), "
            f"got {k!r}",
            field,
        )
    overrides["logprobs"] = k


BYTE_OF_SYMBOL = {c: b for b, c in bytes_to_unicode().items()}
SPM_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenBytes:
    """A token's own bytes, also where it holds only part of a character (its decoded text would
    be U+FFFD): byte-level BPE pieces through GPT-2's table, SentencePiece pieces with their
    space and byte-fallback tokens; other tokenizers through decode."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        detok = type(getattr(tokenizer, "detokenizer", None))
        self.kind = "bpe" if issubclass(detok, BPEStreamingDetokenizer) else None
        if issubclass(detok, SPMStreamingDetokenizer):
            self.kind = "spm"
        self.known = {}

    def __call__(self, token: int) -> bytes:
        out = self.known.get(token)
        if out is None:
            out = self.known[token] = self._bytes(token)
        return out

    def _bytes(self, token: int) -> bytes:
        text = self.tokenizer.decode([token])
        if self.kind is None or token in getattr(self.tokenizer, "all_special_ids", ()):
            return text.encode("utf-8")
        piece = self.tokenizer.convert_ids_to_tokens(token)
        if piece is None:  # an id past the tokenizer's vocabulary (the model's may be larger)
            return text.encode("utf-8")
        if self.kind == "bpe" and all(c in BYTE_OF_SYMBOL for c in piece):
            return bytes(BYTE_OF_SYMBOL[c] for c in piece)
        if self.kind == "spm":
            fallback = SPM_BYTE.fullmatch(piece)
            if fallback:
                return bytes([int(fallback.group(1), 16)])
            return piece.replace("\u2581", " ").encode("utf-8")
        return text.encode("utf-8")


def token_string(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def _value(logprob: float) -> float:
    return logprob if logprob == logprob and logprob > FLOOR else FLOOR


class Logprobs:
    """The logprobs of one response, in the shape of its endpoint: entries are `add`ed as blocks
    arrive and `attach`ed to the packet that sends their text."""

    def __init__(self, tokenizer, chat: bool):
        self.chat = chat
        self.bytes = TokenBytes(tokenizer)
        self.pending = []  # TokenLogprobs not sent yet
        self.sent = 0  # entries sent
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.chars = 0  # characters of the tokens sent (their text offsets start here)

    @classmethod
    def of(cls, settings: ResolvedSettings, tokenizer, object_type: str) -> Optional["Logprobs"]:
        """The logprobs of a request whose resolved settings are `settings`; None when it asked
        for none."""
        if settings.logprobs is None:
            return None
        return cls(tokenizer, chat=object_type.startswith("chat"))

    def add(self, entries: Sequence[TokenLogprob]) -> None:
        self.pending.extend(entries)

    def attach(self, packet: dict, returned: int) -> dict:
        """Put the pending entries in `packet`, as its `logprobs`: those of the first `returned`
        tokens of the response (the tokens a stop string cut off are not returned)."""
        rows = []
        for entry in self.pending[: max(returned - self.sent, 0)]:
            data = self.bytes(entry.token)
            rows.append((entry, data, self.chars))
            self.chars += len(self.utf8.decode(data))
        self.pending = []
        self.sent += len(rows)
        packet["choices"][0]["logprobs"] = self._chat(rows) if self.chat else self._text(rows)
        return packet

    def _alternatives(self, entry: TokenLogprob):
        return [(token_string(self.bytes(t)), self.bytes(t), _value(v)) for t, v in entry.top]

    def _chat(self, rows) -> dict:
        content = []
        for entry, data, _ in rows:
            top = [
                {"token": s, "logprob": v, "bytes": list(b)}
                for s, b, v in self._alternatives(entry)
            ]
            content.append(
                {
                    "token": token_string(data),
                    "logprob": _value(entry.logprob),
                    "bytes": list(data),
                    "top_logprobs": top,
                }
            )
        return {"content": content, "refusal": None}

    def _text(self, rows) -> dict:
        top = []
        for entry, _, _ in rows:
            alternatives = {}
            for s, _, v in self._alternatives(entry):
                alternatives.setdefault(s, v)  # two ids of one spelling: the more probable
            top.append(alternatives)
        return {
            "tokens": [token_string(data) for _, data, _ in rows],
            "token_logprobs": [_value(entry.logprob) for entry, _, _ in rows],
            "top_logprobs": top,
            "text_offset": [offset for _, _, offset in rows],
        }
