"""One rank of python/tests/test_mpi.py (`parallel_ranks.py mpi` under mpirun: fusedhead.mpi over mpi4py) and of
python/tests/test_distributed.py (`parallel_ranks.py torch` under torchrun: fusedhead.distributed over
torch.distributed's gloo), against the single-process call.

Every rank builds the whole problem from one seed, computes it single-process with fusedhead.torch, then its own part
through a parallel Context on each grid that the world size allows (vocab-parallel, data-parallel, 2 x 2), in
fp32 and bf16: cross-entropy (the train step, and 'none' through the split forward and backward), per-token log-probs
and entropy (over the vocabulary, and over a support of ids spread across the shards), GRPO and KTO (train steps). The losses, metrics, this rank's per-token outputs, its rows of hidden's
gradient and its shard of the weight's and bias's must equal the single process's within the C MPI suite's bounds
(tests/mpi/test_mpi.c): 1e-6 relative for losses (the per-token statistics are combined in double, only the summation
order differs), 1e-5 normwise for per-token values and fp32 gradients, 4e-3 more for each of bf16 inputs and bf16
gradients (a bf16 input rounds dU to bf16 once per path, the paths' sums differ in order; a bf16 gradient is rounded
once after the ranks' fp32 sum, the single process's after its own). Also: options that differ across the ranks raise
MPIMismatchError on every rank, one rank's bad argument raises on every rank (not a hang), data ranks holding
different shards raise MPILayoutError, and a head without a parallel entry point raises NotImplementedError. Prints
one line per rank and exits 1 on any failure.
"""
from __future__ import annotations

import sys
from typing import Callable, Dict, List, Tuple

import torch

import fusedhead
import fusedhead.errors
import fusedhead.numpy
import fusedhead.parallel
import fusedhead.torch as ft

LOSS_TOL, VALUE_TOL, BF16_TOL = 1e-6, 1e-5, 4e-3
N_PER_DATA_RANK, B_PER_DATA_RANK, T, H, V = 24, 3, 8, 16, 103


class Engine:
    """The ranks' collectives: mpi4py's communicators or torch.distributed's process groups, split into the grid's
    groups as fh_mpi_layout_create_grid does (consecutive ranks share the tokens)."""

    def __init__(self, name: str):
        self.name = name
        if name == "mpi":
            from mpi4py import MPI
            import fusedhead.mpi
            self.world, self.module = MPI.COMM_WORLD, fusedhead.mpi
            self.rank, self.size = self.world.Get_rank(), self.world.Get_size()
        else:
            import torch.distributed as dist
            import fusedhead.distributed
            dist.init_process_group("gloo")
            self.dist, self.module = dist, fusedhead.distributed
            self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def groups(self, pv: int, pd: int) -> Tuple[object, object]:
        """This rank's vocab and data groups of the pv x pd grid (None where that kind has one rank)."""
        vr, dr = self.rank % pv, self.rank // pv
        if self.name == "mpi":
            vocab, data = self.world.Split(dr, self.rank), self.world.Split(vr, self.rank)
            self._made = [vocab, data]
        else:  # every rank makes every group, in the same order
            vocab = [self.dist.new_group([d * pv + v for v in range(pv)]) for d in range(pd)][dr]
            data = [self.dist.new_group([d * pv + v for d in range(pd)]) for v in range(pv)][vr]
        return (vocab if pv > 1 else None), (data if pd > 1 else None)

    def layout(self, count: int, groups: Tuple[object, object]) -> fusedhead.parallel.Layout:
        if self.name == "mpi":
            return self.module.Layout(count, vocab_comm=groups[0], data_comm=groups[1])
        return self.module.Layout(count, vocab_group=groups[0], data_group=groups[1])

    def free(self) -> None:
        if self.name == "mpi":
            for comm in self._made:
                comm.Free()

    def close(self) -> None:
        """torch.distributed: the process groups destroyed before the interpreter exits (left to exit, gloo's threads
        were torn down mid-flight now and then: 'terminate called without an active exception', SIGABRT, in about 1
        of 5 runs, after every check had passed)."""
        if self.name != "mpi":
            self.dist.barrier()
            self.dist.destroy_process_group()

    def failures_anywhere(self, count: int) -> int:
        if self.name == "mpi":
            return self.world.allreduce(count)
        total = torch.tensor([count])
        self.dist.all_reduce(total)
        return int(total)


engine = Engine(sys.argv[1] if len(sys.argv) > 1 else "mpi")
rank, size = engine.rank, engine.size
failures: List[str] = []
checks = 0


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / max(float(want.norm()), 1e-30))


