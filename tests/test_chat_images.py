"""`mlx_dllm chat` with images (issue #30): a turn asked about an image, a later turn that still
sees it (the conversation keeps its images), `/image PATH` in the REPL and `--image` for the first
question; an image given to a model without a vision tower, or a file that is not there, is an
error line and the conversation goes on."""

import subprocess
import sys

import pytest

from fixtures import build_once
from fixtures.llada_v import build_llada_v
from helpers import random_picture
from mlx_dllm_models import batch_generate_diffusion, load
from mlx_dllm_models.chat import ChatSession
from mlx_dllm_models.tiny import build_tiny_llada
from mlx_dllm_models.vision import ImageError

SETTINGS = dict(max_tokens=8, block_length=8, steps=4)


@pytest.fixture(scope="module")
def checkpoint(fixture_dir):
    return build_once(fixture_dir / "llada_v", build_llada_v)


def picture(seed, size=(40, 70)):
    return random_picture(seed, size)


def test_a_later_turn_still_sees_the_first_turns_image(checkpoint):
    model, processor = load(checkpoint)
    session = ChatSession(model, processor, SETTINGS)
    _, first, _ = session.send("What is it?", images=[picture(0)])
    assert session.messages[0]["content"] == "<image>What is it?"
    _, tokens, _ = session.send("And its colour?")
    # The turn's prompt is the whole conversation, with the first turn's image at its place.
    prompt = session.prompt(session.messages[:-1])
    want = batch_generate_diffusion(model, processor, [prompt], images=[[picture(0)]], **SETTINGS)
    assert tokens == want.tokens[0]
    # The image is read: another picture gives another reply.
    other = ChatSession(model, processor, SETTINGS)
    assert other.send("What is it?", images=[picture(5)])[1] != first
    assert len(session.images) == 1


def test_images_that_cannot_be_asked_about_leave_the_conversation_as_it_was(checkpoint, tmp_path):
    model, processor = load(checkpoint)
    session = ChatSession(model, processor, SETTINGS)
    with pytest.raises(ImageError, match="does not exist"):
        session.send("What is it?", images=[tmp_path / "missing.png"])
    assert session.messages == [] and session.images == []
    text_model, tok = load(build_tiny_llada(tmp_path / "text"))
    with pytest.raises(ImageError, match="reads no images"):
        ChatSession(text_model, tok, SETTINGS).send("hi", images=[picture(0)])


def run_chat(model, lines, *flags):
    out = subprocess.run(
        [sys.executable, "-m", "mlx_dllm_models", "chat", "--model", str(model), *flags]
        + ["--max-tokens", "8", "--block-length", "8", "--steps", "4"],
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.slow
def test_the_repl_attaches_images(checkpoint, tmp_path):
    path = tmp_path / "pic.png"
    picture(1).save(path)
    out = run_chat(
        checkpoint,
        [
            "/image",
            f"/image {tmp_path / 'nope.png'}",
            f"/image {path}",
            "What is it?",
            "more?",
            "q",
        ],
        "--image",
        str(path),
    )
    assert "error: /image needs a path" in out
    assert f"error: image '{tmp_path / 'nope.png'}' does not exist" in out
    assert out.count("[image attached to the next question") == 2  # --image and /image
    assert out.count("NFE: ") == 2, out  # both questions answered
