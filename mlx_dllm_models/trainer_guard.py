"""mlx-lm's trainer, guarded: `mlx_lm.lora` refuses to fit a masked-diffusion model with its
next-token loss.

The start-up hook (mlx_dllm_models_hook) calls guard_trainer on `mlx_lm.tuner.trainer` once that
module is executed, before `mlx_lm.lora` binds its names. Imports only the family facts it reads
(spec, the models' error class): never the loader nor a command.
"""

import functools
import inspect

from .models.common import NotAutoregressiveError
from .spec import CAUSAL_PREFIX


def refuse_next_token_training(model, loss, default_loss) -> None:
    """Stop mlx-lm's trainer from fitting a diffusion model with its next-token loss.

    `mlx_lm.lora` passes no loss, so mlx-lm's trainer uses `default_loss` (next-token
    cross-entropy): on a masked-diffusion model it would train a decoding the model never does and
    save adapters that make it worse. A caller's own loss (`mlx_dllm lora` passes `sft_loss`) goes
    through. Nemotron-Labs-Diffusion (causal-prefix layout) is also an autoregressive model, which
    mlx-lm's generate runs: the next-token loss trains that mode, so it is let through."""
    spec = getattr(model, "diffusion_spec", None)
    if loss is not default_loss or spec is None or spec.attention == CAUSAL_PREFIX:
        return
    raise NotAutoregressiveError(
        f"{spec.family} is a diffusion model: mlx_lm.lora would train it with the next-token loss "
        "of autoregressive models. Use `mlx_dllm lora` (the same flags, data and adapter files, "
        "with the masked-diffusion loss), e.g. `mlx_dllm lora --model PATH --train --data DIR`."
    )


def guard_trainer(trainer) -> None:
    """Wrap `trainer.train` and `trainer.evaluate` (mlx_lm.tuner.trainer, which mlx_lm.lora's
    training and --test call) with refuse_next_token_training. The start-up hook calls it once
    the module is executed, before `mlx_lm.lora` binds the names."""
    for name in ("train", "evaluate"):
        original = getattr(trainer, name)
        if getattr(original, "__wrapped__", None) is not None:
            continue
        signature = inspect.signature(original)
        default_loss = signature.parameters["loss"].default

        @functools.wraps(original)
        def guarded(*args, _original=original, _signature=signature, _default=default_loss, **kw):
            bound = _signature.bind(*args, **kw)
            loss = bound.arguments.get("loss", _default)
            refuse_next_token_training(bound.arguments["model"], loss, _default)
            return _original(*args, **kw)

        setattr(trainer, name, guarded)
