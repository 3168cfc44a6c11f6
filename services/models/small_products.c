/* Linear products of one or two rows (a decode step of one request), float32 and bfloat16.
 *
 * At one row a product only streams its weight from memory once; oneDNN's packed product
 * (services/models/packed.py) reads it at about half the memory's rate there, plus a reorder of
 * its own. Here each thread walks its share of the weight's rows once, in the order they lie,
 * with 16 lanes of float32 sums per input row, and writes y = x W^T + b. Measured on a 2-core
 * AVX-512 machine over SmolLM2-135M's 30 layers: one row 14.5 against 18.5 ms (float32), 6.6
 * against 12.1 ms (bfloat16); at two rows still ahead; from five rows oneDNN's blocked kernels
 * win, so packed.py sends only up to SMALL_ROWS rows here. Sums are float32 in another order
 * than oneDNN's (results differ in the last bits); a bfloat16 output is rounded to nearest even.
 */
#include <stdint.h>

#include "bf16.h"

#define LANES 16

#define DOTS(NAME, WT, WIDEN, M)                                                          \
    static inline void NAME##_##M(const WT *w, const float *x, int64_t k, float *out) {   \
        float s[M][LANES];                                                                \
        for (int r = 0; r < M; r++)                                                       \
            for (int j = 0; j < LANES; j++) s[r][j] = 0.f;                                \
        int64_t i = 0;                                                                    \
        for (; i + LANES <= k; i += LANES)                                                \
            for (int j = 0; j < LANES; j++) {                                             \
                float wv = WIDEN(w[i + j]);                                               \
                for (int r = 0; r < M; r++) s[r][j] += wv * x[r * k + i + j];             \
            }                                                                             \
        for (int r = 0; r < M; r++) {                                                     \
            float t = 0.f;                                                                \
            for (int j = 0; j < LANES; j++) t += s[r][j];                                 \
            for (int64_t q = i; q < k; q++) t += WIDEN(w[q]) * x[r * k + q];              \
            out[r] = t;                                                                   \
        }                                                                                 \
    }

#define SAME(v) (v)
DOTS(dots_f32, float, SAME, 1)
DOTS(dots_f32, float, SAME, 2)
DOTS(dots_bf16, uint16_t, bf16_to_f32, 1)
DOTS(dots_bf16, uint16_t, bf16_to_f32, 2)

/* x: m (1 or 2) float32 rows of k, packed; w: [n, k] row-major; y: [m, n] at row stride sy. */
void small_linear(const float *x, const float *w, const float *bias, float *y, int64_t sy,
                  int64_t m, int64_t n, int64_t k, int threads) {
    if (m < 1 || m > 2) return; /* the caller sends one or two rows, never none */
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c = 0; c < n; c++) {
        float out[2];
        if (m == 1)
            dots_f32_1(w + c * k, x, k, out);
        else
            dots_f32_2(w + c * k, x, k, out);
        float b = bias ? bias[c] : 0.f;
        for (int64_t r = 0; r < m; r++) y[r * sy + c] = out[r] + b;
    }
}

/* The same in bfloat16; xf: room for m * k float32 (the rows widened once, not per thread). */
void small_linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                       int64_t sy, int64_t m, int64_t n, int64_t k, float *xf, int threads) {
    if (m < 1 || m > 2) return;
    for (int64_t i = 0; i < m * k; i++) xf[i] = bf16_to_f32(x[i]);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c = 0; c < n; c++) {
        float out[2];
        if (m == 1)
            dots_bf16_1(w + c * k, xf, k, out);
        else
            dots_bf16_2(w + c * k, xf, k, out);
        float b = bias ? bf16_to_f32(bias[c]) : 0.f;
        for (int64_t r = 0; r < m; r++) y[r * sy + c] = f32_to_bf16(out[r] + b);
    }
}
