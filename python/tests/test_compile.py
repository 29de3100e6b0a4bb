"""torch.compile through fusedhead's custom ops (torch >= 2.4): every head traced with no graph break, forward and
backward, fp32 and bf16, against the same module run eagerly; torch.library.opcheck on every op; a compiled training
loop against the eager one; errors raised while tracing.

Tolerances: compiled and eager make the same library call on the same inputs, so the losses and metrics are equal;
gradients differ at most by the backward's scaling by the upstream scalar (a trace multiplies by it even when it is
1, eagerly the saved gradient is returned as it is), one rounding: fp32 rtol 1e-6, bf16 rtol 2^-8 (atol 0 for both).
The training loop compounds five steps of that: rtol 1e-5 (fp32).
"""
from __future__ import annotations

from typing import Callable, Dict

import pytest
import torch

import fusedhead
import fusedhead.torch as fht
from fusedhead.torch import _ops

pytestmark = pytest.mark.skipif(not _ops.TORCH_OPS, reason=f"torch {torch.__version__} has no torch.library.custom_op "
                                                            "(torch >= 2.4): fusedhead runs through autograd.Function")

BF = torch.bfloat16
RTOL = {torch.float32: 1e-6, BF: 2.0 ** -8}
B, T, H, V = 2, 5, 16, 96


def _data(seed: int) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T)
    mask[1, 3:] = 0
    targets = ids.clone()
    targets[0, 0] = -100
    return dict(hidden=torch.randn(B, T, H, generator=g), teacher_hidden=torch.randn(B, T, H + 3, generator=g),
                teacher_weight=torch.randn(V, H + 3, generator=g) * 0.3, ids=ids, targets=targets, mask=mask,
                advantages=torch.randn(B, generator=g), old=-torch.rand(B, T, generator=g) - 3.0,
                ref=-torch.rand(B, T, generator=g) - 3.0, ref_seq=-torch.rand(B, generator=g) * 10,
                labels=torch.tensor([True, False]), topk_ids=torch.randint(0, V, (B, T, 4), generator=g),
                topk_logprobs=torch.log_softmax(torch.randn(B, T, 4, generator=g), -1) - 0.5)


def _ce(h, w, d):
    return fht.fused_linear_cross_entropy(h, w, d["targets"], label_smoothing=0.1, z_loss=1e-3)


def _ce_none(h, w, d):
    return (fht.fused_linear_cross_entropy(h, w, d["targets"], reduction="none") * d["mask"]).sum()


def _causal_lm(h, w, d):
    return fht.causal_lm_loss(h, w, d["targets"], num_items_in_batch=torch.tensor(6), final_logit_softcapping=30.0)


def _logprobs(h, w, d):
    logp, entropy = fht.fused_linear_logprobs(h, w, d["ids"], temperature=0.9, return_entropy=True)
    return -(logp * d["advantages"][:, None] * d["mask"]).sum() / d["mask"].sum() + 0.01 * entropy.mean()


def _logprobs_support(h, w, d):
    # padded: each token's target and the next four ids, the last one padding in the second sequence
    support = torch.stack([(d["ids"] + k) % V for k in range(5)], -1)
    support[1, :, -1] = -1
    logp, entropy = fht.fused_linear_logprobs(h, w, d["ids"], temperature=0.9, return_entropy=True,
                                              support_ids=support)
    return -(logp * d["advantages"][:, None] * d["mask"]).sum() / d["mask"].sum() + 0.01 * entropy.mean()


def _eagle3(h, w, d):
    # the draft vocabulary the target's whole one (its semantics: test_draft_heads.py)
    return fht.fused_linear_eagle3_loss(h, w, d["teacher_hidden"], d["teacher_weight"], torch.arange(V), d["mask"])


def _grpo(h, w, d):
    return fht.fused_linear_grpo_loss(h, w, d["ids"], d["mask"], d["advantages"], old_per_token_logps=d["old"],
                                      ref_per_token_logps=d["ref"], beta=0.04, loss_type="dapo",
                                      num_items_in_batch=d["mask"].sum())


