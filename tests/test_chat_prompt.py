"""One chat-prompt rule (prompts.py): generate, chat, evaluate and the default model's task lay a
question out through the same call, so they give the same text for the same messages."""

import pytest

from mlx_dllm_models import generate as generate_module
from mlx_dllm_models import load
from mlx_dllm_models.chat import ChatSession
from mlx_dllm_models.cli import generate_main
from mlx_dllm_models.default import DEFAULT_PROMPT, chat_prompt, default_checkpoint
from mlx_dllm_models.prompts import has_chat_template, render_chat, text_tokenizer, user_turn


@pytest.fixture(scope="module")
def default_model():
    return load(default_checkpoint())


class _Captured(Exception):
    pass


def _generate_prompt(monkeypatch, argv):
    """The prompt text `mlx_dllm generate` hands to the decoder."""
    seen = []

    def capture(model, tokenizer, prompts, **kwargs):
        seen.extend(prompts)
        raise _Captured

    monkeypatch.setattr(generate_module, "stream_events", capture)
    with pytest.raises(_Captured):
        generate_main(argv)
    return seen[0]


def test_every_command_lays_a_question_out_alike(default_model, monkeypatch):
    model, tok = default_model
    assert has_chat_template(tok)
    want = render_chat(tok, user_turn(DEFAULT_PROMPT))
    assert want != DEFAULT_PROMPT and DEFAULT_PROMPT in want
    assert chat_prompt(tok, DEFAULT_PROMPT) == want
    assert ChatSession(model, tok).prompt(user_turn(DEFAULT_PROMPT)) == want
    assert _generate_prompt(monkeypatch, ["--prompt", DEFAULT_PROMPT]) == want
    pytest.importorskip("lm_eval")
    from mlx_dllm_models.evaluate import DiffusionLM

    lm = DiffusionLM(model, tok)
    assert lm.use_chat_template
    assert lm.apply_chat_template(user_turn(DEFAULT_PROMPT)) == want


def test_a_system_prompt_goes_first(default_model, monkeypatch):
    model, tok = default_model
    messages = user_turn(DEFAULT_PROMPT, "Answer with digits only.")
    assert [m["role"] for m in messages] == ["system", "user"]
    want = render_chat(tok, messages)
    assert want.index("Answer with digits only.") < want.index(DEFAULT_PROMPT)
    argv = ["--prompt", DEFAULT_PROMPT, "--system-prompt", "Answer with digits only."]
    assert _generate_prompt(monkeypatch, argv) == want
    session = ChatSession(model, tok, system_prompt="Answer with digits only.")
    assert session.prompt(session.messages + user_turn(DEFAULT_PROMPT)) == want


def test_a_final_message_is_continued_without_a_new_turn(default_model):
    """lm-eval's continuations: add_generation_prompt=False continues the last message."""
    _, tok = default_model
    messages = user_turn(DEFAULT_PROMPT) + [{"role": "assistant", "content": "13"}]
    text = render_chat(tok, messages, add_generation_prompt=False)
    assert text.endswith("13")
    assert text.startswith(render_chat(tok, user_turn(DEFAULT_PROMPT)))


def test_template_kwargs_reach_the_template(default_model):
    _, tok = default_model
    inner = text_tokenizer(tok)
    template = "{% for m in messages %}[{{ m.content }}]{% endfor %}{{ tail | default('') }}"
    old = inner.chat_template
    inner.chat_template = template
    try:
        assert render_chat(tok, user_turn("q"), {"tail": "!"}) == "[q]!"
    finally:
        inner.chat_template = old


def test_no_template_and_processors():
    class Bare:
        pass

    class Empty:
        chat_template = ""

    class Processor:
        image_processor = object()
        tokenizer = Empty()

    assert not has_chat_template(Bare())
    assert not has_chat_template(Empty())
    assert not has_chat_template(Processor())
    assert text_tokenizer(Processor()) is Processor.tokenizer
    Processor.tokenizer = type("T", (), {"chat_template": "{{ messages[0].content }}"})()
    assert has_chat_template(Processor())
