"""The row type of the settings table, and what the families' rows share.

A family declares its own rows in its model file (`models/<family>.py`: the `SETTINGS` it adds,
the `UNUSED_SETTINGS` of the shared vocabulary it has no use for) and hands them to its
DiffusionSpec; settings.SETTINGS is the shared rows and the rows of every registered family,
collected from those declarations. A row holds no default of a family: a family's defaults live in
its spec (DiffusionSpec.defaults).
"""

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Tuple

from .validators import cli_bool, number, positive_int, true_or_false


@dataclass(frozen=True)
class Setting:
    name: str
    # A shared setting's package default (None: unset, or the family spec's). A family setting's
    # row holds None: a family's defaults live in its spec (DiffusionSpec.defaults) only.
    default: Any
    help: str  # CLI help
    cli_type: Callable[[str], Any]  # argparse type of the CLI flag
    check: Optional[Callable[[Any], Optional[str]]] = None
    # Families whose decoders read it; empty for a shared setting of every family. Computed by
    # settings.SETTINGS from the families that declare the row, never written in a row.
    families: Tuple[str, ...] = ()
    # Samplers it acts with; empty for any. Passing it with another sampler is an error.
    samplers: Tuple[str, ...] = ()
    # Values of a family's `mode` setting it acts in (for families that have one); empty for any.
    modes: Tuple[str, ...] = ()
    # Another setting it only acts with (e.g. max_post_steps needs editing_threshold).
    requires: Optional[str] = None
    # Families whose decoder has no use for this shared setting -> why, and what to set instead.
    # Computed by settings.SETTINGS from the families' UNUSED_SETTINGS (their specs' unused_settings).
    unused: Mapping[str, str] = field(default_factory=dict)
    # A token id: checked against the family's vocabulary (DiffusionSpec.vocab_size) and mask id.
    token_id: bool = False


@dataclass(frozen=True)
class Relation:
    """Two settings that must agree: `holds(first_value, second_value)`, else `message` formatted
    with the resolved settings. A family lists its own (DiffusionSpec.relations)."""

    first: str
    second: str
    holds: Callable[[Any, Any], bool]
    message: str


# The values of a `mode` setting in which the samplers act (Nemotron's diffusion mode, not its
# self-speculation).
DIFFUSION_MODE = ("diffusion",)


def _d3llm(name, what, check=number(0, 1), cli_type=float):
    """A setting of the d3llm sampler (d3LLM's generate_multi_block)."""
    return Setting(name, None, f"d3LLM: {what}", cli_type, check, samplers=("d3llm",))


# The d3llm sampler's rows, declared by every family that lists the sampler.
D3LLM_SETTINGS: Tuple[Setting, ...] = (
    _d3llm("block_size", "positions per block of its pipeline", positive_int, int),
    _d3llm(
        "block_add_threshold",
        "open a block at this share of the last decoded",
        number(0, 1, low_open=True),
    ),
    _d3llm("decoded_token_threshold", "fully active once the block before is this share decoded"),
    _d3llm("early_stop", "positions after a decoded EOS become EOS", true_or_false, cli_bool),
)

# d3LLM's recipe for its distilled checkpoints (chat/chat_d3llm_llada.py, chat_d3llm_dream.py:
# generate_multi_block(max_new_tokens=256, temperature=0, threshold=0.5, block_size=32,
# block_add_threshold=0.1, decoded_token_threshold=0.95, early_stop=True)): the same for every
# family that lists the sampler. Its whole canvas is the engine's one block.
D3LLM_DEFAULTS: Mapping[str, Any] = {
    "block_length": None,
    "max_tokens": 256,
    "block_size": 32,
    "threshold": 0.5,
    "block_add_threshold": 0.1,
    "decoded_token_threshold": 0.95,
    "early_stop": True,
    "temperature": 0.0,
}
