# The gradchecks (tests/README.md): fh_gradcheck (tools/fh_gradcheck.c) on the accepted cases of every head.

# Every gradcheck runs on the kernels the library picks on this CPU (what a user gets): gradcheck_<name>. The cases
# listed here run on every kernel variant as well (FH_KERNEL_VARIANTS, the top-level CMakeLists.txt),
# gradcheck_<name>_<variant>, skipped (exit 77) where the CPU lacks the variant: each head in each schedule, dtype and
# gradient dtype once, the filtered and edge cases, and the ones scripts/test-aarch64 runs. The variants differ only
# in the row kernels and the bf16 GEMM path, which the CUnit suites compare against the reference on every variant
# (per head, option and tile edge); repeating all 237 cases per variant tripled their time for no path they miss.
set(FH_GRADCHECKS_EVERY_VARIANT
    vh_mean hv_sum_train_step dft_hv_train_step_row_blocks vh_train_step_streaming_fallback
    grpo_dapo_token grpo_row_blocks_grpo_sequence grpo_filtered_cispo grpo_trl_luspo_sequence_row_blocks
    grpo_trl_vespo_token_streaming
    logprob_t0.3_hv logprob_t2.5_bf16_step logprob_streaming_fallback logprob_support_padded_step
    preference_dpo_sigmoid preference_streaming_orpo_sigmoid preference_trl_aot preference_trl_mixed_row_blocks
    bf16_vh_train_step bf16_grads_hv_split bf16_hidden_one_vh_split bf16_fp32_du_vh_train_step bf16_grpo_sapo_sequence
    bf16_preference_dpo_sigmoid
    distill_jsd_row_blocks distill_reverse_kl_streaming distill_jsd_tiny_temperature
    distill_bf16_grads_forward_kl_streaming
    kto_row_blocks_kto_logratios bf16_grads_kto_streaming_apo_zero_unpaired
    distill_topk_tail_streaming distill_topk_bf16_row_blocks distill_topk_jsd_tail_row_blocks)
# Each gradcheck runs on one CPU (its process pinned to it, so the library runs one thread): the double reference,
# most of a gradcheck's time, is single-threaded, so scripts/test runs the label "one_cpu" two at a time on 2 cores.
# The library's threads are tested by the CUnit suites (1 and 2 threads), which run one at a time.
function(fh_gradcheck_add test env)
  add_test(NAME ${test} COMMAND fh_gradcheck ${ARGN})
  set_tests_properties(${test} PROPERTIES SKIP_RETURN_CODE 77 ENVIRONMENT "${env}" LABELS "gradcheck;one_cpu"
                       PROCESSORS 1 PROCESSOR_AFFINITY ON)
endfunction()
function(fh_gradcheck_test name)
  fh_gradcheck_add(gradcheck_${name} "" ${ARGN})
  if(name IN_LIST FH_GRADCHECKS_EVERY_VARIANT)
    foreach(variant IN LISTS FH_KERNEL_VARIANTS)
      fh_variant_environment(${variant} env)
      fh_gradcheck_add(gradcheck_${name}_${variant} "${env}" ${ARGN})
    endforeach()
  endif()
endfunction()

# The issue's acceptance commands.
set(FH_GRADCHECK_CASE --n 257 --hidden 129 --vocab 5003 --bias --ignore-frac 0.1 --label-smoothing 0.1
    --class-weights --softcap 30 --z-loss 1e-4)
fh_gradcheck_test(vh_mean ${FH_GRADCHECK_CASE} --layout vh)
fh_gradcheck_test(hv_none ${FH_GRADCHECK_CASE} --layout hv --reduction none)
fh_gradcheck_test(hv_sum_train_step ${FH_GRADCHECK_CASE} --layout hv --reduction sum --train-step)
fh_gradcheck_test(hv_train_step_row_blocks ${FH_GRADCHECK_CASE} --layout hv --train-step --tile-rows 100)
fh_gradcheck_test(vh_train_step_streaming_fallback ${FH_GRADCHECK_CASE} --layout vh --train-step --budget 600000)
# logit_scale 2 under the softcap (c / m = 15), DFT's token scaling, the entropy and the correct count, in every
# schedule: the split pair (the backward's target logits recomputed), row blocks, the streaming fallback; bf16.
set(FH_GRADCHECK_DFT ${FH_GRADCHECK_CASE} --ce-logit-scale 2 --token-scaling --entropy)
fh_gradcheck_test(dft_vh_mean ${FH_GRADCHECK_DFT} --layout vh)
fh_gradcheck_test(dft_hv_none ${FH_GRADCHECK_DFT} --layout hv --reduction none)
fh_gradcheck_test(dft_hv_train_step_row_blocks ${FH_GRADCHECK_DFT} --layout hv --train-step --tile-rows 100)
fh_gradcheck_test(dft_vh_train_step_streaming_fallback ${FH_GRADCHECK_DFT} --layout vh --reduction sum --train-step
                 --budget 600000)
