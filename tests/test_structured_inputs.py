"""Structured output (issue #31): its inputs. Bad constraints, and decoders or settings that cannot
honour one, are one-line SettingsErrors; the CLI's --json-schema, --regex and --lark flags; the
tokenizer forms llguidance compiles from."""

import json
import re

import jsonschema
import pytest

from helpers import run_cli
from mlx_dllm_models.cli import main
from mlx_dllm_models.settings import SettingsError
from structured_checks import models_fixture, run

models = models_fixture()

# ------------------------------------------------------------------------------------ refusals


def test_bad_constraints_are_one_line_errors(models):
    model, tok = models("llada")
    cases = [
        (dict(regex="a(b"), r"regex of prompt 0 cannot be compiled: .*unclosed|regex parse"),
        (dict(json_schema={"type": "bogus"}), r"json_schema of prompt 0 cannot be compiled"),
        (dict(json_schema="{not json"), r"json_schema is not valid JSON"),
        (dict(json_schema=[1, 2]), r"json_schema has 2 entries for 1 prompts"),
        (dict(json_schema=5), r"json_schema must be a JSON schema"),
        (dict(regex="a", lark='start: "a"'), r"prompt 0 has both regex and lark"),
        (dict(lark="start: ???"), r"lark of prompt 0 cannot be compiled"),
        (dict(regex=""), r"regex must be a non-empty string"),
    ]
    for kw, message in cases:
        with pytest.raises(SettingsError, match=message) as e:
            run(model, tok, "Hello", max_tokens=8, **kw)
        assert "\n" not in str(e.value), str(e.value)


def test_a_decoder_without_constraints_is_refused(models, monkeypatch):
    """registry.check_constraints refuses a decoder that does not declare `takes_constraints`
    (every decoder now does; this is the path a new one takes): a one-line error, before any
    forward."""
    from mlx_dllm_models.engine.wedlm import WeDLMDecoder

    model, tok = models("wedlm")
    monkeypatch.setattr(WeDLMDecoder, "takes_constraints", False)
    with pytest.raises(SettingsError, match="not supported by the wedlm family.*drop the") as e:
        run(model, tok, "Hello", regex="[a-c]", max_tokens=8)
    assert "\n" not in str(e.value)


def test_the_thinking_budget_is_refused_with_a_constraint(models):
    model, tok = models("nemotron")
    with pytest.raises(SettingsError, match="thinking budget"):
        run(
            model,
            tok,
            "Hello",
            regex="[a-c]",
            max_tokens=8,
            max_thinking_tokens=2,
            end_think_token_id=5,
        )


def test_masks_inside_the_prompt_are_refused_with_a_constraint(models):
    model, tok = models("llada")
    mask = model.diffusion_spec.mask_token_id
    prompt = tok.encode("Hello") + [mask, mask] + tok.encode(" there")
    with pytest.raises(SettingsError, match="mask tokens inside a prompt"):
        run(model, tok, prompt, regex="[a-c]", max_tokens=8)


# ------------------------------------------------------------------------------------------ CLI


@pytest.mark.slow
def test_cli_flags(tmp_path, capsys):
    """One fresh process (what a user runs), the other flags through the same entry point in
    this one."""
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"answer": {"type": "integer"}}}))
    out = run_cli("generate", "--json-schema", str(schema), "--verbose", "false")
    assert out.returncode == 0, out.stderr
    jsonschema.validate(json.loads(out.stdout), json.loads(schema.read_text()))

    def generate(*args):
        assert main(["generate", *args, "--verbose", "false"]) == 0
        return capsys.readouterr().out

    assert re.fullmatch("[0-9]{3}\n", generate("--regex", "[0-9]{3}", "--temp", "0"))
    grammar = tmp_path / "g.lark"
    grammar.write_text('start: "yes" | "no"\n')
    assert generate("--lark", str(grammar)).strip() in ("yes", "no")
    out = json.loads(generate("--json-schema", '{"type": "array", "maxItems": 2}'))
    jsonschema.validate(out, {"type": "array", "maxItems": 2})
    with pytest.raises(SystemExit, match="error: --json-schema .*missing.json"):
        main(["generate", "--json-schema", str(tmp_path / "missing.json")])
    with pytest.raises(SystemExit, match="regex of prompt 0 cannot be compiled"):
        main(["generate", "--regex", "a(b"])


def test_tokenizer_forms(models):
    """mlx-lm's TokenizerWrapper, the Hugging Face tokenizer it holds, and the bare `tokenizers`
    object all compile, to one llguidance tokenizer per underlying tokenizer."""
    from mlx_dllm_models.structured import compile_rows

    model, tok = models("llada")
    forms = [tok, tok._tokenizer, tok._tokenizer._tokenizer]
    out = [compile_rows(dict(regex="[ab]"), 1, f, 320, [301])[0] for f in forms]
    assert out[0].tokenizer is out[1].tokenizer
    m = out[2].matcher()
    assert m.try_consume_tokens([ord("a")]) == 1 and m.is_accepting()
    with pytest.raises(SettingsError, match="fast .*tokenizer"):
        compile_rows(dict(regex="[ab]"), 1, object(), 320, [301])
