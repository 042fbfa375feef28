"""Structured output: the `json_schema`, `regex` and `lark` constraints of a request, compiled by
llguidance into grammars and checked once, before decoding.

Why llguidance (not xgrammar or outlines-core): it is the engine llama.cpp, vLLM and SGLang use; it
computes a token mask in tens of microseconds without precomputing per-state tables (so a new
schema per request costs nothing up front), takes JSON schema, regex and Lark alike, and its
`LLMatcher` gives what committing several tokens a step needs: `try_consume_tokens` (how many of
some proposals the grammar allows, in order), `compute_ff_tokens` (the tokens the grammar forces:
filled without a forward) and `is_accepting` / `is_stopped` (whether EOS may, or must, come next).
It is a dependency of the package, not an extra: a 7 MB wheel with no dependencies of its own, for
the same platforms as MLX, and OpenAI clients send `response_format` without asking first.

A constraint is per row (each prompt of a batch may have its own); it never enters the settings
dict, so rows with different constraints share a decoder run (and the server's groups). The engine
keeps one matcher per row (engine/constrained.py); the rule that decides what a row commits under
its matcher is decoding/constrained.py's.
"""

import json
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from .errors import SettingsError

# The constraint keywords of generate_diffusion / batch_generate_diffusion / prepare, in the order
# their errors name them. A row takes at most one.
CONSTRAINT_KEYS = ("json_schema", "regex", "lark")

# llguidance tokenizers by (tokenizer object, vocabulary width, EOS ids): building one reads the
# whole vocabulary (about a second at 150k tokens), so a process builds each once.
_TOKENIZERS: Dict[tuple, Any] = {}


@dataclass(frozen=True)
class Constraint:
    """One row's grammar (llguidance's serialised form) and the llguidance tokenizer of the
    model; `matcher(prefix)` is a fresh matcher that has consumed `prefix` (tokens the row
    already returned: the server's restarts)."""

    kind: str  # "json_schema", "regex" or "lark"
    grammar: str
    tokenizer: Any  # llguidance.LLTokenizer
    candidates: tuple = ()  # closing_candidates(tokenizer): the budget guard's search order

    def matcher(self, prefix: Sequence[int] = ()):
        import llguidance

        m = llguidance.LLMatcher(self.tokenizer, self.grammar, log_level=0)
        if prefix and m.try_consume_tokens(list(prefix)) != len(prefix):
            raise SettingsError(
                f"the tokens already returned do not satisfy the {self.kind} constraint; start "
                "the request again"
            )
        return m


# The budget guard's preference when it closes a grammar early (decoding.constrained.completion):
# what ends a string, an object, an array, then the comma that ends any other value (ahead of the
# digits, which would lengthen a number without end), then the shortest values, then any other
# character.
_CLOSING = '"}],0' + "1tfn:{[-. " + "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ23456789"
_CLOSING += "".join(chr(c) for c in range(32, 127) if chr(c) not in _CLOSING) + "\n"


def closing_candidates(llt) -> tuple:
    """The ids of the one-token spellings of _CLOSING's characters, in its order."""
    out = []
    for ch in _CLOSING:
        ids = llt.tokenize_str(ch)
        if len(ids) == 1 and ids[0] not in out:
            out.append(ids[0])
    return tuple(out)


def _strict_objects(schema, closed: bool = True):
    """The schema with `additionalProperties: false` in every object schema that lists
    `properties` and says nothing about other keys (OpenAI's structured outputs require it
    spelled out; here it is the default). Without it any key may follow the listed ones, and a
    model that does not know the schema spends its budget on one. The text still validates
    against the schema as given. The branches of an `allOf` stay open (`closed` False): each
    must allow the others' keys, or two object branches would exclude each other."""
    if isinstance(schema, list):
        return [_strict_objects(s, closed) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        k: v
        if k in ("enum", "const", "default", "examples")
        else _strict_objects(v, closed=k != "allOf")
        for k, v in schema.items()
    }
    if (
        closed
        and isinstance(out.get("properties"), dict)
        and not ({"additionalProperties", "patternProperties", "unevaluatedProperties"} & set(out))
    ):
        out["additionalProperties"] = False
    return out


def _grammar(kind: str, value) -> str:
    """llguidance's grammar for one constraint value; a SettingsError for a value of the wrong
    type (the grammar's own errors come from `compile_rows`' validation)."""
    from llguidance import LLMatcher

    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise SettingsError(
                    f"json_schema is not valid JSON ({e.msg} at line {e.lineno} column "
                    f"{e.colno}); give a schema as a dict or JSON text"
                ) from None
        if value is True:
            value = {}
        if not isinstance(value, dict):
            raise SettingsError(
                f"json_schema must be a JSON schema (a dict or JSON text), not "
                f"{type(value).__name__}"
            )
        # json.dumps's default separators and no other whitespace: the form models see most,
        # and no budget spent on blanks (llguidance's default allows any amount of whitespace).
        options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        return LLMatcher.grammar_from_json_schema(_strict_objects(value), defaults=options)
    if not isinstance(value, str) or not value:
        raise SettingsError(f"{kind} must be a non-empty string, not {value!r}")
    if kind == "regex":
        return LLMatcher.grammar_from_regex(value)
    return LLMatcher.grammar_from_lark(value)