def _dpo(h, w, d):
    return fht.fused_linear_preference_loss(h, w, d["ids"], d["mask"], ref_logps=d["ref_seq"], beta=0.1,
                                            loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5])


def _kto(h, w, d):
    return fht.fused_linear_kto_loss(h, w, d["ids"], d["mask"], d["labels"], ref_logps=d["ref_seq"],
                                     kl=torch.tensor(0.05))


def _distill(h, w, d):
    th, tw = (d[k].to(h.dtype) for k in ("teacher_hidden", "teacher_weight"))
    return fht.fused_linear_distillation_loss(h, w, th, tw, d["targets"], weight_hard_loss=0.5, temperature=2.0,
                                              top_k=8)


def _distill_none(h, w, d):
    th, tw = (d[k].to(h.dtype) for k in ("teacher_hidden", "teacher_weight"))
    per_token = fht.fused_linear_distillation_loss(h, w, th, tw, d["targets"], divergence="reverse_kl",
                                                   reduction="none")
    return (per_token * d["mask"]).sum()


def _distill_topk(h, w, d):
    return fht.fused_linear_distillation_topk_loss(h, w, d["topk_ids"], d["topk_logprobs"], d["targets"],
                                                   weight_hard_loss=0.3)


def _distill_topk_none(h, w, d):
    per_token = fht.fused_linear_distillation_topk_loss(h, w, d["topk_ids"], d["topk_logprobs"], add_tail=False,
                                                        reduction="none")
    return (per_token * d["mask"]).sum()


HEADS: Dict[str, Callable] = dict(cross_entropy=_ce, cross_entropy_none=_ce_none, causal_lm=_causal_lm,
                                  logprobs=_logprobs, logprobs_support=_logprobs_support, grpo=_grpo, dpo=_dpo,
                                  kto=_kto, distill=_distill, eagle3=_eagle3,
                                  distill_none=_distill_none, distill_topk=_distill_topk,
                                  distill_topk_none=_distill_topk_none)


class HeadModule(torch.nn.Module):
    """hidden -> loss with the lm_head weight a parameter, as a model's head is."""

    def __init__(self, fn: Callable, dtype: torch.dtype, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed + 100)
        self.weight = torch.nn.Parameter((torch.randn(V, H, generator=g) * 0.3).to(dtype))
        self.fn = fn

    def forward(self, hidden: torch.Tensor, data: Dict[str, torch.Tensor]):
        return self.fn(hidden, self.weight, data)


