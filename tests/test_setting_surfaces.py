"""One meaning per setting on every surface: the Python API (`generate_diffusion`), the CLI
(`mlx_dllm generate`) and the server (an OpenAI request) resolve a setting through the same family
reading, so they give the same text, or the same refusal with the same message.

DiffusionGemma reads `temperature` in its own terms (its spec's own_readings): a scale of its
t_max -> t_min schedule, 1 the checkpoint's own, 0 greedy denoising from the seed's noise canvas; a
top_p below 1 cannot be honoured."""

import importlib
import json

import openai
import pytest

from family_cases import CONFIGS, case_spec
from fixtures import all_checkpoints, build_once
from fixtures import diffusion_gemma as dgfx
from fixtures.llada import CHECKPOINTS as LLADA_CHECKPOINTS
from mlx_dllm_models import SettingsError, generate_diffusion, load
from mlx_dllm_models.cli import generate_parser
from mlx_dllm_models.cli import main as cli_main
from mlx_dllm_models.cli_common import chosen_settings
from mlx_dllm_models.registry import MODEL_TYPES
from mlx_dllm_models.request import checkpoint_settings
from mlx_dllm_models.server import shutdown
from mlx_dllm_models.server.api import Service
from mlx_dllm_models.settings import resolve_settings
from mlx_dllm_models.settings_index import choices, flag_rows
from server_checks import chat_prompt, connect, start

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
    scaled = dict(t_min=schedule.t_min * temperature, t_max=schedule.t_max * temperature)
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
    assert resolved.t_max == 0.5  # the caller's own t_max, scaled


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


# ------------------------------------------------------------------------------ the table
# Every setting each family accepts (its spec's rows and the shared rows), at values the flag's
# kind takes (valid and invalid ones), through each surface's own reading, then the one resolution
# every surface calls (request.prepare's resolve_settings): the same resolved settings, or the same
# refusal with the same message. `logprobs` is left out: the server reads it from OpenAI's
# `logprobs` / `top_logprobs` fields (tests/test_logprobs.py).

CANDIDATES = {
    "int": (2, 0, -1),
    "float": (0.5, 0.0, 1.5, -1.0),
    "optional float": (0.5, 1.0, 0.0, 1.5),
    "on/off": (True, False),
}


def _values(row):
    options = choices().get(row.name)
    return tuple(options) if options else CANDIDATES[row.kind]


def _outcome(read, spec, value):
    """The resolved settings a surface's reading gives, or its refusal's message."""
    try:
        return resolve_settings(spec, read(value))
    except SettingsError as e:
        return f"refused: {e}"


def _cli_reading(row):
    flag = "--" + row.name.replace("_", "-")

    def read(value):
        if row.kind == "on/off":
            args = [flag if value else "--no-" + row.name.replace("_", "-")]
        else:
            args = [flag, str(value)]
        return chosen_settings(generate_parser().parse_args(["--prompt", "hi", *args]))

    return read


def _server_reading(name):
    service = Service.__new__(Service)  # request_settings reads the server's defaults only
    service.defaults = {}
    return lambda value: service.request_settings({name: value})


def _rows(spec):
    """The flag rows of the settings a family accepts: the shared ones and its spec's own."""
    own = {row.name for row in spec.settings}
    for row in flag_rows():
        if row.name != "logprobs" and (not row.families or row.name in own):
            yield spec, row


def _same_on_every_surface(spec):
    checked = 0
    for spec, row in _rows(spec):
        for value in _values(row):
            api = _outcome(lambda v: {row.name: v}, spec, value)
            server = _outcome(_server_reading(row.name), spec, value)
            assert server == api, (row.name, value)
            try:
                cli = _outcome(_cli_reading(row), spec, value)
            except SystemExit:  # the flag's own parser refused it: so does the API
                assert isinstance(api, str), (row.name, value, api)
                continue
            assert cli == api, (row.name, value)
            checked += 1
    assert checked > 20


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_every_setting_reads_the_same_on_every_surface(case):
    _same_on_every_surface(case_spec(case))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(all_checkpoints()))
def test_every_fixture_family_reads_its_settings_the_same_on_every_surface(fixture_dir, name):
    """The table over every family's fixture (one per model type and variant), its spec built
    from its config.json as mlx-lm builds the model (no weights read)."""
    config = json.loads(
        (build_once(fixture_dir / name, all_checkpoints()[name]) / "config.json").read_text()
    )
    module = importlib.import_module(f"mlx_dllm_models.models.{MODEL_TYPES[config['model_type']]}")
    _same_on_every_surface(module.Model(module.ModelArgs.from_dict(config)).diffusion_spec)


@pytest.fixture(scope="module")
def llada(fixture_dir):
    path = build_once(fixture_dir / "setting_surfaces_llada", LLADA_CHECKPOINTS["llada"])
    model, tokenizer = load(path)
    server, url = start(path, "llada")
    yield path, model, tokenizer, connect(url)
    shutdown(server)


def _flags(settings):
    return [f for name, v in settings.items() for f in ("--" + name.replace("_", "-"), str(v))]


@pytest.mark.parametrize(
    "settings",
    [dict(sampler="threshold", threshold=0.7), dict(top_p=1.0, top_k=0), dict(steps=4)],
)
def test_a_llada_request_reads_the_same_on_every_surface(llada, capsys, settings):
    """One real request per surface on a second family: the same text."""
    path, model, tokenizer, client = llada
    want = generate_diffusion(
        model, tokenizer, chat_prompt(tokenizer, "hi"), max_tokens=16, **settings
    )
    assert want.strip()
    args = ["generate", "--model", str(path), "--prompt", "hi", "--verbose", "false"]
    assert cli_main([*args, "--max-tokens", "16", *_flags(settings)]) == 0
    assert capsys.readouterr().out == want + "\n"
    out = client.chat.completions.create(
        model="llada",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=16,
        extra_body=settings,
    )
    assert out.choices[0].message.content == want
