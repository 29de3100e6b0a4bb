"""Stand-ins that let TRL's own trainer loss code run on given hidden states and an lm_head weight, without a model
or a trainer: a causal LM whose body returns registered hidden states, with TRL's own fused LM head
(trl.trainer.utils.add_fused_lm_head), and the `self` the trainers' loss methods read, as their __init__ would set
it for one CPU process (a real accelerate.Accelerator, TRL's defaultdict of metrics). Building real trainers would
cost seconds each.

Shared by test_trl_own_losses.py (fusedhead's heads against TRL's code) and bench/peers.py (TRL's GRPO loss timed
against fusedhead's), so that both run the same TRL code the same way. Read against TRL 1.16.0.
"""
from __future__ import annotations

import types
from collections import defaultdict
from typing import Optional

import accelerate
import torch
import transformers
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.utils import add_fused_lm_head


def _key(ids: torch.Tensor):
    return tuple(ids.shape), tuple(ids.flatten().tolist())


class _Backbone(torch.nn.Module):
    """The decoder body: the hidden states registered for the input ids it is called with."""

    def __init__(self):
        super().__init__()
        self.table = {}

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        return types.SimpleNamespace(last_hidden_state=self.table[_key(input_ids)])


class StandInLM(torch.nn.Module):
    """A causal LM whose body returns given hidden states and whose lm_head holds the given weight and bias, with
    TRL's fused LM head (add_fused_lm_head) at the given temperature. With share_weight the lm_head's weight is
    the given tensor itself (a benchmark's leaf, its .grad kept across steps), not a copy."""

    def __init__(self, weight, bias=None, temperature=1.0,
                 outputs=("entropy", "log_sum_sq_probs", "mean_logits", "is_top1"), share_weight: bool = False):
        super().__init__()
        self.config = transformers.PretrainedConfig()
        self.backbone = _Backbone()
        self.lm_head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                                       dtype=weight.dtype)
        if share_weight:
            self.lm_head.weight = torch.nn.Parameter(weight, requires_grad=weight.requires_grad)
        else:
            with torch.no_grad():
                self.lm_head.weight.copy_(weight)
        if bias is not None:
            with torch.no_grad():
                self.lm_head.bias.copy_(bias)
        add_fused_lm_head(self, temperature=temperature, outputs=outputs)

    @property
    def base_model(self):
        return self.backbone

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, attention_mask=None, **kwargs):  # replaced by add_fused_lm_head's forward
        raise NotImplementedError

    def register(self, input_ids, hidden):
        self.backbone.table[_key(input_ids)] = hidden


def trainer_self(model, **attributes):
    """What the trainers' loss methods read from self, as their __init__ sets it for one CPU process."""
    accelerator = accelerate.Accelerator(cpu=True)
    ns = types.SimpleNamespace(model=model, accelerator=accelerator, state=types.SimpleNamespace(global_step=0),
                               _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
                               _total_train_tokens=0, _tp_size=1, aux_loss_enabled=False)
    for name, value in attributes.items():
        setattr(ns, name, value)
    return ns


def grpo_trainer_self(model, *, loss_type: str, importance_sampling_level: str, epsilon: float,
                      epsilon_high: Optional[float], delta: Optional[float], beta: float,
                      use_bias_correction_kl: bool, sapo_temperature_pos: float, sapo_temperature_neg: float,
                      max_completion_length: int, entropy_coef: float, top_entropy_quantile: float,
                      off_policy_mask_threshold: Optional[float], use_vllm: bool,
                      vllm_importance_sampling_correction: bool, vespo: dict):
    """GRPOTrainer's `self` for _compute_loss (GRPOConfig's names; max_completion_length is never None in
    GRPOConfig, 256 by default), with its own _get_per_token_logps_and_entropies and get_high_entropy_mask bound."""
    args = types.SimpleNamespace(use_bias_correction_kl=use_bias_correction_kl, delta=delta,
                                 sapo_temperature_pos=sapo_temperature_pos,
                                 sapo_temperature_neg=sapo_temperature_neg, steps_per_generation=1,
                                 entropy_target=0.0, report_to=[], **vespo)
    ns = trainer_self(model, args=args, loss_type=loss_type, importance_sampling_level=importance_sampling_level,
                      epsilon_low=epsilon, epsilon_high=epsilon if epsilon_high is None else epsilon_high,
                      beta=beta, top_entropy_quantile=top_entropy_quantile,
                      off_policy_mask_threshold=off_policy_mask_threshold, use_vllm=use_vllm,
                      vllm_importance_sampling_correction=vllm_importance_sampling_correction,
                      max_completion_length=max_completion_length, current_gradient_accumulation_steps=1,
                      entropy_coef=entropy_coef, use_adaptive_entropy=False,
                      _entropy_bonus_enabled=entropy_coef != 0.0, _last_world_entropy=float("inf"),
                      _entropy_window_stats=None,
                      get_off_policy_mask=GRPOTrainer.get_off_policy_mask,
                      get_gamma_weights=GRPOTrainer.get_gamma_weights)
    ns._get_per_token_logps_and_entropies = types.MethodType(GRPOTrainer._get_per_token_logps_and_entropies, ns)
    ns.get_high_entropy_mask = types.MethodType(GRPOTrainer.get_high_entropy_mask, ns)
    return ns
