"""dllm's A2D Qwen2 (model_type "a2d-qwen2"): a Qwen2 / Qwen2.5 body without its causal mask, the
checkpoints dllm converts from Qwen2.5 (dllm-hub/Qwen2.5-Coder-0.5B-Instruct-diffusion-mdlm-v0.1 and
-bd3lm-v0.1, examples/a2d/README.md).

`dllm/pipelines/a2d/models/qwen2/modeling_qwen2.py` is the Qwen3 file's change on transformers'
Qwen2 (q/k/v biases, no q/k norms): the padding-only mask instead of the causal one. Everything else,
decoding included (samplers "mdlm" and "bd3lm"), is models.a2d_qwen3's: one family, "a2d".
"""

from dataclasses import dataclass
from typing import Optional, Sequence, Union

from mlx_lm.models import qwen2

from . import a2d_qwen3
from .a2d_qwen3 import QWEN3_EOS_TOKEN_ID, A2DBody
from .common import check_special_ids

# dllm's A2D settings family, rows and samplers.
FAMILY = a2d_qwen3.FAMILY
SETTINGS = a2d_qwen3.SETTINGS
SAMPLERS = a2d_qwen3.SAMPLERS

# dllm's get_tokenizer adds "<|mask|>" to Qwen2.5's tokenizer: the next id after its last added
# token (<|file_sep|>, 151664).
A2D_QWEN2_MASK_TOKEN_ID = 151665


@dataclass
class ModelArgs(qwen2.ModelArgs):
    mask_token_id: Optional[int] = None
    eos_token_id: Optional[Union[int, Sequence[int]]] = QWEN3_EOS_TOKEN_ID  # <|im_end|> too
    pad_token_id: Optional[int] = None
    bos_token_id: Optional[int] = None

    def __post_init__(self):
        check_special_ids(self, mask_default=A2D_QWEN2_MASK_TOKEN_ID)


class Model(A2DBody, qwen2.Model):
    """A2D-Qwen3's checkpoint check and spec on mlx-lm's Qwen2 layers."""

    shard_name = "A2D-Qwen2"
