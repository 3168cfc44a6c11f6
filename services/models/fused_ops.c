/* The elementwise steps of a Llama-family decoder layer, each fused into one pass, on CPU
 * (float32). services/models/fused.py builds this file once per machine (kvcache/native.py's
 * builder) and calls it through ctypes. Unfused, each step is 2 to 14 torch calls, each a pass
 * over the activations and a dispatch: at decode sizes the dispatches cost more than the sums.
 *
 *   rms_norm      out = w * (x / sqrt(mean(x^2) + eps)), row by row
 *   add_rms_norm  h += delta, then out = rms_norm(h)   (the residual add before each norm)
 *   silu_mul      out = silu(g) * u                    (the MLP's activation)
 *   rope          x * cos + rotate_half(x) * sin for `heads` heads of each row, head-major
 *
 * Each also in bfloat16 (`<name>_bf16`, at the end), rounding as transformers' modules do.
 *
 * Inputs may be row-strided (views into a product holding sibling projections); within a row
 * elements are contiguous; `out` and `h` are contiguous. With AVX-512 the sums and exp are
 * vectorized; elsewhere plain loops. Rows split over OpenMP threads only where a step is big
 * enough to pay for waking them (prompt chunks, not decode steps).
 */
#include <math.h>
#include <stdint.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include "bf16.h"     /* kvcache/: bf16_to_f32, f32_to_bf16 */
#include "simd_exp.h" /* kvcache/: exp16 */

static float sum_squares(const float *x, int64_t n) {
    int64_t i = 0;
    float total = 0.0f;
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    total = _mm512_reduce_add_ps(acc);
#endif
    for (; i < n; ++i) total += x[i] * x[i];
    return total;
}

static void scale_row(const float *x, const float *w, float r, float *out, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * r);
}

void rms_norm(const float *x, int64_t x_stride, const float *w, float eps, float *out,
              int64_t out_stride, int64_t rows, int64_t n, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * n > 32768)
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * x_stride;
        float inv = 1.0f / sqrtf(sum_squares(xr, n) / (float)n + eps);
        scale_row(xr, w, inv, out + r * out_stride, n);
    }
}

void add_rms_norm(float *h, const float *delta, int64_t delta_stride, const float *w, float eps,
                  float *out, int64_t rows, int64_t n, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * n > 32768)
    for (int64_t r = 0; r < rows; ++r) {
        float *hr = h + r * n;
        const float *dr = delta + r * delta_stride;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) hr[i] += dr[i];
        float inv = 1.0f / sqrtf(sum_squares(hr, n) / (float)n + eps);
        scale_row(hr, w, inv, out + r * n, n);
    }
}


void silu_mul(const float *gate, int64_t g_stride, const float *up, int64_t u_stride, float *out,
              int64_t rows, int64_t n, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * n > 32768)
    for (int64_t r = 0; r < rows; ++r) {
        const float *g = gate + r * g_stride, *u = up + r * u_stride;
        float *o = out + r * n;
        int64_t i = 0;
#ifdef __AVX512F__
        __m512 one = _mm512_set1_ps(1.0f);
        for (; i + 16 <= n; i += 16) {
            __m512 gv = _mm512_loadu_ps(g + i);
            __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
            __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, e));
            _mm512_storeu_ps(o + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
        }
#endif
        for (; i < n; ++i) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* cos and sin [rows, dim] (both halves equal, as transformers builds them); x rows `x_stride`
 * apart, each `heads` heads of `dim`; out [heads, rows, dim] contiguous (the layout attention
 * reads) */
void rope(const float *x, int64_t x_stride, const float *cos, const float *sin, float *out,
          int64_t rows, int64_t heads, int64_t dim, int num_threads) {
    int64_t half = dim / 2;
#pragma omp parallel for num_threads(num_threads) if (rows * heads * dim > 32768)
    for (int64_t r = 0; r < rows; ++r) {
        const float *c = cos + r * dim, *s = sin + r * dim;
        for (int64_t h = 0; h < heads; ++h) {
            const float *a = x + r * x_stride + h * dim, *b = a + half;
            float *oa = out + (h * rows + r) * dim, *ob = oa + half;
#pragma omp simd
            for (int64_t i = 0; i < half; ++i) {
                oa[i] = a[i] * c[i] - b[i] * s[i];
                ob[i] = b[i] * c[half + i] + a[i] * s[half + i];
            }
        }
    }
}

