"""MMaDA (Gen-Verse/MMaDA-8B-Base, MMaDA-8B-MixCoT; `model_type "mmada"`, `MMadaModelLM`).

The body is LLaDA 8B's (`MMadaModelLM` subclasses `LLaDAModelLM`: the same OLMo weight names
`model.transformer.blocks.N.*`), with its embedding and head resized to `new_vocab_size` so that
the MAGVIT-v2 codebook follows the text vocabulary. Text generation is LLaDA's (its spec and
samplers) with the defaults of MMaDA's generate.py.

Text-to-image (images.py) reads `image_spec`: the config's codebook_size, num_vq_tokens and
num_new_special_tokens (MMadaConfig's keys), the reserved ids of training/prompting_utils.py's
`reserved_token_mapping`, and inference_t2i.py's defaults as the README runs it
(guidance_scale 3.5, generation_timesteps 15, temperature 1.0, the demo yaml's max_seq_length 512).

No copy of the released config.json was found (looked for `"model_type": "mmada"`,
`MMadaModelLM` architectures and `"new_vocab_size": 134656` in the public index): the fields read
here are MMadaConfig's `allowed_keys` and LLaDA's. When `new_vocab_size` exceeds the embedding
size, the resized tables (train_mmada.py's resize_token_embeddings) have new_vocab_size rows.
"""

from dataclasses import dataclass, replace
from typing import Optional

from ..image_spec import ImageSpec
from . import llada
from .common import cached_spec

NAME = "mmada"
# Its text decodes as LLaDA's: the same settings family and rows.
FAMILY = llada.FAMILY
SETTINGS = llada.SETTINGS

# training/prompting_utils.py's reserved_token_mapping (use_reserved_token=True, as inference_t2i.py
# builds UniversalPrompting): LLaDA's tokenizer names these ids <|reserved_token_N|>.
RESERVED_TOKENS = {
    "<|soi|>": 126084,
    "<|eoi|>": 126085,
    "<|sov|>": 126086,
    "<|eov|>": 126087,
    "<|t2i|>": 126088,
    "<|mmu|>": 126089,
    "<|t2v|>": 126090,
    "<|v2v|>": 126091,
    "<|lvg|>": 126092,
    "[iPAD]": 126093,
    "<|r2i|>": 126094,
}

# Text: MMaDA's generate.py, LLaDA's decoding as its main() calls it: 128 tokens in one block of 128,
# 128 steps (one token a step), temperature 1 (Gumbel-max sampling), low-confidence remasking.
TEXT_DEFAULTS = {"max_tokens": 128, "block_length": 128, "temperature": 1.0}

# inference_t2i.py run as the README says (guidance_scale=3.5 generation_timesteps=15), with
# configs/mmada_demo.yaml (max_seq_length 512; generation_temperature absent: 1.0).
IMAGE_DEFAULTS = {"guidance_scale": 3.5, "steps": 15, "temperature": 1.0, "max_text_len": 512}


@dataclass
class ModelArgs(llada.ModelArgs):
    model_type: str = NAME
    llm_vocab_size: Optional[int] = None
    new_vocab_size: Optional[int] = None
    codebook_size: int = 8192
    num_vq_tokens: int = 1024
    num_new_special_tokens: int = 0
    # Left by the training config; MMaDA's released models use no CLIP tower.
    w_clip_vit: bool = False

    def __post_init__(self):
        rows = self.embedding_size or self.vocab_size
        if self.new_vocab_size is not None and rows is not None and self.new_vocab_size > rows:
            self.embedding_size = self.new_vocab_size
        if self.w_clip_vit:
            raise ValueError(
                f"{NAME}: w_clip_vit=True (a CLIP-ViT understanding tower) is not supported"
            )
        for key in ("codebook_size", "num_vq_tokens"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"{NAME}: config.json's {key} must be a positive integer, got {value!r}"
                )
        super().__post_init__()


class Model(llada.Model):
    """LLaDA 8B's model under model_type "mmada", with the facts of its image tokens."""

    @cached_spec
    def diffusion_spec(self):
        spec = llada.Model.diffusion_spec.build(self)
        return replace(spec, defaults={**spec.defaults, **TEXT_DEFAULTS})

    @property
    def image_spec(self) -> ImageSpec:
        a = self.args
        return ImageSpec(
            family=NAME,
            mask_token_id=a.mask_token_id,
            codebook_size=a.codebook_size,
            num_new_special_tokens=a.num_new_special_tokens,
            vocab_rows=a.embedding_size or a.vocab_size,
            num_vq_tokens=a.num_vq_tokens,
            special_tokens=dict(RESERVED_TOKENS),
            **IMAGE_DEFAULTS,
        )
