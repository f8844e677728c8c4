/* Blending order for meshtrain's BlendedDataset (see blend.py, which compiles this file).
 *
 * Position n goes to a dataset among those at least `delta` = 1/(2(K-1)) behind their target
 * share w_d * n, choosing the one whose next sample falls due first (its share would reach
 * count + 1 - delta earliest). This is Tijdeman's solution of the chairman assignment
 * problem: every prefix of length n then holds w_d * n samples of dataset d within
 * 1 - 1/(2(K-1)) < 1, which the plain "furthest behind" greedy does not guarantee (it can
 * drift past 1 with several small weights). */
#include <stdint.h>
#include <stdlib.h>

int meshtrain_blend(const double *w, int64_t k, int64_t n_samples, int16_t *dataset_index,
                    int64_t *dataset_sample_index) {
    int64_t *count = calloc((size_t)k, sizeof(int64_t));
    if (!count) return -1;
    double delta = k > 1 ? 1.0 / (2.0 * (double)(k - 1)) : 0.0;
    for (int64_t n = 0; n < n_samples; n++) {
        double t = (double)(n + 1);
        int64_t best = -1;
        double best_due = 0.0;
        for (int64_t d = 0; d < k; d++) {
            if (w[d] <= 0.0) continue;
            /* the epsilon absorbs rounding in w[d] * t for shares that land exactly on delta */
            if (w[d] * t - (double)count[d] >= delta - 1e-9) {
                double due = ((double)count[d] + 1.0 - delta) / w[d];
                if (best < 0 || due < best_due) { best = d; best_due = due; }
            }
        }
        if (best < 0) { free(count); return -2; } /* the theorem says this cannot happen */
        dataset_index[n] = (int16_t)best;
        dataset_sample_index[n] = count[best]++;
    }
    free(count);
    return 0;
}
