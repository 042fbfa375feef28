"""What a family that writes images as discrete tokens declares to text-to-image decoding.

The image counterpart of spec.DiffusionSpec: the token layout of a text-to-image prompt, where
the image tokens sit in the vocabulary, and the reference's defaults (their one home). A model
that can generate images exposes one as `model.image_spec`; images.py reads nothing else of it.
"""

from dataclasses import dataclass
from typing import Mapping, Optional, Tuple

# The image tokenizer's folder inside a checkpoint (its own config.json and weights): conversion
# copies it, images.py loads it. MMaDA's is vq_model/ (showlab/magvitv2), Lumina-DiMOO's vqvae/
# (a diffusers VQModel).
VQ_SUBFOLDER = "vq_model"
VQ_SUBFOLDERS = (VQ_SUBFOLDER, "vqvae")

# How a prompt is laid out (images.py / image_layout.py): MMaDA's UniversalPrompting
# t2i_gen_prompt (fixed-width text, <|soi|> image <|eoi|>), or a system/user text followed by
# the answer-wrapped token grid with a newline token closing every row (Lumina-DiMOO).
LAYOUTS = ("t2i_gen_prompt", "system_user_grid")
# The step rule (engine/maskgit.py's table): MMaDA's muse step (inverse-CDF sample of every
# position, annealed temperature) or Lumina-DiMOO's gumbel-max step over the masked positions.
RULES = ("muse", "gumbel_max")
# The VQ model's kind: showlab/magvitv2 (models/magvitv2.py) or diffusers' VQModel
# (models/vqmodel.py).
VQ_KINDS = ("magvitv2", "vqmodel")


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
    layout: str = "t2i_gen_prompt"
    rule: str = "muse"
    vq_kind: str = "magvitv2"
    # A fixed id of image token 0 (Lumina-DiMOO: the head's rows less the codebook, as its
    # generate_image infers it); None: after the tokenizer's ids, as MMaDA offsets them.
    image_token_offset: Optional[int] = None
    # The text of a conditional row ({} is the user's prompt) and of an unconditional one
    # (system_user_grid's; MMaDA's rows are t2i_gen_prompt's own).
    text_template: str = "{}"
    uncond_text: str = ""
    # Whether an image and a mask may give the canvas's codes (MMaDA's inpainting).
    inpaints: bool = True
    # Whether an image alone is edited by the text (Lumina-DiMOO's image-to-image "edit" prompt),
    # with its prompt texts, its guidance (text; image: against the prompt without the image)
    # and the largest side of its input crops.
    edits: bool = False
    edit_template: str = "{}"
    edit_uncond_text: str = ""
    edit_guidance_scale: float = 0.0
    image_guidance_scale: float = 0.0
    edit_side: int = 512

    def __post_init__(self):
        for name, value, allowed in (
            ("layout", self.layout, LAYOUTS),
            ("rule", self.rule, RULES),
            ("vq_kind", self.vq_kind, VQ_KINDS),
        ):
            if value not in allowed:
                raise ValueError(f"{self.family}: image {name} {value!r} is not one of {allowed}")
