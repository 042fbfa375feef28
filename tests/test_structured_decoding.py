"""Structured output (issue #31): what a constraint does to decoding.

What is checked against what:
- the commit rule stops at the first position the rule or the grammar refuses; llguidance's
  token mask is read in its bit order;
- the first column's token is the best token the grammar allows under a direct forward's logits
  (LLaDA, WeDLM; DiffusionGemma's canvas readout under its last step's logits);
- forced tokens cost no forward (tokens per forward above 1 on a schema with fixed keys), and a
  proposal the grammar allows commits in the same step as the column before it;
- batch rows with different constraints each get what they get alone, unconstrained rows too;
- a budget that runs out first ends with finish_reason "length" and a valid prefix, and the
  budget guard closes unbounded values in time;
- Nemotron's self-speculation under a grammar is constrained autoregressive decoding; the
  embedded default model gives valid JSON every time.
"""

import json
import re

import jsonschema
import mlx.core as mx
import pytest
import regex as partial_re

from mlx_dllm_models import batch_generate_diffusion, load, stream_generate_diffusion
from mlx_dllm_models.decoding.constrained import allowed_tokens, commit_prefix
from mlx_dllm_models.default import chat_prompt, default_checkpoint, held_out_problems
from structured_checks import FAMILIES, NO_TEMPERATURE, models_fixture, run

models = models_fixture()

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
