"""Structured output (issue #31): `json_schema`, `regex` and `lark` constraints on every family.

What is checked against what:
- random regexes and JSON schemas (hypothesis) on a fixture of every family and backend: the
  returned text matches the regex under Python's `re` / validates under `jsonschema` (both
  independent of llguidance), no mask token is returned, and the row ends with EOS (the strategies
  bound the language's length below max_tokens, so the budget never runs out first);
- the first column's token is the best token the grammar allows under a direct forward's logits;
- forced tokens cost no forward (tokens per forward above 1 on a schema with fixed keys), and a
  proposal the grammar allows commits in the same step as the column before it;
- batch rows with different constraints each get what they get alone, unconstrained rows too;
- a budget that runs out first ends with finish_reason "length" and a valid prefix;
- bad constraints and decoders that cannot honour one are one-line SettingsErrors.

The example count is modest in CI (EXAMPLES per family and kind); MLX_DLLM_SLOW_TESTS=1 runs 200.
"""

import json
import os
import re

import jsonschema
import mlx.core as mx
import pytest
import regex as partial_re
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fixtures import (
    build_once,
    coda,
    dllm,
    dream,
    fast_dllm_v2,
    idlm,
    llada,
    llada2,
    nemotron,
    rnd1,
    sdar,
    wedlm,
)
from fixtures import diffusion_gemma as dgfx
from fixtures.llada_v import build_llada_v
from helpers import load_fixture, run_cli
from mlx_dllm_models import batch_generate_diffusion, load, stream_generate_diffusion
from mlx_dllm_models.cli import main
from mlx_dllm_models.decoding.constrained import allowed_tokens, commit_prefix
from mlx_dllm_models.default import chat_prompt, default_checkpoint, held_out_problems
from mlx_dllm_models.settings import SettingsError

SLOW = bool(os.environ.get("MLX_DLLM_SLOW_TESTS"))
EXAMPLES = 200 if SLOW else 6

# family -> (fixture builder, settings); every family's fixture, and each backend that decodes
# in a different order (Fast-dLLM's dual cache, Nemotron's recompute, LLaDA2.1's token editing).
FAMILIES = {
    "llada": (llada.build_llada, {}),
    "llada_moe": (llada.build_llada_moe, {}),
    "llada dual cache": (llada.build_llada, dict(cache="dual")),
    "dream": (dream.build, {}),
    "sdar": (sdar.build_sdar, {}),
    "sdar_moe": (sdar.build_sdar_moe, {}),
    "llada2": (llada2.build, {}),
    "llada2 editing": (llada2.build, dict(threshold=0.7, editing_threshold=0.6, max_post_steps=4)),
    "nemotron": (nemotron.build, {}),
    "nemotron recompute": (nemotron.build, dict(cache="none")),
    "nemotron self_spec": (nemotron.build, dict(mode="self_spec")),
    "nemotron self_spec draft adapter": (nemotron.build_with_draft_adapter, dict(mode="self_spec")),
    "fast_dllm_v2": (fast_dllm_v2.build, {}),
    "fast_dllm_v2 recompute": (fast_dllm_v2.build, dict(cache="none")),
    "fast_dllm_v2 sub_block cache": (fast_dllm_v2.build, dict(cache="sub_block")),
    "dream d3llm": (dream.build, dict(sampler="d3llm")),
    "rnd1": (rnd1.build, {}),
    "coda": (coda.build, {}),
    # WeDLM's window: a constrained row fills a grammar-valid prefix of it; its K/V kept or not.
    "wedlm": (wedlm.build, {}),
    "wedlm recompute": (wedlm.build, dict(cache="none")),
    # I-DLM's strided decoding: a constrained row keeps grammar-valid drafts only.
    "idlm": (idlm.build_converted, {}),
    # dllm's A2D conversions, under both of their samplers.
    "a2d mdlm": (dllm.build, dict(sampler="mdlm")),
    "a2d bd3lm": (dllm.build, dict(sampler="bd3lm")),
    # LLaDA-V on a text prompt (its language model is LLaDA's, loaded through mlx-vlm).
    "llada_v": (build_llada_v, {}),
    # The canvas: its readout follows the grammar. Its temperature is a schedule of its own.
    "diffusion_gemma": (dgfx.CHECKPOINTS["diffusion_gemma"], {}),
}
NO_TEMPERATURE = {"diffusion_gemma"}
# Loaded by the package's loader (mlx-vlm's, with their processors).
VLM = {"diffusion_gemma", "llada_v"}


