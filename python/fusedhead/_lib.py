"""ctypes mirror of include/fusedhead.h and the shared-library loader.

Nothing here knows about NumPy or torch: the structs take raw addresses. Field order and C types follow the
header exactly (int64_t -> c_int64, size_t -> c_size_t, double -> c_double, float -> c_float, enums -> c_int,
pointers -> POINTER(...)); python/tests/test_lib.py compiles a C program against the header and compares
sizeof/offsetof with these definitions.

Library lookup order (first hit wins):
  1. the environment variable FUSEDHEAD_LIBRARY: a path to libfusedhead.so (an error if it does not load);
  2. the copy inside the package directory, which `pip install .` puts there: an installed package loads the
     library built with it (a checkout's python/fusedhead holds none);
  3. the build tree the package was imported from: CMake links <build>/fusedhead to python/fusedhead, so
     `python3 -c "import fusedhead"` in a build directory loads that build's library;
  4. the build tree next to the package: <repo>/build/libfusedhead.so*, then <repo>/build*/libfusedhead.so*
     in name order (<repo> is the directory holding python/; the directory holding the package is tried too);
  5. the system: ctypes.util.find_library("fusedhead"), then "libfusedhead.so.0".
A library that is found but needs a shared library the system lacks (BLIS, SLEEF, oneDNN, OpenMP: the
distribution's, never bundled) raises MissingDependencyError naming it and the Debian package that provides it.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import enum
import os
import re
import threading
from pathlib import Path
from typing import List, Optional

c_float_p = ctypes.POINTER(ctypes.c_float)
c_double_p = ctypes.POINTER(ctypes.c_double)
c_int64_p = ctypes.POINTER(ctypes.c_int64)


# ---------------------------------------------------------------------------------------------------------
# Enums (values are the header's; they are stable)
# ---------------------------------------------------------------------------------------------------------
class Status(enum.IntEnum):
    OK = 0
    ERR_NULL_POINTER = 1
    ERR_INVALID_SIZE = 2
    ERR_INVALID_STRIDE = 3
    ERR_SIZE_OVERFLOW = 4
    ERR_TARGET_OUT_OF_RANGE = 5
    ERR_MISSING_OUTPUT = 6
    ERR_NONFINITE_INPUT = 7
    ERR_INVALID_LAYOUT = 8
    ERR_INVALID_DTYPE = 9
    ERR_INVALID_REDUCTION = 10
    ERR_INVALID_LABEL_SMOOTHING = 11
    ERR_INVALID_SOFTCAP = 12
    ERR_INVALID_Z_LOSS = 13
    ERR_INVALID_CLASS_WEIGHT = 14
    ERR_INVALID_BETA = 15
    ERR_INVALID_GRAD_OUTPUT = 16
    ERR_INVALID_MASK = 17
    ERR_INVALID_TEMPERATURE = 18
    ERR_INVALID_GRPO_OPTION = 19
    ERR_WORKSPACE_TOO_SMALL = 20
    ERR_OUT_OF_MEMORY = 21
    ERR_BUDGET_TOO_SMALL = 22
    ERR_WISDOM_IO = 23
    ERR_INVALID_WISDOM = 24
    ERR_OVERLAPPING_BUFFERS = 25
    ERR_INVALID_PARAM = 30
    ERR_INVALID_PARAM_VALUE = 31
    ERR_KERNELS_UNAVAILABLE = 32
    ERR_GEMM_FAILED = 40
    ERR_INVALID_PREFERENCE_OPTION = 50
    ERR_INVALID_DISTILL_OPTION = 51
    ERR_TEACHER_MISMATCH = 52
    ERR_INVALID_LOGIT_SCALE = 53
    ERR_INVALID_SUPPORT = 54
    ERR_MPI = 60
    ERR_MPI_LAYOUT = 61
    ERR_MPI_MISMATCH = 62


class Param(enum.IntEnum):
    THREADS = 0
    TILE_ROWS = 1
    TILE_VOCAB = 2
    MEMORY_BUDGET = 3
    CHECK_FINITE = 4
    FP32_DU = 5
    OVERSUBSCRIBE = 6
    GRAD_FILTER_TAIL = 7  # a FilterTail
    GRAD_FILTER_EPS = 8  # real-valued: fh_context_set_real / fh_context_get_real / fh_param_real_bounds
    BATCH_INVARIANT = 9


class Layout(enum.IntEnum):
    HV = 0  # weight stored [H, V] row-major (flax/JAX kernel)
    VH = 1  # weight stored [V, H] row-major (torch nn.Linear.weight)


class Dtype(enum.IntEnum):
    F32 = 0
    BF16 = 1  # raw bfloat16 bits, as torch.bfloat16 stores them


class FilterTail(enum.IntEnum):
    ESTIMATE = 0  # the skipped softmax terms replaced by a rank-one estimate (the default)
    DROP = 1      # left out, as Cut Cross-Entropy does


class Reduction(enum.IntEnum):
    MEAN = 0
    SUM = 1
    NONE = 2


class GRPOLossType(enum.IntEnum):
    GRPO = 0
    BNPO = 1
    DR_GRPO = 2
    DAPO = 3
    CISPO = 4
    SAPO = 5
    LUSPO = 6
    VESPO = 7


class GRPOISLevel(enum.IntEnum):
    TOKEN = 0
    SEQUENCE = 1


class GRPOVllmISMode(enum.IntEnum):  # TRL vllm_importance_sampling_mode
    TOKEN_TRUNCATE = 0
    TOKEN_MASK = 1
    SEQUENCE_TRUNCATE = 2
    SEQUENCE_MASK = 3


class PreferenceLoss(enum.IntEnum):
    DPO = 0
    ORPO = 1
    SIMPO = 2
    CPO = 3


class PreferenceLossType(enum.IntEnum):
    SIGMOID = 0
    HINGE = 1
    IPO = 2
    ROBUST = 3
    EXO_PAIR = 4
    NCA_PAIR = 5
    BCO_PAIR = 6
    SPPO_HARD = 7
    AOT = 8
    AOT_UNPAIRED = 9
    APO_ZERO = 10
    APO_DOWN = 11
    DISCOPOP = 12
    SFT = 13
    SIGMOID_NORM = 14


class DPOSemantics(enum.IntEnum):  # fh_preference_dpo_semantics: which TRL DPOTrainer dpo follows
    TRL_CURRENT = 0  # TRL >= v0.29.0 (the DPO refactor), as at f2cd5771
    TRL_0_28 = 1     # TRL v0.28.0


PREFERENCE_MAX_LOSS_TYPES = 16
DISTILL_TOPK_MAX_K = 1024  # FH_DISTILL_TOPK_MAX_K: the teacher's entries per token
DEFAULT_MEMORY_BUDGET = 512 << 20  # FH_DEFAULT_MEMORY_BUDGET: a call's workspace cap when the context's is 0


class KTOLossType(enum.IntEnum):
    KTO = 0
    APO_ZERO_UNPAIRED = 1


class Divergence(enum.IntEnum):
    FORWARD_KL = 0
    REVERSE_KL = 1
    JSD = 2


# ---------------------------------------------------------------------------------------------------------
# Structs
# ---------------------------------------------------------------------------------------------------------
class fh_kernel_info(ctypes.Structure):
    _fields_ = [
        ("kernel_set", ctypes.c_char_p),
        ("selected_by_library", ctypes.c_int),
        ("user_override", ctypes.c_int),
        ("elementwise", ctypes.c_char_p),
        ("bf16_gemm", ctypes.c_char_p),
        ("bf16_path", ctypes.c_char_p),
        ("refusal", ctypes.c_char_p),
        ("fp32_gemm", ctypes.c_char_p),
        ("fp32_path", ctypes.c_char_p),
    ]


class fh_filter_stats(ctypes.Structure):
    _fields_ = [("gradient_flops", ctypes.c_double), ("skipped_flops", ctypes.c_double)]


class fh_linear(ctypes.Structure):
    _fields_ = [
        ("n", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("vocab", ctypes.c_int64),
        ("x", ctypes.c_void_p),  # x_dtype elements
        ("x_row_stride", ctypes.c_int64),
        ("weight", ctypes.c_void_p),  # weight_dtype elements
        ("w_stride_hidden", ctypes.c_int64),
        ("w_stride_vocab", ctypes.c_int64),
        ("bias", c_float_p),
        ("x_dtype", ctypes.c_int),  # fh_dtype
        ("weight_dtype", ctypes.c_int),
    ]


class fh_linear_grads(ctypes.Structure):
    _fields_ = [
        ("dx", ctypes.c_void_p),  # float32, or bf16 bits when its dtype says
        ("dx_row_stride", ctypes.c_int64),
        ("dx_beta", ctypes.c_float),
        ("dweight", ctypes.c_void_p),
        ("dweight_beta", ctypes.c_float),
        ("dbias", ctypes.c_void_p),
        ("dbias_beta", ctypes.c_float),
        ("dx_dtype", ctypes.c_int),  # fh_dtype
        ("dweight_dtype", ctypes.c_int),
        ("dbias_dtype", ctypes.c_int),
    ]


class fh_ce_options(ctypes.Structure):
    _fields_ = [
        ("ignore_index", ctypes.c_int64),
        ("reduction", ctypes.c_int),  # fh_reduction
        ("label_smoothing", ctypes.c_double),
        ("class_weights", c_float_p),
        ("softcap", ctypes.c_double),
        ("z_loss", ctypes.c_double),
        ("logit_scale", ctypes.c_double),
        ("token_scaling", ctypes.c_int),
    ]


class fh_ce_outputs(ctypes.Structure):
    _fields_ = [
        ("loss", c_double_p),
        ("z_loss", c_double_p),
        ("per_token_loss", c_float_p),
        ("per_token_logp", c_float_p),
        ("lse", c_float_p),
        ("argmax", c_int64_p),
        ("entropy", c_float_p),
        ("correct", c_int64_p),
    ]


# Log-probs (fh_logprob_*)
class fh_logprob_options(ctypes.Structure):
    _fields_ = [
        ("ignore_index", ctypes.c_int64),
        ("temperature", ctypes.c_double),
        ("softcap", ctypes.c_double),
        ("logit_scale", ctypes.c_double),
    ]


class fh_logprob_outputs(ctypes.Structure):
    _fields_ = [("logp", c_float_p), ("entropy", c_float_p), ("lse", c_float_p)]


class fh_support(ctypes.Structure):
    _fields_ = [("ids", c_int64_p), ("offsets", c_int64_p), ("k", ctypes.c_int64)]


# GRPO (fh_grpo_*)
class fh_grpo_options(ctypes.Structure):
    _fields_ = [
        ("loss_type", ctypes.c_int),  # fh_grpo_loss_type
        ("importance_sampling_level", ctypes.c_int),  # fh_grpo_is_level
        ("temperature", ctypes.c_double),
        ("epsilon_low", ctypes.c_double),
        ("epsilon_high", ctypes.c_double),
        ("delta", ctypes.c_double),
        ("beta", ctypes.c_double),
        ("sapo_temperature_pos", ctypes.c_double),
        ("sapo_temperature_neg", ctypes.c_double),
        ("num_items_in_batch", ctypes.c_double),
        ("max_completion_length", ctypes.c_int64),
        ("entropy_coef", ctypes.c_double),
        ("top_entropy_quantile", ctypes.c_double),
        ("off_policy_mask_threshold", ctypes.c_double),  # NaN: off
        ("use_bias_correction_kl", ctypes.c_int),
        ("vllm_importance_sampling_correction", ctypes.c_int),
        ("vllm_importance_sampling_mode", ctypes.c_int),  # fh_grpo_vllm_is_mode
        ("vllm_importance_sampling_clip_min", ctypes.c_double),  # NaN: no bound
        ("vllm_importance_sampling_clip_max", ctypes.c_double),  # NaN: no bound
        ("vespo_k_pos", ctypes.c_double),
        ("vespo_lambda_pos", ctypes.c_double),
        ("vespo_k_neg", ctypes.c_double),
        ("vespo_lambda_neg", ctypes.c_double),
    ]


class fh_grpo_batch(ctypes.Structure):
    _fields_ = [
        ("batch", ctypes.c_int64),
        ("seq", ctypes.c_int64),
        ("completion_ids", c_int64_p),
        ("completion_mask", c_float_p),
        ("advantages", c_float_p),
        ("old_per_token_logps", c_float_p),
        ("ref_per_token_logps", c_float_p),
        ("sampling_per_token_logps", c_float_p),
        ("support", ctypes.POINTER(fh_support)),
        ("cu_seqlens", c_int64_p),
    ]


class fh_grpo_metrics(ctypes.Structure):
    _fields_ = [
        ("kl", ctypes.c_double),
        ("entropy", ctypes.c_double),
        ("clip_ratio_low_mean", ctypes.c_double),
        ("clip_ratio_high_mean", ctypes.c_double),
        ("clip_ratio_region_mean", ctypes.c_double),
        ("cispo_clip_ratio", ctypes.c_double),
        ("clip_ratio_low_min", ctypes.c_double),
        ("clip_ratio_high_max", ctypes.c_double),
        ("policy_loss", ctypes.c_double),
        ("entropy_coef", ctypes.c_double),
        ("vespo_phi_seq_mean", ctypes.c_double),
        ("sampling_logp_difference_mean", ctypes.c_double),
        ("sampling_logp_difference_max", ctypes.c_double),
        ("importance_sampling_ratio_min", ctypes.c_double),
        ("importance_sampling_ratio_mean", ctypes.c_double),
        ("importance_sampling_ratio_max", ctypes.c_double),
    ]


class fh_grpo_outputs(ctypes.Structure):
    _fields_ = [
        ("loss", c_double_p),
        ("metrics", ctypes.POINTER(fh_grpo_metrics)),
        ("per_token_logp", c_float_p),
        ("per_token_loss", c_float_p),
        ("entropy", c_float_p),
        ("lse", c_float_p),
    ]


# Preference heads (fh_preference_*: DPO, ORPO, SimPO, CPO)
class fh_preference_options(ctypes.Structure):
    _fields_ = [
        ("loss", ctypes.c_int),  # fh_preference_loss
        ("loss_type", ctypes.c_int),  # fh_preference_loss_type
        ("beta", ctypes.c_double),
        ("label_smoothing", ctypes.c_double),
        ("simpo_gamma", ctypes.c_double),
        ("rpo_alpha", ctypes.c_double),
        ("cpo_alpha", ctypes.c_double),
        ("dpo_semantics", ctypes.c_int),  # fh_preference_dpo_semantics
        ("loss_type_count", ctypes.c_int),
        ("loss_types", ctypes.c_int * PREFERENCE_MAX_LOSS_TYPES),
        ("loss_weights", ctypes.c_double * PREFERENCE_MAX_LOSS_TYPES),
        ("discopop_tau", ctypes.c_double),
        ("use_weighting", ctypes.c_int),
    ]


class fh_preference_batch(ctypes.Structure):
    _fields_ = [
        ("pairs", ctypes.c_int64),
        ("seq", ctypes.c_int64),
        ("targets", c_int64_p),
        ("mask", c_float_p),
        ("ref_logps", c_float_p),
        ("ref_per_token_logps", c_float_p),
        ("cu_seqlens", c_int64_p),
    ]


class fh_preference_metrics(ctypes.Structure):
    _fields_ = [
        ("rewards_chosen", ctypes.c_double),
        ("rewards_rejected", ctypes.c_double),
        ("rewards_accuracies", ctypes.c_double),
        ("rewards_margins", ctypes.c_double),
        ("logps_chosen", ctypes.c_double),
        ("logps_rejected", ctypes.c_double),
        ("logits_chosen", ctypes.c_double),
        ("logits_rejected", ctypes.c_double),
        ("nll_loss", ctypes.c_double),
        ("log_odds_ratio", ctypes.c_double),
        ("log_odds_chosen", ctypes.c_double),
        ("entropy", ctypes.c_double),
        ("mean_token_accuracy", ctypes.c_double),
    ]


class fh_preference_outputs(ctypes.Structure):
    _fields_ = [
        ("loss", c_double_p),
        ("metrics", ctypes.POINTER(fh_preference_metrics)),
        ("sequence_logps", c_float_p),
        ("rewards", c_float_p),
        ("per_token_logp", c_float_p),
    ]


# KTO (fh_kto_*: TRL's KTOTrainer, loss types kto and apo_zero_unpaired)
class fh_kto_options(ctypes.Structure):
    _fields_ = [
        ("loss_type", ctypes.c_int),  # fh_kto_loss_type
        ("beta", ctypes.c_double),
        ("desirable_weight", ctypes.c_double),
        ("undesirable_weight", ctypes.c_double),
    ]


class fh_kto_batch(ctypes.Structure):
    _fields_ = [
        ("batch", ctypes.c_int64),
        ("seq", ctypes.c_int64),
        ("targets", c_int64_p),
        ("mask", c_float_p),
        ("labels", ctypes.POINTER(ctypes.c_uint8)),
        ("ref_logps", c_float_p),
        ("ref_per_token_logps", c_float_p),
        ("kl", c_float_p),
        ("kl_logratios", c_float_p),
        ("cu_seqlens", c_int64_p),
    ]


class fh_kto_metrics(ctypes.Structure):
    _fields_ = [
        ("kl", ctypes.c_double),
        ("rewards_chosen", ctypes.c_double),
        ("rewards_rejected", ctypes.c_double),
        ("rewards_margins", ctypes.c_double),
        ("logps_chosen", ctypes.c_double),
        ("logps_rejected", ctypes.c_double),
        ("logits_chosen", ctypes.c_double),
        ("logits_rejected", ctypes.c_double),
        ("entropy", ctypes.c_double),
    ]


class fh_kto_outputs(ctypes.Structure):
    _fields_ = [
        ("loss", c_double_p),
        ("metrics", ctypes.POINTER(fh_kto_metrics)),
        ("sequence_logps", c_float_p),
        ("rewards", c_float_p),
        ("per_token_logp", c_float_p),
    ]


# Distillation (fh_distill_*: forward KL, reverse KL, generalized JSD, plus a hard-label cross-entropy)
class fh_distill_options(ctypes.Structure):
    _fields_ = [
        ("divergence", ctypes.c_int),  # fh_divergence
        ("beta", ctypes.c_double),
        ("temperature", ctypes.c_double),
        ("weight_soft_loss", ctypes.c_double),
        ("weight_hard_loss", ctypes.c_double),
        ("ignore_index", ctypes.c_int64),
        ("reduction", ctypes.c_int),  # fh_reduction
        ("top_k", ctypes.c_int64),
        ("add_tail", ctypes.c_int),
    ]


class fh_distill_outputs(ctypes.Structure):
    _fields_ = [
        ("loss", c_double_p),
        ("soft_loss", c_double_p),
        ("hard_loss", c_double_p),
        ("per_token_loss", c_float_p),
    ]


# Top-k teacher distillation (fh_distill_topk_*: TRL's server-distillation forward KL on the teacher's top-k)
class fh_topk_teacher(ctypes.Structure):
    _fields_ = [
        ("k", ctypes.c_int64),
        ("ids", c_int64_p),
        ("logprobs", c_float_p),
    ]


class fh_distill_topk_options(ctypes.Structure):
    _fields_ = [
        ("add_tail", ctypes.c_int),
        ("temperature", ctypes.c_double),
        ("weight_soft_loss", ctypes.c_double),
        ("weight_hard_loss", ctypes.c_double),
        ("ignore_index", ctypes.c_int64),
        ("reduction", ctypes.c_int),  # fh_reduction
    ]


STRUCTS = (fh_kernel_info, fh_linear, fh_linear_grads, fh_ce_options, fh_ce_outputs, fh_logprob_options,
           fh_logprob_outputs, fh_support, fh_grpo_options,
           fh_grpo_batch, fh_grpo_metrics, fh_grpo_outputs, fh_preference_options, fh_preference_batch,
           fh_preference_metrics, fh_preference_outputs, fh_distill_options, fh_distill_outputs, fh_topk_teacher,
           fh_distill_topk_options)
STRUCTS += (fh_kto_options, fh_kto_batch, fh_kto_metrics, fh_kto_outputs)

# ---------------------------------------------------------------------------------------------------------
# Prototypes
# ---------------------------------------------------------------------------------------------------------
_P = ctypes.POINTER
_ctx_p = ctypes.c_void_p  # fh_context * (opaque)
_st = ctypes.c_int  # fh_status

# name: (restype, argtypes). Required symbols: the library does not load without them.
_REQUIRED = {
    "fh_status_string": (ctypes.c_char_p, [_st]),
    "fh_context_create": (_st, [_P(_ctx_p)]),
    "fh_context_destroy": (_st, [_ctx_p]),
    "fh_context_set": (_st, [_ctx_p, ctypes.c_int, ctypes.c_int64]),
    "fh_context_get": (_st, [_ctx_p, ctypes.c_int, c_int64_p]),
    "fh_param_bounds": (_st, [ctypes.c_int, c_int64_p, c_int64_p]),
    "fh_context_set_real": (_st, [_ctx_p, ctypes.c_int, ctypes.c_double]),
    "fh_context_get_real": (_st, [_ctx_p, ctypes.c_int, c_double_p]),
    "fh_param_real_bounds": (_st, [ctypes.c_int, c_double_p, c_double_p]),
    "fh_context_message": (_st, [_ctx_p, _P(ctypes.c_char_p)]),
    "fh_context_set_workspace": (_st, [_ctx_p, ctypes.c_void_p, ctypes.c_size_t]),
    "fh_context_threads": (_st, [_ctx_p, _P(ctypes.c_int)]),
    "fh_context_filter_stats": (_st, [_ctx_p, _P(fh_filter_stats)]),
    "fh_kernel_query": (_st, [_P(fh_kernel_info)]),
    "fh_linear_init": (_st, [_P(fh_linear), ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                             ctypes.c_void_p, ctypes.c_int, c_float_p]),
    "fh_ce_options_init": (_st, [_P(fh_ce_options)]),
    "fh_ce_forward": (_st, [_ctx_p, _P(fh_linear), c_int64_p, _P(fh_ce_options), _P(fh_ce_outputs)]),
    "fh_ce_backward": (_st, [_ctx_p, _P(fh_linear), c_int64_p, _P(fh_ce_options), c_float_p, c_float_p,
                             _P(fh_linear_grads)]),
    "fh_ce_forward_backward": (_st, [_ctx_p, _P(fh_linear), c_int64_p, _P(fh_ce_options), c_float_p,
                                     _P(fh_ce_outputs), _P(fh_linear_grads)]),
    "fh_ce_workspace_size": (_st, [_ctx_p, _P(fh_linear), _P(fh_ce_options), _P(ctypes.c_size_t)]),
    "fh_ce_forward_backward_workspace_size": (_st, [_ctx_p, _P(fh_linear), _P(fh_ce_options),
                                                    _P(ctypes.c_size_t)]),
}
# Bound when present (a library built before they existed still serves cross-entropy).
_OPTIONAL = {
    "fh_logprob_options_init": (_st, [_P(fh_logprob_options)]),
    "fh_logprob_forward": (_st, [_ctx_p, _P(fh_linear), c_int64_p, _P(fh_logprob_options),
                                 _P(fh_logprob_outputs)]),
    "fh_logprob_backward": (_st, [_ctx_p, _P(fh_linear), c_int64_p, _P(fh_logprob_options), c_float_p,
                                  c_float_p, c_float_p, c_float_p, c_float_p, _P(fh_linear_grads)]),
    "fh_logprob_forward_keep": (_st, [_ctx_p, _P(fh_linear), c_int64_p, _P(fh_logprob_options),
                                      _P(fh_logprob_outputs), c_float_p]),
    "fh_logprob_backward_kept": (_st, [_ctx_p, _P(fh_linear), c_int64_p, _P(fh_logprob_options), c_float_p,
                                       c_float_p, c_float_p, c_float_p, c_float_p, c_float_p, _P(fh_linear_grads)]),
    "fh_logprob_forward_backward": (_st, [_ctx_p, _P(fh_linear), c_int64_p, _P(fh_logprob_options), c_float_p,
                                          c_float_p, c_float_p, _P(fh_logprob_outputs), _P(fh_linear_grads)]),
    "fh_logprob_workspace_size": (_st, [_ctx_p, _P(fh_linear), _P(ctypes.c_size_t)]),
    "fh_logprob_support_forward": (_st, [_ctx_p, _P(fh_linear), c_int64_p, _P(fh_support), _P(fh_logprob_options),
                                         _P(fh_logprob_outputs)]),
    "fh_logprob_support_backward": (_st, [_ctx_p, _P(fh_linear), c_int64_p, _P(fh_support),
                                          _P(fh_logprob_options), c_float_p, c_float_p, c_float_p, c_float_p,
                                          c_float_p, _P(fh_linear_grads)]),
    "fh_logprob_support_forward_backward": (_st, [_ctx_p, _P(fh_linear), c_int64_p, _P(fh_support),
                                                  _P(fh_logprob_options), c_float_p, c_float_p, c_float_p,
                                                  _P(fh_logprob_outputs), _P(fh_linear_grads)]),
    "fh_logprob_support_workspace_size": (_st, [_ctx_p, _P(fh_linear), _P(fh_support), _P(ctypes.c_size_t)]),
    "fh_grpo_options_init": (_st, [_P(fh_grpo_options)]),
    "fh_grpo_forward": (_st, [_ctx_p, _P(fh_linear), _P(fh_grpo_batch), _P(fh_grpo_options),
                              _P(fh_grpo_outputs)]),
    "fh_grpo_backward": (_st, [_ctx_p, _P(fh_linear), _P(fh_grpo_batch), _P(fh_grpo_options), c_float_p,
                               c_float_p, c_float_p, c_float_p, _P(fh_linear_grads)]),
    "fh_grpo_forward_backward": (_st, [_ctx_p, _P(fh_linear), _P(fh_grpo_batch), _P(fh_grpo_options), c_float_p,
                                       _P(fh_grpo_outputs), _P(fh_linear_grads)]),
    "fh_grpo_workspace_size": (_st, [_ctx_p, _P(fh_linear), _P(ctypes.c_size_t)]),
    "fh_preference_options_init": (_st, [_P(fh_preference_options)]),
    "fh_preference_forward": (_st, [_ctx_p, _P(fh_linear), _P(fh_preference_batch), _P(fh_preference_options),
                                    _P(fh_preference_outputs)]),
    "fh_preference_forward_backward": (_st, [_ctx_p, _P(fh_linear), _P(fh_preference_batch),
                                             _P(fh_preference_options), c_float_p, _P(fh_preference_outputs),
                                             _P(fh_linear_grads)]),
    "fh_preference_workspace_size": (_st, [_ctx_p, _P(fh_linear), _P(ctypes.c_size_t)]),
    "fh_distill_options_init": (_st, [_P(fh_distill_options)]),
    "fh_distill_forward": (_st, [_ctx_p, _P(fh_linear), _P(fh_linear), c_int64_p, _P(fh_distill_options),
                                 _P(fh_distill_outputs)]),
    "fh_distill_forward_backward": (_st, [_ctx_p, _P(fh_linear), _P(fh_linear), c_int64_p, _P(fh_distill_options),
                                          c_float_p, _P(fh_distill_outputs), _P(fh_linear_grads)]),
    "fh_distill_workspace_size": (_st, [_ctx_p, _P(fh_linear), _P(fh_linear), _P(fh_distill_options),
                                        _P(ctypes.c_size_t)]),
    "fh_kto_options_init": (_st, [_P(fh_kto_options)]),
    "fh_kto_forward": (_st, [_ctx_p, _P(fh_linear), _P(fh_kto_batch), _P(fh_kto_options), _P(fh_kto_outputs)]),
    "fh_kto_forward_backward": (_st, [_ctx_p, _P(fh_linear), _P(fh_kto_batch), _P(fh_kto_options), c_float_p,
                                      _P(fh_kto_outputs), _P(fh_linear_grads)]),
    "fh_kto_workspace_size": (_st, [_ctx_p, _P(fh_linear), _P(ctypes.c_size_t)]),
    "fh_distill_topk_options_init": (_st, [_P(fh_distill_topk_options)]),
    "fh_distill_topk_forward": (_st, [_ctx_p, _P(fh_linear), _P(fh_topk_teacher), c_int64_p,
                                      _P(fh_distill_topk_options), _P(fh_distill_outputs)]),
    "fh_distill_topk_forward_backward": (_st, [_ctx_p, _P(fh_linear), _P(fh_topk_teacher), c_int64_p,
                                               _P(fh_distill_topk_options), c_float_p, _P(fh_distill_outputs),
                                               _P(fh_linear_grads)]),
    "fh_distill_topk_workspace_size": (_st, [_ctx_p, _P(fh_linear), _P(ctypes.c_size_t)]),
}


class LibraryNotFoundError(ImportError):
    """libfusedhead.so could not be found or loaded; the message lists every place tried."""


class MissingDependencyError(LibraryNotFoundError):
    """libfusedhead.so was found, but a shared library it needs is not installed.

    .dependency is that library's file name (e.g. "libblis.so.4"), .package the Debian package that provides it
    (None when it is not one of DEPENDENCY_PACKAGES)."""

    def __init__(self, message: str, dependency: str, package: Optional[str]):
        super().__init__(message)
        self.dependency = dependency
        self.package = package


# The distribution's shared libraries that libfusedhead links (ldd build/libfusedhead.so), with the Debian package
# that provides each (dpkg -S); a wheel bundles none of them.
DEPENDENCY_PACKAGES = {
    "libblis.so.4": "libblis4",
    "libsleef.so.3": "libsleef3",
    "libdnnl.so.2": "libdnnl2",
    "libgomp.so.1": "libgomp1",
}
# What the dynamic loader says, through ctypes's OSError, when a file it looks for does not exist.
_CANNOT_OPEN = re.compile(r"^(?P<name>.+?): cannot open shared object file")


def dependency_error(library: str, message: str) -> Optional[MissingDependencyError]:
    """The error to raise when `message` (ctypes's OSError text on loading `library`) says that a library it needs,
    not `library` itself, is missing; None otherwise."""
    m = _CANNOT_OPEN.match(message)
    if m is None or os.path.basename(m.group("name")) == os.path.basename(library):
        return None
    dependency = os.path.basename(m.group("name"))
    package = DEPENDENCY_PACKAGES.get(dependency)
    how = (f"on Debian, apt-get install {package}" if package
           else f"install the package that provides it (Debian: apt-file search {dependency})")
    return MissingDependencyError(
        f"{library} needs {dependency}, which is not installed: {how}. fusedhead's package holds only libfusedhead; "
        "BLIS, SLEEF, oneDNN and OpenMP come from the system.", dependency, package)


ENV_VAR = "FUSEDHEAD_LIBRARY"
_PACKAGE_DIR = Path(__file__).resolve().parent
# Where the package was imported from, links not followed: <build>/fusedhead when imported from a build tree.
_IMPORT_DIR = Path(os.path.abspath(__file__)).parent
_LIB_GLOBS = ("libfusedhead.so", "libfusedhead.so.0", "libfusedhead.so.*")


def _libs_in(directory: Path) -> List[Path]:
    found: List[Path] = []
    for pattern in _LIB_GLOBS:
        for p in sorted(directory.glob(pattern)):
            if p.is_file() and p not in found:
                found.append(p)
    return found


def build_tree_candidates(package_dir: Path = _PACKAGE_DIR) -> List[Path]:
    """libfusedhead.so* in build directories near the package, best first: build/ before any other build*/
    (those in name order); the repository root (package_dir/../..) before package_dir/.."""
    candidates: List[Path] = []
    for base in (package_dir.parent.parent, package_dir.parent):
        if not base.is_dir():
            continue
        dirs = sorted(d for d in base.glob("build*") if d.is_dir())
        dirs.sort(key=lambda d: d.name != "build")  # stable: build/ first, the rest stay in name order
        for d in dirs:
            for p in _libs_in(d):
                if p not in candidates:
                    candidates.append(p)
    return candidates


def _bind(cdll: ctypes.CDLL) -> ctypes.CDLL:
    for table, required in ((_REQUIRED, True), (_OPTIONAL, False)):
        for name, (restype, argtypes) in table.items():
            try:
                fn = getattr(cdll, name)
            except AttributeError:
                if required:
                    raise LibraryNotFoundError(f"{cdll._name} does not export {name}: not a compatible libfusedhead")
                continue
            fn.restype = restype
            fn.argtypes = argtypes
    return cdll


_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_lib_path: Optional[str] = None


def load_library(path: Optional[str] = None) -> ctypes.CDLL:
    """The loaded library (loaded once per process). `path` overrides the lookup on the first call only."""
    global _lib, _lib_path
    with _lock:
        if _lib is not None:
            return _lib
        tried: List[str] = []
        env = os.environ.get(ENV_VAR)
        if path is not None or env:
            explicit = path if path is not None else env
            source = "load_library(path)" if path is not None else ENV_VAR
            try:
                cdll = ctypes.CDLL(os.fspath(explicit))
            except OSError as e:
                raise (dependency_error(os.fspath(explicit), str(e))
                       or LibraryNotFoundError(f"{source} = {explicit!r} could not be loaded: {e}")) from None
            _lib, _lib_path = _bind(cdll), os.fspath(explicit)
            return _lib
        found = _libs_in(_PACKAGE_DIR) + _libs_in(_IMPORT_DIR.parent) + build_tree_candidates()
        candidates = [str(p) for p in found]
        system = ctypes.util.find_library("fusedhead")
        candidates += [c for c in (system, "libfusedhead.so.0") if c]
        missing: Optional[MissingDependencyError] = None
        for candidate in candidates:
            try:
                cdll = ctypes.CDLL(candidate)
            except OSError as e:
                tried.append(f"  {candidate}: {e}")
                missing = missing or dependency_error(candidate, str(e))
                continue
            _lib, _lib_path = _bind(cdll), candidate
            return _lib
        if missing is not None:  # the first library found lacks a dependency: that, not "not found", is the problem
            raise missing
        raise LibraryNotFoundError(
            "libfusedhead.so not found. Build it (cmake -S . -B build && cmake --build build --target fusedhead), "
            f"set {ENV_VAR}=/path/to/libfusedhead.so, or install it system-wide. Tried:\n" + "\n".join(tried))


def library_path() -> str:
    """Path of the loaded library (the soname when the system's was loaded); loads it if needed."""
    load_library()
    assert _lib_path is not None
    return _lib_path


def has_symbol(name: str) -> bool:
    return hasattr(load_library(), name)
