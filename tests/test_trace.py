"""The decoding trace (`trace=` / `mlx_dllm generate --trace`): for every family the page embeds
the run's steps, tokens and forwards, the SVG still parses; self-speculation, re-masking and an
image in the prompt show as such; the page replays in a real headless browser."""

import math
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fixtures import all_checkpoints, build_once
from mlx_dllm_models import load, stream_generate_diffusion
from mlx_dllm_models.default import DEFAULT_PROMPT, default_checkpoint
from mlx_dllm_models.trace import KINDS, embedded_data

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = dict(max_tokens=8)
SVG = "{http://www.w3.org/2000/svg}"


def traced(path, out: Path, prompt="hi", **settings):
    """(responses, the page's record) of one traced run of the checkpoint at `path`."""
    model, tok = load(str(path))
    responses = list(
        stream_generate_diffusion(model, tok, prompt, trace=out, **{**SETTINGS, **settings})
    )
    return responses, embedded_data(out.read_text(encoding="utf-8"))


def check_record(responses, data, svg: Path):
    """What every trace holds: the run's tokens and forwards, steps in order, a canvas whose
    decoded start is the returned tokens, and an SVG that parses with one cell a position."""
    tokens = [t for r in responses for t in r.tokens]
    assert data["tokens"] == tokens
    assert data["nfe"] == responses[-1].nfe
    steps = data["steps"]
    assert steps, "no step recorded"
    nfes = [s["nfe"] for s in steps]
    assert nfes == sorted(nfes) and 0 < nfes[-1] <= data["nfe"]
    for s in steps:
        assert len(s["ids"]) == len(s["kind"]) == len(s["conf"])
        assert all(0 <= k < len(KINDS) for k in s["kind"])
        assert all(c is None or (0.0 <= c <= 1.0 + 1e-6) for c in s["conf"])
    final = steps[-1]
    assert final["ids"][: len(tokens)] == tokens
    assert all(KINDS[k] != "masked" for k in final["kind"][: len(tokens)])
    assert data["text"] == "".join(r.text for r in responses)
    assert all(str(t) in data["vocab"] for t in tokens)
    root = ET.parse(svg).getroot()
    assert root.tag == SVG + "svg"
    cells = root.findall(SVG + "g")
    assert len(cells) == len(data["order"]) == len(final["ids"])
    committed = [o for o in data["order"] if o >= 0]
    assert committed and max(committed) < len(steps)


@pytest.mark.parametrize("name", sorted(all_checkpoints()))
def test_trace_of_every_family(name, fixture_dir, tmp_path):
    path = build_once(fixture_dir / name, all_checkpoints()[name])
    out = tmp_path / "trace.html"
    responses, data = traced(path, out)
    check_record(responses, data, out.with_suffix(".svg"))
    html = out.read_text(encoding="utf-8")
    # Self-contained: nothing is fetched.
    assert "http://" not in html.replace('"http://www.w3.org', "") and "https://" not in html
    assert "<script src" not in html and "<link" not in html


@pytest.mark.parametrize(
    "name, settings",
    [("llada", {}), ("diffusion_gemma", {}), ("wedlm", {}), ("nemotron", {"mode": "self_spec"})],
)
def test_the_decoders_report_the_confidence_they_commit_with(name, settings, fixture_dir, tmp_path):
    """Masked, canvas, window decoding and self-speculation: every position a step commits has
    the confidence that step gave it."""
    path = build_once(fixture_dir / name, all_checkpoints()[name])
    responses, data = traced(path, tmp_path / "trace.html", **settings)
    news = 0
    for s in data["steps"]:
        fresh = [p for p, k in enumerate(s["kind"]) if KINDS[k] in ("new", "edited")]
        news += len(fresh)
        assert all(s["conf"][p] is not None for p in fresh), s
    assert news > 0


def test_step_events_carry_confidence_only_when_asked(fixture_dir):
    from mlx_dllm_models.engine import StepEvent
    from mlx_dllm_models.generate import stream_events

    model, tok = load(str(build_once(fixture_dir / "llada", all_checkpoints()["llada"])))
    for asked in (False, True):
        _, ids, decoder = stream_events(model, tok, ["hi"], max_tokens=8)
        decoder.step_confidence = asked
        steps = [e for e in decoder.run(ids) if isinstance(e, StepEvent)]
        assert steps and all((e.confidence is not None) == asked for e in steps)
        if asked:
            e = steps[0]
            assert e.confidence.shape == e.generated.shape
            values = np.array(e.confidence)
            lo, hi = e.block
            assert np.isfinite(values[:, lo:hi]).all() and not np.isfinite(values[:, hi:]).any()


