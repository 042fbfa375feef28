"""Structured output (issue #31) on every family, at random: regexes and JSON schemas drawn by
hypothesis on a fixture of every family and backend. The returned text matches the regex under
Python's `re` / validates under `jsonschema` (both independent of llguidance), no mask token is
returned, and the row ends with EOS (the strategies bound the language's length below max_tokens,
so the budget never runs out first).

The example count is modest in CI (EXAMPLES per family and kind); MLX_DLLM_SLOW_TESTS=1 runs 200.
"""

import json
import os
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from structured_checks import FAMILIES, NO_TEMPERATURE, models_fixture, run

models = models_fixture()

SLOW = bool(os.environ.get("MLX_DLLM_SLOW_TESTS"))
EXAMPLES = 200 if SLOW else 6


def examples(name):
    """Hypothesis examples per test: in CI, a third for a canvas (tens of forwards a row)."""
    return max(2, EXAMPLES // 3) if name in NO_TEMPERATURE and not SLOW else EXAMPLES


# ---------------------------------------------------------------------------------- strategies

LITERALS = "abcxyz019 -_"
CLASSES = ["[a-c]", "[0-9]", "[xyz]", "[a-z]"]


@st.composite
def regexes(draw, depth=2):
    """(pattern, longest match in bytes): literals, classes, concatenation, alternation and
    bounded repetition (no * or +: every match has a bounded length)."""
    kinds = ["literal", "class"] + (["concat", "alt", "repeat"] if depth > 0 else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "literal":
        return re.escape(draw(st.sampled_from(LITERALS))), 1
    if kind == "class":
        return draw(st.sampled_from(CLASSES)), 1
    if kind == "concat":
        parts = draw(st.lists(regexes(depth - 1), min_size=2, max_size=3))
        return "".join(p for p, _ in parts), sum(n for _, n in parts)
    if kind == "alt":
        parts = draw(st.lists(regexes(depth - 1), min_size=2, max_size=3))
        return "(" + "|".join(p for p, _ in parts) + ")", max(n for _, n in parts)
    inner, n = draw(regexes(depth - 1))
    lo = draw(st.integers(0, 2))
    hi = draw(st.integers(max(lo, 1), 3))
    return f"({inner}){{{lo},{hi}}}", n * hi


WORDS = ["alpha", "b", "yes", "no", "x y"]
KEYS = ["answer", "name", "ok", "n", "items"]


@st.composite
def schemas(draw, depth=2):
    """(JSON schema, longest instance in bytes as json.dumps writes it)."""
    kinds = ["integer", "boolean", "null", "enum", "pattern"]
    if depth > 0:
        kinds += ["array", "object", "object"]
    kind = draw(st.sampled_from(kinds))
    if kind == "integer":
        lo = draw(st.integers(-1000, 1000))
        hi = draw(st.integers(lo, lo + 2000))
        return {"type": "integer", "minimum": lo, "maximum": hi}, max(len(str(lo)), len(str(hi)))
    if kind == "boolean":
        return {"type": "boolean"}, 5
    if kind == "null":
        return {"type": "null"}, 4
    if kind == "enum":
        words = draw(st.lists(st.sampled_from(WORDS), min_size=1, max_size=3, unique=True))
        return {"type": "string", "enum": words}, max(len(w) for w in words) + 2
    if kind == "pattern":
        n = draw(st.integers(1, 4))
        return {"type": "string", "pattern": f"^[a-z]{{1,{n}}}$"}, n + 2
    if kind == "array":
        items, n = draw(schemas(depth - 1))
        most = draw(st.integers(1, 3))
        return (
            {
                "type": "array",
                "items": items,
                "minItems": draw(st.integers(0, most)),
                "maxItems": most,
            },
            2 + most * n + 2 * (most - 1),
        )
    keys = draw(st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True))
    props = {k: draw(schemas(depth - 1)) for k in keys}
    required = draw(st.lists(st.sampled_from(keys), unique=True))
    schema = {
        "type": "object",
        "properties": {k: s for k, (s, _) in props.items()},
        "required": required,
        "additionalProperties": False,
    }
    return schema, 2 + sum(len(k) + 4 + n for k, (_, n) in props.items()) + 2 * len(keys)


def budget(longest):
    """max_tokens that leaves room for the longest match and its EOS; examples longer than the
    smallest fixture context (Nemotron's 64 positions, with the prompt) are left out."""
    assume(longest + 2 <= 56)
    return longest + 2


# ------------------------------------------------------------------------ every family, random


def each_example(name, *strategies):
    """hypothesis' `given(*strategies)`: examples(name) examples, the same in every run."""
    rules = settings(
        max_examples=examples(name),
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    return lambda check: rules(given(*strategies)(check))


def constrained_text(model, tok, name, longest, temperature, seed, **constraint):
    """The text of one "Hello" run of family `name` under `constraint` (regex= or json_schema=,
    and block_length=), with the budget its longest match needs; it holds no mask and stopped on
    its own."""
    kw = dict(FAMILIES[name][1], max_tokens=budget(longest), temperature=temperature, seed=seed)
    if name in NO_TEMPERATURE:
        del kw["temperature"]
    text, tokens, reason, _ = run(model, tok, "Hello", **constraint, **kw)
    assert model.diffusion_spec.mask_token_id not in tokens
    assert reason == "stop", (constraint, text)
    return text


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_random_regexes_match(models, name):
    model, tok = models(name)
    draws = (st.sampled_from([0.0, 0.8]), st.integers(0, 3), st.sampled_from([8, 16]))

    @each_example(name, regexes(), *draws)
    def check(rx, temperature, seed, block):
        pattern, longest = rx
        blocks = {} if "block" in name or name in NO_TEMPERATURE else dict(block_length=block)
        text = constrained_text(
            model, tok, name, longest, temperature, seed, regex=pattern, **blocks
        )
        seen.append(text)
        assert re.fullmatch(pattern, text), (pattern, text)

    seen = []
    check()
    assert len(seen) >= examples(name)  # the examples ran (none was filtered out instead)
    assert len(set(seen)) > 1, seen  # and were not all the same


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_random_json_schemas_validate(models, name):
    model, tok = models(name)

    @each_example(name, schemas(), st.sampled_from([0.0, 0.8]), st.integers(0, 3))
    def check(sc, temperature, seed):
        schema, longest = sc
        text = constrained_text(model, tok, name, longest, temperature, seed, json_schema=schema)
        seen.append(text)
        jsonschema.validate(json.loads(text), schema)

    seen = []
    check()
    assert len(seen) >= examples(name)  # the examples ran (none was filtered out instead)
    assert len(set(seen)) > 1, seen  # and were not all the same