fh_gradcheck_test(logit_scale_vh_entropy --n 257 --hidden 129 --vocab 5003 --bias --ce-logit-scale 0.5 --entropy --layout vh
                 --train-step)

# GRPO acceptance: every loss type at both importance-sampling levels, B=3 T=47 H=67 V=5003, beta 0.04,
# temperature 0.7, against the TRL-semantics reference (the cases without --loss-type name grpo, the default
# before dapo became TRL's).
foreach(loss_type grpo bnpo dr_grpo dapo cispo sapo luspo vespo)
  foreach(level token sequence)
    fh_gradcheck_test(grpo_${loss_type}_${level} --loss grpo --batch 3 --seq 47 --hidden 67 --vocab 5003 --loss-type ${loss_type}
                     --is-level ${level} --beta 0.04 --temperature 0.7)
    # The single-call step in row blocks of whole sequences: 8 sequences of 20 tokens in blocks of 3, 3 and 2
    # sequences (block boundaries between sequences), with a bias and the entropy bonus.
    fh_gradcheck_test(grpo_row_blocks_${loss_type}_${level} --loss grpo --batch 8 --seq 20 --hidden 67 --vocab 5003 --loss-type ${loss_type}
                     --is-level ${level} --beta 0.04 --temperature 0.7 --entropy-coef 0.01 --bias --train-step
                     --tile-rows 64)
  endforeach()
endforeach()
# Log-probs: temperatures 0.3, 1 and 2.5 with the entropy gradient on and off, both layouts, forward + backward and
# the single call (row blocks, and the streaming fallback under a small budget), fp32 and bf16, 25% of the tokens
# ignored (tolerances in tests/cases/logprob_case.c).
set(FH_GRADCHECK_LOGPROB --loss logprob --n 193 --hidden 96 --vocab 5003 --bias --ignore-frac 0.25)
foreach(temperature 0.3 1 2.5)
  fh_gradcheck_test(logprob_t${temperature}_hv ${FH_GRADCHECK_LOGPROB} --temperature ${temperature} --layout hv)
  fh_gradcheck_test(logprob_t${temperature}_vh_step_no_entropy ${FH_GRADCHECK_LOGPROB} --temperature ${temperature}
                    --layout vh --train-step --no-entropy-grad)
  fh_gradcheck_test(logprob_t${temperature}_bf16_step ${FH_GRADCHECK_LOGPROB} --temperature ${temperature}
                    --dtype bf16 --grad-dtype bf16 --train-step --softcap 30 --head-logit-scale 0.5)
endforeach()
fh_gradcheck_test(logprob_streaming_fallback ${FH_GRADCHECK_LOGPROB} --train-step --budget 600000)
# Over a support (fh_logprob_support_*): CSR and padded, 64 ids and every id, both layouts, both calls, fp32 and bf16.
fh_gradcheck_test(logprob_support_csr_hv ${FH_GRADCHECK_LOGPROB} --support csr --support-size 64 --layout hv
                  --temperature 0.7)
fh_gradcheck_test(logprob_support_padded_step ${FH_GRADCHECK_LOGPROB} --support padded --support-size 64 --layout vh
                  --train-step --softcap 30 --head-logit-scale 0.5)
fh_gradcheck_test(logprob_support_every_id_bf16 ${FH_GRADCHECK_LOGPROB} --support csr --support-size 5003
                  --dtype bf16 --grad-dtype bf16 --train-step)

# Gradient filtering against the reference filtered as the call's tiles are (ref/ref_filter.c), at the unfiltered
# tolerances: peaked logits (typical size 10), thin row tiles and eps 0.2 skip about 40% to 80% of the gradient
# GEMMs here (the JSON's filter_skipped_fraction). Streaming and row blocks of whole sequences, entropy bonus and
# temperature (the e term and dz/du in the row scale), every loss type at the token level (vespo: its tolerance adds
# the conditioning slack of tests/cases/grpo_case.h, large here, where logits of size 10 make |logp| large).
foreach(loss_type grpo bnpo dr_grpo dapo cispo sapo luspo vespo)
  fh_gradcheck_test(grpo_filtered_${loss_type} --loss grpo --batch 4 --seq 37 --hidden 40 --vocab 3001 --loss-type ${loss_type}
                   --is-level token --tile-rows 4 --tile-vocab 1024 --logit-scale 10 --grad-filter-eps 0.2
                   --entropy-coef 0.01 --temperature 0.8 --beta 0.04)