def test_a_masked_decoder_commits_within_its_block(fixture_dir, tmp_path):
    path = build_once(fixture_dir / "llada", all_checkpoints()["llada"])
    out = tmp_path / "llada.html"
    responses, data = traced(path, out, block_length=4, steps=4)
    # Two blocks, one step a block's quarter: each step's block is where its new tokens are.
    blocks = [tuple(s["block"]) for s in data["steps"]]
    assert blocks[0] == (0, 4) and blocks[-1] == (4, 8)
    for s in data["steps"]:
        fresh = [p for p, k in enumerate(s["kind"]) if KINDS[k] == "new"]
        assert all(s["block"][0] <= p < s["block"][1] for p in fresh)


def test_self_speculation_records_a_step_a_round(fixture_dir, tmp_path):
    path = build_once(fixture_dir / "nemotron", all_checkpoints()["nemotron"])
    out = tmp_path / "self_spec.html"
    responses, data = traced(path, out, mode="self_spec", logprobs=1)
    check_record(responses, data, out.with_suffix(".svg"))
    assert data["title"]["decoder"] == "SelfSpeculativeDecoder"
    # Each round's step holds the tokens confirmed so far, then the positions still to come; a
    # token's confidence is its probability, which the logprobs setting reports as a log.
    sofar = []
    for s, r in zip(data["steps"], responses):
        start = len(sofar)
        sofar += r.tokens
        assert s["ids"][: len(sofar)] == sofar
        assert all(KINDS[k] == "masked" for k in s["kind"][len(sofar) :])
        for p, entry in enumerate(r.logprobs, start):
            assert s["conf"][p] == pytest.approx(math.exp(entry.logprob), abs=2e-4)


def test_re_masked_positions_show_as_such(fixture_dir, tmp_path):
    """Open-dCoder's p2 re-masks the least confident committed positions every step."""
    path = build_once(fixture_dir / "open_dcoder", all_checkpoints()["open_dcoder"])
    out = tmp_path / "p2.html"
    responses, data = traced(path, out, sampler="p2", steps=6)
    check_record(responses, data, out.with_suffix(".svg"))
    kinds = {KINDS[k] for s in data["steps"] for k in s["kind"]}
    assert "remasked" in kinds


def test_edited_positions_show_as_such(fixture_dir, tmp_path):
    """LLaDA2.1's token editing rewrites committed tokens: those steps mark them edited, with the
    confidence of the edit."""
    path = build_once(fixture_dir / "llada2_moe", all_checkpoints()["llada2_moe"])
    out = tmp_path / "edit.html"
    responses, data = traced(path, out, max_tokens=16, editing_mode="quality")
    check_record(responses, data, out.with_suffix(".svg"))
    edited = [
        (s, p) for s in data["steps"] for p, k in enumerate(s["kind"]) if KINDS[k] == "edited"
    ]
    assert edited and all(s["conf"][p] is not None for s, p in edited)


def test_the_uniform_noise_canvas_marks_unaccepted_positions(fixture_dir, tmp_path):
    path = build_once(fixture_dir / "diffusion_gemma", all_checkpoints()["diffusion_gemma"])
    out = tmp_path / "canvas.html"
    responses, data = traced(path, out, sampler="threshold")
    assert data["title"]["decoder"] == "CanvasDecoder"
    first = data["steps"][0]
    assert any(KINDS[k] == "masked" for k in first["kind"])  # not yet accepted
    assert all(KINDS[k] != "masked" for k in data["steps"][-1]["kind"])


VISION = ["diffusion_gemma", "dimple", "lavida", "lavida_dream", "llada_v", "nemotron_vlm"]


