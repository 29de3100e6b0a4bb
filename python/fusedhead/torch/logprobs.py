"""Per-token log-probs (and entropies and log-sum-exps), differentiable: fused_linear_logprobs, the primitive for a
loss fusedhead has no head for."""
from __future__ import annotations

from typing import Optional

import torch

from .._core import Context, LogprobProblem, View, default_context
from ._ops import SplitStep
from ._tensors import INT64_HINT, TorchLinear, check_tensor, contiguous_vector, support_of, token_vector, view

_ARGS = (("Tensor", "hidden"), ("Tensor", "weight"), ("Tensor", "targets"), ("Tensor?", "bias"),
         ("int", "ignore_index"), ("float", "temperature"), ("float?", "softcap"), ("float?", "logit_scale"),
         ("str", "layout"), ("bool", "want_entropy"), ("bool", "keep_logits"))


_SUPPORT_ARGS = _ARGS[:3] + (("Tensor", "support_ids"), ("Tensor?", "support_offsets")) + _ARGS[3:-1]


class _Logprobs:
    """Everything one log-prob call needs, checked and in library form (over a support when a["support_ids"])."""

    def __init__(self, a: dict):
        self.lin = TorchLinear(a["hidden"], a["weight"], a["bias"], a["layout"])
        check_tensor(a["targets"], "targets", torch.int64, INT64_HINT)
        self.token_shape = self.lin.hidden_shape[:-1]
        self.targets = token_vector(a["targets"], "targets", self.token_shape, self.lin.n,
                                    "hidden's leading dimensions")
        targets_view = view(self.targets) if self.lin.n > 0 else View(0, (1,), (1,))
        support = None
        if "support_ids" in a:
            support = support_of(a["support_ids"], a["support_offsets"], self.token_shape, self.lin.n)
        self.problem = LogprobProblem(self.lin.head, targets_view, ignore_index=a["ignore_index"],
                                      temperature=a["temperature"], softcap=a["softcap"],
                                      logit_scale=a["logit_scale"], support=support)


def _forward(a: dict, context: Optional[Context]):
    """(logp, entropy, lse), float32 of the targets' shape (the entropy computed only when asked for, 0 else), and the
    logits [N, V] float32 that the backward reads instead of recomputing them when keep_logits is asked for and the
    context keeps them (Context.keeps_logits), else an empty tensor."""
    lp = _Logprobs(a)
    ctx = context or default_context()
    keep = a["keep_logits"] and ctx.keeps_logits(lp.lin.n, lp.lin.vocab)
    logp, entropy, lse = (torch.zeros(lp.lin.n, dtype=torch.float32) for _ in range(3))
    logits = torch.empty((lp.lin.n, lp.lin.vocab) if keep else (0,), dtype=torch.float32)
    if lp.lin.computes:
        lp.problem.forward(ctx, logp=logp.data_ptr(), entropy=entropy.data_ptr() if a["want_entropy"] else None,
                           lse=lse.data_ptr(), logits=logits.data_ptr() if keep else None)
    return (*(t.view(lp.token_shape) for t in (logp, entropy, lse)), logits)


def _backward(a: dict, saved, upstream, need, context: Optional[Context]):
    """fh_logprob_backward (fh_logprob_backward_kept on the logits the forward kept) with the upstream gradients of
    the outputs used (None: unused, the library's NULL)."""
    lp = _Logprobs(a)
    entropy, lse, logits = saved
    dx, dw, db = lp.lin.alloc_grads(*need)
    if lp.lin.computes and any(need):
        g = [None if t is None else contiguous_vector(t.reshape(lp.lin.n).to(torch.float32)) for t in upstream]
        lp.problem.backward(context or default_context(), lse.data_ptr(),
                            entropy.data_ptr() if g[1] is not None else None,
                            *(None if t is None else t.data_ptr() for t in g), lp.lin.grads_struct(dx, dw, db),
                            logits=logits.data_ptr() if logits.numel() else None)
    return dx, dw, db


_LOGPROBS = SplitStep("logprobs", _ARGS, 4, differentiable=(0, 1, 2), saved=(1, 2, 3), forward=_forward,
                      backward=_backward, entry="fh_logprob")


def _support_forward(a: dict, context: Optional[Context]):
    """(logp, entropy, lse) over the support, float32 of the targets' shape (the entropy 0 unless asked for)."""
    lp = _Logprobs(a)
    logp, entropy, lse = (torch.zeros(lp.lin.n, dtype=torch.float32) for _ in range(3))
    if lp.lin.computes:
        lp.problem.forward(context or default_context(), logp=logp.data_ptr(),
                           entropy=entropy.data_ptr() if a["want_entropy"] else None, lse=lse.data_ptr())
    return tuple(t.view(lp.token_shape) for t in (logp, entropy, lse))