def check(what: str, got, want, tol: float) -> None:
    global checks
    checks += 1
    got_t, want_t = torch.as_tensor(got), torch.as_tensor(want)
    err = rel(got_t, want_t)
    if not err <= tol:
        failures.append(f"{what}: relative error {err:.3g} > {tol:g}")


def shard(count: int, parts: int, r: int) -> Tuple[int, int]:
    base, extra = divmod(count, parts)
    return r * base + min(r, extra), base + (r < extra)


def leaves(*tensors: torch.Tensor) -> List[torch.Tensor]:
    return [t.detach().clone().requires_grad_() for t in tensors]


Run = Callable[[List[torch.Tensor], dict], Tuple[torch.Tensor, Dict[str, torch.Tensor]]]


def compare(name: str, run: Run, inputs: Dict[str, torch.Tensor], rows: str, pv: int, pd: int, vr: int, dr: int,
            dtype: torch.dtype, context: fusedhead.Context) -> None:
    """run(leaves [hidden, weight, bias], token inputs) -> (loss, per-token outputs): single process on the whole
    problem, then this rank's part (its tokens' rows of `rows`-split inputs, its vocabulary shard) on context."""
    x, w, b = (inputs[k].to(dtype) for k in ("hidden", "weight", "bias"))
    whole = leaves(x, w, b)
    loss, outputs = run(whole, {k: v for k, v in inputs.items() if k not in ("hidden", "weight", "bias")})
    loss.backward()
    lo, count = shard(V, pv, vr)
    units = x.shape[0]  # tokens (CE, log-probs) or sequences (GRPO, KTO): the data ranks split the first dimension
    first, mine = dr * units // pd, units // pd

    def local(t: torch.Tensor) -> torch.Tensor:
        return t[first:first + mine]

    part = leaves(local(x), w[lo:lo + count], b[lo:lo + count])
    token_inputs = {k: (local(v) if v.dim() > 0 and v.shape[0] == units else v) for k, v in inputs.items()
                    if k not in ("hidden", "weight", "bias")}
    got_loss, got_outputs = run(part, dict(token_inputs, context=context))
    got_loss.backward()
    bf16 = dtype == torch.bfloat16
    grad_tol = VALUE_TOL + (2 * BF16_TOL if bf16 else 0.0)
    value_tol = VALUE_TOL + (BF16_TOL if bf16 else 0.0)
    label = f"{name} {str(dtype)[6:]} grid {pv}x{pd} rank {rank}"
    if rows not in ("tokens", "support") or pd == 1:  # per-token heads: this rank's tokens' sum (outputs are checked)
        check(f"{label} loss", got_loss.float(), loss.float(), LOSS_TOL if not bf16 else value_tol)
    for key, want in outputs.items():
        want = local(want) if want.dim() > 0 and want.shape[0] == units else want
        check(f"{label} {key}", got_outputs[key].float(), want.float(), value_tol)
    check(f"{label} dhidden", part[0].grad, local(whole[0].grad), grad_tol)
    check(f"{label} dweight", part[1].grad, whole[1].grad[lo:lo + count], grad_tol)
    check(f"{label} dbias", part[2].grad, whole[2].grad[lo:lo + count], grad_tol)


def ce_mean(p, a):
    return ft.fused_linear_cross_entropy(p[0], p[1], a["targets"], bias=p[2], label_smoothing=0.1,
                                         context=a.get("context")), {}


def ce_none(p, a):
    per_token = ft.fused_linear_cross_entropy(p[0], p[1], a["targets"], bias=p[2], reduction="none",
                                              context=a.get("context"))
    return (per_token * a["upstream"]).sum(), {"per_token_loss": per_token}


def logprobs(p, a):
    logp, entropy = ft.fused_linear_logprobs(p[0], p[1], a["targets"], temperature=0.9, return_entropy=True,
                                             bias=p[2], context=a.get("context"))
    return (logp * a["upstream"] + 0.1 * entropy).sum(), {"logp": logp, "entropy": entropy}


def logprobs_support(p, a):
    logp, entropy = ft.fused_linear_logprobs(p[0], p[1], a["targets"], temperature=0.9, return_entropy=True,
                                             bias=p[2], support_ids=a["support"], context=a.get("context"))
    return (logp * a["upstream"] + 0.1 * entropy).sum(), {"logp": logp, "entropy": entropy}