/* The same steps over bfloat16 tensors, rounding where transformers' bfloat16 modules round
 * (each torch op's result is bfloat16), the sums in float32 as torch computes them. */
/* f as a bfloat16 holds it */
static inline float rbf(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* out = w * bf16(x / rms(x)) over a row of bfloat16, given the sum of its squares */
static void norm_row_bf16(const uint16_t *x, float total, const uint16_t *w, float eps,
                          uint16_t *out, int64_t n) {
    float inv = 1.0f / sqrtf(total / (float)n + eps);
    for (int64_t i = 0; i < n; ++i)
        out[i] = f32_to_bf16(bf16_to_f32(w[i]) * rbf(bf16_to_f32(x[i]) * inv));
}

void rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, float eps,
                   uint16_t *out, int64_t out_stride, int64_t rows, int64_t n, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * n > 32768)
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t *xr = x + r * x_stride;
        float total = 0.0f;
        for (int64_t i = 0; i < n; ++i) total += bf16_to_f32(xr[i]) * bf16_to_f32(xr[i]);
        norm_row_bf16(xr, total, w, eps, out + r * out_stride, n);
    }
}

void add_rms_norm_bf16(uint16_t *h, const uint16_t *delta, int64_t delta_stride,
                       const uint16_t *w, float eps, uint16_t *out, int64_t rows, int64_t n,
                       int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * n > 32768)
    for (int64_t r = 0; r < rows; ++r) {
        uint16_t *hr = h + r * n;
        const uint16_t *dr = delta + r * delta_stride;
        float total = 0.0f;
        for (int64_t i = 0; i < n; ++i) {
            /* the residual stream, rounded as torch's */
            hr[i] = f32_to_bf16(bf16_to_f32(hr[i]) + bf16_to_f32(dr[i]));
            total += bf16_to_f32(hr[i]) * bf16_to_f32(hr[i]);
        }
        norm_row_bf16(hr, total, w, eps, out + r * n, n);
    }
}

void silu_mul_bf16(const uint16_t *gate, int64_t g_stride, const uint16_t *up, int64_t u_stride,
                   uint16_t *out, int64_t rows, int64_t n, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * n > 32768)
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t *g = gate + r * g_stride, *u = up + r * u_stride;
        uint16_t *o = out + r * n;
        for (int64_t i = 0; i < n; ++i) {
            float gv = bf16_to_f32(g[i]);
            o[i] = f32_to_bf16(rbf(gv / (1.0f + expf(-gv))) * bf16_to_f32(u[i]));
        }
    }
}

void rope_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *cos, const uint16_t *sin,
               uint16_t *out, int64_t rows, int64_t heads, int64_t dim, int num_threads) {
    int64_t half = dim / 2;
#pragma omp parallel for num_threads(num_threads) if (rows * heads * dim > 32768)
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t *c = cos + r * dim, *s = sin + r * dim;
        for (int64_t h = 0; h < heads; ++h) {
            const uint16_t *a = x + r * x_stride + h * dim, *b = a + half;
            uint16_t *oa = out + (h * rows + r) * dim, *ob = oa + half;
            for (int64_t i = 0; i < half; ++i) {
                float av = bf16_to_f32(a[i]), bv = bf16_to_f32(b[i]);
                float c1 = bf16_to_f32(c[i]), s1 = bf16_to_f32(s[i]);
                float c2 = bf16_to_f32(c[half + i]), s2 = bf16_to_f32(s[half + i]);
                oa[i] = f32_to_bf16(rbf(av * c1) + rbf(-bv * s1));
                ob[i] = f32_to_bf16(rbf(bv * c2) + rbf(av * s2));
            }
        }
    }
}
