"""The `logprobs` setting: each returned token's log-probability at the denoising step that
committed it, with that step's best alternatives (engine.base.TokenLogprob), and OpenAI's
logprobs fields on `mlx_dllm serve`.

On fixtures at temperature 0 (confident heads), every returned token is the best alternative of
its own entry, and its values equal the log-softmax of a direct forward over the canvas as it was
at that step (from the StepEvent stream), computed here in float64: the masked decoder over a
bidirectional family (LLaDA, full recompute) and a block-causal one (SDAR, prefix cache),
Nemotron's causal prefix (the AR head's seed of each block, and the denoising steps), Nemotron's
self-speculation (the causal model's own rows), and DiffusionGemma's canvas (its last step's
logits, by spying on the decoder's forwards). Tokens are bit-identical with the setting off, and
the step's host reads are the same.
"""

import json
import threading
import urllib.error
import urllib.request

import mlx.core as mx
import numpy as np
import openai
import pytest
from openai import OpenAI

from fixtures import build_once, sdar
from fixtures import diffusion_gemma as dgfx
from fixtures import nemotron as nfx
from fixtures.llada import build_llada
from helpers import load_fixture
from mlx_dllm_models import batch_generate_diffusion, load, stream_generate_diffusion
from mlx_dllm_models.engine import BlockEvent
from mlx_dllm_models.generate import stream_events
from mlx_dllm_models.masks import block_causal_mask, causal_prefix_mask
from mlx_dllm_models.server import make_server, shutdown
from mlx_dllm_models.settings import SettingsError
from mlx_dllm_models.vision import text_tokenizer

TOL = 2e-5  # float32 forwards (a KV cache, a head over the block) against a float64 softmax
K = 4