def grpo(p, a):
    loss, metrics = ft.fused_linear_grpo_loss(p[0], p[1], a["ids"], a["mask"], a["advantages"], bias=p[2],
                                              old_per_token_logps=a["old"], ref_per_token_logps=a["ref"],
                                              loss_type="dapo", beta=0.04, context=a.get("context"))
    return loss, {k: torch.as_tensor(v) for k, v in metrics.items()}


def kto(p, a):
    out = ft.fused_linear_kto_loss(p[0], p[1], a["ids"], a["mask"], a["labels"], ref_logps=a["ref_logps"],
                                   kl=0.05, bias=p[2], context=a.get("context"))
    return out[0], {"logps": out[2], "rewards": out[3], **{k: torch.as_tensor(v) for k, v in out[1].items()}}


def inputs_for(kind: str, pd: int, g: torch.Generator) -> Dict[str, torch.Tensor]:
    weight = {"weight": torch.randn(V, H, generator=g) * 0.4, "bias": torch.randn(V, generator=g) * 0.1}
    if kind in ("ce", "tokens", "support"):
        n = N_PER_DATA_RANK * pd
        targets = torch.randint(0, V, (n,), generator=g)
        targets[::5] = -100
        tokens = dict(weight, hidden=torch.randn(n, H, generator=g), targets=targets,
                      upstream=torch.randn(n, generator=g))
        if kind == "support":  # each token's target and 7 more ids over the whole vocabulary, -1 padding in some
            base = torch.where(targets >= 0, targets, 0)
            tokens["support"] = (base[:, None] + 13 * torch.arange(8)) % V
            tokens["support"][::3, -2:] = -1
        return tokens
    b = B_PER_DATA_RANK * pd
    mask = (torch.rand(b, T, generator=g) > 0.2).float()
    seq = dict(weight, hidden=torch.randn(b, T, H, generator=g), ids=torch.randint(0, V, (b, T), generator=g),
               mask=mask)
    if kind == "grpo":
        return dict(seq, advantages=torch.randn(b, generator=g), old=-3.0 - torch.rand(b, T, generator=g),
                    ref=-3.0 - torch.rand(b, T, generator=g))
    return dict(seq, labels=torch.arange(b) % 2 == 0, ref_logps=-30.0 - torch.rand(b, generator=g))


HEADS = (("ce mean", ce_mean, "ce"), ("ce none", ce_none, "tokens"), ("logprobs", logprobs, "tokens"),
         ("logprobs over a support", logprobs_support, "support"),
         ("grpo", grpo, "grpo"), ("kto", kto, "kto"))


def grids() -> List[Tuple[int, int]]:
    out = [(size, 1), (1, size)]
    if size == 4:
        out.append((2, 2))
    return out


def main() -> int:
    global checks
    dtypes = [torch.float32] + ([torch.bfloat16] if fusedhead.bf16_available() else [])
    for pv, pd in grids():
        vr, dr = rank % pv, rank // pv
        groups = engine.groups(pv, pd)
        lo, count = shard(V, pv, vr)
        with engine.layout(count, groups) as layout:
            check(f"layout {pv}x{pd} rank {rank}", torch.tensor(layout.info),  # every field of the ctypes mirror
                  torch.tensor([vr, pv, dr, pd, lo, count, V]), 0.0)
            context = engine.module.Context(layout, threads=1)
            for dtype in dtypes:
                for name, run, kind in HEADS:
                    g = torch.Generator().manual_seed(7)
                    compare(name, run, inputs_for(kind, pd, g), kind, pv, pd, vr, dr, dtype, context)
            mismatch_and_refusal(context, count, pv, pd)
            context.close()
        if pd > 1:  # data ranks holding different shards: MPILayoutError on every rank
            try:
                engine.layout(count + (rank == 0), groups).close()
                failures.append(f"grid {pv}x{pd}: data ranks with different shards made a layout")
            except fusedhead.errors.MPILayoutError:
                checks += 1
        engine.free()
    if engine.name == "torch":
        dtensor_weight()
    print(f"rank {rank}/{size}: {checks} checks, {len(failures)} failures", flush=True)
    for f in failures[:20]:
        print(f"rank {rank}: FAILED {f}", flush=True)
    return 1 if engine.failures_anywhere(len(failures)) else 0


