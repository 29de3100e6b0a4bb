/* grpo_shapes: N = B*T and V at tile - 1, tile, tile + 1 (and V = 1), degenerate tiles, temperature != 1,
 * entropy_coef != 0, num_items_in_batch and max_completion_length set explicitly. Tolerances: grpo_harness.h. */
#include "grpo_harness.h"

enum { SHAPE_TILE_ROWS = 8, SHAPE_TILE_VOCAB = 16 };

/* N = B*T in {7, 8, 9, 15, 16, 17} (tile_rows 8 - 1, 8, 8 + 1, 16 - 1, 16, 16 + 1, with B = 1 or T = 1 among the
 * factorizations) x V in {1, 15, 16, 17, 33} (tile_vocab 16: -1, 0, +1, 2 tiles + 1; V = 1: logp = 0, entropy 0,
 * zero gradients), each over all six loss types, one thread; level, call style, old log-probs, beta, delta,
 * layout, bias and grad_output (1, -0.5, 2) picked per case by gp_pick. Every case has temperature != 1 (0.7 or 1.3),
 * entropy_coef != 0 (+-0.05), num_items_in_batch set (5.5 or 40) and max_completion_length set (T + 3).
 * Tolerances: gp_check. */
static void test_tile_edges(void)
{
    static const int64_t shapes[][2] = {{1, 7}, {7, 1}, {2, 4}, {1, 8}, {3, 3}, {9, 1},
                                        {3, 5}, {4, 4}, {1, 16}, {17, 1}, {2, 8}};
    static const int64_t vocabs[] = {1, 15, 16, 17, 33};
    int k = 0;
    for (size_t s = 0; s < TU_COUNT(shapes); s++)
        for (size_t vi = 0; vi < TU_COUNT(vocabs); vi++)
            for (size_t lt = 0; lt < TU_COUNT(gp_all_losses); lt++, k++) {
                fh_grpo_options o;
                gp_options(&o, gp_all_losses[lt], gp_all_levels[gp_pick(k, 61, 2)]);
                o.temperature = gp_pick(k, 62, 2) ? 0.7 : 1.3;
                /* |entropy_coef| 0.05: the bonus's gradient -c p_j (z_j - sum p z) carries the fp32 logit error
                 * (~5e-7 absolute) against z_j - sum p z, which is small on peaked rows; when the bonus dominates
                 * (c = -0.2 over a one-token batch whose policy term nib = 40 shrinks) that conditioning alone
                 * gave 6.3e-6 normwise, too close to GRPO_GRAD_NORM_REL_TOL; at 0.05 the worst is < 3.3e-6. */
                o.entropy_coef = gp_pick(k, 63, 3) ? -0.05 : 0.05;
                o.num_items_in_batch = gp_pick(k, 64, 2) ? 5.5 : 40.0;
                o.max_completion_length = shapes[s][1] + 3;
                o.beta = gp_pick(k, 65, 2) ? 0.04 : 0.0;
                o.delta = gp_pick(k, 66, 3) ? 1.5 : NAN;
                gp_problem p;
                gp_init(&p, shapes[s][0], shapes[s][1], 9, vocabs[vi], gp_pick(k, 67, 2) ? FH_LAYOUT_HV : FH_LAYOUT_VH,
                        !gp_pick(k, 68, 3), 6000 + (uint64_t)k);
                gp_set_ref(&p, o.temperature);
                if (!gp_pick(k, 69, 4))
                    gp_set_old(&p, &o);
                const gp_config c = {.threads = 1, .tile_rows = SHAPE_TILE_ROWS,
                                     .tile_vocab = SHAPE_TILE_VOCAB, .train_step = gp_pick(k, 71, 2),
                                     .grad_output = gp_pick(k, 72, 3) ? -0.5f : gp_pick(k, 73, 2) ? 2.0f : 1.0f};
                gp_check(&p, &o, &c, "tile edges");
                gp_free(&p);
            }
    gp_print_worst("grpo_shapes");
}

/* Degenerate and uneven tiles on one problem, and the library's default tiles (and the hidden size at BLIS's
 * micro-kernel edges: H in {1, 8, 17}). */
static void test_tile_configurations(void)
{
    static const int64_t tiles[][2] = {{1, 1}, {3, 5}, {35, 37}, {0, 0}, {2, 1}};
    static const int64_t hiddens[] = {1, 8, 17};
    int k = 0;
    for (size_t ti = 0; ti < TU_COUNT(tiles); ti++)
        for (size_t hi = 0; hi < TU_COUNT(hiddens); hi++)
            for (int step = 0; step <= 1; step++, k++) {
                fh_grpo_options o;
                gp_options(&o, gp_all_losses[k % 6], gp_all_levels[(k / 6) & 1]);
                o.temperature = 1.3;
                o.entropy_coef = 0.05;
                o.beta = 0.04;
                o.num_items_in_batch = 12.0;
                o.max_completion_length = 11;
                gp_problem p;
                gp_init(&p, 5, 7, hiddens[hi], 37, gp_pick(k, 81, 2) ? FH_LAYOUT_HV : FH_LAYOUT_VH, 1,
                        6500 + (uint64_t)k);
                gp_set_ref(&p, o.temperature);
                gp_set_old(&p, &o);
                /* 2 threads on the default tiles only (gp_two_threads). */
                const gp_config c = {.threads = 1 + (tiles[ti][0] == 0 && hi == 0 && step == 0),
                                     .tile_rows = tiles[ti][0], .tile_vocab = tiles[ti][1],
                                     .train_step = step};
                gp_check(&p, &o, &c, "tile configuration");
                gp_free(&p);
            }
    gp_print_worst("grpo_shapes (tiles)");
}

/* fp32 row blocks at N <= H compute their logits into dU chunks in a dense [V, H] dweight's memory (beta 0) and work
 * on each row in a row of their own (plan.c, keep_f32_du): B = 2, T = 4, H = 32, V = 20000 (three chunks, two in
 * dweight), where GRPO's block hook needs every row folded before any coefficient, so each folded row goes back
 * into the chunks (temperature 1.3 and a bias make that row differ from the GEMM's logits). Both levels, every loss
 * type, each with beta 0 at one level and beta 1 (nothing moves) at the other; against the reference (gp_check). */
static void test_chunks_in_dweight(void)
{
    for (int k = 0; k < 2 * GP_LOSS_TYPES; k++) {
        fh_grpo_options o;
        gp_options(&o, gp_all_losses[k % GP_LOSS_TYPES], gp_all_levels[k / GP_LOSS_TYPES]);
        o.temperature = 1.3;
        o.entropy_coef = 0.05;
        o.beta = 0.04;
        gp_problem p;
        gp_init(&p, 2, 4, 32, 20000, FH_LAYOUT_VH, 1, 7000 + (uint64_t)k);
        gp_set_ref(&p, o.temperature);
        gp_set_old(&p, &o);
        const gp_config c = {.threads = 2, .train_step = 1, .grad_beta = (float)((k + k / GP_LOSS_TYPES) & 1)};
        gp_check(&p, &o, &c, "dU chunks in dweight");
        gp_free(&p);
    }
    gp_print_worst("grpo_shapes (dU chunks in dweight)");
}

static const tu_test tests[] = {
    {"tile edges with temperature, entropy_coef, normalisers", test_tile_edges},
    {"tile configurations and hidden sizes", test_tile_configurations},
    {"fp32 train step, logits computed into dU chunks in dweight's memory", test_chunks_in_dweight},
};
const tu_suite suite_grpo_shapes = {tests, TU_COUNT(tests)};
