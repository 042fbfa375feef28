"""`mlx_dllm serve` on loopback: the OpenAI Python client and curl, streaming and not, bad requests,
disconnects, images (DiffusionGemma), and concurrent requests that share forwards, each answered
with exactly the tokens of a single `generate_diffusion` call at temperature 0."""

import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from openai import OpenAI
from PIL import Image

from fixtures import build_once
from fixtures import diffusion_gemma as dgfx
from fixtures.llada import build_llada
from fixtures.nemotron import build as build_nemotron
from fixtures.sdar import build_sdar
from helpers import checkpoint_fixtures, data_url, step_to_the_end
from helpers import single_call as single
from mlx_dllm_models import load
from mlx_dllm_models.cli import main as cli_main
from mlx_dllm_models.server import Job, Scheduler, StopWords, make_server, shutdown
from mlx_dllm_models.server.images import ImagePolicy
from server_checks import chat_prompt, post

MODEL_ID = "llada-fixture"


def _serve(path, model_id, **kwargs):
    """A server on a free loopback port; its worker thread loads its own copy of the checkpoint
    (the tests compute references with theirs, on the main thread)."""
    server = make_server(lambda: load(path), host="127.0.0.1", port=0, model_id=model_id, **kwargs)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


llada_path, llada = checkpoint_fixtures("server_llada", build_llada, "llada", "llada_path")


@pytest.fixture(scope="module")
def served(llada_path):
    server, url = _serve(llada_path, MODEL_ID, max_batch=16)
    yield server, url
    shutdown(server)
    assert not server.service.scheduler.healthy