@pytest.mark.parametrize("name", VISION)
def test_images_in_the_prompt_are_placeholders(name, fixture_dir, tmp_path):
    """A prompt's image ids (past the vocabulary, or the image token) show as placeholders, one
    per run of them; the prompt's text around them stays."""
    path = build_once(fixture_dir / name, all_checkpoints()[name])
    rng = np.random.default_rng(0)
    image = Image.fromarray((rng.random((40, 70, 3)) * 255).astype(np.uint8))
    out = tmp_path / "image.html"
    model, processor = load(str(path))
    responses = list(
        stream_generate_diffusion(
            model, processor, "What is it?", image=image, trace=out, **SETTINGS
        )
    )
    data = embedded_data(out.read_text(encoding="utf-8"))
    check_record(responses, data, out.with_suffix(".svg"))
    images = [seg["image"] for seg in data["prompt"] if "image" in seg]
    assert images and all(n > 0 for n in images)
    assert "What is it?" in "".join(seg.get("text", "") for seg in data["prompt"])
    assert sum(images) < len(model_prompt_ids(model, processor, image))


def model_prompt_ids(model, processor, image):
    from mlx_dllm_models.generate import stream_events

    _, ids, _ = stream_events(model, processor, ["What is it?"], images=[image], **SETTINGS)
    return ids[0]


def test_generate_trace_flag_writes_page_and_still(fixture_dir, tmp_path, capsys):
    from mlx_dllm_models.cli import main

    path = build_once(fixture_dir / "llada", all_checkpoints()["llada"])
    out = tmp_path / "sub" / "out.html"
    argv = ["generate", "--model", str(path), "--prompt", "hi", "--max-tokens", "8"]
    code = main(argv + ["--no-live", "--trace", str(out)])
    err = capsys.readouterr().err
    assert code == 0, err
    assert out.is_file() and out.with_suffix(".svg").is_file()
    assert str(out) in err
    data = embedded_data(out.read_text(encoding="utf-8"))
    assert data["steps"] and data["nfe"] == data["steps"][-1]["nfe"]


# --------------------------------------------------------------------------- in a browser

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def browser_or_skip():
    """Playwright's sync API and the system's Chromium, or a skip that says which is missing."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install playwright: the [test] extra)")
    if not Path(CHROMIUM).is_file():
        found = shutil.which("chromium")
        if found is None:
            pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium; .ci/run does)")
        return sync_playwright, found
    return sync_playwright, CHROMIUM


@pytest.mark.slow
def test_the_page_replays_in_a_headless_browser(fixture_dir, tmp_path):
    sync_playwright, chromium = browser_or_skip()
    # The embedded default model (trained on two-digit sums): its canvas shows something to
    # read, the EOS at the end committed before the answer's digits.
    model, tok = load(default_checkpoint())
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": DEFAULT_PROMPT}], add_generation_prompt=True, tokenize=False
    )
    out = tmp_path / "trace.html"
    run = dict(max_tokens=16, block_length=16, steps=16)
    list(stream_generate_diffusion(model, tok, prompt, trace=out, **run))
    data = embedded_data(out.read_text(encoding="utf-8"))
    count = len(data["steps"])
    assert count > 2
    errors = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 900, "height": 560})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))

            def local_only(route):  # the page is self-contained: nothing else may be fetched
                if route.request.url.startswith("file:"):
                    route.continue_()
                else:
                    errors.append("fetched " + route.request.url)
                    route.abort()

            page.route("**/*", local_only)
            page.goto(out.as_uri())
            counter = page.locator("#counter")
            assert counter.inner_text().startswith(f"step {count} / {count}")
            seen = set()
            for i in (0, count // 2, count - 1):
                page.locator("#step").fill(str(i))
                text = counter.inner_text()
                assert text.startswith(f"step {i + 1} / {count}"), text
                assert f"forwards {data['steps'][i]['nfe']}" in text
                masked = page.locator("#canvas .masked").count()
                want = sum(KINDS[k] == "masked" for k in data["steps"][i]["kind"])
                assert masked == want
                seen.add(text)
            assert len(seen) == 3
            page.locator("#step").fill("0")
            page.locator("#play").click()
            page.wait_for_function(
                f"document.getElementById('counter').textContent.startsWith('step {count} /')",
                timeout=20_000,
            )
            page.wait_for_function("document.getElementById('play').textContent === 'Play'")
            # Near the end: the answer's digits coming in after the EOS padding around them.
            page.locator("#step").fill(str(max(count - 2, 0)))
            shot = tmp_path / "trace.png"
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    assert not errors, errors
    assert shot.stat().st_size > 1000
    images = ROOT / "docs" / "images"
    images.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(shot, images / "trace.png")