endforeach()
fh_gradcheck_test(grpo_filtered_row_blocks_sequence --loss grpo --loss-type grpo --batch 12 --seq 4 --hidden 40 --vocab 3001 --is-level sequence
                 --tile-rows 4 --logit-scale 10 --grad-filter-eps 0.2 --entropy-coef 0.01 --train-step --bias)
# A sequence taller than a row block: the step streams both passes (the same results).
fh_gradcheck_test(grpo_row_blocks_sequence_too_tall --loss grpo --loss-type grpo --batch 8 --seq 20 --hidden 67 --vocab 5003 --is-level sequence --beta 0.04
                 --train-step --tile-rows 10)

# GRPO at TRL f2cd5771: every option TRL added (luspo, vespo, the vLLM importance-sampling correction in each of its
# four modes with sampler log-probs, the off-policy mask, top_entropy_quantile, the bias-corrected KL, the entropy
# bonus over the masked (kept) tokens) at both importance-sampling levels, fp32 and bf16, in row blocks of
# whole sequences (--train-step --tile-rows 64: blocks of 3, 3 and 2 of the 8 sequences of 20 tokens) and streaming
# (--tile-rows 10: no sequence fits a block). Four bundles put each option in every cell (vespo takes only the token
# modes, TRL's rule): luspo with sequence_mask, vespo with token_mask and its own k and lambda, sapo on-policy (the
# ratios from sg(logp)) with token_truncate and the quantile, dapo with sequence_truncate (upper bound only) and the
# quantile. With top_entropy_quantile < 1 the single call streams whatever the tiles (fusedhead.h), so its row-block
# cells check that the request is honoured with the same results. Sampler log-probs: the old ones (current ones
# on-policy) plus U(-0.15, 0.15): token ratios in [0.86, 1.16] and sequence ones of about e^+-0.3, so the bounds
# below truncate or mask a share of each. Tolerances: tests/cases/grpo_case.c (vespo's conditioning slack: grpo_case.h).
set(FH_GRPO_TRL_CASE --loss grpo --batch 8 --seq 20 --hidden 67 --vocab 5003 --temperature 0.7 --beta 0.04 --bias
    --train-step --entropy-coef 0.01)
set(FH_GRPO_TRL_luspo --loss-type luspo --sampling-logps --vllm-is-mode sequence_mask --vllm-is-clip-min 0.8
    --vllm-is-clip-max 1.25 --bias-correction-kl --off-policy-mask-threshold 0)
set(FH_GRPO_TRL_vespo --loss-type vespo --sampling-logps --vllm-is-mode token_mask --vllm-is-clip-min 0.92
    --vllm-is-clip-max 1.08 --bias-correction-kl --off-policy-mask-threshold 0 --num-items-in-batch 150
    --vespo-k-pos 1.5 --vespo-lambda-pos 2 --vespo-k-neg 2.5 --vespo-lambda-neg 1.5)
set(FH_GRPO_TRL_sapo_quantile --loss-type sapo --no-old-logps --sampling-logps --vllm-is-mode token_truncate
    --vllm-is-clip-min 0.92 --vllm-is-clip-max 1.08 --top-entropy-quantile 0.6 --off-policy-mask-threshold 0.05)
set(FH_GRPO_TRL_dapo_quantile --loss-type dapo --sampling-logps --vllm-is-mode sequence_truncate --vllm-is-clip-max 1.25
    --top-entropy-quantile 0.3 --bias-correction-kl --num-items-in-batch 150)
foreach(bundle luspo vespo sapo_quantile dapo_quantile)
  foreach(level token sequence)
    set(case ${FH_GRPO_TRL_CASE} ${FH_GRPO_TRL_${bundle}} --is-level ${level})
    fh_gradcheck_test(grpo_trl_${bundle}_${level}_row_blocks ${case} --layout vh --tile-rows 64)
    fh_gradcheck_test(grpo_trl_${bundle}_${level}_streaming ${case} --layout hv --tile-rows 10)
    fh_gradcheck_test(bf16_grpo_trl_${bundle}_${level}_row_blocks ${case} --dtype bf16 --layout hv --tile-rows 64)
    fh_gradcheck_test(bf16_grpo_trl_${bundle}_${level}_streaming ${case} --dtype bf16 --grad-dtype bf16 --layout vh
                      --tile-rows 10)
  endforeach()