def log_softmax(logits) -> np.ndarray:
    z = np.asarray(logits.astype(mx.float32), dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def check_entry(entry, token, logp, never=()):
    """`entry` is `token`'s under the log-probabilities `logp` (V,): its value, and the K best
    alternatives (never the ids in `never`), the token first."""
    assert entry.token == token
    assert entry.top[0][0] == token, "at temperature 0 the token is its own best alternative"
    assert abs(entry.logprob - logp[token]) < TOL, (entry.logprob, logp[token])
    ranked = logp.copy()
    ranked[list(never)] = -np.inf
    best = np.argsort(-ranked, kind="stable")[:K]
    assert [t for t, _ in entry.top] == best.tolist()
    np.testing.assert_allclose([v for _, v in entry.top], ranked[best], atol=TOL, rtol=0)


def trace(model, tok, prompt, **settings):
    """One prompt at temperature 0: (prompt ids, resolved settings, [(canvas after each step, its
    block span)], returned tokens, their TokenLogprobs)."""
    s, ids, decoder = stream_events(model, tok, [prompt], temperature=0, logprobs=K, **settings)
    steps, tokens, entries = [], [], []
    for event in decoder.run(ids):
        if isinstance(event, BlockEvent):
            assert len(event.logprobs[0]) == len(event.tokens[0])
            tokens += event.tokens[0]
            entries += event.logprobs[0]
        else:
            steps.append((event.canvas[0], event.block))
    assert tokens, "the fixture must return tokens"
    return ids[0], s, steps, tokens, entries


def check_masked(model, prompt, steps, tokens, entries, forward, seeded=None):
    """Every returned token against the direct forward of the step that committed it: the
    canvas before that step (the previous step's, with masks for what was not decided), whose
    logits `forward(prompt, canvas, block)` gives over the canvas positions. `seeded(prompt,
    canvas, start)`: the log-probabilities of a block's first position when the family seeds it
    before the block's steps (Nemotron's AR head)."""
    spec = model.diffusion_spec
    mask_id, never = spec.mask_token_id, (spec.mask_token_id, *spec.suppressed_token_ids)
    before, block, checked = [mask_id] * len(steps[0][0]), None, set()
    for canvas, span in steps:
        if span != block and seeded is not None and span[0] < len(tokens):
            start = span[0]  # placed when the block began: no step of it decides it
            check_entry(entries[start], tokens[start], seeded(prompt, before, start))
            before = before[:start] + [canvas[start]] + before[start + 1 :]
            checked.add(start)
        block = span
        logp = None
        for p in range(*span):
            if p < len(tokens) and before[p] == mask_id and canvas[p] != mask_id:
                if logp is None:
                    logp = log_softmax(forward(prompt, before, span))
                check_entry(entries[p], tokens[p], logp[p], never)
                checked.add(p)
        before = canvas
    assert checked == set(range(len(tokens)))


def _full(prompt, canvas):
    return mx.array([prompt + canvas], dtype=mx.int32)


@pytest.fixture(scope="module")
def llada(fixture_dir):
    return load_fixture(build_once(fixture_dir / "server_llada", build_llada))


@pytest.fixture(scope="module")
def sdar_model(fixture_dir):
    return load_fixture(build_once(fixture_dir / "sdar", sdar.build_sdar))


@pytest.fixture(scope="module")
def nemotron(fixture_dir):
    return load_fixture(nfx.shared_checkpoint(fixture_dir))


@pytest.fixture(scope="module")
def gemma(fixture_dir):
    return load(build_once(fixture_dir / "diffusion_gemma", dgfx.CHECKPOINTS["diffusion_gemma"]))


# ------------------------------------------------------------------------------ the engine


@pytest.mark.parametrize("sampler", ["quota", "threshold"])
def test_bidirectional_masked_decoding_llada(llada, sampler):
    model, tok = llada
    kw = dict(max_tokens=16, block_length=8, sampler=sampler)
    prompt, _, steps, tokens, entries = trace(model, tok, "Hello there", **kw)

    def forward(prompt, canvas, span):
        return model(_full(prompt, canvas))[0, len(prompt) :]

    check_masked(model, prompt, steps, tokens, entries, forward)


def test_block_causal_masked_decoding_sdar(sdar_model):
    model, tok = sdar_model
    prompt = tok.encode("Hi there, you", add_special_tokens=False)
    # The canvas ends at a block boundary: a block-causal run decodes its last block whole.
    n = 12 + (-(len(prompt) + 12)) % sdar.BLOCK_SIZE
    kw = dict(max_tokens=n, sampler="threshold", threshold=0.9)
    prompt, s, steps, tokens, entries = trace(model, tok, prompt, **kw)

    def forward(prompt, canvas, span):
        x = _full(prompt, canvas)
        mask = block_causal_mask(x.shape[1], s.block_length)
        return model(x, mask=mask)[0, len(prompt) :]

    check_masked(model, prompt, steps, tokens, entries, forward)


def _nemotron_seed(model):
    def seeded(prompt, canvas, start):
        return log_softmax(model(_full(prompt, canvas[:start]), mask="causal")[0, -1])

    return seeded


@pytest.mark.parametrize("cache", ["prefix", "none"])
def test_causal_prefix_nemotron(nemotron, cache):
    model, tok = nemotron
    kw = dict(max_tokens=3 * nfx.BLOCK_SIZE, block_length=nfx.BLOCK_SIZE, cache=cache)
    prompt, _, steps, tokens, entries = trace(model, tok, nfx.prompts(1, seed=3)[0], **kw)
    assert len(tokens) > nfx.BLOCK_SIZE, "the check must span seeded blocks"

    def forward(prompt, canvas, span):
        x = _full(prompt, canvas[: span[1]])
        mask = causal_prefix_mask(x.shape[1], len(prompt) + span[0])
        return model(x, mask=mask)[0, len(prompt) :]

    check_masked(model, prompt, steps, tokens, entries, forward, _nemotron_seed(model))


def test_self_speculation_nemotron(nemotron):
    """Each confirmed token's entry is the causal model's, at the row that verified it."""
    model, tok = nemotron
    prompt = nfx.prompts(1, seed=3)[0]
    _, _, _, tokens, entries = trace(model, tok, prompt, max_tokens=12, mode="self_spec")
    seeded = _nemotron_seed(model)
    for i, (token, entry) in enumerate(zip(tokens, entries)):
        check_entry(entry, token, seeded(prompt, tokens, i))


def test_canvas_diffusion_gemma(gemma, monkeypatch):
    """A canvas is the argmax of its last step: its entries are that step's log-softmax."""
    model, processor = gemma
    outputs, real = [], type(model).decode

    def spy(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        if self is model:
            outputs.append(out)
        return out

    monkeypatch.setattr(type(model), "decode", spy)
    prompt = [dgfx.BOS, 72, 101, 108, 108, 111]
    s, ids, decoder = stream_events(
        model,
        processor,
        [prompt],
        max_tokens=2 * dgfx.CANVAS_LENGTH,
        max_denoising_steps=4,
        logprobs=K,
    )
    canvases = 0
    for event in decoder.run(ids):
        if isinstance(event, BlockEvent):
            logp = log_softmax(outputs[-1][0])
            for c, (token, entry) in enumerate(zip(event.tokens[0], event.logprobs[0])):
                assert token == int(np.argmax(logp[c]))
                check_entry(entry, token, logp[c])
            canvases += 1
    assert canvases == 2 or event.eos[0]


CASES = {
    "llada": dict(max_tokens=16, block_length=8, sampler="threshold"),
    "sdar": dict(max_tokens=16, sampler="threshold", threshold=0.95),
    "nemotron": dict(max_tokens=16, block_length=nfx.BLOCK_SIZE),
    "self_spec": dict(max_tokens=12, mode="self_spec"),
    "gemma": dict(max_tokens=dgfx.CANVAS_LENGTH, max_denoising_steps=4),
}


def _fixture(request, name):
    fixture = {"sdar": "sdar_model", "self_spec": "nemotron"}.get(name, name)
    return request.getfixturevalue(fixture)


@pytest.mark.parametrize("name", sorted(CASES))
def test_tokens_and_host_reads_are_those_of_a_run_without(request, monkeypatch, name):
    """The setting changes no token, in a batch too (rows of different lengths), and adds no
    host read to the masked and canvas loops (their reads carry the values)."""
    model, tok = _fixture(request, name)
    prompts = ["Hello there", "a much longer prompt than the first"]
    if name == "self_spec":
        prompts = prompts[:1]  # decodes row by row: one more read a round, by design
    reads = []
    for method in ("item", "tolist"):
        real = getattr(mx.array, method)
        monkeypatch.setattr(mx.array, method, lambda a, _r=real: reads.append(1) or _r(a))

    def run(**kw):
        reads.clear()
        out = batch_generate_diffusion(model, tok, prompts, **CASES[name], **kw)
        return out, len(reads)

    off, reads_off = run()
    for k in (0, K):
        on, reads_on = run(logprobs=k)
        assert on.tokens == off.tokens
        assert off.logprobs is None
        assert [[e.token for e in row] for row in on.logprobs] == on.tokens
        assert all(len(e.top) == k for row in on.logprobs for e in row)
        if name != "self_spec":
            assert reads_on == reads_off


def test_batch_rows_get_the_values_they_get_alone(sdar_model):
    """Rows of different lengths in one batch (the prefix cache runs a step over the rows that
    still have masks only): each row's entries are those of its run alone."""
    model, tok = sdar_model
    prompts = ["Hello there", "a much longer prompt than the first one"]
    kw = dict(max_tokens=16, sampler="threshold", threshold=0.95, logprobs=K)
    batch = batch_generate_diffusion(model, tok, prompts, **kw)
    for prompt, tokens, entries in zip(prompts, batch.tokens, batch.logprobs):
        alone = batch_generate_diffusion(model, tok, [prompt], **kw)
        assert alone.tokens[0] == tokens
        for a, b in zip(alone.logprobs[0], entries):
            assert a.token == b.token and abs(a.logprob - b.logprob) < TOL
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_infilled_prompt_masks_come_with_their_entries(llada):
    """Masks inside a prompt are filled with the first block, and returned from the prompt's
    first mask on: each filled mask's entry is that of its step's commit (its own best
    alternative at temperature 0); a prompt token between them holds its log-probability at
    the first forward over it."""
    model, tok = llada
    m = model.diffusion_spec.mask_token_id
    prompt = [40, m, 42, m, m, 45]
    kw = dict(max_tokens=8, block_length=8, suffix=[60, 61], logprobs=K)
    out = batch_generate_diffusion(model, tok, [prompt], **kw)
    tokens, entries = out.tokens[0], out.logprobs[0]
    assert len(tokens) == 5 + 8 and [e.token for e in entries] == tokens
    for i, (token, entry) in enumerate(zip(tokens, entries)):
        assert np.isfinite(entry.logprob) and len(entry.top) == K
        if i not in (1, 4):  # 42, 45: given, not committed
            assert entry.top[0][0] == token


def test_stream_generate_and_setting_bounds(llada):
    model, tok = llada
    got = list(stream_generate_diffusion(model, tok, "Hi", max_tokens=8, block_length=4))
    assert all(r.logprobs is None for r in got)
    got = list(
        stream_generate_diffusion(model, tok, "Hi", max_tokens=8, block_length=4, logprobs=2)
    )
    assert all(len(r.logprobs) == len(r.tokens) for r in got)
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(SettingsError, match="logprobs"):
            batch_generate_diffusion(model, tok, ["Hi"], max_tokens=4, logprobs=bad)


# ------------------------------------------------------------------------------ the server

MODEL_ID = "llada-fixture"


@pytest.fixture(scope="module")
def served(fixture_dir):
    path = build_once(fixture_dir / "server_llada", build_llada)
    server = make_server(lambda: load(path), host="127.0.0.1", port=0, model_id=MODEL_ID)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    shutdown(server)


def _chat_prompt(tok, content):
    messages = [{"role": "user", "content": content}]
    return text_tokenizer(tok).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )


def _reference(model, tok, prompt):
    """(tokens, text, TokenLogprobs) of the request's single call: what the server must answer."""
    out = batch_generate_diffusion(model, tok, [prompt], logprobs=K, **SETTINGS)
    return out.tokens[0], out.texts[0], out.logprobs[0]


SETTINGS = dict(max_tokens=16, block_length=8)
QUESTION = "Why is the sky blue?"


@pytest.mark.slow
def test_chat_logprobs_not_streaming_and_streaming(llada, served):
    model, tok = llada
    client = OpenAI(base_url=served + "/v1", api_key="unused", max_retries=0)
    tokens, _, entries = _reference(model, tok, _chat_prompt(tok, QUESTION))
    ask = dict(
        model=MODEL_ID,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=SETTINGS["max_tokens"],
        extra_body={"block_length": SETTINGS["block_length"]},
        logprobs=True,
        top_logprobs=K,
    )
    out = client.chat.completions.create(**ask)
    content = out.choices[0].logprobs.content
    assert len(content) == len(tokens) == out.usage.completion_tokens
    for got, want in zip(content, entries):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-6)
        assert len(got.top_logprobs) == K
        assert got.top_logprobs[0].token == got.token
        assert got.top_logprobs[0].logprob == pytest.approx(want.top[0][1], abs=1e-6)
    text = bytes(b for got in content for b in got.bytes).decode("utf-8", errors="replace")
    assert text == out.choices[0].message.content

    chunks = list(client.chat.completions.create(**ask, stream=True))
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]

    # Not asked: no logprobs; top_logprobs alone, or more than 20, is refused with a 400.
    plain = client.chat.completions.create(**{**ask, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == out.choices[0].message.content
    for bad in ({"logprobs": None, "top_logprobs": 2}, {"top_logprobs": 21}):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(**{**ask, **bad})
        assert "top_logprobs" in refused.value.response.text


def test_completion_logprobs_not_streaming_and_streaming(llada, served):
    model, tok = llada
    client = OpenAI(base_url=served + "/v1", api_key="unused", max_retries=0)
    tokens, _, entries = _reference(model, tok, "Once upon a time")
    ask = dict(
        model=MODEL_ID,
        prompt="Once upon a time",
        max_tokens=SETTINGS["max_tokens"],
        extra_body={"block_length": SETTINGS["block_length"]},
        logprobs=2,
    )
    out = client.completions.create(**ask)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(tokens) == out.usage.completion_tokens
    assert lp.token_logprobs == pytest.approx([e.logprob for e in entries], abs=1e-6)
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    assert [max(top.values()) for top in lp.top_logprobs] == pytest.approx(
        [e.top[0][1] for e in entries], abs=1e-6
    )
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)

    chunks = list(client.completions.create(**ask, stream=True))
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            for key in streamed:
                streamed[key] += getattr(chunk.choices[0].logprobs, key)
    assert streamed == lp.model_dump(include=set(streamed))

    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(**{**ask, "logprobs": 25})
    assert "logprobs must be an integer from 0 to 20" in refused.value.response.text


def test_stop_string_cuts_the_entries_with_the_tokens(llada, served):
    """A stop string inside a block: the entries are those of the tokens returned."""
    model, tok = llada
    prompt = "The quick brown fox"
    _, text, _ = _reference(model, tok, prompt)
    middle = range(len(text) // 2, len(text) - 2)
    stop = next(text[i : i + 2] for i in middle if "\ufffd" not in text[i : i + 2])
    body = dict(model=MODEL_ID, prompt=prompt, logprobs=1, stop=[stop], **SETTINGS)
    out = _post(served, "/v1/completions", body)
    lp = out["choices"][0]["logprobs"]
    assert out["choices"][0]["finish_reason"] == "stop"
    assert 0 < len(lp["tokens"]) == out["usage"]["completion_tokens"]


def test_requests_with_and_without_logprobs_share_a_run(llada, served):
    """The setting is left out of the scheduler's groups: rows with and without it batch, and
    each gets what it asked for."""
    model, tok = llada
    prompts = ["Once upon a time", "The quick brown fox"]
    results = [None, None]

    def ask(i):
        body = dict(model=MODEL_ID, prompt=prompts[i], **SETTINGS)
        if i == 0:
            body["logprobs"] = 1
        results[i] = _post(served, "/v1/completions", body)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for i, out in enumerate(results):
        assert out["choices"][0]["text"] == _reference(model, tok, prompts[i])[1]
    assert (
        len(results[0]["choices"][0]["logprobs"]["tokens"])
        == results[0]["usage"]["completion_tokens"]
    )
    assert results[1]["choices"][0].get("logprobs") is None


def _post(url, path, body):
    req = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise AssertionError(e.read().decode()) from None


def test_generate_cli_prints_the_logprobs_it_is_asked_for(capsys):
    """`mlx_dllm generate --logprobs k` prints each generated token's entry (never a setting that
    is silently ignored): its log-probability, then its k alternatives, the token itself first at
    temperature 0."""
    from mlx_dllm_models.cli import main as cli_main

    args = ["generate", "--max-tokens", "8", "--verbose", "false", "--temp", "0"]
    assert cli_main(args + ["--logprobs", "2"]) == 0
    out = capsys.readouterr().out
    text, _, table = out.partition("=" * 10 + "\n")
    rows = [line.split("\t") for line in table.strip().splitlines()]
    assert rows and all(len(r) == 3 for r in rows), out
    for token, logprob, top in rows:
        assert float(logprob) <= 0 and top.startswith(token + " " + logprob)
    assert cli_main(args) == 0
    assert capsys.readouterr().out == text, "the text changed with --logprobs"


def test_chat_refuses_logprobs_rather_than_ignoring_them():
    from mlx_dllm_models.chat import chat_main

    with pytest.raises(SystemExit, match="--logprobs is not shown by mlx_dllm chat"):
        chat_main(["--logprobs", "2"])
