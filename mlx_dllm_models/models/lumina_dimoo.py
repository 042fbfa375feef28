"""Lumina-DiMOO (Alpha-VLLM/Lumina-DiMOO): LLaDA 8B's body trained to write images as tokens.

Its class, `LLaDAForMultiModalGeneration` (model/modeling_xllmx_dimoo.py), subclasses
`LLaDAModelLM` and changes only the forward's padding: the weights keep LLaDA 8B's OLMo names and
its configuration class is LLaDA's `LLaDAConfig` (model_type "llada"). So a checkpoint loads as
model_type "llada" (models/llada.py), and its config.json's `architectures` naming this class is
what gives the model the image facts below (`llada.Model.image_spec`). Text decoding is LLaDA's.

The image facts, from the reference's code (no copy of the released config.json was found in the
public index; looked for `LLaDAForMultiModalGeneration` architectures):
- config.py's SPECIAL_TOKENS: mask 126336, the row-ending newline 126084, <answer_start> 126354,
  <answer_end> 126355, <boi> 126349, <eoi> 126350 (by those names, which the tokenizer does not
  carry), image token 0 at 126356;
- generate_image's codebook_size 8192 and its offset rule (the head's rows less the codebook:
  126356 when the head has 134548 rows, the id decode_vq_to_image subtracts);
- inference_t2i.py's defaults: 1024 x 1024 (a 64 x 64 grid of the 16x VQ-VAE), 64 timesteps,
  cfg_scale 4.0, temperature 1.0; utils/prompt_utils.py's generate_text_to_image_prompt
  (`<system>` ... `</system><user>PROMPT</user>`, the unconditional `<uncondition>`);
- the VQ-VAE is diffusers' VQModel in the checkpoint's `vqvae/` folder (models/vqmodel.py).
"""

from typing import Optional

from ..image_spec import ImageSpec

NAME = "lumina_dimoo"
ARCHITECTURE = "LLaDAForMultiModalGeneration"

SPECIAL_TOKENS = {
    "newline_token": 126084,
    "boi": 126349,
    "eoi": 126350,
    "uncondition": 126351,
    "answer_start": 126354,
    "answer_end": 126355,
}
CODEBOOK_SIZE = 8192
SYSTEM_PROMPT = "Generate an image according to the text prompt."
TEXT_TEMPLATE = "<system>" + SYSTEM_PROMPT + "</system><user>{}</user>"
UNCOND_TEXT = "<system>" + SYSTEM_PROMPT + "</system><user><uncondition></user>"
# utils/prompt_utils.py's generate_image_to_image_prompt for edit types "edit_*"; inference_i2i.py's
# argparse defaults (cfg_scale 2.5, cfg_img 4.0, as its README runs them) and crops of at most
# 512 x 512.
EDIT_PROMPT = (
    "Generate an image applying the following editing instruction based on the original image."
)
EDIT_DEFAULTS = {
    "edits": True,
    "edit_template": "<system>" + EDIT_PROMPT + "</system><user>{}</user>",
    "edit_uncond_text": "<system>" + EDIT_PROMPT + "</system><user><uncondition></user>",
    "edit_guidance_scale": 2.5,
    "image_guidance_scale": 4.0,
    "edit_side": 512,
}

# inference_t2i.py's argparse defaults (its README command passes the same timesteps and cfg).
IMAGE_DEFAULTS = {
    "guidance_scale": 4.0,
    "steps": 64,
    "temperature": 1.0,
    "num_vq_tokens": (1024 // 16) ** 2,
}


def is_dimoo(args) -> bool:
    archs = getattr(args, "architectures", None) or ()
    if isinstance(archs, str):
        archs = (archs,)
    return ARCHITECTURE in archs


def image_spec(args) -> Optional[ImageSpec]:
    """The image facts of a Lumina-DiMOO config (None for any other LLaDA)."""
    if not is_dimoo(args):
        return None
    rows = args.embedding_size or args.vocab_size
    if rows <= CODEBOOK_SIZE:
        raise ValueError(
            f"{NAME}: the head's {rows} rows cannot hold the {CODEBOOK_SIZE}-entry codebook"
        )
    return ImageSpec(
        family=NAME,
        mask_token_id=args.mask_token_id,
        codebook_size=CODEBOOK_SIZE,
        num_new_special_tokens=0,
        vocab_rows=rows,
        special_tokens=dict(SPECIAL_TOKENS),
        max_text_len=0,  # the text part is as long as the tokenized prompt
        vq_subfolder="vqvae",
        prompt_tokens=tuple(SPECIAL_TOKENS),
        layout="system_user_grid",
        rule="gumbel_max",
        vq_kind="vqmodel",
        image_token_offset=rows - CODEBOOK_SIZE,
        text_template=TEXT_TEMPLATE,
        uncond_text=UNCOND_TEXT,
        inpaints=False,
        **IMAGE_DEFAULTS,
        **EDIT_DEFAULTS,
    )
