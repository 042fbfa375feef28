"""Chat prompts: the one way a conversation becomes prompt text, the tokenizer's own chat template,
with the same rules for every command (generate, chat, evaluate, the default model's task, serve).

Standard library only: the CLI imports it at start-up (through default.py).
"""

from typing import Dict, List, Mapping, Optional, Sequence


def is_processor(obj) -> bool:
    """Whether `obj` is a multimodal processor (an image processor around a text tokenizer)."""
    return hasattr(obj, "image_processor") and hasattr(obj, "tokenizer")


def text_tokenizer(tokenizer_or_processor):
    """The text tokenizer behind a processor (or the tokenizer itself)."""
    if is_processor(tokenizer_or_processor):
        return tokenizer_or_processor.tokenizer
    return tokenizer_or_processor


def has_chat_template(tokenizer) -> bool:
    """Whether the tokenizer (or a processor's) has a chat template to lay a conversation out with
    (an empty one is none)."""
    # Tokenizers without the attribute at all (a bare tokenizers.Tokenizer) have no template.
    return bool(getattr(text_tokenizer(tokenizer), "chat_template", None))


def user_turn(content: str, system_prompt: Optional[str] = None) -> List[Dict[str, str]]:
    """The messages of one question: the system prompt, when given, then the user's turn."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return messages + [{"role": "user", "content": content}]


def render_chat(
    tokenizer,
    messages: Sequence[Mapping],
    template_kwargs: Optional[Mapping] = None,
    add_generation_prompt: bool = True,
) -> str:
    """`messages` through the tokenizer's (or a processor's) chat template, as text: ending with
    the assistant's turn opened (`add_generation_prompt`), or else continuing the last message (an
    answer's prefix, lm-eval's continuations). `template_kwargs`: the template's own arguments
    (--chat-template-config, a request's chat_template_kwargs)."""
    kwargs = dict(template_kwargs or {})
    if not add_generation_prompt:
        kwargs["continue_final_message"] = True
    return text_tokenizer(tokenizer).apply_chat_template(
        list(messages), add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
    )
