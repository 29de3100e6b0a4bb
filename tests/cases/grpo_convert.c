#include "grpo_convert.h"

#include <stddef.h>

ref_grpo_options grpo_ref_options(const fh_grpo_options *o)
{
    ref_grpo_options r;
    ref_grpo_options_default(&r);
    r.loss_type = (ref_grpo_loss_type)o->loss_type;
    r.importance_sampling_level =
        o->importance_sampling_level == FH_GRPO_IS_SEQUENCE ? REF_GRPO_IS_SEQUENCE : REF_GRPO_IS_TOKEN;
    r.temperature = o->temperature;
    r.epsilon_low = o->epsilon_low;
    r.epsilon_high = o->epsilon_high;
    r.delta = o->delta;
    r.beta = o->beta;
    r.sapo_temperature_pos = o->sapo_temperature_pos;
    r.sapo_temperature_neg = o->sapo_temperature_neg;
    r.num_items_in_batch = o->num_items_in_batch;
    r.max_completion_length = o->max_completion_length;
    r.entropy_coef = o->entropy_coef;
    r.entropy_bonus = REF_GRPO_ENTROPY_TRL;
    r.top_entropy_quantile = o->top_entropy_quantile;
    r.off_policy_mask_threshold = o->off_policy_mask_threshold;
    r.use_bias_correction_kl = o->use_bias_correction_kl;
    r.vllm_importance_sampling_correction = o->vllm_importance_sampling_correction;
    r.vllm_importance_sampling_mode = (ref_grpo_vllm_is_mode)o->vllm_importance_sampling_mode;
    r.vllm_importance_sampling_clip_min = o->vllm_importance_sampling_clip_min;
    r.vllm_importance_sampling_clip_max = o->vllm_importance_sampling_clip_max;
    r.vespo_k_pos = o->vespo_k_pos;
    r.vespo_lambda_pos = o->vespo_lambda_pos;
    r.vespo_k_neg = o->vespo_k_neg;
    r.vespo_lambda_neg = o->vespo_lambda_neg;
    return r;
}

fh_grpo_metrics grpo_fh_metrics(const ref_grpo_metrics *m)
{
    const fh_grpo_metrics f = {.kl = m->kl,
                               .entropy = m->entropy,
                               .clip_ratio_low_mean = m->clip_low_mean,
                               .clip_ratio_high_mean = m->clip_high_mean,
                               .clip_ratio_region_mean = m->clip_region_mean,
                               .cispo_clip_ratio = m->cispo_clip_ratio,
                               .clip_ratio_low_min = m->clip_low_min,
                               .clip_ratio_high_max = m->clip_high_max,
                               .policy_loss = m->policy_loss,
                               .entropy_coef = m->entropy_coef,
                               .vespo_phi_seq_mean = m->vespo_phi_seq_mean,
                               .sampling_logp_difference_mean = m->sampling_logp_diff_mean,
                               .sampling_logp_difference_max = m->sampling_logp_diff_max,
                               .importance_sampling_ratio_min = m->is_ratio_min,
                               .importance_sampling_ratio_mean = m->is_ratio_mean,
                               .importance_sampling_ratio_max = m->is_ratio_max};
    return f;
}

/* Every field of fh_grpo_metrics, in declaration order, with its TRL key. */
int grpo_metrics_fields(const fh_grpo_metrics *m, double values[GRPO_METRIC_COUNT])
{
    const double v[GRPO_METRIC_COUNT] = {m->kl,
                                         m->entropy,
                                         m->clip_ratio_low_mean,
                                         m->clip_ratio_high_mean,
                                         m->clip_ratio_region_mean,
                                         m->cispo_clip_ratio,
                                         m->clip_ratio_low_min,
                                         m->clip_ratio_high_max,
                                         m->policy_loss,
                                         m->entropy_coef,
                                         m->vespo_phi_seq_mean,
                                         m->sampling_logp_difference_mean,
                                         m->sampling_logp_difference_max,
                                         m->importance_sampling_ratio_min,
                                         m->importance_sampling_ratio_mean,
                                         m->importance_sampling_ratio_max};
    for (int k = 0; k < GRPO_METRIC_COUNT; k++)
        values[k] = v[k];
    return GRPO_METRIC_COUNT;
}

const char *const grpo_metric_keys[GRPO_METRIC_COUNT] = {"kl",
                                                         "entropy",
                                                         "clip_ratio/low_mean",
                                                         "clip_ratio/high_mean",
                                                         "clip_ratio/region_mean",
                                                         "cispo_clip_ratio",
                                                         "clip_ratio/low_min",
                                                         "clip_ratio/high_max",
                                                         "policy_loss",
                                                         "entropy_coef",
                                                         "vespo/phi_seq_mean",
                                                         "sampling/sampling_logp_difference/mean",
                                                         "sampling/sampling_logp_difference/max",
                                                         "sampling/importance_sampling_ratio/min",
                                                         "sampling/importance_sampling_ratio/mean",
                                                         "sampling/importance_sampling_ratio/max"};

_Static_assert(sizeof(fh_grpo_metrics) == GRPO_METRIC_COUNT * sizeof(double),
               "grpo_metrics_fields must list every field of fh_grpo_metrics");
_Static_assert(offsetof(fh_grpo_metrics, policy_loss) == GRPO_METRIC_POLICY_LOSS * sizeof(double) &&
                   offsetof(fh_grpo_metrics, vespo_phi_seq_mean) == GRPO_METRIC_VESPO_PHI_SEQ_MEAN * sizeof(double),
               "GRPO_METRIC_* index grpo_metrics_fields' order");
_Static_assert(offsetof(fh_grpo_metrics, importance_sampling_ratio_min) == GRPO_METRIC_IS_RATIO_MIN * sizeof(double) &&
                   offsetof(fh_grpo_metrics, importance_sampling_ratio_max) == GRPO_METRIC_IS_RATIO_MAX * sizeof(double),
               "GRPO_METRIC_IS_* index grpo_metrics_fields' order");
