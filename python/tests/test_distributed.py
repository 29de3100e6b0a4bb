"""fusedhead.distributed (torch.distributed process groups, gloo) under torchrun with 2 and 4 ranks: every grid those
allow (vocab-parallel, data-parallel, 2 x 2), fp32 and bf16, cross-entropy, log-probs, GRPO and KTO against the single
process, a mismatch of options, one rank's bad argument (an error on every rank, not a hang: the run's timeout fails
the test), data ranks holding different shards, and a head without a parallel entry point
(python/tests/parallel_ranks.py: what is compared and the bounds; test_mpi.py runs the same over mpi4py); and the
training example under DDP, FSDP2 and vocab parallelism against one process. Skipped, saying why, without
torch.distributed's gloo."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("this torch has no torch.distributed with gloo", allow_module_level=True)
if int(torch.__version__.split(".")[0]) < 2:
    pytest.skip(f"torch {torch.__version__}: its torchrun fails before starting a rank under this Python "
                "(torch.distributed.elastic: 'NoneType' object has no attribute 'get'); torch 2 runs these tests",
                allow_module_level=True)

import fusedhead  # noqa: E402
from conftest import subprocess_env  # noqa: E402

RANKS = Path(__file__).with_name("parallel_ranks.py")
EXAMPLE = Path(__file__).parents[2] / "examples" / "distributed" / "train_lm_torchrun.py"


def _torchrun(ranks: int, *script: str) -> subprocess.CompletedProcess:
    env = subprocess_env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", FUSEDHEAD_LIBRARY=fusedhead.library_path())
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                           *script], env=env, capture_output=True, text=True, timeout=300)  # 10-20 s; a hang fails


@pytest.mark.parametrize("ranks", [2, 4])
def test_heads_across_ranks_equal_the_single_process(ranks: int):
    run = _torchrun(ranks, str(RANKS), "torch")
    summary = re.findall(r"rank \d+/\d+: \d+ checks, \d+ failures|rank \d+: FAILED [^\n]*", run.stdout)
    assert run.returncode == 0, "\n".join(summary) + "\n" + run.stderr[-4000:]
    assert len([s for s in summary if s.endswith(" 0 failures")]) == ranks, run.stdout


@pytest.mark.parametrize("how", [("data", "ddp"), ("data", "fsdp2"), ("vocab", "ddp")], ids=["ddp", "fsdp2", "vocab"])
def test_example_trains_as_one_process(how):
    """examples/distributed/train_lm_torchrun.py, 5 steps on 2 ranks: each step's loss within 1e-5 relative of one
    process training the same model on the same batches (as test_mpi's example: 20 steps measured 0 for data
    parallelism under DDP and FSDP2, 7.7e-8 for vocab parallelism)."""
    pytest.importorskip("transformers", reason="the example builds a transformers model")
    parallel, wrapper = how
    run = _torchrun(2, str(EXAMPLE), "--parallel", parallel, "--wrapper", wrapper, "--steps", "5")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    worst = re.search(r"largest relative loss difference (\S+)", run.stdout)
    assert worst is not None and float(worst.group(1)) <= 1e-5, run.stdout


def test_one_process_layout_and_a_failing_collective(monkeypatch):
    """In this process, a gloo group of one rank: a layout over it runs the single-process step; a collective that
    raises (torch.distributed.all_reduce replaced by one that does) fails the call with MPIError naming the exception
    rather than letting it cross the C frames; arguments that are not process groups are refused with TypeError; a
    call with no parallel form (distillation) is refused with NotImplementedError naming it."""
    import fusedhead.distributed
    import fusedhead.errors
    import fusedhead.torch as ft
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(6, 8, generator=g), torch.randn(30, 8, generator=g)
        targets = torch.randint(0, 30, (6,), generator=g)
        with fusedhead.distributed.Layout(30, vocab_group=dist.group.WORLD) as layout:
            assert layout.info == (0, 1, 0, 1, 0, 30, 30)
            context = fusedhead.distributed.Context(layout, threads=1)
            loss = ft.fused_linear_cross_entropy(x, w, targets, context=context)
            assert torch.allclose(loss, ft.fused_linear_cross_entropy(x, w, targets), rtol=1e-6, atol=0)
            support = torch.stack([targets, (targets + 1) % 30], -1)
            got = ft.fused_linear_logprobs(x, w, targets, support_ids=support, context=context)
            assert torch.allclose(got, ft.fused_linear_logprobs(x, w, targets, support_ids=support), rtol=1e-6,
                                  atol=1e-7)
            # distillation has no parallel form: refused, not run on one shard as if it were the whole
            with pytest.raises(NotImplementedError, match=r"fh_distill_forward(_backward)? has no parallel version"):
                ft.fused_linear_distillation_loss(x, w, x, w, context=context)
            context.close()
        with pytest.raises(TypeError, match="vocab_group: expected a torch.distributed ProcessGroup"):
            fusedhead.distributed.Layout(30, vocab_group="world")

        def planted(*args, **kwargs):
            raise RuntimeError("planted: the peer is gone")
        monkeypatch.setattr(dist, "all_reduce", planted)
        with pytest.raises(fusedhead.errors.MPIError,
                           match="torch.distributed: RuntimeError: planted: the peer is gone"):
            fusedhead.distributed.Layout(30, vocab_group=dist.group.WORLD)
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()