def examples(name):
    """Hypothesis examples per test: in CI, a third for a canvas (tens of forwards a row)."""
    return max(2, EXAMPLES // 3) if name in NO_TEMPERATURE and not SLOW else EXAMPLES


_LOADED = {}


@pytest.fixture(scope="module")
def models(fixture_dir):
    def get(name):
        build = FAMILIES[name][0]
        key = build.__module__ + "." + build.__name__
        if key not in _LOADED:
            path = build_once(fixture_dir / f"structured_{key}", build)
            # DiffusionGemma's processor comes from the package's loader (mlx-vlm's).
            _LOADED[key] = load(path) if name in VLM else load_fixture(path)
        return _LOADED[key]

    return get


def run(model, tok, prompt, **kw):
    """(text, tokens, finish_reason, nfe) of one prompt."""
    text, tokens, last = "", [], None
    for last in stream_generate_diffusion(model, tok, prompt, **kw):
        text += last.text
        tokens += last.tokens
    return text, tokens, last.finish_reason, last.nfe


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


# ------------------------------------------------------------------------------- the pure rule


def test_commit_prefix_stops_at_the_first_position_the_rule_or_grammar_refuses():
    allowed = {1, 2, 3}
    consumed = []

    def consume(t):
        if t in allowed:
            consumed.append(t)
            return True
        return False

    eos = lambda t: t == 9  # noqa: E731
    # passes until the rule says no
    assert commit_prefix(5, [1, 2, 3], [True, True, False], consume, eos) == [5, 1, 2]
    assert consumed == [1, 2]
    consumed.clear()
    # a refused proposal stops the prefix, even where the rule would commit the next one
    assert commit_prefix(5, [1, 7, 3], [True, True, True], consume, eos) == [5, 1]
    # nothing after an EOS
    assert commit_prefix(9, [1, 2], [True, True], consume, eos) == [9]


def test_allowed_tokens_reads_llguidance_bit_order():
    words = mx.array([[0b101, 1 << 31, 0]], dtype=mx.uint32)
    allowed = allowed_tokens(words, 70).tolist()[0]
    assert [i for i, a in enumerate(allowed) if a] == [0, 2, 63]


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


# ------------------------------------------------------------------------------- the rule's facts


def test_first_column_takes_the_best_allowed_token_of_a_direct_forward(models):
    """LLaDA, full recompute: the forward over [prompt ; masks] ranks the allowed tokens; the
    returned token is the best of them (and not the best overall, which the grammar forbids)."""
    model, tok = models("llada")
    prompt = tok.encode("Hello")
    mask = model.diffusion_spec.mask_token_id
    logits = model(mx.array([prompt + [mask] * 8]))[0, len(prompt)]
    ranked = sorted(range(logits.shape[0]), key=lambda t: -logits[t].item())
    best_overall = ranked[0]
    allowed = [t for t in range(ord("a"), ord("z") + 1) if t != best_overall][:6]
    pattern = "[" + "".join(chr(t) for t in allowed) + "]"
    text, tokens, reason, nfe = run(
        model, tok, prompt, regex=pattern, max_tokens=8, block_length=8, temperature=0
    )
    assert tokens[0] == max(allowed, key=lambda t: logits[t].item())
    assert reason == "stop" and nfe == 1  # the grammar then only takes EOS: filled, no forward


def test_forced_tokens_cost_no_forward(models):
    """Three required keys: their names, quotes, colons and braces are forced; only the values
    need forwards (one block, so that no block boundary's own forward counts)."""
    model, tok = models("llada")
    schema = {
        "type": "object",
        "properties": {k: {"type": "boolean"} for k in ("alpha", "beta", "gamma")},
        "required": ["alpha", "beta", "gamma"],
        "additionalProperties": False,
    }
    text, tokens, reason, nfe = run(
        model, tok, "Hello", json_schema=schema, max_tokens=64, block_length=64
    )
    value = json.loads(text)
    assert list(value) == ["alpha", "beta", "gamma"]
    assert reason == "stop"
    # true / false: their first letter needs a forward, the rest is forced; EOS is forced too
    assert nfe == 3, (text, nfe)
    assert len(tokens) / nfe > 10


def test_allowed_proposals_commit_in_the_same_step():
    """The embedded default model answers a sum in one forward at threshold 0.5 (its digits are
    confident): under a regex that allows them, the constraint keeps all of them in that step."""
    model, tok = load(default_checkpoint())
    prompt = chat_prompt(tok, held_out_problems(1)[0][0])
    kw = dict(sampler="threshold", threshold=0.5, temperature=0)
    free = run(model, tok, prompt, **kw)
    text, tokens, reason, nfe = run(model, tok, prompt, regex="[0-9]+", **kw)
    assert free[3] == 1 and text == free[0]
    assert nfe == 1 and len(tokens) == 3 and reason == "stop"


def test_budget_running_out_ends_with_length_and_a_valid_prefix(models):
    model, tok = models("llada")
    pattern = "[a-z]{40}"
    text, tokens, reason, _ = run(model, tok, "Hello", regex=pattern, max_tokens=10)
    assert reason == "length" and len(text) == 10
    assert partial_re.fullmatch(pattern, text, partial=True)


def test_infilling_suffix_with_a_constraint(models):
    model, tok = models("llada")
    pattern = "[0-9]{2}:[0-9]{2}"
    text, tokens, reason, _ = run(
        model, tok, "The time is ", suffix=" o'clock.", regex=pattern, max_tokens=8
    )
    assert re.fullmatch(pattern, text) and reason == "stop"


@pytest.mark.parametrize("name", ["sdar", "wedlm"])
def test_logprobs_with_a_constraint(models, name):
    model, tok = models(name)
    last = None
    for last in stream_generate_diffusion(
        model, tok, "Hello", regex="[a-c]{3}", logprobs=2, max_tokens=8
    ):
        pass
    assert [e.token for e in last.logprobs] == last.tokens[: len(last.logprobs)]


@pytest.mark.parametrize("cache", ["prefix", "none"])
def test_wedlm_first_token_is_the_best_allowed_of_a_direct_forward(models, cache):
    """WeDLM: the first step's window is all masks after the prompt, which the reordered causal
    mask leaves plain causal; the first committed token is the best the grammar allows under that
    forward's logits at the window's first column (not the best overall, which it forbids), and
    the grammar's forced tail costs no forward."""
    model, tok = models("wedlm")
    prompt = tok.encode("Hello")
    mask = model.diffusion_spec.mask_token_id
    logits = model(mx.array([prompt + [mask] * 8]), mask="causal")[0, len(prompt)]
    best_overall = max(range(logits.shape[0]), key=lambda t: logits[t].item())
    allowed = [t for t in range(ord("a"), ord("z") + 1) if t != best_overall][:6]
    pattern = "[" + "".join(chr(t) for t in allowed) + "]-end"
    text, tokens, reason, nfe = run(
        model, tok, prompt, regex=pattern, max_tokens=8, block_length=8, temperature=0, cache=cache
    )
    assert tokens[0] == max(allowed, key=lambda t: logits[t].item())
    assert text[1:] == "-end" and reason == "stop"
    # one forward chooses the letter (its fill, "-end" and EOS come after it in that step), one
    # more commits the window's prefix
    assert nfe == 2, nfe


def test_wedlm_allowed_proposals_commit_in_the_same_step(models):
    """At entropy_threshold 2 the fixture fills its whole window in one forward; under a regex
    that allows every proposal (printable ASCII) the constrained row keeps all of them in that
    step: the same text (the regex's 15 characters), the same two forwards."""
    model, tok = models("wedlm")
    kw = dict(max_tokens=16, block_length=16, temperature=0, entropy_threshold=2.0)
    free = run(model, tok, "Hello", **kw)
    assert free[3] == 2 and re.fullmatch("[ -~]{16}", free[0]), free  # the premise
    text, tokens, reason, nfe = run(model, tok, "Hello", regex="[ -~]{15}", **kw)
    assert text == free[0][:15] and reason == "stop"
    assert nfe == 2, nfe


def test_wedlm_sampled_constrained_row_beside_an_unconstrained_one(models):
    """Above temperature 0 the rows of a step share one draw; the constrained row's first column
    takes a draw of its own from its masked logits: its text is valid, its neighbour's is
    returned in full."""
    model, tok = models("wedlm")
    kw = dict(max_tokens=16, block_length=8, temperature=0.9)
    texts = set()
    for seed in range(3):
        mixed = batch_generate_diffusion(
            model, tok, ["Hello", "x"], regex=["[0-9]{2,4}", None], seed=seed, **kw
        )
        assert re.fullmatch("[0-9]{2,4}", mixed.texts[0]) and mixed.finish_reasons[0] == "stop"
        assert mixed.finish_reasons[1] in ("stop", "length") and mixed.tokens[1]
        texts.add(mixed.texts[0])
    assert len(texts) > 1, texts  # the draws are sampled, not the argmax every time


# ---------------------------------------------------------------------------------- batch rows


@pytest.mark.parametrize("name", ["llada", "sdar", "nemotron", "wedlm", "wedlm recompute"])
def test_batch_rows_with_different_constraints_get_what_they_get_alone(models, name):
    model, tok = models(name)
    prompts = ["Hello", "Another prompt", "Third", "x"]
    kinds = dict(
        regex=["[a-c]{2,5}", None, None, "(yes|no)"],
        json_schema=[
            None,
            {"type": "object", "properties": {"n": {"type": "boolean"}}, "required": ["n"]},
            None,
            None,
        ],
    )
    kw = dict(FAMILIES[name][1], max_tokens=24, block_length=8, temperature=0)
    batch = batch_generate_diffusion(model, tok, prompts, **kinds, **kw)
    assert re.fullmatch("[a-c]{2,5}", batch.texts[0])
    assert json.loads(batch.texts[1]) in ({"n": True}, {"n": False})
    assert batch.texts[3] in ("yes", "no")
    for i, prompt in enumerate(prompts):
        row = {k: v[i] for k, v in kinds.items() if v[i] is not None}
        alone = batch_generate_diffusion(model, tok, [prompt], **row, **kw)
        assert batch.tokens[i] == alone.tokens[0], (name, i)
        assert batch.finish_reasons[i] == alone.finish_reasons[0]


# ------------------------------------------------------------------------------------ refusals


def test_bad_constraints_are_one_line_errors(models):
    model, tok = models("llada")
    cases = [
        (dict(regex="a(b"), r"regex of prompt 0 cannot be compiled: .*unclosed|regex parse"),
        (dict(json_schema={"type": "bogus"}), r"json_schema of prompt 0 cannot be compiled"),
        (dict(json_schema="{not json"), r"json_schema is not valid JSON"),
        (dict(json_schema=[1, 2]), r"json_schema has 2 entries for 1 prompts"),
        (dict(json_schema=5), r"json_schema must be a JSON schema"),
        (dict(regex="a", lark='start: "a"'), r"prompt 0 has both regex and lark"),
        (dict(lark="start: ???"), r"lark of prompt 0 cannot be compiled"),
        (dict(regex=""), r"regex must be a non-empty string"),
    ]
    for kw, message in cases:
        with pytest.raises(SettingsError, match=message) as e:
            run(model, tok, "Hello", max_tokens=8, **kw)
        assert "\n" not in str(e.value), str(e.value)


def test_a_decoder_without_constraints_is_refused(models, monkeypatch):
    """registry.check_constraints refuses a decoder that does not declare `takes_constraints`
    (every decoder now does; this is the path a new one takes): a one-line error, before any
    forward."""
    from mlx_dllm_models.engine.wedlm import WeDLMDecoder

    model, tok = models("wedlm")
    monkeypatch.setattr(WeDLMDecoder, "takes_constraints", False)
    with pytest.raises(SettingsError, match="not supported by the wedlm family.*drop the") as e:
        run(model, tok, "Hello", regex="[a-c]", max_tokens=8)
    assert "\n" not in str(e.value)


def test_the_thinking_budget_is_refused_with_a_constraint(models):
    model, tok = models("nemotron")
    with pytest.raises(SettingsError, match="thinking budget"):
        run(
            model,
            tok,
            "Hello",
            regex="[a-c]",
            max_tokens=8,
            max_thinking_tokens=2,
            end_think_token_id=5,
        )


def test_masks_inside_the_prompt_are_refused_with_a_constraint(models):
    model, tok = models("llada")
    mask = model.diffusion_spec.mask_token_id
    prompt = tok.encode("Hello") + [mask, mask] + tok.encode(" there")
    with pytest.raises(SettingsError, match="mask tokens inside a prompt"):
        run(model, tok, prompt, regex="[a-c]", max_tokens=8)


# ------------------------------------------------------------------------------------------ CLI


@pytest.mark.slow
def test_cli_flags(tmp_path, capsys):
    """One fresh process (what a user runs), the other flags through the same entry point in
    this one."""
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"answer": {"type": "integer"}}}))
    out = run_cli("generate", "--json-schema", str(schema), "--verbose", "false")
    assert out.returncode == 0, out.stderr
    jsonschema.validate(json.loads(out.stdout), json.loads(schema.read_text()))

    def generate(*args):
        assert main(["generate", *args, "--verbose", "false"]) == 0
        return capsys.readouterr().out

    assert re.fullmatch("[0-9]{3}\n", generate("--regex", "[0-9]{3}", "--temp", "0"))
    grammar = tmp_path / "g.lark"
    grammar.write_text('start: "yes" | "no"\n')
    assert generate("--lark", str(grammar)).strip() in ("yes", "no")
    out = json.loads(generate("--json-schema", '{"type": "array", "maxItems": 2}'))
    jsonschema.validate(out, {"type": "array", "maxItems": 2})
    with pytest.raises(SystemExit, match="error: --json-schema .*missing.json"):
        main(["generate", "--json-schema", str(tmp_path / "missing.json")])
    with pytest.raises(SystemExit, match="regex of prompt 0 cannot be compiled"):
        main(["generate", "--regex", "a(b"])


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_self_speculation_is_constrained_autoregressive_decoding(models, temperature):
    """Nemotron's self-speculation under a grammar returns what one token a round (no drafts:
    block_length 1) returns: drafts are kept only where the masked causal model agrees. Greedy:
    the same tokens; sampled: valid text either way."""
    model, tok = models("nemotron")
    pattern = "[a-z]{3,12}( [a-z]{2,6}){0,3}"
    kw = dict(regex=pattern, mode="self_spec", max_tokens=40, temperature=temperature, seed=1)
    text, tokens, reason, nfe = run(model, tok, "Hello", **kw)
    assert re.fullmatch(pattern, text) and reason == "stop"
    if temperature == 0:
        one = run(model, tok, "Hello", **dict(kw, block_length=1))
        assert one[1] == tokens and one[3] >= nfe


