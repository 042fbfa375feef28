"""Schedules: per-step commit quotas and block boundaries."""

from typing import List, Tuple

import mlx.core as mx


def transfer_schedule(num_masked: mx.array, steps: int) -> mx.array:
    """LLaDA's get_num_transfer_tokens, per row: spread `num_masked` (B,) over `steps` steps,
    front-loaded (the first num_masked % steps steps get one more). Returns (B, steps) int32 whose
    rows sum to num_masked exactly."""
    n = num_masked.astype(mx.int32)[:, None]
    base = n // steps
    rem = n % steps
    return (base + (mx.arange(steps)[None, :] < rem)).astype(mx.int32)


def block_ranges(
    prompt_len: int, gen_len: int, block_length: int, aligned: bool = False
) -> List[Tuple[int, int]]:
    """Block boundaries (start, stop) over the generated region [prompt_len, prompt_len + gen_len).

    aligned=False counts blocks from the prompt's end (LLaDA, Dream). aligned=True puts boundaries on
    absolute multiples of block_length, as block-causal models are trained; the first block then
    starts at the prompt's end, inside the block that holds the prompt's tail.
    """
    end = prompt_len + gen_len
    ranges = []
    start = prompt_len
    while start < end:
        stop = ((start // block_length) + 1) * block_length if aligned else start + block_length
        stop = min(stop, end)
        ranges.append((start, stop))
        start = stop
    return ranges