endforeach()

# Preference losses (TRL's DPO at v0.28.0, CPO, SimPO, ORPO) against the reference: every loss with every loss_type
# TRL gives it, each with its own options (reference log-probs per sequence or per token, label smoothing, NLL
# weights, the SimPO paper's beta and gamma), through fh_preference_forward and fh_preference_forward_backward.
set(FH_PREFERENCE_VARIANTS dpo_sigmoid dpo_hinge dpo_ipo dpo_robust cpo_sigmoid cpo_hinge cpo_ipo simpo_sigmoid
    orpo_sigmoid)
set(FH_PREFERENCE_dpo_sigmoid --ref sequence --label-smoothing 0.1 --rpo-alpha 0.5 --trl 0.28)
set(FH_PREFERENCE_dpo_hinge --ref token --trl 0.28)
set(FH_PREFERENCE_dpo_ipo --ref token --rpo-alpha 1 --trl 0.28)
set(FH_PREFERENCE_dpo_robust --label-smoothing 0.2 --trl 0.28)
set(FH_PREFERENCE_cpo_sigmoid --label-smoothing 0.1)
set(FH_PREFERENCE_cpo_hinge --cpo-alpha 0.5)
set(FH_PREFERENCE_cpo_ipo)
set(FH_PREFERENCE_simpo_sigmoid --beta 2 --simpo-gamma 1)
set(FH_PREFERENCE_orpo_sigmoid)
foreach(variant IN LISTS FH_PREFERENCE_VARIANTS)
  string(REGEX REPLACE "_.*" "" loss ${variant})
  string(REGEX REPLACE ".*_" "" loss_type ${variant})
  set(case --loss ${loss} --loss-type ${loss_type} ${FH_PREFERENCE_${variant}} --hidden 67 --vocab 5003)
  # 4 pairs of 23 tokens on the library's default tiles.
  fh_gradcheck_test(preference_${variant} ${case} --batch 4 --seq 23 --layout vh)
  # The single-call step in row blocks of whole pairs: 8 pairs of 20 tokens, tile_rows 120 (3 pairs), so blocks of
  # 3, 3 and 2 pairs.
  fh_gradcheck_test(preference_row_blocks_${variant} ${case} --batch 8 --seq 20 --layout hv --bias --tile-rows 120)
  # tile_rows 30 < 2 T = 40 holds no pair: the step streams both passes (the same results).
  fh_gradcheck_test(preference_streaming_${variant} ${case} --batch 8 --seq 20 --layout vh --bias --tile-rows 30)
endforeach()

# DPO at TRL's current semantics (the default; f2cd5771): each loss type alone in row blocks of whole pairs (aot and
# aot_unpaired stream: they sort over every pair), label smoothing 0.1 (read by robust, exo_pair and the aots), per
# token reference log-probs; three weighted lists in both schedules (MPO's sigmoid + bco_pair + sft; the aots with
# ipo; five pair-local types with a negative weight).
set(FH_DPO_TRL_TYPES sigmoid hinge ipo robust exo_pair nca_pair bco_pair sppo_hard aot aot_unpaired apo_zero apo_down
    discopop sft sigmoid_norm)
set(FH_DPO_TRL_CASE --loss dpo --batch 8 --seq 20 --hidden 67 --vocab 5003 --label-smoothing 0.1)
foreach(type IN LISTS FH_DPO_TRL_TYPES)
  fh_gradcheck_test(preference_trl_${type} ${FH_DPO_TRL_CASE} --loss-type ${type} --ref token --layout hv --bias
                    --tile-rows 120)
endforeach()
set(FH_DPO_TRL_LISTS mpo aot mixed)
set(FH_DPO_TRL_mpo --loss-type sigmoid,bco_pair,sft --loss-weights 0.8,0.2,1 --ref sequence)
set(FH_DPO_TRL_aot --loss-type aot,aot_unpaired,ipo --loss-weights 1,0.5,0.1 --ref token)
set(FH_DPO_TRL_mixed --loss-type discopop,apo_down,sigmoid_norm,exo_pair,nca_pair --loss-weights 1,-0.3,2,0.5,0.25
    --ref token)
