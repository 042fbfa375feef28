"""What an OpenAI request body may hold, and how the server reads it: the fields the handler reads
itself, those it accepts and ignores (as mlx_lm.server does) and those it refuses unless neutral;
OpenAI's error objects; whether a request draws noise (and so gets a fresh seed when it names
none).
"""

from ..request import Request

# Body fields of the OpenAI API that the handler reads itself; every other field is a setting.
REQUEST_FIELDS = {
    "model",
    "messages",
    "prompt",
    "stream",
    "stream_options",
    "stop",
    "max_tokens",
    "max_completion_tokens",
    "chat_template_kwargs",
    "role_mapping",
    "n",
    "logprobs",  # these two: logprobs.read_fields
    "top_logprobs",
    "response_format",  # read_response_format
}
# Fields OpenAI clients send that change nothing here: accepted and ignored, as mlx_lm.server does.
IGNORED_FIELDS = {
    "user",
    "store",
    "metadata",
    "service_tier",
    "reasoning_effort",
    "parallel_tool_calls",
}
# Fields mlx-lm's server (or OpenAI) accepts that diffusion decoding has no use for: refused when
# given a value that would change anything, rather than ignored.
UNSUPPORTED_FIELDS = {
    "logit_bias": "the diffusion samplers take no logit bias",
    "min_p": "the diffusion samplers take temperature, top_p and top_k",
    "repetition_penalty": "the diffusion samplers take no repetition penalty",
    "presence_penalty": "the diffusion samplers take no presence penalty",
    "frequency_penalty": "the diffusion samplers take no frequency penalty",
    "xtc_probability": "the diffusion samplers take no XTC sampling",
    "tools": "tool calls are not parsed by this server",
    "draft_model": "diffusion models need no draft model",
    "num_draft_tokens": "diffusion models need no draft model",
    "adapters": "adapters are chosen when the server starts (--adapter-path)",
    "tool_choice": "tool calls are not parsed by this server",
    # OpenAI's legacy completion fields.
    "echo": "the answer never repeats the prompt (send echo: false or leave it out)",
    "best_of": "one completion is decoded per request (send best_of: 1 or leave it out)",
    "suffix": "text after the completion is not taken (leave suffix out)",
}
# Neutral values beyond `neutral`'s defaults (None, false, 0, empty).
NEUTRAL_VALUES = {
    "repetition_penalty": (0, 1),
    "tool_choice": ("none", "auto"),
    "best_of": (1,),
}


class RequestError(ValueError):
    """A bad request: answered with `status` and the message (the body field at fault in `param`,
    an OpenAI error code in `code`), and the server keeps serving."""

    def __init__(self, message, status=400, param=None, code=None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def error_body(message: str, status: int = 400, param=None, code=None) -> dict:
    """OpenAI's error object (its clients' exception `.message` carries `message`)."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def read_response_format(body: dict, overrides: dict) -> None:
    """OpenAI's `response_format` as the json_schema setting (structured.py): "json_object" any
    JSON object, "json_schema" its `json_schema.schema` (its `name` and `strict` change nothing:
    the output always follows the schema); "text" or none, nothing. A request may also send
    `json_schema`, `regex` or `lark` as fields of their own, as any setting."""
    fmt = body.get("response_format")
    if fmt is None:
        return
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return
    if kind == "json_object":
        overrides["json_schema"] = {"type": "object"}
        return
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise RequestError(
                'response_format json_schema needs {"json_schema": {"name": ..., "schema": '
                "{...}}}, with the schema an object",
                param="response_format",
            )
        overrides["json_schema"] = spec.get("schema", {"type": "object"})
        return
    raise RequestError(
        f"response_format type {kind!r} is not supported; send text, json_object or json_schema",
        param="response_format",
    )


def neutral(name, value) -> bool:
    """A value of an unsupported field that asks for nothing (what OpenAI clients send by
    default)."""
    if value is None or value is False:
        return True
    if isinstance(value, bool):
        return False
    return value in NEUTRAL_VALUES.get(name, (0, "", [], {}))


def draws_noise(request: Request) -> bool:
    """Whether a request's decoding draws from its seed's stream (else the seed changes nothing,
    and requests that name none keep sharing a batch): sampling at temperature > 0, LLaDA's random
    remasking, Dream's origin transfers or ranking temperature, and DiffusionGemma's canvases,
    which start from noise."""
    s = request.settings
    dream = s.sampler == "dream" and (s.alg == "origin" or bool(s.alg_temp))
    canvas = request.spec.decoder == "canvas"
    return canvas or dream or s.temperature > 0 or s.sampler == "random"
