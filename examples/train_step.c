/* A training step's loss and gradients from hidden states and a torch-layout lm_head, without the
 * [N, V] logits. Build: cc train_step.c -lfusedhead -o train_step */
#include <fusedhead.h>

#include <stdio.h>
#include <stdlib.h>

int main(void)
{
    enum { N = 64, H = 32, V = 1000 };
    float *hidden = malloc(sizeof(float) * N * H), *weight = malloc(sizeof(float) * V * H);
    float *dhidden = malloc(sizeof(float) * N * H), *dweight = malloc(sizeof(float) * V * H);
    int64_t targets[N];
    for (int i = 0; i < N * H; i++)
        hidden[i] = (float)((i * 37 % 101) - 50) / 50.0f;
    for (int i = 0; i < V * H; i++)
        weight[i] = (float)((i * 53 % 97) - 48) / 480.0f;
    for (int i = 0; i < N; i++)
        targets[i] = i % 7 == 0 ? -100 : (i * 31) % V; /* -100: ignored, as in torch */

    fh_context *ctx;
    fh_status st = fh_context_create(&ctx);
    fh_linear lin;
    fh_linear_init(&lin, N, H, V, hidden, weight, FH_LAYOUT_VH, NULL); /* nn.Linear.weight is [V, H] */
    fh_ce_options options;
    fh_ce_options_init(&options);
    options.label_smoothing = 0.1;
    options.z_loss = 1e-4;

    double loss;
    const float grad_loss = 1.0f; /* d(total)/d(loss) */
    fh_ce_outputs out = {.loss = &loss};
    fh_linear_grads grads = {.dx = dhidden, .dx_row_stride = H, .dx_beta = 0.0f, .dweight = dweight, .dweight_beta = 0.0f};
    if (st == FH_OK)
        st = fh_ce_forward_backward(ctx, &lin, targets, &options, &grad_loss, &out, &grads);
    if (st != FH_OK) {
        const char *why = "";
        fh_context_message(ctx, &why);
        fprintf(stderr, "fusedhead: %s (%s)\n", fh_status_string(st), why);
    } else {
        printf("loss %.6f, dhidden[0] %.3e, dweight[0] %.3e\n", loss, dhidden[0], dweight[0]);
    }
    fh_context_destroy(ctx);
    free(hidden);
    free(weight);
    free(dhidden);
    free(dweight);
    return st == FH_OK ? 0 : 1;
}