foreach(list IN LISTS FH_DPO_TRL_LISTS)
  fh_gradcheck_test(preference_trl_${list}_row_blocks ${FH_DPO_TRL_CASE} ${FH_DPO_TRL_${list}} --layout vh --tile-rows 120)
  fh_gradcheck_test(preference_trl_${list}_streaming ${FH_DPO_TRL_CASE} ${FH_DPO_TRL_${list}} --layout hv --bias
                    --tile-rows 30)
endforeach()

# bf16 x and weight (oneDNN GEMMs, dU rounded to bf16): against the double reference on the bf16-valued inputs,
# at the bf16 gradient tolerance (tests/cases/ce_case.c says why).
fh_gradcheck_test(bf16_vh_train_step ${FH_GRADCHECK_CASE} --dtype bf16 --layout vh --train-step)
fh_gradcheck_test(bf16_hv_none ${FH_GRADCHECK_CASE} --dtype bf16 --layout hv --reduction none)
fh_gradcheck_test(bf16_dft_vh_train_step ${FH_GRADCHECK_DFT} --dtype bf16 --grad-dtype bf16 --layout vh --train-step)
fh_gradcheck_test(bf16_dft_hv_split ${FH_GRADCHECK_DFT} --dtype bf16 --layout hv)
# bf16 gradients (one more rounding), and fp32 dU (the fp32 tolerance), in both schedules and layouts.
fh_gradcheck_test(bf16_grads_vh_train_step ${FH_GRADCHECK_CASE} --dtype bf16 --grad-dtype bf16 --layout vh --train-step)
fh_gradcheck_test(bf16_grads_hv_split ${FH_GRADCHECK_CASE} --dtype bf16 --grad-dtype bf16 --layout hv)
fh_gradcheck_test(bf16_fp32_du_vh_train_step ${FH_GRADCHECK_CASE} --dtype bf16 --fp32-du --layout vh --train-step)
fh_gradcheck_test(bf16_fp32_du_grads_hv_split ${FH_GRADCHECK_CASE} --dtype bf16 --fp32-du --grad-dtype bf16 --layout hv)
# H = 1: a [V, H] weight's dweight is a 1 x V view with both strides 1, which oneDNN accepted when making the
# matmul and refused when running it, in a fresh process (the call returned FH_ERR_OUT_OF_MEMORY after writing
# dx; found by the fuzzer). Each test is its own process, as that failure needs.
fh_gradcheck_test(bf16_hidden_one_vh_train_step --n 2 --hidden 1 --vocab 4 --dtype bf16 --layout vh --train-step)
fh_gradcheck_test(bf16_hidden_one_vh_split --n 2 --hidden 1 --vocab 4 --dtype bf16 --layout vh)
foreach(loss_type grpo bnpo dr_grpo dapo cispo sapo)
  foreach(level token sequence)
    fh_gradcheck_test(bf16_grpo_${loss_type}_${level} --loss grpo --batch 3 --seq 47 --hidden 67 --vocab 5003 --loss-type ${loss_type}
                     --is-level ${level} --beta 0.04 --temperature 0.7 --dtype bf16 --layout vh --train-step)
  endforeach()
  fh_gradcheck_test(bf16_grads_grpo_${loss_type} --loss grpo --batch 3 --seq 47 --hidden 67 --vocab 5003 --loss-type ${loss_type}
                   --beta 0.04 --temperature 0.7 --dtype bf16 --grad-dtype bf16 --layout hv)
endforeach()
# Preference losses in bf16: row blocks (vh) with fp32 gradients, and streaming (hv) with bf16 gradients.
foreach(variant IN LISTS FH_PREFERENCE_VARIANTS)
  string(REGEX REPLACE "_.*" "" loss ${variant})
  string(REGEX REPLACE ".*_" "" loss_type ${variant})
  set(case --loss ${loss} --loss-type ${loss_type} ${FH_PREFERENCE_${variant}} --batch 8 --seq 20 --hidden 67
      --vocab 5003 --dtype bf16)
  fh_gradcheck_test(bf16_preference_${variant} ${case} --layout vh --tile-rows 120)
  fh_gradcheck_test(bf16_grads_preference_${variant} ${case} --layout hv --bias --grad-dtype bf16 --tile-rows 30)
