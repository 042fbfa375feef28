"""`mlx_dllm chat` reads its lines through readline (issue #27 §2): on a pseudo-terminal, a pasted
line longer than the terminal's canonical-mode line (4095 characters on Linux) arrives whole, and
Ctrl-A moves to the start of the line being edited. Without readline, the same input loses
everything past the 4095th character and the Ctrl-A stays in the text, which each assertion
below would show."""

import os
import re
import select

import pytest

from fixtures import sdar as sdar_fx
from helpers import cli_on_pty, read_pty
from mlx_dllm_models import load
from mlx_dllm_models.chat import HELP, ChatSession

CANONICAL_LINE = 4095  # N_TTY_BUF_SIZE - 1: what a Linux terminal holds of a line it edits

pytest.importorskip("readline")


@pytest.fixture(scope="module")
def sdar(tmp_path_factory):
    return sdar_fx.build_sdar(tmp_path_factory.mktemp("chat_lines") / "sdar")


def _type(fd, data: bytes):
    """Write all of `data` to the terminal (the child reads it as it goes: a full input queue
    blocks the writer, never drops characters in readline's raw mode)."""
    while data:
        _, ready, _ = select.select([], [fd], [], 60)
        assert ready, "the chat stopped reading its terminal"
        data = data[os.write(fd, data[:1024]) :]


@pytest.mark.slow
def test_a_line_longer_than_the_terminal_line_arrives_whole(sdar):
    pid, fd = cli_on_pty("chat", "--model", str(sdar), "--no-live", "--max-tokens", "8")
    out = b""

    def until(predicate, timeout=120):
        nonlocal out
        while not predicate(out):
            ready, _, _ = select.select([fd], [], [], timeout)
            assert ready, out.decode("utf-8", "replace")[-2000:]
            out += os.read(fd, 65536)

    until(lambda o: o.count(b">> ") >= 1)
    # A command after 6,000 spaces: canonical mode would keep the spaces and lose the "h".
    _type(fd, b" " * 6000 + b"h\r")
    until(lambda o: o.count(HELP.encode()) >= 2 and b">> " in o.rpartition(HELP.encode())[2])
    # Ctrl-A edits the line: "elp", then to its start, then "/h" -> "/help".
    _type(fd, b"elp\x01/h\r")
    # (Each line is typed once the prompt shows: readline reads the terminal raw only while it
    # waits for a line; what is typed before goes through the canonical mode.)
    until(lambda o: o.count(HELP.encode()) >= 3 and b">> " in o.rpartition(HELP.encode())[2])
    # A question of 6,000 characters: the model's context (512) refuses it, naming its length
    # in tokens, which is the whole line's.
    words = " ".join(f"w{i % 97}" for i in range(2000))[:6000]
    assert len(words) > CANONICAL_LINE
    _type(fd, words.encode() + b"\r")
    until(lambda o: re.search(rb"error: .*?prompt \((\d+) tokens\)", o) is not None)
    got = int(re.search(rb"error: .*?prompt \((\d+) tokens\)", out).group(1))
    until(lambda o: b">> " in o.rpartition(b" tokens)")[2])
    _type(fd, b"q\r")
    text = out.decode("utf-8", "replace") + read_pty(fd, pid)
    assert text.rstrip().endswith("bye"), text[-500:]

    model, tokenizer = load(sdar)
    session = ChatSession(model, tokenizer)
    prompt = session.prompt([{"role": "user", "content": words}])
    whole = len(tokenizer.encode(prompt, add_special_tokens=False))
    cut = session.prompt([{"role": "user", "content": words[:CANONICAL_LINE]}])
    assert got == whole != len(tokenizer.encode(cut, add_special_tokens=False))