def _loss_of(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out[0]


def _step(model: torch.nn.Module, run, hidden: torch.Tensor, data) -> tuple:
    """The output, and the gradients of hidden and the weight after backward of 3 * loss (upstream 3)."""
    model.zero_grad(set_to_none=True)
    h = hidden.detach().requires_grad_()
    out = run(h, data)
    (3 * _loss_of(out)).backward()
    return out, h.grad, model.weight.grad


def _assert_same_metrics(got, want) -> None:
    """Compiled metrics are 0-d tensors for every key (NaN where TRL logs nothing); eager ones floats, NaN omitted."""
    for key, value in got.items():
        if key in want:
            assert float(value) == want[key], key
        else:
            assert torch.isnan(value), key


@pytest.mark.parametrize("dtype", [torch.float32, BF], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head", list(HEADS))
def test_compiled_head_matches_eager(head, dtype):
    torch._dynamo.reset()
    data = _data(1)
    hidden = data["hidden"].to(dtype)
    model = HeadModule(HEADS[head], dtype)
    explanation = torch._dynamo.explain(model)(hidden, data)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    eager_out, eager_dh, eager_dw = _step(model, model, hidden, data)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out, dh, dw = _step(model, compiled, hidden, data)
    assert torch.equal(_loss_of(out), _loss_of(eager_out))
    if isinstance(out, tuple) and isinstance(out[1], dict):
        _assert_same_metrics(out[1], eager_out[1])
    torch.testing.assert_close(dh, eager_dh, rtol=RTOL[dtype], atol=0)
    torch.testing.assert_close(dw, eager_dw, rtol=RTOL[dtype], atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, BF], ids=["fp32", "bf16"])
def test_inductor_cross_entropy(dtype):
    """The default backend (Inductor, C++ code generated around the op) on the head every trainer uses."""
    torch._dynamo.reset()
    data = _data(2)
    hidden = data["hidden"].to(dtype)
    model = HeadModule(_ce, dtype)
    eager_out, eager_dh, eager_dw = _step(model, model, hidden, data)
    out, dh, dw = _step(model, torch.compile(model, fullgraph=True), hidden, data)
    assert torch.equal(out, eager_out)
    torch.testing.assert_close(dh, eager_dh, rtol=RTOL[dtype], atol=0)
    torch.testing.assert_close(dw, eager_dw, rtol=RTOL[dtype], atol=0)


def test_compiled_training_loop_matches_eager():
    """Five SGD steps of a tiny model (embedding, linear, head) compiled with Inductor against the same eagerly."""
    torch._dynamo.reset()

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(7)
            self.embed = torch.nn.Embedding(V, H)
            self.mix = torch.nn.Linear(H, H)
            self.lm_head = torch.nn.Linear(H, V, bias=False)

        def forward(self, ids, labels):
            hidden = torch.tanh(self.mix(self.embed(ids)))
            return fht.causal_lm_loss(hidden, self.lm_head.weight, labels)

    data = _data(3)
    losses = {}
    weights = {}
    for mode in ("eager", "compiled"):
        model = Tiny()
        run = torch.compile(model, fullgraph=True) if mode == "compiled" else model
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        losses[mode] = []
        for _ in range(5):
            opt.zero_grad()
            loss = run(data["ids"], data["targets"])
            loss.backward()
            opt.step()
            losses[mode].append(loss.detach())
        weights[mode] = model.lm_head.weight.detach().clone()
    torch.testing.assert_close(torch.stack(losses["compiled"]), torch.stack(losses["eager"]), rtol=1e-5, atol=0)
    torch.testing.assert_close(weights["compiled"], weights["eager"], rtol=1e-5, atol=1e-7)
    assert losses["eager"][-1] < losses["eager"][0]


def _record_ops(monkeypatch) -> list:
    """(op, args) of every fusedhead op called, the backward ops' arguments built from their forward's."""
    calls = []

    def recorder(op, backward_op=None, saved=(), differentiable=()):
        def call(*args):
            out = op(*args)
            calls.append((op, args))
            if backward_op is not None:
                # a backward op runs inside backward, on tensors that need no gradient of their own
                detached = [a.detach() if isinstance(a, torch.Tensor) else a for a in args[:-1]]
                upstream = [torch.ones_like(out[i]).detach() for i in differentiable]
                calls.append((backward_op, (*detached, *(out[i].detach() for i in saved), *upstream, args[-1],
                                            True, True, args[3] is not None)))
            return out
        return call

    for module in (fht.cross_entropy, fht.logprobs, fht.grpo, fht.preference, fht.kto, fht.distill, fht.draft_heads):
        for value in vars(module).values():
            steps = [value.train, value.none] if isinstance(value, fht.distill._Head) else [value]
            for step in steps:
                if isinstance(step, _ops.TrainStep):
                    monkeypatch.setattr(step, "op", recorder(step.op))
                elif isinstance(step, _ops.SplitStep):
                    forward, backward = step.ops
                    monkeypatch.setattr(step, "ops", (recorder(forward, backward, step.saved, step.differentiable),
                                                      backward))
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, BF], ids=["fp32", "bf16"])
def test_opcheck_every_op(dtype, monkeypatch):
    """torch.library.opcheck (schema, autograd registration, fake tensors, AOT dispatch with static and dynamic
    shapes) on each op, with the arguments the front ends pass."""
    calls = _record_ops(monkeypatch)
    data = _data(4)
    for fn in HEADS.values():
        model = HeadModule(fn, dtype)
        fn(data["hidden"].to(dtype).requires_grad_(), model.weight, data)
    checked = set()
    for op, args in calls:
        name = op._name
        if name in checked:
            continue
        checked.add(name)
        opcheck_args = tuple(a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                             for a in args)
        torch.library.opcheck(op, opcheck_args)
    expected = {n for n in ("cross_entropy", "cross_entropy_none", "cross_entropy_none_backward",
                                             "logprobs", "logprobs_backward", "logprobs_support",
                                             "logprobs_support_backward", "grpo", "preference", "kto", "distill",
                                             "distill_none", "distill_none_backward", "distill_topk",
                                             "distill_topk_none", "distill_topk_none_backward", "eagle3")}
    assert expected <= checked, expected - checked