@pytest.mark.slow
def test_embedded_default_always_gives_valid_json():
    """The issue's schema on the model trained on bare sums: valid JSON every time, at its
    default budget (16 tokens, where `{"answer": 132}` leaves one position for EOS: the budget
    guard closes the object when the model would run on)."""
    model, tok = load(default_checkpoint())
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}}
    prompts = [chat_prompt(tok, q) for q, _ in held_out_problems(12)]
    # (At temperature 1 every row samples from the stream of seed 4, as it would alone: the
    # rows' draws are alike, and seed 3 happens to draw "{}" for all twelve.)
    for kw in (dict(), dict(sampler="threshold", threshold=0.5), dict(temperature=1.0, seed=4)):
        batch = batch_generate_diffusion(model, tok, prompts, json_schema=schema, **kw)
        for text in batch.texts:
            jsonschema.validate(json.loads(text), schema)
        assert any("answer" in json.loads(t) for t in batch.texts)


def test_tokenizer_forms(models):
    """mlx-lm's TokenizerWrapper, the Hugging Face tokenizer it holds, and the bare `tokenizers`
    object all compile, to one llguidance tokenizer per underlying tokenizer."""
    from mlx_dllm_models.structured import compile_rows

    model, tok = models("llada")
    forms = [tok, tok._tokenizer, tok._tokenizer._tokenizer]
    out = [compile_rows(dict(regex="[ab]"), 1, f, 320, [301])[0] for f in forms]
    assert out[0].tokenizer is out[1].tokenizer
    m = out[2].matcher()
    assert m.try_consume_tokens([ord("a")]) == 1 and m.is_accepting()
    with pytest.raises(SettingsError, match="fast .*tokenizer"):
        compile_rows(dict(regex="[ab]"), 1, object(), 320, [301])