endforeach()
# DPO at TRL's current semantics in bf16: the lists, row blocks (the aots stream); MPO's with bf16 gradients,
# streaming.
foreach(list IN LISTS FH_DPO_TRL_LISTS)
  fh_gradcheck_test(bf16_preference_trl_${list} ${FH_DPO_TRL_CASE} ${FH_DPO_TRL_${list}} --dtype bf16 --layout vh
                    --tile-rows 120)
endforeach()
fh_gradcheck_test(bf16_grads_preference_trl_mpo ${FH_DPO_TRL_CASE} ${FH_DPO_TRL_mpo} --dtype bf16 --grad-dtype bf16
                  --layout hv --bias --tile-rows 30)
fh_gradcheck_test(bf16_grpo_filtered_row_blocks --loss grpo --loss-type grpo --batch 12 --seq 4 --hidden 40 --vocab 3001 --tile-rows 8
                 --logit-scale 10 --grad-filter-eps 0.2 --entropy-coef 0.01 --train-step --dtype bf16 --grad-dtype bf16)
fh_gradcheck_test(bf16_fp32_du_preference_dpo --loss dpo --ref token --batch 8 --seq 20 --hidden 67 --vocab 5003 --dtype bf16
                 --fp32-du --tile-rows 120)
fh_gradcheck_test(bf16_fp32_du_grpo_sequence --loss grpo --loss-type grpo --batch 3 --seq 47 --hidden 67 --vocab 5003 --is-level sequence
                 --beta 0.04 --temperature 0.7 --dtype bf16 --fp32-du --train-step)
# bf16 dweight holding the train step's logits block and its leading dU chunks (H > n, [V, H], three chunks of at
# most 8192 columns; test_bf16 has the cross-entropy cases): GRPO's and the preference losses' row blocks.
fh_gradcheck_test(bf16_grpo_scratch_in_dweight --loss grpo --batch 4 --seq 10 --hidden 160 --vocab 20000 --loss-type dapo --beta 0.04
                 --layout vh --bias --train-step --dtype bf16 --grad-dtype bf16 --tile-rows 20)
fh_gradcheck_test(bf16_preference_scratch_in_dweight --loss dpo --batch 2 --seq 10 --hidden 160 --vocab 20000 --layout vh --dtype bf16
                 --grad-dtype bf16 --tile-rows 20)

# Distillation (forward KL, reverse KL, generalized JSD, plus the hard-label cross-entropy; TRL GKD / Liger
# semantics) against ref_distill_linear: every divergence in both schedules of the single-call step, jsd's beta 0
# and 1 ends, temperatures 0.7 and 2, the hard loss (alone too), both layouts of both heads, biases, every reduction;
# tolerances in tools/gradcheck_distill.c. n = 64, student hidden 67, teacher hidden 45, V = 5003. Row blocks: the
# default budget (one block), or --tile-rows 24 (blocks of 22, 21, 21 rows). Streaming: a budget of 40000 bytes, below
# the 8 V = 40024 bytes of one row block's two V-wide fp32 logits rows, with 16 x 128 tiles (5003 = 39 x 128 + 11).
set(FH_DISTILL_CASE --loss distill --n 64 --hidden 67 --teacher-hidden 45 --vocab 5003)
set(FH_DISTILL_STREAMING --tile-rows 16 --tile-vocab 128 --budget 40000)
set(FH_DISTILL_HARD --weight-soft-loss 0.6 --weight-hard-loss 0.4)
fh_gradcheck_test(distill_forward_kl_row_blocks ${FH_DISTILL_CASE} --divergence forward_kl --layout vh --bias)
fh_gradcheck_test(distill_forward_kl_streaming ${FH_DISTILL_CASE} --divergence forward_kl ${FH_DISTILL_STREAMING} --teacher-layout vh
                 --teacher-bias --reduction sum)
fh_gradcheck_test(distill_reverse_kl_row_blocks ${FH_DISTILL_CASE} --divergence reverse_kl --temperature 0.7 --teacher-layout vh
                 --reduction none)
fh_gradcheck_test(distill_reverse_kl_streaming ${FH_DISTILL_CASE} --divergence reverse_kl ${FH_DISTILL_STREAMING} --temperature 0.7
                 ${FH_DISTILL_HARD} --layout vh --bias)
fh_gradcheck_test(distill_jsd_row_blocks ${FH_DISTILL_CASE} --divergence jsd --temperature 0.7 ${FH_DISTILL_HARD} --bias
                 --tile-rows 24)
fh_gradcheck_test(distill_jsd_streaming ${FH_DISTILL_CASE} --divergence jsd --beta 0.3 ${FH_DISTILL_STREAMING} --reduction none
                 --layout vh --bias --teacher-bias)