def test_openai_client_chat_not_streaming_and_streaming(llada, served):
    model, tokenizer = llada
    _, url = served
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    settings = dict(max_tokens=24, block_length=8)
    messages = [{"role": "user", "content": "Why is the sky blue?"}]
    tokens, text, reason = single(
        model, tokenizer, chat_prompt(tokenizer, messages[0]["content"]), **settings
    )
    assert len(tokens) > 8, "the reference must span several blocks"

    out = client.chat.completions.create(
        model=MODEL_ID, messages=messages, max_tokens=24, extra_body={"block_length": 8}
    )
    assert out.choices[0].message.content == text
    assert out.choices[0].finish_reason == reason
    assert out.usage.completion_tokens == len(tokens)
    assert out.usage.prompt_tokens == len(
        tokenizer.encode(chat_prompt(tokenizer, messages[0]["content"]), add_special_tokens=False)
    )
    extra = out.usage.model_extra
    assert extra["nfe"] >= 1
    assert extra["tokens_per_forward"] == pytest.approx(len(tokens) / extra["nfe"], rel=1e-3)

    stream = client.chat.completions.create(
        model=MODEL_ID,
        messages=messages,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"block_length": 8},
    )
    chunks = list(stream)
    blocks = [c for c in chunks if c.choices]
    assert len(blocks) == -(-len(tokens) // 8)  # one chunk per committed block
    assert "".join(c.choices[0].delta.content or "" for c in blocks) == text
    assert blocks[-1].choices[0].finish_reason == reason
    assert all(c.choices[0].finish_reason is None for c in blocks[:-1])
    assert chunks[-1].usage.completion_tokens == len(tokens)


def test_curl_completions_not_streaming_and_streaming(llada, served):
    model, tokenizer = llada
    _, url = served
    body = {"prompt": "Once upon a time", "max_tokens": 20, "block_length": 8, "steps": 4}
    tokens, text, reason = single(
        model, tokenizer, "Once upon a time", max_tokens=20, block_length=8, steps=4
    )
    curl = ["curl", "-sS", "--max-time", "60", url + "/v1/completions"]
    curl += ["-H", "Content-Type: application/json"]
    out = subprocess.run(curl + ["-d", json.dumps(body)], capture_output=True, text=True)
    packet = json.loads(out.stdout)
    assert packet["object"] == "text_completion"
    assert packet["choices"][0]["text"] == text
    assert packet["choices"][0]["finish_reason"] == reason
    assert packet["usage"]["completion_tokens"] == len(tokens)
    assert packet["usage"]["nfe"] >= 1

    out = subprocess.run(
        curl + ["-N", "-d", json.dumps(dict(body, stream=True))], capture_output=True, text=True
    )
    events = [line[len("data: ") :] for line in out.stdout.splitlines() if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == -(-len(tokens) // 8)
    assert "".join(c["choices"][0]["text"] for c in chunks) == text


def test_models_and_health(served):
    _, url = served
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        assert [m["id"] for m in json.loads(r.read())["data"]] == [MODEL_ID]
    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        assert json.loads(r.read()) == {"status": "ok"}


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


@pytest.mark.parametrize(
    "path, body, raw, status, message",
    [
        ("/v1/chat/completions", None, b'{"messages": [', 400, "Invalid JSON"),
        ("/v1/chat/completions", dict(CHAT, bogus=1), None, 400, "unknown setting.*bogus"),
        ("/v1/chat/completions", dict(CHAT, steps=0), None, 400, "steps must be"),
        (
            "/v1/chat/completions",
            dict(CHAT, sampler="threshold", threshold=2),
            None,
            400,
            "threshold must be",
        ),
        ("/v1/completions", {"prompt": [65] * 4096}, None, 400, "fills the model's context"),
        ("/v1/chat/completions", dict(CHAT, model="gpt-4"), None, 404, "not served here"),
        (
            "/v1/chat/completions",
            dict(CHAT, logprobs=True, top_logprobs=21),
            None,
            400,
            "top_logprobs must be an integer from 0 to 20",
        ),
        ("/v1/chat/completions", dict(CHAT, stop=3), None, 400, "stop must be"),
        ("/v1/chat/completions", {"max_tokens": 8}, None, 400, "needs messages"),
        ("/v1/completions", {"max_tokens": 8}, None, 400, "needs a prompt"),
        ("/v1/completions", {"prompt": ""}, None, 400, "prompt is empty"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
            None,
            400,
            "reads no images",
        ),
    ],
)
def test_bad_requests_get_a_4xx_and_the_server_keeps_serving(
    served, path, body, raw, status, message
):
    _, url = served
    code, text = post(url, path, body, raw)
    assert code == status
    assert re.search(message, json.loads(text)["error"]["message"])
    code, text = post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 4})
    assert code == 200 and json.loads(text)["usage"]["completion_tokens"] >= 1


def test_stop_words_cut_the_text_and_end_the_request(llada, served):
    model, tokenizer = llada
    _, url = served
    _, text, _ = single(model, tokenizer, "The sky", max_tokens=24, block_length=8)
    word = text[10:13]
    assert word and len(text) > 13
    code, out = post(
        url,
        "/v1/completions",
        {"prompt": "The sky", "max_tokens": 24, "block_length": 8, "stop": [word]},
    )
    choice = json.loads(out)["choices"][0]
    assert choice["text"] == text[: text.index(word)] and choice["finish_reason"] == "stop"


def test_stop_words_hold_back_a_possible_start():
    stop = StopWords(["END"])
    assert stop.feed("abcE", final=False) == ("abc", False)
    assert stop.feed("Nx", final=False) == ("ENx", False)
    assert stop.feed("yEN", final=False) == ("y", False)
    assert stop.feed("D tail", final=False) == ("", True)


def test_a_client_that_disconnects_frees_its_row(served):
    server, url = served
    scheduler = server.service.scheduler
    before = scheduler.blocks
    body = {"prompt": "a long story", "max_tokens": 64, "block_length": 8, "stream": True}
    data = json.dumps(body).encode()
    port = server.server_address[1]
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        received = b""
        while b"data: " not in received:
            received += sock.recv(4096)
    deadline = time.time() + 30
    while any(not g.idle for g in scheduler.groups.values()) and time.time() < deadline:
        time.sleep(0.02)
    assert all(g.idle for g in scheduler.groups.values())
    # 64 tokens are 8 blocks: the row left after a few, not after all of them.
    assert 1 <= scheduler.blocks - before < 8


@pytest.mark.slow
def test_cli_serve_answers_curl_and_stops(llada, llada_path):
    """`mlx_dllm serve` as users start it: a subprocess on a loopback port."""
    model, tokenizer = llada
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "mlx_dllm_models", "serve", "--model", str(llada_path)]
    cmd += [
        "--port",
        str(port),
        "--max-tokens",
        "12",
        "--block-length",
        "4",
        "--log-level",
        "ERROR",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except OSError:
                assert time.time() < deadline, "the server did not come up"
                time.sleep(0.2)
        # The flags are the defaults: max_tokens=12, block_length=4.
        _, text, _ = single(model, tokenizer, "hi there", max_tokens=12, block_length=4)
        out = subprocess.run(
            ["curl", "-sS", "--max-time", "60", url + "/v1/completions"]
            + ["-H", "Content-Type: application/json", "-d", json.dumps({"prompt": "hi there"})],
            capture_output=True,
            text=True,
        )
        assert json.loads(out.stdout)["choices"][0]["text"] == text
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_cli_serve_flag_errors_are_one_line(llada_path, tmp_path):
    with pytest.raises(SystemExit, match="adapter_config.json"):
        cli_main(["serve", "--model", str(llada_path), "--adapter-path", str(tmp_path)])
    with pytest.raises(SystemExit, match="steps must be"):
        cli_main(["serve", "--model", str(llada_path), "--port", "0", "--steps", "0"])


# --------------------------------------------------------------------------- continuous batching


@pytest.mark.parametrize("build, block", [(build_llada, 8), (build_sdar, 4), (build_nemotron, 8)])
def test_rows_joining_a_running_batch_get_the_tokens_of_single_calls(fixture_dir, build, block):
    """Requests arrive one block apart, so each joins a batch in progress (the bidirectional
    full-recompute, block-causal prefix-cache and causal-prefix cache backends); one leaves
    mid-way. Budgets that are not whole blocks of a causal-prefix model batch at arrival."""
    path = build_once(fixture_dir / f"server_{build.__name__}", build)
    model, tokenizer = load(path)
    scheduler = Scheduler(model, tokenizer, max_batch=4)
    prompts = ["hello world", "a longer prompt", "x", "tell me", "ok fine"]
    budgets = [3 * block, 5 * block, 3 * block + 1, 2 * block, 4 * block - 2]
    samplers = ["quota", "quota", "threshold", "quota", "threshold"]
    settings = [
        dict(
            max_tokens=m,
            block_length=block,
            sampler=s,
            **({"threshold": 0.5} if s[0] == "t" else {}),
        )
        for m, s in zip(budgets, samplers)
    ]
    jobs = []
    for i, (prompt, s) in enumerate(zip(prompts, settings)):
        jobs.append(scheduler.submit(Job(prompt, dict(s))))
        scheduler.step()
        if i == 4:
            jobs[1].cancelled = True
    step_to_the_end(scheduler)
    assert [j.events.get_nowait()[0] for j in jobs] == ["accepted"] * len(jobs)
    assert scheduler.joins >= 2 and scheduler.max_rows >= 2
    assert all(j.done for j in jobs)
    for i, (job, prompt, s) in enumerate(zip(jobs, prompts, settings)):
        if i == 1:
            assert 0 < len(job.tokens) < s["max_tokens"]  # cancelled mid-way
            continue
        tokens, _, _ = single(model, tokenizer, prompt, **s)
        assert job.tokens == tokens, f"request {i}"


@pytest.mark.slow
def test_load_16_clients_mixed_settings_streaming_and_not(llada, served):
    """16 concurrent clients (chat and completions, streaming or not, two block lengths, two
    samplers, several budgets): all answered, each with the tokens of its single call."""
    model, tokenizer = llada
    server, url = served
    scheduler = server.service.scheduler
    joins = scheduler.joins
    words = ["sky", "sea", "tree", "a long question about the weather today", "why", "cats"]
    cases = []
    for i in range(16):
        s = dict(max_tokens=[16, 24, 40][i % 3], block_length=[8, 16][(i // 3) % 2])
        if i % 4 == 3:
            s.update(sampler="threshold", threshold=0.6)
        chat = i % 2 == 0
        content = f"{words[i % len(words)]} {i}"
        prompt = chat_prompt(tokenizer, content) if chat else content
        cases.append((chat, i % 3 == 1, content, s, single(model, tokenizer, prompt, **s)))
    results = [None] * 16

    def client(i):
        chat, stream, content, s, _ = cases[i]
        time.sleep(0.03 * i)  # arrivals spread over the first blocks of the others
        if chat:
            body = dict(s, messages=[{"role": "user", "content": content}])
            path = "/v1/chat/completions"
        else:
            body = dict(s, prompt=content)
            path = "/v1/completions"
        code, text = post(url, path, dict(body, stream=stream))
        assert code == 200
        if stream:
            events = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
            key = "delta" if chat else None
            out = "".join((c[key].get("content") or "") if key else c["text"] for c in chunks)
        else:
            choice = json.loads(text)["choices"][0]
            out = choice["message"]["content"] or "" if chat else choice["text"]
        results[i] = out

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    for i, case in enumerate(cases):
        assert results[i] == case[4][1], f"client {i}"
    assert scheduler.joins > joins, "no request joined a running batch"
    assert scheduler.max_rows >= 4


# ----------------------------------------------------------------------------------------- images


def picture(seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    size = dgfx.IMAGE_SIZE
    return Image.fromarray((rng.random((size, size, 3)) * 255).astype(np.uint8))


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("images")


@pytest.fixture(scope="module")
def gemma(fixture_dir, image_dir):
    path = build_once(fixture_dir / "server_diffusion_gemma", dgfx.CHECKPOINTS["diffusion_gemma"])
    model, processor = load(path)
    # Local image files are read from the folder --allowed-image-dir names only.
    server, url = _serve(path, "gemma-fixture", image_policy=ImagePolicy(allowed_dir=image_dir))
    yield model, processor, url, path
    shutdown(server)


DG_SETTINGS = dict(max_tokens=dgfx.CANVAS_LENGTH, max_denoising_steps=4)


def test_chat_with_images_openai_client_and_curl(gemma, image_dir):
    model, processor, url, _ = gemma
    images = [picture(1), picture(2)]
    refs = [
        single(
            model,
            processor,
            chat_prompt(processor, "describe" + processor.image_token),
            image=[im],
            **DG_SETTINGS,
        )[1]
        for im in images
    ]
    assert refs[0] != refs[1], "the image must change the output"
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    results = [None, None]

    def ask(i):
        content = [
            {"type": "text", "text": "describe"},
            {"type": "image_url", "image_url": {"url": data_url(images[i])}},
        ]
        out = client.chat.completions.create(
            model="gemma-fixture",
            messages=[{"role": "user", "content": content}],
            max_tokens=DG_SETTINGS["max_tokens"],
            seed=0,  # the references' seed (a request without one draws fresh noise)
            extra_body={"max_denoising_steps": 4},
        )
        results[i] = out.choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == refs

    # A local path under the allowed folder, through curl, streaming.
    file = image_dir / "picture.png"
    images[0].save(file)
    content = [{"type": "text", "text": "describe"}, {"type": "image_url", "image_url": str(file)}]
    body = dict(DG_SETTINGS, messages=[{"role": "user", "content": content}], stream=True, seed=0)
    out = subprocess.run(
        [
            "curl",
            "-sS",
            "-N",
            "--max-time",
            "60",
            url + "/v1/chat/completions",
            "-H",
            "Content-Type: application/json",
            "-d",
            json.dumps(body),
        ],
        capture_output=True,
        text=True,
    )
    events = [ln[6:] for ln in out.stdout.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text == refs[0]


def test_unreachable_image_urls_are_refused_politely(gemma):
    _, _, url, _ = gemma
    with socket.socket() as s:  # a port nobody listens on: what an offline fetch meets
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for image in (f"http://127.0.0.1:{port}/cat.png", "/no/such/file.png"):
        content = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": image}]
        code, text = post(
            url, "/v1/chat/completions", {"messages": [{"role": "user", "content": content}]}
        )
        assert code == 400 and "data URL" in json.loads(text)["error"]["message"]


def test_image_requests_share_a_batch_with_each_other_and_with_text(gemma):
    model, processor, _, _ = gemma
    scheduler = Scheduler(model, processor)
    prompt = chat_prompt(processor, "describe" + processor.image_token)
    text_prompt = chat_prompt(processor, "describe")
    cases = [(prompt, [picture(3)]), (text_prompt, None), (prompt, [picture(4)])]
    jobs = [scheduler.submit(Job(p, dict(DG_SETTINGS), images=im)) for p, im in cases]
    step_to_the_end(scheduler, 50)
    assert scheduler.max_rows == 3 and all(j.done for j in jobs)
    for job, (p, im) in zip(jobs, cases):
        extra = {} if im is None else {"image": im}
        assert job.tokens == single(model, processor, p, **extra, **DG_SETTINGS)[0]