def _support_backward(a: dict, saved, upstream, need, context: Optional[Context]):
    """fh_logprob_support_backward with the upstream gradients of the outputs used (None: the library's NULL)."""
    lp = _Logprobs(a)
    entropy, lse = saved
    dx, dw, db = lp.lin.alloc_grads(*need)
    if lp.lin.computes and any(need):
        g = [None if t is None else contiguous_vector(t.reshape(lp.lin.n).to(torch.float32)) for t in upstream]
        lp.problem.backward(context or default_context(), lse.data_ptr(),
                            entropy.data_ptr() if g[1] is not None else None,
                            *(None if t is None else t.data_ptr() for t in g), lp.lin.grads_struct(dx, dw, db))
    return dx, dw, db


_SUPPORT_LOGPROBS = SplitStep("logprobs_support", _SUPPORT_ARGS, 3, differentiable=(0, 1, 2), saved=(1, 2),
                              forward=_support_forward, backward=_support_backward, entry="fh_logprob_support")


def fused_linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                          return_entropy: bool = False, return_lse: bool = False, *,
                          bias: Optional[torch.Tensor] = None, ignore_index: int = -100,
                          softcap: Optional[float] = None, logit_scale: Optional[float] = None, layout: str = "vh",
                          context: Optional[Context] = None, support_ids: Optional[torch.Tensor] = None,
                          support_offsets: Optional[torch.Tensor] = None):
    """log_softmax(s).gather(-1, targets) with s = softcap(logit_scale F.linear(hidden, weight, bias)) / temperature,
    without the logits; differentiable with respect to hidden, weight and bias.

    Returns logp (float32, the targets' shape; 0 where the target is ignore_index), or a tuple (logp, entropy[,
    lse]) with return_entropy / return_lse: the entropy -sum p log p of softmax(s) and its log-sum-exp, also
    differentiable (0 and no gradient at ignored tokens). E.g. a GRPO-style loss:

        logp, entropy = fused_linear_logprobs(h, W, ids, temperature=0.9, return_entropy=True)
        ratio = torch.exp(logp - old_logp)
        loss = -(torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv) * mask).sum() / mask.sum()
        loss.backward()

    A non-finite upstream gradient raises InvalidGradOutputError (the library refuses it) instead of propagating.
    When a gradient will be taken and the [N, V] float32 logits take at most half of the context's memory budget
    (512 MiB by default), they are kept from the forward to the backward, which then reads them instead of
    recomputing them (three GEMMs of N H V for the pair instead of four); a smaller memory_budget recomputes.

    With support_ids, everything is over each token's support S (a sampler's kept set) instead of the vocabulary:
    logp = s_y - logsumexp over S, the entropy of softmax over S, lse over S (fh_logprob_support_*: one dot product
    per id, no logits, O(|S| H) per token). support_ids is padded, the tokens' shape + [k] with -1 as padding, or, with
    support_offsets ([N + 1], from 0), a 1-D CSR list (vLLM's sampling mask): token i's ids are
    support_ids[support_offsets[i]:support_offsets[i + 1]]. Each counted token's target must be in its support
    (InvalidSupportError otherwise, as for an id outside [0, V) or listed twice).
    """
    if support_ids is not None or support_offsets is not None:
        if support_ids is None:
            raise ValueError("support_offsets without support_ids: a CSR support is support_ids with support_offsets")
        logp, entropy, lse = _SUPPORT_LOGPROBS(context, hidden=hidden, weight=weight, targets=targets,
                                               support_ids=support_ids, support_offsets=support_offsets, bias=bias,
                                               ignore_index=ignore_index, temperature=temperature, softcap=softcap,
                                               logit_scale=logit_scale, layout=layout, want_entropy=return_entropy)
    else:
        logp, entropy, lse = _full_vocabulary(hidden, weight, targets, bias, ignore_index, temperature, softcap,
                                              logit_scale, layout, context, return_entropy)
    if not (return_entropy or return_lse):
        return logp
    return (logp, entropy, lse) if return_entropy and return_lse else (logp, entropy) if return_entropy else (logp, lse)


def _full_vocabulary(hidden, weight, targets, bias, ignore_index, temperature, softcap, logit_scale, layout, context,
                     return_entropy):
    """(logp, entropy, lse) over the whole vocabulary, keeping the logits for the backward when it will run."""
    # Keep the logits for the backward only when there will be one.
    keep = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                           for t in (hidden, weight, bias))
    logp, entropy, lse, _ = _LOGPROBS(context, hidden=hidden, weight=weight, targets=targets, bias=bias,
                                      ignore_index=ignore_index, temperature=temperature, softcap=softcap,
                                      logit_scale=logit_scale, layout=layout, want_entropy=return_entropy,
                                      keep_logits=keep)
    return logp, entropy, lse
