"""TRL's trainers with and without fusedhead, 10 steps each, on tiny Llamas built from their config (CPU, fp32).

    FUSEDHEAD_LIBRARY=build/libfusedhead.so PYTHONPATH=python python examples/trl_with_fusedhead.py [--steps 10]

For DPO and KTO (fusedhead.trl.patch(): TRL's per-token function on fusedhead), GRPO with generation (patch(), and
fusedhead.trl.fuse_loss(): the whole loss on fused_linear_grpo_loss) and GKD with a teacher (fuse_loss():
fused_linear_distillation_loss), three runs on the same model, data and seed: stock, stock again (the drift of two
stock runs), fusedhead. Prints per step the stock loss, the relative difference of the second stock run and of the
fusedhead run, and at step 0 the largest relative difference over every logged metric. The models, data, reward and
trainer settings are python/tests/test_trl_trainers.py's (imported from there).
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python" / "tests"))

import test_trl_trainers as T  # noqa: E402

CASES = [("dpo", "patch", {}), ("kto", "patch", {}), ("grpo", "patch", {}),
         ("grpo", "fuse_loss", dict(loss_type="grpo", beta=0.05, entropy_coef=0.01, num_iterations=2)),
         ("gkd", "fuse_loss", {})]
SKIP = ("epoch", "step", "learning_rate", "num_tokens", "step_time")


def rel(a, b):
    return abs(a - b) / max(abs(a), 1e-12)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    steps = parser.parse_args().steps
    warnings.simplefilter("ignore")
    import transformers
    transformers.logging.set_verbosity_error()
    for kind, route, options in CASES:
        base = T.model()
        teacher = T.model(seed=1, layers=3, hidden=96) if kind == "gkd" else None
        runs = [T.run(kind, base, r, teacher=teacher, max_steps=steps, **options) for r in (None, None, route)]
        stock, again, fused = runs
        print(f"\n{kind} via fusedhead.trl.{route}() {options or ''}")
        print(f"{'step':>4} {'stock loss':>14} {'stock drift':>12} {'fusedhead':>12} {'grad norm diff':>15}")
        for i in range(steps):
            a = stock[i]["loss"]
            print(f"{i:>4} {a:>14.7g} {rel(a, again[i]['loss']):>12.2e} {rel(a, fused[i]['loss']):>12.2e} "
                  f"{rel(stock[i]['grad_norm'], fused[i]['grad_norm']):>15.2e}")
        keys = [k for k in stock[0] if k not in SKIP and "/std" not in k]
        worst = max(keys, key=lambda k: abs(stock[0][k] - fused[0][k]) / max(abs(stock[0][k]), 1.0))
        print(f"step 0, {len(keys)} logged values: largest difference {worst} "
              f"{abs(stock[0][worst] - fused[0][worst]) / max(abs(stock[0][worst]), 1.0):.2e} (relative, or absolute "
              f"below 1)")


if __name__ == "__main__":
    main()
