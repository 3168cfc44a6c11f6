/* Vectorized e^x shared by the project's C files (kvcache/paged_attention.c,
 * services/models/fused_ops.c); kvcache/native.py puts this folder on the include path and
 * hashes this file into every library's name. */
#ifndef STRUCTSERVE_SIMD_EXP_H
#define STRUCTSERVE_SIMD_EXP_H
#ifdef __AVX512F__
#include <immintrin.h>

/* e^x for 16 floats: Cephes' expf polynomial scaled by 2^n, x clamped to [-87, 88] (where
 * float's e^x neither underflows to a denormal nor overflows) */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, x), x, _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}
#endif
#endif
