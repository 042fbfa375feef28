"""The request bodies' own fields as pydantic models: the fields the HTTP side reads itself
(fields.REQUEST_FIELDS) must have their types; every other field is a decoding setting or an
OpenAI field that fields.py accepts, ignores or refuses (extra fields pass through here). A wrong
type is a 400 whose `param` names the field and whose message says what it must be."""

from typing import Any, Dict, List, Optional, Union

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr, ValidationError

from .fields import RequestError


class Body(BaseModel):
    """What both endpoints read themselves."""

    model_config = ConfigDict(extra="allow")

    stream: Optional[StrictBool] = None
    stream_options: Optional[Dict[str, Any]] = None
    stop: Union[StrictStr, List[StrictStr], None] = None
    n: Optional[StrictInt] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = None


class ChatBody(Body):
    messages: List[Any]
    role_mapping: Optional[Dict[str, Any]] = None


class CompletionBody(Body):
    prompt: Union[StrictStr, List[Any]]


# What each field must be, in the words of the error.
EXPECTED = {
    "stream": "true or false",
    "stream_options": 'an object, e.g. {"include_usage": true}',
    "stop": "a string or a list of strings",
    "n": "1 (one completion per request)",
    "chat_template_kwargs": "an object",
    "role_mapping": "an object",
    "messages": "a list of messages",
    "prompt": "a text or a list of token ids",
}
MISSING = {
    "messages": "a chat completion request needs messages (a list)",
    "prompt": "a completion request needs a prompt",
}


def read_body_fields(body: dict, chat: bool) -> None:
    """Check the types of the fields a request body's endpoint reads (a RequestError naming the
    first wrong one)."""
    try:
        (ChatBody if chat else CompletionBody).model_validate(body)
    except ValidationError as e:
        error = e.errors()[0]
        name = str(error["loc"][0])
        if error["type"] == "missing":
            raise RequestError(MISSING.get(name, f"{name} is required"), param=name)
        value = body.get(name)
        raise RequestError(
            f"{name} must be {EXPECTED.get(name, 'of another type')}, got {_short(value)}",
            param=name,
        )


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "..."
