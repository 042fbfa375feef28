"""The budget guard's closing search on a nested object with integer fields (issue #40): the
embedded default model writes long numbers, so the guard must find a closing from inside one (a
comma, then the remaining required keys) and every budget ends in valid JSON."""

import json

import jsonschema
import pytest

from mlx_dllm_models import generate_diffusion, load
from mlx_dllm_models.decoding.constrained import completion
from mlx_dllm_models.default import default_checkpoint
from mlx_dllm_models.structured import compile_rows

POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
    "required": ["x", "y"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {"p": POINT},
    "required": ["p"],
    "additionalProperties": False,
}
THROUGH_REF = {
    "$defs": {"point": POINT},
    "type": "object",
    "properties": {"p": {"$ref": "#/$defs/point"}},
    "required": ["p"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def default_model():
    return load(default_checkpoint())


def test_closing_search_ends_a_number_inside_an_object(default_model):
    """From inside a nonzero integer, the greedy walk ends the number and fills the required key
    left, instead of appending digits without end."""
    model, tok = default_model
    constraint = compile_rows(
        {"json_schema": NESTED}, 1, tok, model.args.vocab_size, [tok.eos_token_id]
    )[0]
    matcher = constraint.matcher(tok.encode('{"p": {"x": 8', add_special_tokens=False))
    path = completion(matcher, 40, constraint.candidates)
    assert path is not None
    text = '{"p": {"x": 8' + tok.decode(path)
    jsonschema.validate(json.loads(text), NESTED)


@pytest.mark.parametrize("schema", [NESTED, THROUGH_REF], ids=["inline", "ref"])
@pytest.mark.parametrize("max_tokens", [64, pytest.param(128, marks=pytest.mark.slow)])
def test_nested_integers_give_valid_json_at_every_budget(default_model, schema, max_tokens):
    model, tok = default_model
    text = generate_diffusion(model, tok, "Hello", json_schema=schema, max_tokens=max_tokens)
    jsonschema.validate(json.loads(text), schema)