@pytest.mark.slow
def test_canvas_readout_is_the_best_allowed_token_of_its_last_step(models, monkeypatch):
    """DiffusionGemma: the canvas a constrained row returns is, position by position, the best
    token the grammar allows under the last denoising step's logits (spied); unconstrained rows
    of the same batch keep their argmax (their run alone)."""
    from mlx_dllm_models.engine import canvas as canvas_module

    model, tok = models("diffusion_gemma")
    seen = []
    real = canvas_module.CanvasDecoder._constrained

    def spy(self, rows, argmax, last, lp, wanted, **kw):
        out = real(self, rows, argmax, last, lp, wanted, **kw)
        seen.append((last, out))
        return out

    monkeypatch.setattr(canvas_module.CanvasDecoder, "_constrained", spy)
    pattern = "[a-e]{4}"
    batch = batch_generate_diffusion(
        model, tok, ["hello", "world x"], regex=[pattern, None], max_tokens=8, seed=1
    )
    assert re.fullmatch(pattern, batch.texts[0]) and batch.finish_reasons[0] == "stop"
    last, out = seen[-1]
    letters = list(range(ord("a"), ord("e") + 1))
    for pos in range(4):
        scores = last[0, pos].tolist()
        assert out[0, pos].item() == max(letters, key=lambda t: scores[t])
    alone = batch_generate_diffusion(model, tok, ["world x"], max_tokens=8, seed=1)
    assert batch.tokens[1] == alone.tokens[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["llada", "sdar", "nemotron self_spec", "diffusion_gemma", "wedlm", "wedlm recompute"]
)
def test_budget_guard_closes_unbounded_values_in_time(models, name):
    """An unbounded string and integer under a tight budget, blocks of 4: the random fixtures
    run the integer's digits on until the guard closes the object (its closing then spans
    blocks where it is longer than one); the text is valid JSON every time, EOS included."""
    model, tok = models(name)
    schema = {
        "type": "object",
        "properties": {"alpha": {"type": "string"}, "beta": {"type": "integer"}},
        "required": ["alpha", "beta"],
    }
    kw = dict(FAMILIES[name][1], max_tokens=34)
    if name in ("llada", "sdar") or name.startswith("wedlm"):
        kw["block_length"] = 4
    lengths = []
    for seed, temperature in [(0, 0.0), (1, 1.5), (2, 1.5)]:
        if name not in NO_TEMPERATURE:
            kw["temperature"] = temperature
        text, tokens, reason, _ = run(model, tok, "Hello", json_schema=schema, seed=seed, **kw)
        jsonschema.validate(json.loads(text), schema)
        assert reason == "stop" and len(tokens) <= 33, text
        lengths.append(len(tokens))
    if name in ("llada", "sdar"):
        assert max(lengths) == 33  # the budget, not the model, ended one of them
