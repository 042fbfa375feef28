"""One meaning per setting on every surface: the Python API (`generate_diffusion`), the CLI
(`mlx_dllm generate`) and the server (an OpenAI request) resolve a setting through the same family
reading, so they give the same text, or the same refusal with the same message.

DiffusionGemma reads `temperature` in its own terms (its spec's own_readings): a scale of its
t_max -> t_min schedule, 1 the checkpoint's own, 0 greedy denoising from the seed's noise canvas; a
top_p below 1 cannot be honoured."""

import openai
import pytest
from test_server import chat_prompt
from test_server_openai import connect, start

from fixtures import diffusion_gemma as dgfx
from mlx_dllm_models import SettingsError, generate_diffusion, load
from mlx_dllm_models.cli import main as cli_main
from mlx_dllm_models.request import checkpoint_settings
from mlx_dllm_models.server import shutdown
from mlx_dllm_models.settings import resolve_settings

STEPS = 4
SEED = 5


@pytest.fixture(scope="module")
def gemma(fixture_dir):
    path = fixture_dir / "setting_surfaces_diffusion_gemma"
    if not (path / "config.json").exists():
        dgfx.build(path)
    model, processor = load(path)
    server, url = start(path, "gemma")
    yield path, model, processor, connect(url)
    shutdown(server)


def _api(gemma, **settings):
    _, model, processor, _ = gemma
    prompt = chat_prompt(processor, "hi")
    return generate_diffusion(
        model,
        processor,
        prompt,
        max_tokens=dgfx.CANVAS_LENGTH,
        max_denoising_steps=STEPS,
        seed=SEED,
        **settings,
    )


def _cli(gemma, capsys, *flags):
    path = gemma[0]
    args = ["generate", "--model", str(path), "--prompt", "hi", "--verbose", "false"]
    args += ["--max-tokens", str(dgfx.CANVAS_LENGTH), "--max-denoising-steps", str(STEPS)]
    assert cli_main([*args, "--seed", str(SEED), *flags]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n"), out
    return out[:-1]


def _server(gemma, **fields):
    client = gemma[3]
    out = client.chat.completions.create(
        model="gemma",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=dgfx.CANVAS_LENGTH,
        seed=SEED,
        extra_body={"max_denoising_steps": STEPS},
        **fields,
    )
    return out.choices[0].message.content


@pytest.mark.parametrize("temperature", [0.0, 0.5, 1.0])
def test_diffusion_gemma_temperature_is_one_scale_everywhere(gemma, capsys, temperature):
    _, model, _, _ = gemma
    spec = model.diffusion_spec
    schedule = resolve_settings(spec, {}, checkpoint_settings(model, spec))
    scaled = dict(t_min=schedule["t_min"] * temperature, t_max=schedule["t_max"] * temperature)
    want = _api(gemma, temperature=temperature)
    if temperature:  # the schedule the scale stands for (0 is greedy, no schedule's)
        assert _api(gemma, **scaled) == want
    assert _cli(gemma, capsys, "--temp", str(temperature)) == want
    assert _server(gemma, temperature=temperature) == want
    # top_p 1 (OpenAI clients' default) asks for nothing on every surface.
    assert _api(gemma, temperature=temperature, top_p=1) == want
    assert _server(gemma, temperature=temperature, top_p=1) == want


def test_temperature_0_is_the_greedy_limit(gemma):
    """Greedy denoising takes each step's argmax: what a small enough temperature draws, from the
    same noise canvas (the seed's), and not what the checkpoint's schedule draws."""
    greedy = _api(gemma, temperature=0)
    assert greedy == _api(gemma, temperature=1e-4)
    assert greedy != _api(gemma)


def test_a_lower_temperature_is_another_schedule(gemma):
    assert _api(gemma, temperature=1.0) == _api(gemma)
    resolved = resolve_settings(gemma[1].diffusion_spec, {"temperature": 0.25, "t_max": 2.0})
    assert resolved["t_max"] == 0.5  # the caller's own t_max, scaled


@pytest.mark.parametrize(
    "name, value, phrase",
    [
        ("temperature", -1.0, "temperature must be a number >= 0"),
        ("top_p", 0.9, "top_p=0.9 cannot be honoured"),
    ],
)
def test_diffusion_gemma_refusals_are_the_same_everywhere(gemma, capsys, name, value, phrase):
    with pytest.raises(SettingsError) as api:
        _api(gemma, **{name: value})
    message = str(api.value)
    assert phrase in message and api.value.param == name
    flag = "--temp" if name == "temperature" else "--top-p"
    with pytest.raises(SystemExit) as cli:
        _cli(gemma, capsys, flag, str(value))
    assert str(cli.value) == f"error: {message}"
    with pytest.raises(openai.BadRequestError) as server:
        _server(gemma, **{name: value})
    assert server.value.body["message"] == message and server.value.param == name
