"""Text-to-image through `mlx_dllm generate --image-out` and `mlx_dllm serve`'s Images API
(`/v1/images/generations`, `/v1/images/edits`) on the tiny MMaDA fixture: PNGs of the requested
size, images equal to batch_generate_image's rows with the same seeds, concurrent requests sharing
one batch on the scheduler's worker, and the refusals in OpenAI's error shape."""

import base64
import io
import threading

import numpy as np
import openai
import pytest
import requests
from openai import OpenAI
from PIL import Image

from fixtures import build_once
from fixtures.llada import build_llada
from fixtures.mmada import build_mmada
from helpers import checkpoint_fixtures, run_cli, serving
from image_checks import cli_writes_a_png
from mlx_dllm_models.images import batch_generate_image, generate_image
from mlx_dllm_models.server.image_jobs import ImageJob, ImageQueue
from mlx_dllm_models.server.scheduler import Scheduler

MODEL_ID = "mmada-images"
STEPS = 3


ckpt, loaded = checkpoint_fixtures("mmada", build_mmada)


@pytest.fixture(scope="module")
def url(ckpt):
    with serving(ckpt, MODEL_ID) as base:
        yield base


def connect(base):
    return OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


def decoded(item) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(item.b64_json)))
    assert image.format == "PNG"
    return image


def photo(seed=0, size=16):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8))


def png(image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def test_server_returns_a_png_of_the_requested_size(url):
    client = connect(url)
    answer = client.images.generate(prompt="a red cat", size="32x16", extra_body={"steps": 2})
    (item,) = answer.data
    assert decoded(item).size == (32, 16)
    assert answer.created > 0
    default = client.images.generate(prompt="a red cat", extra_body={"steps": 1})
    assert decoded(default.data[0]).size == (16, 16)  # the fixture's 4x4 tokens of 4x4 pixels


@pytest.mark.slow
def test_n_images_equal_batch_rows_with_the_same_seeds(url, loaded):
    model, tok = loaded
    answer = connect(url).images.generate(
        prompt="two birds", n=2, extra_body={"seed": 11, "steps": STEPS, "guidance_scale": 2.0}
    )
    got = [np.asarray(decoded(item).convert("RGB")) for item in answer.data]
    want = batch_generate_image(
        model, tok, ["two birds"] * 2, seed=[11, 12], steps=STEPS, guidance_scale=2.0
    )
    assert len(got) == 2
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, np.asarray(w))
    assert not np.array_equal(got[0], got[1])


@pytest.mark.slow
def test_concurrent_jobs_share_one_batch_equal_to_their_single_runs(loaded):
    model, tok = loaded
    scheduler = Scheduler(model, tok)  # stepped on this thread: the jobs are all waiting
    options = {"steps": STEPS, "width": 16, "height": 16}
    jobs = [
        ImageJob("a red cat", [3], options),
        ImageJob("the sea at dusk", [4, 5], options),
        ImageJob("a red cat", [3], dict(options, steps=STEPS + 1)),  # another batch
    ]
    for job in jobs:
        scheduler.images.add(job)
    assert scheduler.step()
    assert scheduler.images.batches == 1 and scheduler.images.rows == 3
    assert jobs[2].events.empty()
    assert scheduler.step()
    assert scheduler.images.batches == 2
    forwards = scheduler.images.forwards
    assert forwards == 2 * STEPS + 1
    for job in jobs:
        kind, images, nfe = job.events.get_nowait()
        assert kind == "images" and len(images) == len(job.seeds)
        for seed, image in zip(job.seeds, images):
            alone = generate_image(model, tok, job.prompt, seed=seed, **job.options)
            np.testing.assert_array_equal(np.asarray(image), np.asarray(alone))


@pytest.mark.slow
def test_concurrent_http_requests_equal_their_single_runs(url, loaded):
    model, tok = loaded
    prompts = ["a red cat", "a blue dog", "green hills"]
    out = {}

    def ask(i):
        answer = connect(url).images.generate(
            prompt=prompts[i], extra_body={"seed": 20 + i, "steps": STEPS}
        )
        out[i] = np.asarray(decoded(answer.data[0]).convert("RGB"))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, prompt in enumerate(prompts):
        alone = generate_image(model, tok, prompt, seed=20 + i, steps=STEPS)
        np.testing.assert_array_equal(out[i], np.asarray(alone))


@pytest.mark.slow
def test_edits_inpaint_the_masks_transparent_region(url, loaded):
    model, tok = loaded
    picture = photo()
    mask = Image.new("RGBA", (16, 16), (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), (0, 0, 8, 16))  # the left half transparent: repainted
    answer = connect(url).images.edit(
        image=("in.png", png(picture), "image/png"),
        mask=("mask.png", png(mask), "image/png"),
        prompt="a cat",
        extra_body={"seed": 2, "steps": STEPS},
    )
    got = np.asarray(decoded(answer.data[0]).convert("RGB"))
    white = np.zeros((16, 16), np.uint8)
    white[:, :8] = 255
    want = generate_image(
        model, tok, "a cat", image=picture, mask=Image.fromarray(white), seed=2, steps=STEPS
    )
    np.testing.assert_array_equal(got, np.asarray(want))
    with pytest.raises(openai.BadRequestError, match="mask is required"):
        connect(url).images.edit(image=("in.png", png(picture), "image/png"), prompt="a cat")


