"""The `system_user_grid` prompt layout of text-to-image (Lumina-DiMOO's inference_t2i.py).

A conditional row is the tokenized `text_template` with the user's prompt in it
(`<system>Generate an image according to the text prompt.</system><user>PROMPT</user>`), then
`<answer_start> <boi>`, the h x w image tokens row by row with the newline token closing every
row (add_break_line), then `<eoi> <answer_end>`. The unconditional row is the tokenized
`uncond_text` followed by the same image part. The reference runs each alone; here every text
part (conditional and unconditional) is left-padded to the batch's widest, the padding masked
off, so that the rows share their forwards (RoPE sees only relative positions, so a padded row's
logits are its unpadded ones).
"""

from typing import Dict, List, Sequence, Tuple

import mlx.core as mx

from .image_spec import ImageSpec

# The image part's special tokens, by the names of the reference's config.py SPECIAL_TOKENS.
GRID_TOKENS = ("answer_start", "boi", "newline_token", "eoi", "answer_end")


def grid_part(ids: Dict[str, int], rows: int, cols: int, mask_id: int) -> Tuple[List[int], list]:
    """(the image part's ids, the positions of its image tokens within it)."""
    part = [ids["answer_start"], ids["boi"]]
    columns = []
    for _ in range(rows):
        columns.extend(range(len(part), len(part) + cols))
        part.extend([mask_id] * cols + [ids["newline_token"]])
    return part + [ids["eoi"], ids["answer_end"]], columns


def grid_rows(
    tok, spec: ImageSpec, ids: Dict[str, int], texts: Sequence[str], shape: Tuple[int, int]
):
    """(cond ids (B, L), cond pads, uncond text prefix (B, T), uncond pads, text width T, image
    columns) of the prompts, every row's image tokens masked."""
    cond = [list(tok(spec.text_template.format(t))["input_ids"]) for t in texts]
    blank = list(tok(spec.uncond_text)["input_ids"])
    width = max(len(blank), *(len(c) for c in cond))
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    part, columns = grid_part(ids, *shape, spec.mask_token_id)

    def padded(text: List[int]) -> List[int]:
        return [pad_id] * (width - len(text)) + text

    rows = mx.array([padded(c) + part for c in cond], dtype=mx.int32)
    pads = [width - len(c) for c in cond]
    uncond = mx.array([padded(blank)] * len(texts), dtype=mx.int32)
    uncond_pads = [width - len(blank)] * len(texts)
    return rows, pads, uncond, uncond_pads, width, [width + c for c in columns]