def _row_values(settings: dict, n_rows: int) -> List[Optional[tuple]]:
    """Each row's (kind, value) or None, from the constraint keywords popped off `settings`: a
    value for every row, or a list with one entry per row (None: that row unconstrained)."""
    rows: List[Optional[tuple]] = [None] * n_rows
    for kind in CONSTRAINT_KEYS:
        value = settings.pop(kind, None)
        if value is None:
            continue
        if isinstance(value, (list, tuple)):
            if len(value) != n_rows:
                raise SettingsError(
                    f"{kind} has {len(value)} entries for {n_rows} prompts; give one per prompt "
                    "(None for an unconstrained one), or one value for all"
                )
        else:
            value = [value] * n_rows
        for i, v in enumerate(value):
            if v is None:
                continue
            if rows[i] is not None:
                raise SettingsError(
                    f"prompt {i} has both {rows[i][0]} and {kind}; give one constraint per prompt"
                )
            rows[i] = (kind, v)
    return rows


def llg_tokenizer(tokenizer, vocab_size: int, eos_ids: Sequence[int]):
    """The llguidance tokenizer of an mlx-lm / HF tokenizer, over the model's logits width (ids
    past the tokenizer's vocabulary are never allowed) with the request's EOS ids (allowed
    exactly where the grammar accepts)."""
    import llguidance.hf
    from transformers import PreTrainedTokenizerFast

    # mlx-lm's TokenizerWrapper holds the HF tokenizer in `_tokenizer`, an mlx-vlm processor in
    # `tokenizer`; a bare `tokenizers.Tokenizer` is wrapped.
    hf = tokenizer
    while not isinstance(hf, PreTrainedTokenizerFast):
        inner = getattr(hf, "_tokenizer", None) or getattr(hf, "tokenizer", None)
        if inner is None or inner is hf:
            break
        hf = inner
    base = hf  # the cache's key (held by the cache, so that its id is not reused)
    key = (id(base), vocab_size, tuple(sorted(eos_ids)))
    found = _TOKENIZERS.get(key)
    if found is None or found[0] is not base:
        if type(hf).__module__.startswith("tokenizers"):
            hf = PreTrainedTokenizerFast(tokenizer_object=hf)
        try:
            # A tokenizer may hold ids past the logits (DiffusionGemma's image tokens): the
            # wider of the two, and the engine masks the logits' own width.
            width = max(vocab_size, len(hf)) if hasattr(hf, "__len__") else vocab_size
            llt = llguidance.hf.from_tokenizer(hf, n_vocab=width, eos_token=sorted(eos_ids) or None)
        except (ValueError, TypeError, AttributeError) as e:
            raise SettingsError(
                f"structured output needs a fast (tokenizers-backed) Hugging Face tokenizer; "
                f"this one ({type(hf).__name__}) cannot be read by llguidance: {e}"
            ) from None
        found = _TOKENIZERS[key] = (base, llt)
    return found[1]


def compile_rows(
    settings: dict, n_rows: int, tokenizer, vocab_size: int, eos_ids: Sequence[int]
) -> Optional[List[Optional[Constraint]]]:
    """Pop the constraint keywords off `settings` and compile them: one Constraint (or None) per
    row, or None when no row has one. A grammar that llguidance cannot compile is a SettingsError
    naming the keyword and llguidance's message."""
    rows = _row_values(settings, n_rows)
    if not any(rows):
        return None
    if not eos_ids:
        raise SettingsError(
            "a constraint ends its text with EOS, but this checkpoint names no EOS token "
            "(config.json's eos_token_id); add one or drop the constraint"
        )
    from llguidance import LLMatcher

    llt = llg_tokenizer(tokenizer, vocab_size, eos_ids)
    candidates = closing_candidates(llt)
    compiled: Dict[tuple, Constraint] = {}
    out: List[Optional[Constraint]] = []
    for i, row in enumerate(rows):
        if row is None:
            out.append(None)
            continue
        kind, value = row
        key = (kind, json.dumps(value, sort_keys=True, default=repr))
        if key not in compiled:
            grammar = _grammar(kind, value)
            error = LLMatcher.validate_grammar(grammar, llt)
            if error:
                # llguidance's message may span lines (a regex error shows the pattern, a
                # caret under the fault, then the reason): all of it, on one line.
                words = " ".join(line.strip() for line in error.strip().splitlines())
                raise SettingsError(f"{kind} of prompt {i} cannot be compiled: {words[:500]}")
            compiled[key] = Constraint(kind, grammar, llt, candidates)
        out.append(compiled[key])
    return out
