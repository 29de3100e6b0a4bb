"""PyTorch front end: every fusedhead head as a functional and an nn.Module, differentiable, and traceable by
torch.compile with no graph break (torch >= 2.4: custom ops, fusedhead/torch/_ops.py).

    from fusedhead.torch import fused_linear_cross_entropy
    loss = fused_linear_cross_entropy(hidden, lm_head.weight, targets)   # == F.cross_entropy(F.linear(...))
    loss.backward()

Semantics: F.cross_entropy(F.linear(hidden, weight, bias).view(-1, V), targets.view(-1), weight=class_weights,
ignore_index=..., reduction=..., label_smoothing=...), plus a logit scale (m * u, before the softcap), Gemma-style
logit softcap (c * tanh(m u / c)), z-loss (z_loss * lse^2, averaged over non-ignored tokens for 'mean', never
class-weighted, added to the loss) and DFT's token scaling (each token's loss times its target's probability,
detached); return_entropy / return_correct add the per-token entropy and the correct count. causal_lm_loss is Hugging
Face's ForCausalLMLoss (labels shifted by one, sum over num_items_in_batch or mean) on the same call.
One documented difference: when every token is ignored (or every target has class weight 0), 'mean' gives
loss 0 and zero gradients where torch gives NaN. N = 0 tokens behaves the same way.

Inputs: CPU tensors; hidden and weight both float32 or both bfloat16 (mixed: TypeError); bias and
class_weights float32 (with bfloat16 inputs bfloat16 too, converted to float32: [V] copies); targets int64.
hidden is [..., H] (e.g. [B, T, H]) and targets hidden's leading shape (or flat [N]); weight is [V, H]
(layout="vh", nn.Linear.weight, the default) or [H, V] (layout="hv"). Anything else raises TypeError /
ValueError saying what was expected.

bfloat16: the library reads the tensors' own bf16 bits with their strides (no float32 copy of hidden or
weight), runs its GEMMs in bf16 with f32 accumulation and every statistic in fp32/double (docs/bf16.md).
Outputs follow F.cross_entropy(F.linear(hidden, weight), ...) on bf16 tensors: the loss (and z_loss, and
the per-token losses of 'none') in bfloat16, the library's value rounded once; the gradients of hidden,
weight and bias in their own dtypes, written by the library in that dtype (bf16: accumulated in f32 inside
the call, rounded once; no float32 gradient buffer exists). GRPO's and the preference heads' metrics are
Python floats, their per-token / per-sequence log-probs and rewards float32 whatever the dtype.

Copies (only where the library cannot take the tensor as it is):
  - hidden: none when its rows have unit element stride (contiguous, or row-padded 2-D slices); [B, T, H]
    is flattened with reshape (a view when possible); otherwise one contiguous copy.
  - weight: none for any positive non-overlapping strides (contiguous, transposed, sliced); else a copy.
  - targets, bias, class_weights: a copy only when not contiguous ([N] / [V] vectors, cheap).
  - the per-token upstream gradient of reduction='none': made contiguous (autograd often passes an
    expanded, zero-stride tensor).

Gradients: only for inputs that require grad (the library is handed NULL for the others).
  - 'mean'/'sum' with grad enabled: the forward calls fh_ce_forward_backward with upstream gradient 1
    (6 NHV flops instead of 8 for forward + backward, as Liger does); backward scales the saved gradients by
    the incoming scalar (no work when it is 1; otherwise into new tensors, the saved ones untouched). The
    gradients (dweight is V x H) are held from forward to backward.
  - dweight buffers (in the weight's dtype) are recycled per weight (at most two, freed with the weight): one
    is handed out again only when no tensor refers to it any more, so .grad, hooks and torch.autograd.grad see
    what a fresh tensor would give them, without a fresh tensor's page faults (see _tensors.DweightPool).
  - 'none': the forward (fh_ce_forward) saves lse [N]; backward calls fh_ce_backward with the per-token
    upstream gradient. The library refuses a non-finite upstream value, so the binding passes 0 for it and makes
    that token's dx row and all of dweight and dbias NaN, as torch's NaN propagation does ('mean'/'sum' scale the
    saved gradients, so a NaN propagates there by itself).
  - Without grad (torch.no_grad, or nothing requires grad): forward only.
Double backward (create_graph=True) raises RuntimeError: the gradients are the library's numbers, not torch
operations, so a graph built on them would be wrong.

torch.compile (torch >= 2.4): each head is a torch.library.custom_op ("fusedhead::cross_entropy", ...) with a
fake implementation (the real one run on fake tensors: bad shapes, dtypes and devices raise while tracing, where
Dynamo reports them as a TorchRuntimeError whose __cause__ is fusedhead's error) and an autograd formula; options
are Python values the trace specialises on. Compiled, the metrics of GRPO, the preference heads and KTO are 0-d
tensors for every key (NaN where TRL logs nothing), and a backward always multiplies the saved gradients by the
upstream scalar (eagerly, an upstream 1 returns them as they are). On older torch the same implementations run
inside an autograd.Function.

GRPO: fused_linear_grpo_loss / FusedLinearGRPOLoss compute TRL's
GRPOTrainer._compute_loss of TRL 1.16.0 (every loss_type, luspo and vespo included, token or sequence
importance sampling, KL and its bias correction, the entropy bonus, top_entropy_quantile, the off-policy mask, the
vLLM importance-sampling correction from sampling_per_token_logps) from hidden [B, T, H]; returns (loss, metrics
with TRL's keys). With grad enabled the forward calls
fh_grpo_forward_backward (upstream 1) and backward scales the saved gradients, as for 'mean'/'sum' above.

Preference: fused_linear_preference_loss / FusedLinearDPOLoss, FusedLinearORPOLoss, FusedLinearSimPOLoss,
FusedLinearCPOLoss compute TRL's DPO, ORPO, SimPO and CPO losses from the
hidden states of 2B sequences, the chosen ones then the rejected ones (Liger's layout); they return (loss,
metrics with TRL's keys, sequence log-probs, rewards). Gradients as for GRPO (fh_preference_forward_backward).

KTO: fused_linear_kto_loss / FusedLinearKTOLoss compute TRL's KTO loss (KTOTrainer,
loss types "kto" and "apo_zero_unpaired") from the hidden states of B sequences, each desirable or undesirable;
they return (loss, metrics with TRL's keys, sequence log-probs, rewards). Gradients as for GRPO
(fh_kto_forward_backward).

Distillation: fused_linear_distillation_loss / FusedLinearDistillationLoss, FusedLinearJSDLoss (Liger's
LigerFusedLinearJSD) compute forward KL, reverse KL or the generalized JSD
(TRL's GKD generalized_jsd_loss) between a student head and a teacher head over the same vocabulary, plus a
weighted hard-label cross-entropy, from both heads' hidden states and weights (the teacher's hidden size, layout
and dtype may differ). The teacher is detached: it never gets a gradient. 'mean'/'sum': gradients as for GRPO
(fh_distill_forward_backward, upstream 1, scaled in backward). 'none': the forward runs fh_distill_forward and
backward fh_distill_forward_backward with the per-token upstream gradient (the logits computed twice).
fused_linear_distillation_topk_loss: the same towards a teacher given per
token as its top-k ids and log-probs (a vLLM server's answer; TRL's server distillation), no teacher head.
fused_linear_eagle3_loss: SpecForge's EAGLE-3 draft-head loss, a draft lm_head over a subset of the target's
vocabulary towards the frozen target head renormalised over it.

Log-probs: fused_linear_logprobs gives per-token log p(target) (and the entropy and
log-sum-exp) of softmax(softcap(logit_scale (x W + b)) / temperature), differentiable, so that any loss on [N]
vectors (a GRPO variant, a preference loss) backpropagates into hidden, weight and bias without [N, V] logits: the
forward runs fh_logprob_forward (saving lse and the entropy), backward fh_logprob_backward with the upstream
gradients of the outputs used (8 N H V flops in all). Outputs are float32 whatever the inputs' dtype.
"""
from .cross_entropy import CrossEntropyOutput, FusedLinearCrossEntropy, causal_lm_loss, fused_linear_cross_entropy
from .distill import (FusedLinearDistillationLoss, FusedLinearJSDLoss, fused_linear_distillation_loss,
                      fused_linear_distillation_topk_loss)
from .draft_heads import fused_linear_eagle3_loss
from .grpo import FusedLinearGRPOLoss, fused_linear_grpo_loss
from .kto import FusedLinearKTOLoss, KTOLossOutput, fused_linear_kto_loss
from .logprobs import fused_linear_logprobs
from .preference import (FusedLinearCPOLoss, FusedLinearDPOLoss, FusedLinearORPOLoss, FusedLinearSimPOLoss,
                         PreferenceLossOutput, fused_linear_preference_loss)

__all__ = ["fused_linear_cross_entropy", "FusedLinearCrossEntropy", "CrossEntropyOutput", "causal_lm_loss",
           "fused_linear_logprobs", "fused_linear_grpo_loss", "FusedLinearGRPOLoss",
           "fused_linear_preference_loss", "PreferenceLossOutput", "FusedLinearDPOLoss", "FusedLinearORPOLoss",
           "FusedLinearSimPOLoss", "FusedLinearCPOLoss", "fused_linear_kto_loss", "FusedLinearKTOLoss",
           "KTOLossOutput", "fused_linear_distillation_loss", "FusedLinearDistillationLoss", "FusedLinearJSDLoss",
           "fused_linear_distillation_topk_loss", "fused_linear_eagle3_loss"]
