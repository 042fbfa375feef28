"""Batch invariance at every family's default settings: each row of a batch of chat prompts of
different lengths (so the shorter ones are left-padded) gets the tokens it gets alone, with the
checkpoint's generation_config and the family's recipe as they are (DiffusionGemma's 48 denoising
steps, LLaDA's steps = max_tokens, the block-causal families' threshold samplers, Nemotron's
causal-prefix cache); and so does every concurrent request of the server."""

import threading
from pathlib import Path

import pytest
from openai import OpenAI

from fixtures import build_once
from fixtures import diffusion_gemma as dg_fx
from fixtures import dream as dream_fx
from fixtures import llada as llada_fx
from fixtures import llada2 as l2_fx
from fixtures import nemotron as nem_fx
from fixtures import sdar as sdar_fx
from mlx_dllm_models import batch_generate_diffusion, load
from mlx_dllm_models.server import Job, Scheduler, make_server, shutdown
from mlx_dllm_models.vision import text_tokenizer

BUILDERS = {
    **llada_fx.CHECKPOINTS,
    **dream_fx.CHECKPOINTS,
    **sdar_fx.CHECKPOINTS,
    **l2_fx.CHECKPOINTS,
    "nemotron": nem_fx.build,
    **dg_fx.CHECKPOINTS,
}
QUESTIONS = ["hi", "What is the sum of two and two?", "Tell me about the sea, please, in detail."]
MAX_TOKENS = 32  # at most one default block of the masked families; two DiffusionGemma canvases


def chat_questions(chat):
    """QUESTIONS, each a user turn laid out by the tokenizer `chat`'s template."""
    return [
        chat.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in QUESTIONS
    ]


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def family(request, fixture_dir):
    path = build_once(Path(fixture_dir) / f"invariance_{request.param}", BUILDERS[request.param])
    model, tok = load(path)
    chat = text_tokenizer(tok)
    prompts = chat_questions(chat)
    limit = model.diffusion_spec.max_position_embeddings
    lengths = [len(chat.encode(p)) for p in prompts]
    assert len(set(lengths)) == len(lengths), "the rows must differ in length"
    # Nemotron's fixture has a 64-position context.
    max_tokens = MAX_TOKENS if limit is None else min(MAX_TOKENS, limit - max(lengths))
    assert max_tokens >= 16
    return request.param, model, tok, prompts, max_tokens


@pytest.mark.slow
def test_batch_rows_equal_single_runs_at_the_defaults(family):
    name, model, tok, prompts, max_tokens = family
    alone = [batch_generate_diffusion(model, tok, [p], max_tokens=max_tokens) for p in prompts]
    batch = batch_generate_diffusion(model, tok, prompts, max_tokens=max_tokens)
    for row, single in enumerate(alone):
        assert batch.tokens[row] == single.tokens[0], f"{name}: row {row} differs in the batch"
        assert batch.finish_reasons[row] == single.finish_reasons[0]
    assert any(len(r.tokens[0]) > 1 for r in alone), "nothing generated: the test shows nothing"


@pytest.mark.slow
def test_concurrent_requests_equal_single_requests(family):
    """Requests submitted together share the server's runs (or join them) and get the tokens of
    a request served alone."""
    name, model, tok, prompts, max_tokens = family
    settings = dict(max_tokens=max_tokens)

    def served(batch):
        scheduler = Scheduler(model, tok, max_batch=8)
        jobs = [scheduler.submit(Job(p, dict(settings))) for p in batch]
        while not all(j.done for j in jobs):
            scheduler.step()
        return [j.tokens for j in jobs], scheduler.max_rows

    alone = [served([p])[0][0] for p in prompts]
    together, rows = served(prompts)
    assert together == alone, f"{name}: a concurrent request got other tokens"
    assert rows > 1, f"{name}: the requests did not share a forward"