MODULES = dict(
    cross_entropy=(lambda: fht.FusedLinearCrossEntropy(label_smoothing=0.1, return_z_loss=True),
                   lambda d: (d["targets"],)),
    grpo=(lambda: fht.FusedLinearGRPOLoss(loss_type="grpo", beta=0.04),
          lambda d: (d["ids"], d["mask"], d["advantages"], None, d["old"], d["ref"])),
    dpo=(lambda: fht.FusedLinearDPOLoss(beta=0.2), lambda d: (d["ids"], d["mask"], None, d["ref_seq"])),
    orpo=(lambda: fht.FusedLinearORPOLoss(), lambda d: (d["ids"], d["mask"])),
    kto=(lambda: fht.FusedLinearKTOLoss(), lambda d: (d["ids"], d["mask"], d["labels"], None, d["ref_seq"], None,
                                                      0.1)),
    distill=(lambda: fht.FusedLinearDistillationLoss(divergence="forward_kl"),
             lambda d: (d["teacher_hidden"], d["teacher_weight"], d["targets"])),
    jsd=(lambda: fht.FusedLinearJSDLoss(jsd_beta=0.3), lambda d: (d["teacher_hidden"], d["teacher_weight"])),
)


@pytest.mark.parametrize("name", list(MODULES))
def test_module_forms_compile(name):
    """The library's own nn.Module forms, options held as attributes, under torch.compile(fullgraph=True)."""
    torch._dynamo.reset()
    make, args = MODULES[name]
    loss_fn, data = make(), _data(8)
    weight = torch.nn.Parameter(torch.randn(V, H) * 0.3)

    def run(h):
        return loss_fn(h, weight, *args(data))

    assert torch._dynamo.explain(run)(data["hidden"]).graph_break_count == 0
    eager = _loss_of(run(data["hidden"]))
    assert torch.equal(_loss_of(torch.compile(run, fullgraph=True, backend="aot_eager")(data["hidden"])), eager)


def test_trace_time_errors():
    """A bad shape raises while tracing: Dynamo's error chains fusedhead's own (its __cause__ or __context__)."""
    torch._dynamo.reset()
    data = _data(5)
    model = HeadModule(_ce, torch.float32)
    bad = dict(data, targets=data["targets"][:, :3])
    with pytest.raises(ValueError, match="targets: expected shape"):
        model(data["hidden"], bad)
    with pytest.raises(Exception) as caught:
        torch.compile(model, fullgraph=True, backend="aot_eager")(data["hidden"], bad)
    cause = caught.value
    while cause is not None and not isinstance(cause, ValueError):
        cause = cause.__cause__ or cause.__context__
    assert cause is not None and "targets: expected shape" in str(cause)


@pytest.mark.parametrize("head", list(HEADS))
def test_double_backward_refused(head):
    """create_graph=True would build a graph on numbers the library computed: refused with a clear error."""
    data = _data(6)
    model = HeadModule(HEADS[head], torch.float32)
    h = data["hidden"].requires_grad_()
    loss = _loss_of(model(h, data))
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(loss, h, create_graph=True)


def test_context_through_compile():
    """A Context reaches the op by its key; a freed one is named."""
    torch._dynamo.reset()
    data = _data(7)
    ctx = fusedhead.Context(threads=1, tile_vocab=32)

    def fn(h, w):
        return fht.fused_linear_cross_entropy(h, w, data["targets"], context=ctx)

    w = torch.randn(V, H)
    eager = fn(data["hidden"], w)
    assert torch.equal(torch.compile(fn, fullgraph=True, backend="aot_eager")(data["hidden"], w), eager)
    with pytest.raises(ValueError, match="no longer exists"):
        fusedhead._core.context_by_key(10 ** 9)
