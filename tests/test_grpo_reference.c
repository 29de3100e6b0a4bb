/* grpo_reference: every loss_type x importance_sampling_level x {old log-probs or on-policy} x beta {0, 0.04} x
 * delta {off, 1.5}; temperature 0.7; tiles 4 x 16 over N = 35, V = 37 (edges on both sides); both layouts, bias
 * on half, the train step on a third, grad_output -0.5 and accumulation (gradient beta 1) on some.
 * Tolerances: grpo_harness.h. */
#include "grpo_harness.h"

/* 8 loss types x 2 levels x {old, on-policy} x beta {0, 0.04} x delta {off, 1.5} = 128 problems, each checked
 * with separate calls and about a third also with the train step; layout (half), bias (half), eps_high 0.28
 * (half of the clipped cases), 2 threads (1/40, gp_two_threads), grad_output -0.5 (1/5) and gradient
 * accumulation (1/6) spread over the matrix by gp_pick. B = 5 rows with advantages +, -, 0, + and the last row
 * empty; T = 7 (N = 35 = 8 x 4 + 3 rows: a 3-row edge tile); V = 37 = 2 x 16 + 5 (a 5-column edge tile); H = 11;
 * temperature 0.7; DAPO-style eps_high 0.28 on the clipped types. Tolerances: gp_check (header comment). */
static void test_option_matrix(void)
{
    int k = 0;
    for (size_t lt = 0; lt < TU_COUNT(gp_all_losses); lt++)
        for (size_t lv = 0; lv < TU_COUNT(gp_all_levels); lv++)
            for (int old = 0; old <= 1; old++)
                for (int with_beta = 0; with_beta <= 1; with_beta++)
                    for (int with_delta = 0; with_delta <= 1; with_delta++, k++) {
                        fh_grpo_options o;
                        gp_options(&o, gp_all_losses[lt], gp_all_levels[lv]);
                        o.temperature = 0.7;
                        o.beta = with_beta ? 0.04 : 0.0;
                        o.delta = with_delta ? 1.5 : NAN;
                        if (gp_clipped(o.loss_type) && gp_pick(k, 1, 2))
                            o.epsilon_high = 0.28;
                        gp_problem p;
                        gp_init(&p, 5, 7, 11, 37, gp_pick(k, 2, 2) ? FH_LAYOUT_HV : FH_LAYOUT_VH, gp_pick(k, 3, 2),
                                1000 + (uint64_t)k);
                        gp_set_ref(&p, o.temperature);
                        if (old)
                            gp_set_old(&p, &o);
                        gp_config c = {.threads = 1, .tile_rows = 4, .tile_vocab = 16};
                        if (gp_pick(k, 4, 40))
                            gp_two_threads(&c);
                        c.grad_output = gp_pick(k, 5, 5) ? -0.5f : 1.0f;
                        c.grad_beta = gp_pick(k, 6, 6) ? 1.0f : 0.0f;
                        gp_check(&p, &o, &c, "option matrix");
                        if (gp_pick(k, 7, 3)) {
                            c.train_step = 1;
                            gp_check(&p, &o, &c, "option matrix, train step");
                        }
                        gp_free(&p);
                    }
    gp_print_worst("grpo_reference");
}

/* Non-default SAPO temperatures, epsilon_low != epsilon_high, delta inside the clip range (1.1 < 1 + 0.3) and
 * below it (0.7 < 1 - 0.35: c1 = min(r, delta) then drives the low clip), larger and smaller advantages: the same
 * comparison. */
static void test_option_values(void)
{
    static const struct {
        double eps_low, eps_high, tau_pos, tau_neg, adv_scale, delta;
    } variants[] = {{0.2, NAN, 1.0, 1.05, 1.0, NAN}, {0.1, 0.3, 0.5, 2.0, 3.0, 1.1}, {0.35, 0.05, 3.0, 0.25, 0.5, 0.7}};
    int k = 0;
    for (size_t vi = 0; vi < TU_COUNT(variants); vi++)
        for (size_t lt = 0; lt < TU_COUNT(gp_all_losses); lt++)
            for (size_t lv = 0; lv < TU_COUNT(gp_all_levels); lv++, k++) {
                fh_grpo_options o;
                gp_options(&o, gp_all_losses[lt], gp_all_levels[lv]);
                o.temperature = 0.7;
                o.epsilon_low = variants[vi].eps_low;
                o.epsilon_high = variants[vi].eps_high;
                o.sapo_temperature_pos = variants[vi].tau_pos;
                o.sapo_temperature_neg = variants[vi].tau_neg;
                o.delta = variants[vi].delta;
                o.beta = gp_pick(k, 11, 2) ? 0.04 : 0.0;
                gp_problem p;
                gp_init(&p, 4, 6, 9, 23, gp_pick(k, 12, 2) ? FH_LAYOUT_HV : FH_LAYOUT_VH, 1, 2000 + (uint64_t)k);
                for (int64_t b = 0; b < p.batch; b++)
                    p.adv[b] *= (float)variants[vi].adv_scale;
                gp_set_ref(&p, o.temperature);
                gp_set_old(&p, &o);
                const gp_config c = {.threads = 1, .tile_rows = 4, .tile_vocab = 16, .train_step = gp_pick(k, 13, 3)};
                gp_check(&p, &o, &c, "option values");
                gp_free(&p);
            }
    gp_print_worst("grpo_reference (values)");
}

static const tu_test tests[] = {
    {"loss_type x level x old x beta x delta vs reference", test_option_matrix},
    {"epsilons, SAPO temperatures, advantage scales", test_option_values},
};
const tu_suite suite_grpo_reference = {tests, TU_COUNT(tests)};
