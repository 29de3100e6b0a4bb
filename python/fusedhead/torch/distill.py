"""Distillation: forward KL, reverse KL, generalized JSD plus a hard-label cross-entropy between a student head and
a teacher head (TRL's GKD generalized_jsd_loss, Liger's LigerFusedLinearJSD and chunked distillation losses), and
towards a teacher given per token as its top-k ids and log-probs (TRL's server distillation)."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .._core import (Context, DistillProblem, DistillTopkProblem, default_context, distill_options,
                     distill_topk_options, parse_layout, prefixed_errors)
from .._lib import Reduction
from ._ops import SplitStep, TrainStep, train_step
from ._tensors import (FP32_HINT, INT64_HINT, TorchLinear, check_tensor, opt_view, scalar, token_vector, view)

_OPTIONS = (("int", "ignore_index"), ("str", "reduction"), ("float", "temperature"), ("float", "weight_soft_loss"),
            ("float", "weight_hard_loss"))
_ARGS = (("Tensor", "student_input"), ("Tensor", "student_weight"), ("Tensor", "teacher_input"),
         ("Tensor", "teacher_weight"), ("Tensor?", "targets"), ("Tensor?", "student_bias"),
         ("Tensor?", "teacher_bias"), ("str", "student_layout"), ("str", "teacher_layout"), ("str", "divergence"),
         ("float", "beta"), ("int", "top_k"), ("bool", "add_tail")) + _OPTIONS
_TOPK_ARGS = (("Tensor", "input"), ("Tensor", "weight"), ("Tensor", "teacher_ids"), ("Tensor", "teacher_logprobs"),
              ("Tensor?", "targets"), ("Tensor?", "bias"), ("str", "layout"), ("bool", "add_tail")) + _OPTIONS


def _option_dict(a: dict, names) -> dict:
    return {name: a[name] for name in names}


class _Distill:
    """Everything one distillation call needs, checked and in library form: the student's and the teacher's
    TorchLinear (each float32 or bfloat16, hidden [..., H] with the same number of tokens; the teacher detached),
    targets (int64, the student hidden's leading shape or [N]; None: every token counts) and the options."""

    def __init__(self, a: dict):
        self.options = distill_options(**_option_dict(a, ("divergence", "beta", "top_k", "add_tail") +
                                                      tuple(n for _, n in _OPTIONS)))
        self.lin = prefixed_errors("student", TorchLinear, a["student_input"], a["student_weight"],
                                   a["student_bias"], a["student_layout"])
        self.teacher = prefixed_errors("teacher", TorchLinear, a["teacher_input"], a["teacher_weight"],
                                       a["teacher_bias"], a["teacher_layout"])
        self.token_shape = self.lin.hidden_shape[:-1]
        self.targets = _targets(a["targets"], self.token_shape, self.lin.n, "the student input's leading dimensions")
        if (self.lin.n == 0) != (self.teacher.n == 0):
            raise ValueError(f"teacher_input: expected as many tokens as the student's ({self.lin.n}), got "
                             f"{self.teacher.n}")
        self.problem = None
        if self.lin.n > 0:  # N = 0: nothing to compute (the library is not called)
            self.problem = DistillProblem(self.lin.head, self.teacher.head, opt_view(self.targets), self.options)


class _DistillTopk:
    """One top-k distillation call, checked and in library form: the student's TorchLinear, the teacher's ids
    (int64) and log-probs (float32), both [..., k] with the input's leading shape or [N, k] (contiguous copies only
    where needed), targets and the options."""

    def __init__(self, a: dict):
        self.options = distill_topk_options(**_option_dict(a, ("add_tail",) + tuple(n for _, n in _OPTIONS)))
        self.lin = TorchLinear(a["input"], a["weight"], a["bias"], a["layout"])
        self.token_shape = self.lin.hidden_shape[:-1]
        n = self.lin.n
        teacher_ids, teacher_logprobs = a["teacher_ids"], a["teacher_logprobs"]
        check_tensor(teacher_ids, "teacher_ids", torch.int64, INT64_HINT)
        check_tensor(teacher_logprobs, "teacher_logprobs", torch.float32, FP32_HINT)
        shape = tuple(teacher_ids.shape)
        if shape != tuple(teacher_logprobs.shape) or len(shape) < 1 or shape[:-1] not in (self.token_shape, (n,)):
            raise ValueError(f"teacher_ids {list(teacher_ids.shape)} and teacher_logprobs "
                             f"{list(teacher_logprobs.shape)}: expected both {list(self.token_shape) + ['k']} (the "
                             f"input's leading dimensions) or [{n}, k]")
        k = shape[-1]
        self.ids = teacher_ids.detach().reshape(n, k).contiguous()
        self.logprobs = teacher_logprobs.detach().reshape(n, k).contiguous()
        self.targets = _targets(a["targets"], self.token_shape, n, "the input's leading dimensions")
        self.problem = None
        if n > 0:  # N = 0: nothing to compute (the library is not called)
            self.problem = DistillTopkProblem(self.lin.head, view(self.ids), view(self.logprobs),
                                              opt_view(self.targets), self.options)


def _targets(targets: Optional[torch.Tensor], token_shape, n: int, what: str) -> Optional[torch.Tensor]:
    if targets is None:
        return None
    check_tensor(targets, "targets", torch.int64, INT64_HINT)
    return token_vector(targets.detach(), "targets", token_shape, n, what)


def _train(make: Callable) -> Callable:
    """'mean'/'sum': (loss, soft_loss, hard_loss) and the gradients of the loss (upstream 1)."""
    def run(a: dict, need, context: Optional[Context]):
        d = make(a)
        result, grads = train_step(d.problem, d.lin, context, need)
        loss, soft, hard = result if result is not None else (None, None, None)
        dtype = d.lin.dtype
        return (scalar(loss, dtype), scalar(soft, dtype), scalar(hard, dtype)), grads
    return run


def _per_token(d, context: Optional[Context], grad_output: Optional[torch.Tensor] = None, grads=None):
    """'none': (per-token loss in the student's dtype, soft_loss, hard_loss): the forward, or with a per-token
    grad_output the forward_backward into grads (the library's fh_linear_grads; the logits are recomputed: the
    library has no separate distillation backward)."""
    per_token = torch.zeros(d.lin.n, dtype=torch.float32)
    loss = soft = hard = None
    if d.lin.computes:
        ctx = context or default_context()
        if grad_output is None:
            loss, soft, hard = d.problem.forward(ctx, per_token.data_ptr())
        else:
            loss, soft, hard = d.problem.forward_backward(ctx, grad_output.data_ptr(), grads, per_token.data_ptr())
    dtype = d.lin.dtype
    return per_token.view(d.token_shape).to(dtype), scalar(soft, dtype), scalar(hard, dtype)


def _forward_none(make: Callable) -> Callable:
    return lambda a, context: _per_token(make(a), context)


def _backward_none(make: Callable) -> Callable:
    def backward(a: dict, saved, upstream, need, context: Optional[Context]):
        d = make(a)
        (grad,) = upstream
        dx, dw, db = d.lin.alloc_grads(*need)
        if d.lin.computes and grad is not None:
            g = token_vector(grad.to(torch.float32), "grad_output", d.token_shape, d.lin.n, "per token")
            _per_token(d, context, g, d.lin.grads_struct(dx, dw, db))
        return dx, dw, db
    return backward


class _Head:
    """A distillation head's two ops: the train step ('mean'/'sum') and the per-token pair ('none')."""

    def __init__(self, name: str, args, make: Callable, grad_args, entry: str):
        self.train = TrainStep(name, args, 3, _train(make), entry, grad_args)
        self.none = SplitStep(f"{name}_none", args, 3, differentiable=(0,), saved=(), forward=_forward_none(make),
                              backward=_backward_none(make), entry=entry, grad_args=grad_args)

    def call(self, context: Optional[Context], **values):
        step = self.none if values["reduction"] in ("none", Reduction.NONE) else self.train
        return step(context, **values)


_DISTILL = _Head("distill", _ARGS, _Distill, ("student_input", "student_weight", "student_bias"), "fh_distill")
_DISTILL_TOPK = _Head("distill_topk", _TOPK_ARGS, _DistillTopk, ("input", "weight", "bias"), "fh_distill_topk")


def _distill_option_dict(divergence, beta, temperature, weight_soft_loss, weight_hard_loss, ignore_index,
                         reduction, top_k=0, add_tail=True) -> dict:
    options = dict(divergence=divergence, beta=beta, temperature=temperature, weight_soft_loss=weight_soft_loss,
                   weight_hard_loss=weight_hard_loss, ignore_index=ignore_index, reduction=reduction, top_k=top_k,
                   add_tail=add_tail)
    distill_options(**options)  # bad names, choices and types fail here; values in the library
    return options


def fused_linear_distillation_loss(student_input: torch.Tensor, student_weight: torch.Tensor,
                                   teacher_input: torch.Tensor, teacher_weight: torch.Tensor,
                                   targets: Optional[torch.Tensor] = None, *,
                                   student_bias: Optional[torch.Tensor] = None,
                                   teacher_bias: Optional[torch.Tensor] = None, divergence: str = "jsd",
                                   beta: float = 0.5, temperature: float = 1.0, weight_soft_loss: float = 1.0,
                                   weight_hard_loss: float = 0.0, ignore_index: int = -100, reduction: str = "mean",
                                   top_k: int = 0, add_tail: bool = True, student_layout: str = "vh",
                                   teacher_layout: str = "vh", return_soft_hard_loss: bool = False,
                                   context: Optional[Context] = None):
    """Distillation of a student lm_head towards a teacher's over the same vocabulary, without either's [N, V]
    logits (TRL's GKD generalized_jsd_loss, Liger's fused linear JSD / distillation losses; include/fusedhead.h,
    "Distillation", has the formulas).

    s, t: the student's and teacher's logits (F.linear(input, weight, bias)) over temperature; p, q their
    softmaxes. divergence "forward_kl": KL(q || p); "reverse_kl": KL(p || q); "jsd": beta KL(q || m) +
    (1 - beta) KL(p || m) with m = beta q + (1 - beta) p (beta 0 is forward_kl, 1 reverse_kl, as TRL and Liger
    define them). Per token l = weight_soft_loss D + weight_hard_loss CE(student's untempered logits, target),
    over the tokens whose target is not ignore_index; 'mean' divides by their count (0 when there is none, with
    zero gradients), 'sum' adds them, 'none' returns them per token (0 where ignored). No temperature^2 factor.

    top_k > 0 (and < V): the divergence over each token's support, as TRL's generalized_jsd_loss(top_k, add_tail)
    (IWOPDTrainer, trl/experimental/iw_opd, TRL 1.16.0): the teacher's top_k for forward_kl, the student's for
    reverse_kl, their union for jsd; both distributions renormalised over it, or with add_tail their log-probs
    there plus one entry for the mass outside it. The selection reads the fp32 tempered logits, ties to the lower
    id (TRL selects on the logits in their own dtype). top_k 0 or >= V is the whole vocabulary.

    student_input [..., H_s] and teacher_input [..., H_t] hold the same N tokens; weights [V, H] (layout "vh",
    nn.Linear.weight) or [H, V] ("hv"), each its own layout; biases [V]. targets int64 with the student input's
    leading shape (or [N]); optional when weight_hard_loss is 0 (every token counts). The teacher gets no
    gradient: its tensors are detached (as TRL and Liger run the teacher under torch.no_grad()). Each head is
    float32 or bfloat16 (its input and weight alike); the loss comes back in the student's dtype, the student's
    gradients in its tensors' dtypes. Returns the loss, or (loss, soft_loss, hard_loss) with
    return_soft_hard_loss=True (the unweighted divergence and cross-entropy parts, reduced like the loss, summed
    over tokens for 'none'; detached; hard_loss is the cross-entropy also when weight_hard_loss is 0, and 0
    without targets).
    """
    detach = lambda t: t.detach() if isinstance(t, torch.Tensor) else t  # noqa: E731
    loss, soft, hard = _DISTILL.call(
        context, student_input=student_input, student_weight=student_weight,
        teacher_input=detach(teacher_input), teacher_weight=detach(teacher_weight), targets=targets,
        student_bias=student_bias, teacher_bias=detach(teacher_bias), student_layout=student_layout,
        teacher_layout=teacher_layout, divergence=divergence, beta=beta, top_k=top_k, add_tail=add_tail,
        temperature=temperature, weight_soft_loss=weight_soft_loss, weight_hard_loss=weight_hard_loss,
        ignore_index=ignore_index, reduction=reduction)
    return (loss, soft, hard) if return_soft_hard_loss else loss


class FusedLinearDistillationLoss(torch.nn.Module):
    """nn.Module form of fused_linear_distillation_loss (options fixed at construction; the weights are forward
    arguments, as in the other modules):

        loss_fn = FusedLinearDistillationLoss(divergence="jsd", beta=0.5, temperature=2.0, weight_hard_loss=0.5)
        loss = loss_fn(student_hidden, student.lm_head.weight, teacher_hidden, teacher.lm_head.weight, labels)
    """

    def __init__(self, divergence: str = "jsd", beta: float = 0.5, temperature: float = 1.0,
                 weight_soft_loss: float = 1.0, weight_hard_loss: float = 0.0, ignore_index: int = -100,
                 reduction: str = "mean", top_k: int = 0, add_tail: bool = True, student_layout: str = "vh",
                 teacher_layout: str = "vh", return_soft_hard_loss: bool = False, context: Optional[Context] = None):
        super().__init__()
        parse_layout(student_layout)
        parse_layout(teacher_layout)
        self.options = _distill_option_dict(divergence, beta, temperature, weight_soft_loss, weight_hard_loss,
                                            ignore_index, reduction, top_k, add_tail)
        self.student_layout, self.teacher_layout = student_layout, teacher_layout
        self.return_soft_hard_loss, self.context = return_soft_hard_loss, context

    def forward(self, student_input: torch.Tensor, student_weight: torch.Tensor, teacher_input: torch.Tensor,
                teacher_weight: torch.Tensor, targets: Optional[torch.Tensor] = None,
                student_bias: Optional[torch.Tensor] = None, teacher_bias: Optional[torch.Tensor] = None):
        return fused_linear_distillation_loss(student_input, student_weight, teacher_input, teacher_weight, targets,
                                              student_bias=student_bias, teacher_bias=teacher_bias,
                                              student_layout=self.student_layout, teacher_layout=self.teacher_layout,
                                              return_soft_hard_loss=self.return_soft_hard_loss, context=self.context,
                                              **self.options)

    def extra_repr(self) -> str:
        return (", ".join(f"{k}={v!r}" for k, v in self.options.items()) +
                f", student_layout={self.student_layout!r}, teacher_layout={self.teacher_layout!r}")


class FusedLinearJSDLoss(torch.nn.Module):
    """Liger's LigerFusedLinearJSD: the generalized JSD between the student's and the teacher's tempered
    distributions (jsd_beta 0 is forward KL, 1 reverse KL), the mean over the tokens whose shift_labels are not
    ignore_index (every token without shift_labels); no hard-label term.

        loss_fn = FusedLinearJSDLoss(jsd_beta=0.5, temperature=2.0)
        loss = loss_fn(student_hidden, student.lm_head.weight, teacher_hidden, teacher.lm_head.weight, labels)
    """

    def __init__(self, jsd_beta: float = 0.5, ignore_index: int = -100, temperature: float = 1.0,
                 student_layout: str = "vh", teacher_layout: str = "vh", context: Optional[Context] = None):
        super().__init__()
        parse_layout(student_layout)
        parse_layout(teacher_layout)
        self.options = _distill_option_dict("jsd", jsd_beta, temperature, 1.0, 0.0, ignore_index, "mean")
        self.jsd_beta, self.ignore_index, self.temperature = jsd_beta, ignore_index, temperature
        self.student_layout, self.teacher_layout, self.context = student_layout, teacher_layout, context

    def forward(self, student_input: torch.Tensor, student_weight: torch.Tensor, teacher_input: torch.Tensor,
                teacher_weight: torch.Tensor, shift_labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        return fused_linear_distillation_loss(student_input, student_weight, teacher_input, teacher_weight,
                                              shift_labels, student_layout=self.student_layout,
                                              teacher_layout=self.teacher_layout, context=self.context,
                                              **self.options)

    def extra_repr(self) -> str:
        return (f"jsd_beta={self.jsd_beta!r}, ignore_index={self.ignore_index!r}, temperature={self.temperature!r}, "
                f"student_layout={self.student_layout!r}, teacher_layout={self.teacher_layout!r}")


# top-k teacher
def fused_linear_distillation_topk_loss(input: torch.Tensor, weight: torch.Tensor, teacher_ids: torch.Tensor,
                                        teacher_logprobs: torch.Tensor, targets: Optional[torch.Tensor] = None, *,
                                        bias: Optional[torch.Tensor] = None, add_tail: bool = True,
                                        temperature: float = 1.0, weight_soft_loss: float = 1.0,
                                        weight_hard_loss: float = 0.0, ignore_index: int = -100,
                                        reduction: str = "mean", layout: str = "vh",
                                        return_soft_hard_loss: bool = False, context: Optional[Context] = None):
    """Forward KL of a student lm_head towards a teacher given per token as its top-k token ids and log-probs (a
    vLLM server's top_logprobs; TRL's ServerDistillationTrainer with loss_top_k = k, loss_add_tail = add_tail,
    beta 0; include/fusedhead.h, "Top-k teacher distillation", has the formulas), without the [N, V] logits.

    The student's log-probs are log_softmax(F.linear(input, weight, bias) / temperature); the teacher's are taken
    as given (the server applied its temperature). With add_tail both sides get a (k+1)-th entry for the mass
    outside the support, log(1 - exp(min(logsumexp, -1e-7))); without it both renormalise over the support (k = 1
    is then 0). A log-prob of -inf marks a padded entry (its id is not read); a token with none left adds 0 and is
    counted. Per token l = weight_soft_loss D + weight_hard_loss CE(untempered logits, target), over the tokens
    whose target is not ignore_index; 'mean' divides by their count (TRL's batchmean), 'sum' adds, 'none' returns
    them per token. input [..., H]; weight [V, H] ("vh") or [H, V] ("hv"); teacher_ids int64 and teacher_logprobs
    float32 [..., k] (or [N, k]); targets int64 with the input's leading shape (or [N]), optional when
    weight_hard_loss is 0. Returns the loss, or (loss, soft_loss, hard_loss) with return_soft_hard_loss=True.
    """
    loss, soft, hard = _DISTILL_TOPK.call(
        context, input=input, weight=weight, teacher_ids=teacher_ids, teacher_logprobs=teacher_logprobs,
        targets=targets, bias=bias, layout=layout, add_tail=add_tail, temperature=temperature,
        weight_soft_loss=weight_soft_loss, weight_hard_loss=weight_hard_loss, ignore_index=ignore_index,
        reduction=reduction)
    return (loss, soft, hard) if return_soft_hard_loss else loss
