"""`mlx_dllm chat`: turns that reuse the previous turns' K/V give the tokens of a fresh run over the
whole conversation; the REPL on a pseudo-terminal (two turns, /reset, /exit)."""

import os

import pytest

from fixtures.kv_turns import FAMILIES, TURNS
from helpers import cli_on_pty, load_fixture, pty_session
from mlx_dllm_models import load
from mlx_dllm_models.cache import PriorKV
from mlx_dllm_models.chat import ChatSession
from mlx_dllm_models.generate import stream_events
from mlx_dllm_models.settings import SettingsError
from mlx_dllm_models.tiny import build_tiny_llada


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    return {name: build(root / name) for name, (build, _) in FAMILIES.items()}


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_reused_kv_equals_a_fresh_run_over_the_conversation(checkpoints, family, temperature):
    model, tok = load(checkpoints[family])
    settings = dict(max_tokens=12, temperature=temperature, seed=3, **FAMILIES[family][1])
    reusing = ChatSession(model, tok, settings)
    fresh = ChatSession(model, tok, settings, reuse_kv=False)
    reused = []
    for query in TURNS:
        text, tokens, last = reusing.send(query)
        ref_text, ref_tokens, _ = fresh.send(query)
        assert tokens == ref_tokens and text == ref_text and len(tokens) > 0
        reused.append(reusing.reused)
        assert fresh.reused == 0
    assert reused[0] == 0 and reused[-1] > 0, "no K/V was reused"
    assert reusing.messages == fresh.messages and len(reusing.messages) == 2 * len(TURNS)


def test_reuse_skips_the_shared_prefix(checkpoints, monkeypatch):
    """The prefill computes only the columns after the reused ones."""
    model, tok = load(checkpoints["sdar"])
    session = ChatSession(model, tok, dict(max_tokens=12, **FAMILIES["sdar"][1]))
    session.send("hello there")
    prior = session.prior
    assert isinstance(prior, PriorKV) and len(prior.tokens) % 4 == 0 and prior.tokens
    prompt = session.prompt(session.messages + [{"role": "user", "content": "more"}])
    _, ids, decoder = stream_events(model, tok, [prompt], **FAMILIES["sdar"][1], max_tokens=4)
    widths = []
    real = type(model).__call__

    def spy(self, x, **kw):
        widths.append(x.shape[1])
        return real(self, x, **kw)

    monkeypatch.setattr(type(model), "__call__", spy)
    list(decoder.run(ids, prior=prior))
    monkeypatch.undo()
    prefix = len(ids[0]) // 4 * 4
    assert decoder.backend.reused > 0
    assert widths[0] == prefix - decoder.backend.reused, widths
    # K/V of another block partition are refused.
    other = dict(FAMILIES["sdar"][1], block_length=8)
    _, ids, decoder = stream_events(model, tok, [prompt], **other, max_tokens=4)
    with pytest.raises(ValueError, match="block-causal \\(block_length 4\\) attention, not"):
        list(decoder.run(ids, prior=prior))


def test_bidirectional_families_recompute_and_refuse_a_prior(tmp_path):
    model, tok = load(build_tiny_llada(tmp_path / "llada"))
    session = ChatSession(model, tok, dict(max_tokens=8, block_length=8, steps=4))
    session.send("hi")
    assert session.prior is None and session.reused == 0
    _, ids, decoder = stream_events(model, tok, ["hi"], max_tokens=8, block_length=8, steps=4)
    with pytest.raises(SettingsError, match="FullRecompute cannot reuse"):
        list(decoder.run(ids, prior=PriorKV([1, 2], None, "causal")))


def test_chat_needs_a_chat_template(checkpoints, tmp_path):
    model, tok = load_fixture(checkpoints["sdar"])
    tok._tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        ChatSession(model, tok)


def _pty_run(args, lines, rows=24, cols=100, timeout=120):
    """Run the CLI on a pseudo-terminal, typing `lines` one after the other, each once the
    previous prompt (">> ") has appeared; returns everything it printed and its exit status."""
    pid, fd = cli_on_pty(*args, size=(rows, cols))
    pending = list(lines)

    def type_next(out):
        if pending and out.count(b">> ") > len(lines) - len(pending):
            os.write(fd, (pending.pop(0) + "\n").encode())

    out, code = pty_session(fd, pid, timeout, type_next)
    return out.decode("utf-8", "replace"), code


@pytest.mark.slow
def test_chat_repl_on_a_terminal(checkpoints):
    args = ["chat", "--model", str(checkpoints["sdar"]), "--max-tokens", "8"]
    args += ["--block-length", "4", "--steps", "4"]
    out, code = _pty_run(args, ["hello", "and more?", "/reset", "again", "/exit"])
    assert code == 0, out
    assert out.count("NFE:") == 3, out
    assert "░" in out and "\x1b[J" in out, "no live canvas"
    assert out.count("reused K/V") == 1, "the second turn reuses the first's K/V, not after /reset"
    assert "[conversation reset]" in out and out.rstrip().endswith("bye")


def test_a_turn_past_the_context_is_an_error_that_keeps_the_conversation(checkpoints):
    model, tok = load(checkpoints["nemotron"])
    session = ChatSession(model, tok, dict(max_tokens=8, **FAMILIES["nemotron"][1]))
    session.send("hi")
    before, prior = list(session.messages), session.prior
    with pytest.raises(SettingsError, match="exceeds the model's context"):
        session.send("word " * 40)
    assert session.messages == before and session.prior is prior
    assert session.send("ok")[1]  # the conversation goes on