def dtensor_weight() -> None:
    """torch.distributed only, vocab-parallel over every rank: a weight DTensor sharded on the vocabulary (Shard(0) on
    a 1-D mesh) with a context on a layout over the mesh's group is taken as the rank's shard: the loss and hidden's
    gradient are the whole vocabulary's, the DTensor's gradient its shard's; a replicated DTensor is refused."""
    global checks
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (size,))
    g = torch.Generator().manual_seed(11)
    x, w = torch.randn(N_PER_DATA_RANK, H, generator=g), torch.randn(V, H, generator=g)
    targets = torch.randint(0, V, (N_PER_DATA_RANK,), generator=g)
    sharded = distribute_tensor(w.clone(), mesh, [Shard(0)]).requires_grad_()
    with engine.module.Layout(sharded.to_local().shape[0], vocab_group=mesh.get_group()) as layout:
        context = engine.module.Context(layout, threads=1)
        xs, xf, wf = x.clone().requires_grad_(), x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = ft.fused_linear_cross_entropy(xs, sharded, targets, label_smoothing=0.1, context=context)
        loss.backward()
        want = ft.fused_linear_cross_entropy(xf, wf, targets, label_smoothing=0.1)
        want.backward()
        lo, count = layout.info.vocab_offset, layout.info.local_vocab
        check(f"DTensor weight rank {rank} loss", loss.detach(), want.detach(), LOSS_TOL)
        check(f"DTensor weight rank {rank} dx", xs.grad, xf.grad, VALUE_TOL)
        check(f"DTensor weight rank {rank} dweight", sharded.grad.to_local(), wf.grad[lo:lo + count], VALUE_TOL)
        try:
            ft.fused_linear_cross_entropy(x, distribute_tensor(w, mesh, [Replicate()]), targets, context=context)
            failures.append("a replicated DTensor weight was taken")
        except TypeError as e:
            checks += 1
            if "Shard(0)" not in str(e):
                failures.append(f"the replicated DTensor's refusal does not say what is taken: {e}")
        context.close()


def mismatch_and_refusal(context: fusedhead.Context, count: int, pv: int, pd: int) -> None:
    """Rank 0 asks for other label smoothing than the others: MPIMismatchError on every rank, naming the option; the
    last rank's targets are of the wrong dtype: it raises TypeError, the others an error saying that a rank failed (not
    a hang), in a train step, a split forward and NumPy's train step; the preference head has no parallel entry point:
    NotImplementedError."""
    global checks
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(4, H, generator=g), torch.randn(count, H, generator=g)
    targets = torch.zeros(4, dtype=torch.int64)
    try:
        ft.fused_linear_cross_entropy(x, w, targets, label_smoothing=0.1 if rank == 0 else 0.2, context=context)
        failures.append(f"grid {pv}x{pd}: options differing across ranks did not raise")
    except fusedhead.errors.MPIMismatchError as e:
        checks += 1
        if "label_smoothing" not in str(e):
            failures.append(f"grid {pv}x{pd}: the mismatch error does not name the option: {e}")
    bad = rank == size - 1  # its targets are int32: the front end raises before the library is called
    wrong = targets.to(torch.int32) if bad else targets
    calls = (("the train step", lambda: ft.fused_linear_cross_entropy(x, w.requires_grad_(), wrong, context=context)),
             ("the split forward", lambda: ft.fused_linear_logprobs(x, w, wrong, context=context)),
             ("NumPy's train step", lambda: fusedhead.numpy.forward_backward(x.numpy(), w.detach().numpy(),
                                                                              wrong.numpy(), context=context)))
    for what, call in calls:
        try:
            call()
            failures.append(f"grid {pv}x{pd}: {what} with one rank's bad targets did not raise")
        except fusedhead.FusedheadError as e:  # the others: told that a rank failed
            checks += 1
            if bad or "rank" not in str(e):
                failures.append(f"grid {pv}x{pd}: {what}: {type(e).__name__}: {e}")
        except (TypeError, ValueError) as e:  # the bad rank's own error, as without MPI (after: the library's
            # errors are ValueErrors too)
            checks += 1
            if not bad:
                failures.append(f"grid {pv}x{pd}: {what}: a good rank raised the bad rank's error: {e}")
    w.requires_grad_(False)
    try:
        ft.fused_linear_preference_loss(torch.randn(2, 3, H), w, torch.zeros(2, 3, dtype=torch.int64),
                                        torch.ones(2, 3), context=context)
        failures.append("the preference head ran on a parallel context")
    except NotImplementedError as e:
        checks += 1
        if "fh_preference_forward" not in str(e):
            failures.append(f"NotImplementedError does not name the function: {e}")
    except TypeError as e:  # a front end whose arguments differ: report it, do not hide it
        failures.append(f"the preference call's arguments: {e}")


if __name__ == "__main__":
    status = main()
    engine.close()
    sys.exit(status)