fh_gradcheck_test(distill_jsd_beta0_row_blocks ${FH_DISTILL_CASE} --divergence jsd --beta 0 --temperature 0.7 --layout vh
                 --teacher-layout vh)
fh_gradcheck_test(distill_jsd_beta1_streaming ${FH_DISTILL_CASE} --divergence jsd --beta 1 ${FH_DISTILL_STREAMING} ${FH_DISTILL_HARD}
                 --reduction sum)
fh_gradcheck_test(distill_jsd_temperature2_no_targets ${FH_DISTILL_CASE} --divergence jsd --temperature 2 --no-targets --bias)
# Over top-k supports (TRL's iw_opd top_k / add_tail): jsd's union of both top-64s with the tail in row blocks,
# reverse KL's student top-20 renormalised streaming (the budget adds the selections' 64 x 20 x 16 bytes).
fh_gradcheck_test(distill_topk_jsd_tail_row_blocks ${FH_DISTILL_CASE} --divergence jsd --beta 0.3 --top-k 64
                 --temperature 0.7 ${FH_DISTILL_HARD} --bias)
fh_gradcheck_test(distill_topk_reverse_kl_streaming ${FH_DISTILL_CASE} --divergence reverse_kl --top-k 20 --no-tail
                 --tile-rows 16 --tile-vocab 128 --budget 60480 --layout vh --reduction none)
# Temperature 1e-9: logits / T ~ 1e9, both softmaxes one-hot, jsd ln 2 where the argmaxes differ and a gradient of 0.
# The AVX-512 kernels fused inv_t z - lse into one rounding while the lse rounded inv_t z first: log p of the
# largest entry came out up to half an ulp of 1e9 above 0 (p = e^32), and the loss NaN.
fh_gradcheck_test(distill_jsd_tiny_temperature ${FH_DISTILL_CASE} --divergence jsd --temperature 1e-9)
fh_gradcheck_test(distill_hard_only_streaming ${FH_DISTILL_CASE} --divergence forward_kl ${FH_DISTILL_STREAMING} --weight-soft-loss 0
                 --weight-hard-loss 1 --temperature 0.7 --layout vh --bias)
# bf16 heads (the reference on the bf16-valued inputs; dx and dweight at the bf16 tolerance, tests/cases/ce_case.c): row
# blocks and streaming (a 120000-byte budget, below the 2 n V bytes of a bf16 row block's dU), bf16 gradients, and
# fp32 dU (which always streams; the fp32 tolerance).
fh_gradcheck_test(distill_bf16_jsd_row_blocks ${FH_DISTILL_CASE} --divergence jsd --dtype bf16 --layout vh --bias --temperature 0.7)
fh_gradcheck_test(distill_bf16_grads_forward_kl_streaming ${FH_DISTILL_CASE} --divergence forward_kl --dtype bf16 --grad-dtype bf16
                 --tile-rows 16 --tile-vocab 128 --budget 120000 ${FH_DISTILL_HARD} --bias)
fh_gradcheck_test(distill_bf16_grads_reverse_kl_row_blocks ${FH_DISTILL_CASE} --divergence reverse_kl --dtype bf16 --grad-dtype bf16
                 --reduction none --teacher-layout vh)
fh_gradcheck_test(distill_bf16_grads_scratch_in_dweight --loss distill --divergence jsd --n 40 --hidden 160 --vocab 20000 --layout vh
                 --dtype bf16 --grad-dtype bf16)
fh_gradcheck_test(distill_bf16_fp32_du_jsd ${FH_DISTILL_CASE} --divergence jsd --beta 0.3 --dtype bf16 --fp32-du
                 --tile-rows 16 --tile-vocab 128 ${FH_DISTILL_HARD} --bias)

