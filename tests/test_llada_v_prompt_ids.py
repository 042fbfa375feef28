"""LLaDA-V's prompt ids as its reference builds them (issues #41, #43): generate_demo.py's prompt
(the llava_llada conversation: BOS, the user turn "<image>\\nPlease describe the image in
detail.", the assistant header) through `tokenizer_image_token` (LLaDA-V's llava/mm_utils.py),
with the fixture's tokenizer, which adds no BOS of its own (as LLaDA's). That function keeps the
first chunk's leading BOS and drops the first token of every chunk after an `<image>`, meant to be
that chunk's BOS: here the "\\n" after the placeholder. The released model was trained on such
ids."""

import numpy as np
import pytest
from PIL import Image

from fixtures.llada_v import build_llada_v
from helpers import checkpoint_fixtures
from llava_prompt_ids import IMAGE_TOKEN_INDEX, tokenizer_image_token, with_image_markers
from mlx_dllm_models.request import prepare

QUESTION = "<image>\nPlease describe the image in detail."


ckpt, loaded = checkpoint_fixtures("llada_v", build_llada_v)


@pytest.fixture(scope="module")
def tok(ckpt):
    """The checkpoint's tokenizer as the reference loads it (transformers' AutoTokenizer)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpt)


def picture(seed):
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((40, 70, 3)) * 255).astype(np.uint8))


def demo_prompt(tok, question=QUESTION):
    return tok.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )


def test_the_demo_prompts_ids_are_the_references(loaded, tok):
    model, processor = loaded
    prompt = demo_prompt(tok)
    want = tokenizer_image_token(prompt, tok)
    assert want[0] == tok.bos_token_id and want.count(tok.bos_token_id) == 1
    # The chunk after <image> loses its first token, the "\n": its ids start at "Please".
    rest = tok(prompt.split("<image>")[1]).input_ids
    assert rest[:1] == tok("\n").input_ids
    assert want[want.index(IMAGE_TOKEN_INDEX) + 1 :] == rest[1:]
    got = prepare(model, processor, [prompt], {}, images=[picture(0)]).ids[0]
    assert with_image_markers(model, got) == want


def test_several_images_and_a_prompt_without_bos(loaded, tok):
    model, processor = loaded
    prompt = demo_prompt(tok, "<image>\nLeft, <image> right: which?")
    got = prepare(model, processor, [prompt], {}, images=[[picture(1), picture(2)]]).ids[0]
    assert with_image_markers(model, got) == tokenizer_image_token(prompt, tok)
    # Without a leading BOS nothing is dropped (offset 0).
    plain = "Look: <image>\nWhat is it?"
    got = prepare(model, processor, [plain], {}, images=[picture(3)]).ids[0]
    want = tokenizer_image_token(plain, tok)
    assert want[want.index(IMAGE_TOKEN_INDEX) + 1 :] == tok("\nWhat is it?").input_ids
    assert with_image_markers(model, got) == want
