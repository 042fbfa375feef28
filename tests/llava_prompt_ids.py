"""LLaVA's prompt ids as its reference code builds them (LLaDA-V's and LaViDa's llava/mm_utils.py):
the image placeholder's id, `tokenizer_image_token`, and the package's ids read the same way."""

IMAGE_TOKEN_INDEX = -200  # llava/constants.py


def tokenizer_image_token(prompt, tokenizer):
    """mm_utils.tokenizer_image_token, written again from its description: each chunk between
    `<image>`s encoded by `tokenizer(chunk).input_ids`; offset 1 when the first chunk starts with
    BOS (kept once); every chunk then contributes its ids from `offset` on, separated by one
    IMAGE_TOKEN_INDEX."""
    chunks = [tokenizer(chunk).input_ids for chunk in prompt.split("<image>")]
    bos = tokenizer.bos_token_id
    offset = 1 if chunks and chunks[0] and chunks[0][0] == bos else 0
    out = [bos] if offset else []
    for i, chunk in enumerate(chunks):
        if i:
            out.append(IMAGE_TOKEN_INDEX)
        out += chunk[offset:]
    return out


def with_image_markers(model, ids):
    """`ids` with each run of image feature ids as one IMAGE_TOKEN_INDEX."""
    out = []
    for t in ids:
        if model.is_image_id(t):
            if not out or out[-1] != IMAGE_TOKEN_INDEX:
                out.append(IMAGE_TOKEN_INDEX)
        else:
            out.append(t)
    return out
