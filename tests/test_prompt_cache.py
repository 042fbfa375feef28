"""The server's prompt cache: a conversation resent turn by turn reuses the K/V its earlier turns
left, with the tokens of a server without the cache; the cache's bounds."""

from pathlib import Path

import pytest

from fixtures import build_once
from fixtures.kv_turns import FAMILIES, TURNS
from mlx_dllm_models import load
from mlx_dllm_models.request import encode
from mlx_dllm_models.server import Job, Scheduler
from mlx_dllm_models.server.prompt_cache import PromptCache, parse_size
from mlx_dllm_models.tiny import build_tiny_llada
from mlx_dllm_models.vision import text_tokenizer


@pytest.fixture(scope="module")
def checkpoints(fixture_dir):
    return {
        name: build_once(Path(fixture_dir) / f"prompt_cache_{name}", build)
        for name, (build, _) in FAMILIES.items()
    }


def serve(scheduler, prompt, settings):
    job = scheduler.submit(Job(prompt, dict(settings)))
    while not job.done:
        scheduler.step()
    events = []
    while not job.events.empty():
        events.append(job.events.get())
    assert not [e for e in events if e[0] == "error"], events
    return job


def conversation(model, tok, settings, cache):
    """The three turns sent as three requests, each the whole conversation so far."""
    scheduler = Scheduler(model, tok, prompt_cache=cache)
    chat = text_tokenizer(tok)
    messages, turns = [], []
    for query in TURNS:
        messages.append({"role": "user", "content": query})
        prompt = chat.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        job = serve(scheduler, prompt, settings)
        messages.append({"role": "assistant", "content": chat.decode(job.tokens)})
        turns.append((job.tokens, job.cached_tokens))
    return turns


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_resent_conversation_reuses_its_kv(checkpoints, family, temperature):
    model, tok = load(checkpoints[family])
    settings = dict(max_tokens=12, temperature=temperature, seed=3, **FAMILIES[family][1])
    cache = PromptCache(max_entries=4)
    cached = conversation(model, tok, settings, cache)
    fresh = conversation(model, tok, settings, None)
    assert [t for t, _ in cached] == [t for t, _ in fresh]
    assert all(len(t) > 0 for t, _ in fresh)
    assert [n for _, n in fresh] == [0, 0, 0]
    assert cached[0][1] == 0 and cached[1][1] > 0 and cached[2][1] > 0, cached
    assert cache.hits == 2 and len(cache.entries) == 3


def test_full_recompute_families_keep_nothing(fixture_dir):
    """Bidirectional families recompute every step: nothing to cache, nothing reported."""
    model, tok = load(build_once(Path(fixture_dir) / "prompt_cache_llada", build_tiny_llada))
    cache = PromptCache()
    scheduler = Scheduler(model, tok, prompt_cache=cache)
    for prompt in ["hello there", "hello there, again"]:
        job = serve(scheduler, prompt, dict(max_tokens=8, block_length=8, steps=4))
        assert job.cached_tokens == 0
    assert cache.entries == []


def test_bounds(checkpoints):
    model, tok = load(checkpoints["sdar"])
    settings = dict(max_tokens=8, **FAMILIES["sdar"][1])
    cache = PromptCache(max_entries=2)
    scheduler = Scheduler(model, tok, prompt_cache=cache)
    prompts = ["one fish", "two fish", "red fish"]
    for prompt in prompts:
        serve(scheduler, prompt, settings)
    assert len(cache.entries) == 2, "the least recently used entry goes past max_entries"
    ids = [encode(tok, p) for p in prompts[1:]]
    assert [e.tokens[: len(i)] for e, i in zip(cache.entries, ids)] == ids, "not the newest two"
    assert cache.nbytes > 0
    one = cache.nbytes // 2
    cache = PromptCache(max_entries=10, max_bytes=one)
    scheduler = Scheduler(model, tok, prompt_cache=cache)
    for prompt in prompts:
        serve(scheduler, prompt, settings)
    assert len(cache.entries) == 1 and cache.nbytes <= one


@pytest.mark.parametrize(
    "text, size",
    [("1024", 1024), ("8GB", 8 * 10**9), ("500MB", 500 * 10**6), ("2GiB", 2 * 2**30)],
)
def test_sizes_as_mlx_lm_takes_them(text, size):
    assert parse_size(text) == size


def test_a_bad_size_is_refused():
    with pytest.raises(ValueError, match="expected a size"):
        parse_size("lots")