@pytest.mark.parametrize(
    "fields, param, message",
    [
        ({"response_format": "url"}, "response_format", "keeps no files"),
        ({"size": "17x16"}, "size", "multiples of 4"),
        ({"size": "big"}, "size", "WIDTHxHEIGHT"),
        ({"n": 0}, "n", "between 1 and 8"),
        ({"n": 9}, "n", "between 1 and 8"),
        ({"quality": "hd"}, "quality", "not supported"),
    ],
)
def test_bad_requests_are_refused_in_openais_shape(url, fields, param, message):
    reply = requests.post(url + "/v1/images/generations", json={"prompt": "a cat", **fields})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == param and message in error["message"]
    assert error["type"] == "invalid_request_error"


def test_bad_option_is_a_400_from_the_worker(url):
    reply = requests.post(url + "/v1/images/generations", json={"prompt": "a cat", "steps": 0})
    assert reply.status_code == 400
    assert "steps must be a positive integer" in reply.json()["error"]["message"]


def test_text_chat_keeps_working_and_metrics_count_images(url):
    client = connect(url)
    chat = client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert chat.choices[0].message.content is not None
    before = forwards(requests.get(url + "/metrics").text)
    client.images.generate(prompt="a cat", extra_body={"steps": 2})
    metrics = requests.get(url + "/metrics").text
    line = 'mlx_dllm_requests_total{endpoint="/v1/images/generations",status="200"}'
    assert line in metrics
    assert forwards(metrics) == before + 2  # one forward a step (the guidance rows share it)


def forwards(metrics: str) -> int:
    (line,) = [x for x in metrics.splitlines() if x.startswith("mlx_dllm_forwards_total ")]
    return int(float(line.split()[1]))


def test_text_only_model_cannot_generate_images(fixture_dir):
    path = build_once(fixture_dir / "images_serving_llada", build_llada)
    with serving(path, "llada") as base:
        with pytest.raises(openai.BadRequestError, match="cannot generate images"):
            connect(base).images.generate(prompt="a cat")


@pytest.mark.slow
def test_cli_writes_a_png_of_the_requested_size(ckpt, tmp_path):
    cli_writes_a_png(ckpt, tmp_path / "out.png", "--trace", str(tmp_path / "steps.html"))
    page = (tmp_path / "steps.html").read_text()
    assert page.count("data:image/png;base64,") == 2 and "step 2/2" in page
    inpaint = tmp_path / "inpainted.png"
    mask = tmp_path / "mask.png"
    photo_path = tmp_path / "in.png"
    photo().save(photo_path)
    Image.fromarray(np.full((16, 16), 255, np.uint8)).save(mask)
    done = run_cli(
        "generate",
        "--model",
        str(ckpt),
        "--prompt",
        "a cat",
        "--image-out",
        str(inpaint),
        "--image",
        str(photo_path),
        "--mask",
        str(mask),
        "--steps",
        "1",
    )
    assert done.returncode == 0, done.stderr
    assert Image.open(inpaint).size == (16, 16)


@pytest.mark.slow
def test_cli_refusals(ckpt, fixture_dir, tmp_path):
    out = str(tmp_path / "x.png")
    done = run_cli("generate", "--model", str(ckpt), "--image-out", out, "--suffix", "x")
    assert done.returncode != 0 and "--suffix" in done.stderr and "--image-out" in done.stderr
    done = run_cli("generate", "--model", str(ckpt), "--mask", out)
    assert done.returncode != 0 and "--mask" in done.stderr
    done = run_cli("generate", "--image-out", out, "--prompt", "x", "--block-length", "4")
    assert done.returncode != 0 and "--block-length is a text-decoding setting" in done.stderr
    llada = build_once(fixture_dir / "images_serving_llada", build_llada)
    done = run_cli("generate", "--model", str(llada), "--prompt", "x", "--image-out", out)
    assert done.returncode == 1
    assert "cannot generate images" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_image_batches_take_turns_with_waiting_text_runs():
    queue = ImageQueue(object(), None)  # a model without image tokens: each batch is refused
    first, second = (ImageJob("a cat", [0], {"steps": s}) for s in (1, 2))
    queue.add(first)
    queue.add(second)
    queue.run_ready(text_waiting=True)
    assert first.events.get_nowait()[:2] == (
        "error",
        "object cannot generate images: it writes no image tokens (MMaDA does)",
    )
    queue.run_ready(text_waiting=True)  # the text runs' turn
    assert second.events.empty() and queue.waiting == [second]
    queue.run_ready(text_waiting=True)
    assert second.events.get_nowait()[2] == 400


def test_a_sharded_server_refuses_images_and_loads_no_vq_model(loaded):
    model, tok = loaded
    queue = ImageQueue(model, tok, sharded=True)
    assert queue.vq is None and "sharded server generates no images" in queue.refusal
    assert ImageQueue(model, tok).vq is not None
