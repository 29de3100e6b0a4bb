"""TRL's trainers with and without fusedhead, 10 steps each, on tiny Llamas built from their config (CPU).

    FUSEDHEAD_LIBRARY=build/libfusedhead.so PYTHONPATH=python python examples/trl_with_fusedhead.py [--steps 10]
        [--bf16] [--only sft,grpo]

For SFT (nll, dft, completion-only; packed), DPO, KTO and RLOO with generation (fusedhead.trl.patch(): TRL's
per-token function on fusedhead), GRPO with generation (patch(), and fusedhead.trl.fuse_loss(): the whole loss on
fused_linear_grpo_loss), the DistillationTrainer with generation and GKD, each with a teacher (fuse_loss():
fused_linear_distillation_loss), three runs on the same model, data and seed: stock, stock again (the drift of two
stock runs), fusedhead. Prints per step the stock loss, the relative difference of the second stock run and of the
fusedhead run, and at step 0 the largest relative difference over every logged metric; then one summary line per
case. fp32 by default; --bf16 runs TRL's bf16=True (on the CPU, autocast to bf16) on both sides. The models, data,
reward and trainer settings are python/tests/test_trl_trainers.py's (imported from there).
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

CASES = [("sft", "patch", dict(loss_type="nll")), ("sft", "patch", dict(loss_type="dft")),
         ("sft", "patch", T.SFT_PACKED), ("dpo", "patch", {}), ("kto", "patch", {}), ("rloo", "patch", T.RLOO_SPLIT),
         ("grpo", "patch", {}),
         ("grpo", "fuse_loss", dict(loss_type="grpo", beta=0.05, entropy_coef=0.01, num_iterations=2)),
         ("distill", "fuse_loss", dict(beta=0.5, temperature=0.7)), ("gkd", "fuse_loss", {})]


def rel(a, b):
    return abs(a - b) / max(abs(a), 1e-12)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--bf16", action="store_true", help="TRL's bf16=True (CPU autocast to bf16) on both sides")
    parser.add_argument("--only", default="", help="comma-separated trainer kinds (sft, dpo, kto, rloo, grpo, "
                                                   "distill, gkd); all by default")
    a = parser.parse_args()
    only = set(filter(None, a.only.split(",")))
    warnings.simplefilter("ignore")
    import transformers
    transformers.logging.set_verbosity_error()
    summary = []
    for kind, route, options in CASES:
        if only and kind not in only:
            continue
        base = T.model()
        teacher = T.model(seed=1, layers=3, hidden=96) if kind in ("gkd", "distill") else None
        runs = [T.run(kind, base, r, teacher=teacher, max_steps=a.steps, bf16=a.bf16, **options)
                for r in (None, None, route)]
        stock, again, fused = runs
        name = f"{kind} {route}() " + " ".join(f"{k}={v}" for k, v in options.items())
        print(f"\n{name}")
        print(f"{'step':>4} {'stock loss':>14} {'stock drift':>12} {'fusedhead':>12} {'grad norm diff':>15}")
        for i in range(a.steps):
            x = stock[i]["loss"]
            print(f"{i:>4} {x:>14.7g} {rel(x, again[i]['loss']):>12.2e} {rel(x, fused[i]['loss']):>12.2e} "
                  f"{rel(stock[i]['grad_norm'], fused[i]['grad_norm']):>15.2e}")
        keys = T.logged_keys(stock[0])
        diff = {k: abs(stock[0][k] - fused[0][k]) / max(abs(stock[0][k]), 1.0) for k in keys}
        worst = max(keys, key=diff.get)
        print(f"step 0, {len(keys)} logged values: largest difference {worst} {diff[worst]:.2e} (relative, or "
              f"absolute below 1)")
        identical = all(s[k] == t[k] for s, t in zip(stock, again) for k in T.logged_keys(s))
        pairs = list(zip(stock, fused))
        summary.append((name, max(rel(s["loss"], f["loss"]) for s, f in pairs),
                        max(abs(s["loss"] - f["loss"]) for s, f in pairs),
                        max(rel(s["grad_norm"], f["grad_norm"]) for s, f in pairs), worst, diff[worst], identical))
    print(f"\nlargest over the steps: loss difference relative and absolute (a loss near 0 from terms that cancel, "
          f"as RLOO's and GRPO's, has a large relative one), grad norm relative; step 0's largest metric difference")
    print(f"{'case':<64} {'loss rel':>9} {'loss abs':>9} {'grad norm':>9}  {'step-0 metric':<28} {'':>8} stock runs")
    for name, loss, loss_abs, grad, worst, d, identical in summary:
        print(f"{name:<64} {loss:>9.2e} {loss_abs:>9.2e} {grad:>9.2e}  {worst:<28} {d:>8.2e} "
              f"{'identical' if identical else 'differ'}")


if __name__ == "__main__":
    main()