@pytest.mark.slow
def test_simultaneous_canvas_requests_share_a_run(fixture_dir):
    """DiffusionGemma's canvases take no rows once a run has started: requests sent at the same
    moment by concurrent clients wait the server's short gathering window and share one run,
    each with the tokens it gets alone."""
    path = build_once(Path(fixture_dir) / "invariance_diffusion_gemma", dg_fx.build)
    server = make_server(lambda: load(path), host="127.0.0.1", port=0, model_id="dg")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = OpenAI(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key="none")
    try:

        def ask(question):
            reply = client.chat.completions.create(
                model="dg",
                messages=[{"role": "user", "content": question}],
                max_tokens=16,
                seed=1,
            )
            return reply.choices[0].message.content

        alone = [ask(q) for q in QUESTIONS[:2]]
        assert server.service.scheduler.max_rows == 1
        start = threading.Barrier(2)
        answers = [None, None]

        def client_thread(i):
            start.wait()
            answers[i] = ask(QUESTIONS[i])

        threads = [threading.Thread(target=client_thread, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert answers == alone
        assert server.service.scheduler.max_rows == 2, "the two requests queued one by one"
    finally:
        shutdown(server)


@pytest.mark.slow
def test_canvas_rows_with_their_own_seeds_share_a_run(fixture_dir):
    """DiffusionGemma's rows draw from streams of their own seeds: requests with different seeds
    (a client's, or one drawn for a request that named none) share a run, each with the tokens
    it gets alone with its seed."""
    path = build_once(Path(fixture_dir) / "invariance_diffusion_gemma", dg_fx.build)
    model, tok = load(path)
    chat = text_tokenizer(tok)
    prompts = chat_questions(chat)
    seeds = [3, 11, 12345]

    def served(rows):
        scheduler = Scheduler(model, tok, max_batch=8)
        jobs = [scheduler.submit(Job(p, dict(max_tokens=16, seed=s))) for p, s in rows]
        while not all(j.done for j in jobs):
            scheduler.step()
        return [j.tokens for j in jobs], scheduler.max_rows

    alone = [served([row])[0][0] for row in zip(prompts, seeds)]
    together, rows = served(list(zip(prompts, seeds)))
    assert together == alone
    assert rows == 3, "rows with different seeds did not share a run"
    assert served([(prompts[0], 4)])[0][0] != alone[0], "the seed changes nothing: a weak test"


def test_requests_that_named_no_seed_share_a_run(fixture_dir):
    """A sampling request that names no seed gets a fresh one (server/fields.draws_noise). The
    masked decoder's rows draw from streams of their own seeds, so requests with different seeds
    (named or fresh) share a run, and each gets the tokens it gets served alone with its seed; a
    decoder whose draws are batch-wide (self-speculation's) decodes named seeds apart."""
    model, tok = load(build_once(Path(fixture_dir) / "invariance_llada", llada_fx.build_llada))
    settings = dict(max_tokens=16, block_length=8, steps=8, temperature=0.9)

    def served(rows, fresh=False):
        scheduler = Scheduler(model, tok, max_batch=8)
        jobs = [scheduler.submit(Job(q, dict(settings, seed=s), fresh_seed=fresh)) for q, s in rows]
        while not all(j.done for j in jobs):
            scheduler.step()
        return [j.tokens for j in jobs], scheduler.max_rows

    rows = list(zip(QUESTIONS, [101, 202, 303]))
    for fresh in (True, False):
        together, width = served(rows, fresh)
        assert width == 3
        assert together == [served([row], fresh)[0][0] for row in rows]
    other = served([(QUESTIONS[0], 5)])[0][0]
    assert other != served(rows[:1])[0][0], "the seed changes nothing: a weak test"


def test_backends_that_draw_for_the_batch_keep_seeds_apart(fixture_dir):
    """Nemotron's AR head draws its block seeds from one key for the batch: its requests of
    different seeds are not batched together (each stays reproducible by its seed), while
    LLaDA's masked rows draw from their own streams and are."""
    from mlx_dllm_models.engine import join_policy
    from mlx_dllm_models.request import prepare

    for build, name, own in (
        (nem_fx.build, "nemotron", False),
        (llada_fx.build_llada, "llada", True),
    ):
        model, tok = load(build_once(Path(fixture_dir) / f"invariance_{name}", build))
        request = prepare(model, tok, ["hi"], dict(max_tokens=8, temperature=0.5))
        assert join_policy(request.spec, request.settings).row_seeds is own, name


MOE = ("diffusion_gemma", "llada2_moe", "llada_moe", "sdar_moe")


@pytest.mark.slow
@pytest.mark.parametrize("form", ["bf16", "q4"])
@pytest.mark.parametrize("name", MOE)
def test_narrow_moe_rows_equal_single_runs_on_the_cpu_path(name, form, fixture_dir, monkeypatch):
    """The MoE families in bfloat16 and 4 bits on the CPU's float32 path (models/cpu_layers.py),
    where an expert gather runs expert by expert once its sorted pairs are many an expert: a
    batch's gathers take that path where a row alone may not (or the other way round), and each
    row still gets its tokens alone."""
    from checkpoint_forms import narrow
    from mlx_dllm_models.models import cpu_layers

    path = build_once(Path(fixture_dir) / f"invariance_{name}", BUILDERS[name])
    model, tok = load(path)
    narrow(model, form)
    assert cpu_layers.use_float32_matmuls(model) > 0
    grouped = []
    original = cpu_layers._grouped

    def spy(x, pieces, rhs):
        grouped.append(rhs.size)
        return original(x, pieces, rhs)

    monkeypatch.setattr(cpu_layers, "_grouped", spy)
    chat = text_tokenizer(tok)
    prompts = chat_questions(chat)
    alone = [batch_generate_diffusion(model, tok, [p], max_tokens=MAX_TOKENS) for p in prompts]
    batch = batch_generate_diffusion(model, tok, prompts, max_tokens=MAX_TOKENS)
    for row, single in enumerate(alone):
        assert batch.tokens[row] == single.tokens[0], f"{name} {form}: row {row} differs"
    assert grouped, "no gather ran expert by expert: the test shows nothing"
