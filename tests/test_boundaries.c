/* Vocabulary boundaries: targets on the first and last column and on either side of each tile edge
 * (tile_vocab - 1, tile_vocab, tile_vocab + 1, ...), and argmax ties across tiles, through the public
 * API with caller-chosen targets, against the double reference. */
#include "ce_harness.h"

#include <stdio.h>
#include <stdlib.h>

/* Every target column in {0, 1, k t - 1, k t, k t + 1 (k = 1, 2), V - 2, V - 1} that lies in [0, V);
 * each used by two rows so that the rows also cross tile_rows = 3. Plain and with every option that
 * reads per-column data (class weights, label smoothing) or transforms logits (softcap, z-loss);
 * mean and none, both layouts, separate calls and the train step (which spans the whole vocabulary
 * per row block, so there only the row edges are exercised). Tolerances: ce_metrics_pass (tests/cases/ce_case.c). */
static void test_targets_on_tile_boundaries(void)
{
    static const struct {
        int64_t vocab, tile_vocab;
    } shapes[] = {{33, 16}, {48, 16}, {17, 16}, {16, 16}, {37, 8}, {5, 1}};
    const fh_reduction reductions[] = {FH_REDUCTION_MEAN, FH_REDUCTION_NONE};
    uint64_t seed = 200;
    for (size_t s = 0; s < TU_COUNT(shapes); s++) {
        const int64_t v = shapes[s].vocab, t = shapes[s].tile_vocab;
        const int64_t candidates[] = {0, 1, t - 1, t, t + 1, 2 * t - 1, 2 * t, 2 * t + 1, v - 2, v - 1};
        int64_t columns[TU_COUNT(candidates)];
        int64_t count = 0;
        for (size_t c = 0; c < TU_COUNT(candidates); c++)
            if (candidates[c] >= 0 && candidates[c] < v)
                columns[count++] = candidates[c];
        for (int layout = FH_LAYOUT_HV; layout <= FH_LAYOUT_VH; layout++)
            for (size_t r = 0; r < TU_COUNT(reductions); r++)
                for (int variant = 0; variant < 4; variant++) {
                    const int options = variant & 1, train_step = variant >> 1;
                    cp_problem p;
                    cp_problem_init(&p, 2 * count, 7, v, (fh_layout)layout, CP_BIAS | (options ? CP_CLASS_WEIGHTS : 0));
                    p.options.reduction = reductions[r];
                    if (options) {
                        p.options.label_smoothing = 0.1;
                        p.options.softcap = 2.5;
                        p.options.z_loss = 1e-2;
                    }
                    cp_problem_randomize(&p, seed++, 3.0);
                    for (int64_t i = 0; i < p.n; i++)
                        p.targets[i] = columns[i % count];
                    const cp_config cfg = {.threads = 1 + (int)r, .tile_rows = 3, .tile_vocab = t, .train_step = train_step};
                    char label[128];
                    snprintf(label, sizeof label, "V %lld, tile_vocab %lld, layout %d, reduction %d, options %d",
                             (long long)v, (long long)t, layout, (int)reductions[r], options);
                    cp_check_against_reference(&p, &cfg, label);
                    cp_problem_free(&p);
                }
    }
}

/* Argmax is documented as the lowest index among the largest logits. With hand-built logits (identity
 * x, so that fp32 logits are exactly the given floats) ties are exact, and the expected index is
 * computed here from that rule. Ties sit across tile edges (15 | 16 and 31 | 32 | 33 with
 * tile_vocab 16), between distant tiles, on the first and last columns; with tile_vocab 1 every column
 * is its own tile. Loss and gradients are also compared with the reference (ce_metrics_pass). */
static void test_argmax_ties_across_tiles(void)
{
    enum { N = 9, V = 37 };
    static const int64_t maxima[N][4] = {
        /* columns holding the row's maximum; -1 ends the list */
        {15, 16, -1}, {16, -1}, {32, 17, -1}, {V - 1, -1}, {V - 1, 0, -1}, {31, 32, 33, -1}, {0, -1},
        {-2} /* every column equal */, {20, 36, 5, -1}};
    float *logits = malloc(sizeof(float) * N * V);
    uint64_t rng = 99;
    for (int64_t i = 0; i < N; i++) {
        for (int64_t j = 0; j < V; j++)
            logits[i * V + j] = maxima[i][0] == -2 ? 0.5f : (float)(-ref_uniform(&rng));
        for (int k = 0; k < 4 && maxima[i][k] >= 0; k++)
            logits[i * V + maxima[i][k]] = 2.0f;
    }
    const int64_t tile_vocabs[] = {16, 1, 0};
    for (size_t tv = 0; tv < TU_COUNT(tile_vocabs); tv++)
        for (int variant = 0; variant < 4; variant++) {
            const int layout = variant & 1, train_step = variant >> 1;
            cp_problem p;
            cp_problem_from_logits(&p, N, V, (fh_layout)layout, logits);
            for (int64_t i = 0; i < N; i++)
                p.targets[i] = (i * 7) % V;
            const cp_config cfg = {.threads = 2, .tile_rows = 3, .tile_vocab = tile_vocabs[tv], .train_step = train_step};
            char label[96];
            snprintf(label, sizeof label, "argmax ties, tile_vocab %lld, layout %d, train step %d",
                     (long long)tile_vocabs[tv], layout, train_step);
            cp_check_against_reference(&p, &cfg, label);
            cp_fused f;
            const fh_status st = cp_run_fused(&p, &cfg, &f);
            TU_CHECK(st == FH_OK, "%s: status %d", label, (int)st);
            for (int64_t i = 0; st == FH_OK && i < N; i++) {
                int64_t expected = 0;
                for (int64_t j = 1; j < V; j++)
                    if (logits[i * V + j] > logits[i * V + expected])
                        expected = j;
                TU_CHECK(f.argmax[i] == expected, "%s: row %lld: argmax %lld, expected %lld (lowest tied index)",
                         label, (long long)i, (long long)f.argmax[i], (long long)expected);
            }
            cp_fused_free(&f);
            cp_problem_free(&p);
        }
    free(logits);
}

static const tu_test tests[] = {
    {"targets on first, last and tile-edge columns", test_targets_on_tile_boundaries},
    {"argmax ties across tiles", test_argmax_ties_across_tiles},
};
const tu_suite suite_boundaries = {tests, TU_COUNT(tests)};
