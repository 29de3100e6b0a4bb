#include "grpo_convert.h"

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
    r.entropy_bonus = REF_GRPO_ENTROPY_MASKED_MEAN;
    return r;
}

fh_grpo_metrics grpo_fh_metrics(const ref_grpo_metrics *m)
{
    const fh_grpo_metrics f = {m->kl, m->entropy, m->clip_low_mean, m->clip_high_mean, m->clip_region_mean,
                               m->cispo_clip_ratio};
    return f;
}
