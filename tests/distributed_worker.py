"""One rank of tests/test_distributed.py, launched by `mlx.launch` (or with a single process for
the baseline): for each checkpoint of the plan, load it (sharded over the launch's group when
there is one), record the logits of one forward, the tokens of a greedy generation and the memory
the load took, and write them to OUT/rank<r>.npz; then run `mlx_dllm generate` with the plan's
`cli` arguments, each rank's standard output in OUT/cli_rank<r>.txt, and `mlx_dllm serve` (which
refuses several ranks), its error in OUT/serve_rank<r>.txt.

    python tests/distributed_worker.py PLAN.json OUT
"""

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_dllm_models import batch_generate_diffusion, load
from mlx_dllm_models.cli import main
from mlx_dllm_models.distributed import launch_group, share


def run(plan: dict, out: Path) -> None:
    group = launch_group()
    rank = 0 if group is None else group.rank()
    results = {}
    for name, entry in plan["checkpoints"].items():
        mx.synchronize()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        model, tokenizer = load(entry["path"], group=group)
        mx.eval(model.parameters())
        results[f"{name}/load_peak"] = np.array(mx.get_peak_memory() - before)
        results[f"{name}/weights"] = np.array(mx.get_active_memory() - before)
        if entry.get("memory_only"):
            del model, tokenizer
            continue
        ids = mx.array([entry["prompt"]])
        logits = model(ids)
        results[f"{name}/logits"] = np.array(logits.astype(mx.float32))
        r = batch_generate_diffusion(model, tokenizer, [entry["prompt"]], **entry["settings"])
        results[f"{name}/tokens"] = np.array(r.tokens[0], dtype=np.int64)
        del model, tokenizer
    # What a server does with a request: rank 0's object on every rank.
    results["share/from_rank"] = np.array(share({"from_rank": rank}, group)["from_rank"])
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / f"rank{rank}.npz", **results)
    if "cli" in plan:
        # `mlx_dllm generate` on every rank: what each rank printed goes to its own file.
        stdout = sys.stdout
        with open(out / f"cli_rank{rank}.txt", "w") as f:
            sys.stdout = f
            try:
                code = main(plan["cli"])
            finally:
                sys.stdout = stdout
        (out / f"cli_rank{rank}.code").write_text(str(code))
    if "cli" in plan and group is not None:  # alone, serve would start serving
        try:
            main(["serve", "--model", plan["cli"][2]])
            refused = ""
        except SystemExit as e:
            refused = str(e)
        (out / f"serve_rank{rank}.txt").write_text(refused)


if __name__ == "__main__":
    run(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
