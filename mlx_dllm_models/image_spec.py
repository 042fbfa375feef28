"""What a family that writes images as discrete tokens declares to text-to-image decoding.

The image counterpart of spec.DiffusionSpec: the token layout of a text-to-image prompt, where
the image tokens sit in the vocabulary, and the reference's defaults (their one home). A model
that can generate images exposes one as `model.image_spec`; images.py reads nothing else of it.
"""

from dataclasses import dataclass
from typing import Mapping, Tuple

# The image tokenizer's folder inside a checkpoint (its own config.json and weights): conversion
# copies it, images.py loads it.
VQ_SUBFOLDER = "vq_model"


@dataclass(frozen=True)
class ImageSpec:
    family: str
    mask_token_id: int
    # Image token k is vocabulary id `len(tokenizer) + num_new_special_tokens + k` (the reference
    # offsets by the text tokenizer's length, not by the config's llm_vocab_size).
    codebook_size: int
    num_new_special_tokens: int
    # Rows of the model's embedding and head (the image tokens must fall below).
    vocab_rows: int
    # The number of image tokens the model was trained on (a square grid).
    num_vq_tokens: int
    # Special tokens by name, with the ids the reference hard-codes when the tokenizer does not
    # name them (MMaDA's reserved_token_mapping over LLaDA's <|reserved_token_N|>).
    special_tokens: Mapping[str, int]
    # The reference's defaults (inference_t2i.py with the README's command and the demo yaml).
    max_text_len: int
    guidance_scale: float
    steps: int
    temperature: float
    vq_subfolder: str = VQ_SUBFOLDER
    prompt_tokens: Tuple[str, ...] = ("<|t2i|>", "<|soi|>", "<|eoi|>", "[iPAD]")