# KTO (TRL's KTOTrainer: loss types kto and apo_zero_unpaired) against ref_kto, through fh_kto_forward and
# fh_kto_forward_backward: both loss types, the reference per sequence and per token, kto's KL term as a value and as
# per-sequence log-ratios, TRL's default weights and unequal ones. 8 sequences of 20 tokens: row blocks of whole
# sequences with --tile-rows 60 (blocks of 3, 3 and 2 sequences), streaming with --tile-rows 10 (< T, no sequence
# fits); the default tiles hold the whole batch in one block. Tolerances in tests/cases/kto_case.c.
set(FH_KTO_VARIANTS kto_value kto_logratios apo_zero_unpaired)
set(FH_KTO_kto_value --loss-type kto --kl value --ref sequence)
set(FH_KTO_kto_logratios --loss-type kto --kl logratios --ref token --desirable-weight 1.33 --undesirable-weight 0.8)
set(FH_KTO_apo_zero_unpaired --loss-type apo_zero_unpaired --ref token --beta 0.3 --undesirable-weight 1.5)
foreach(variant IN LISTS FH_KTO_VARIANTS)
  set(case --loss kto ${FH_KTO_${variant}} --batch 8 --seq 20 --hidden 67 --vocab 5003)
  fh_gradcheck_test(kto_${variant} ${case} --layout vh)
  fh_gradcheck_test(kto_row_blocks_${variant} ${case} --layout hv --bias --tile-rows 60)
  fh_gradcheck_test(kto_streaming_${variant} ${case} --layout vh --bias --tile-rows 10)
  # bf16 x and weight: row blocks with fp32 gradients, streaming with bf16 ones (the bf16 tolerances).
  fh_gradcheck_test(bf16_kto_row_blocks_${variant} ${case} --dtype bf16 --layout vh --tile-rows 60)
  fh_gradcheck_test(bf16_grads_kto_streaming_${variant} ${case} --dtype bf16 --grad-dtype bf16 --layout hv --bias
                    --tile-rows 10)
endforeach()

# Top-k teacher distillation (TRL's server distillation: forward KL on the teacher's top-k, with and without the tail)
# against ref_distill_topk_linear; tolerances in tools/gradcheck_distill_topk.c. n = 64, H = 67, V = 5003, k 20 by
# default with up to 30% of each row's entries padded and every fifth token's all; k = 1 and 256; both schedules: row
# blocks (the default budget, one block; --tile-rows 24: 22, 21, 21 rows) and streaming (a budget of 400000 bytes,
# below the 4 V 64 = 1.28 MB of one fp32 block of the 64 rows and the 2 n V = 640 kB of a bf16 block's dU, with
# 16 x 128 tiles); bf16 inputs (the bf16 tolerance) and bf16 gradients.
set(FH_TOPK_CASE --loss distill_topk --n 64 --hidden 67 --vocab 5003)
set(FH_TOPK_STREAMING --tile-rows 16 --tile-vocab 128 --budget 400000)
set(FH_TOPK_HARD --weight-soft-loss 0.6 --weight-hard-loss 0.4)
fh_gradcheck_test(distill_topk_tail_row_blocks ${FH_TOPK_CASE} --layout vh --bias)
fh_gradcheck_test(distill_topk_tail_streaming ${FH_TOPK_CASE} ${FH_TOPK_STREAMING} --temperature 0.7 ${FH_TOPK_HARD}
                 --reduction none)
fh_gradcheck_test(distill_topk_no_tail_row_blocks ${FH_TOPK_CASE} --no-tail --temperature 0.7 ${FH_TOPK_HARD} --tile-rows 24
                 --bias)
fh_gradcheck_test(distill_topk_no_tail_streaming ${FH_TOPK_CASE} --no-tail ${FH_TOPK_STREAMING} --reduction sum --layout vh)
fh_gradcheck_test(distill_topk_k1_tail_row_blocks ${FH_TOPK_CASE} --k 1 --temperature 2 --no-targets)
fh_gradcheck_test(distill_topk_k256_streaming ${FH_TOPK_CASE} --k 256 ${FH_TOPK_STREAMING} --reduction none --bias)
fh_gradcheck_test(distill_topk_k256_no_tail_row_blocks ${FH_TOPK_CASE} --k 256 --no-tail --layout vh)
fh_gradcheck_test(distill_topk_bf16_row_blocks ${FH_TOPK_CASE} --dtype bf16 --bias --temperature 0.7 ${FH_TOPK_HARD})
fh_gradcheck_test(distill_topk_bf16_grads_no_tail_streaming ${FH_TOPK_CASE} --dtype bf16 --grad-dtype bf16 --no-tail
                 ${FH_TOPK_STREAMING} --layout vh)

# A renamed case must leave the list above too.
foreach(name IN LISTS FH_GRADCHECKS_EVERY_VARIANT)
  if(NOT TEST gradcheck_${name})
    message(FATAL_ERROR "tests/gradchecks.cmake: FH_GRADCHECKS_EVERY_VARIANT names ${name}, which no fh_gradcheck_test defines")
  endif()
endforeach()
