/* Attention of short queries (decode tokens, jump-forward spans) reading the paged KV pool in
 * place, on CPU: kvcache/native.py builds this file once per machine and calls it through ctypes.
 *
 * The plain path copies every page a row reads into a workspace and runs SDPA over the copy:
 * three passes over the cache per layer where this makes one. Each (row, KV head) is one task,
 * which serves every query head of that KV head (GQA) from one read of each key and value page
 * (with too few rows to keep the threads busy, each query head is a task of its own).
 * Two passes per query (scores, then the weighted values) with an exact softmax: the same sums
 * as SDPA up to their order and the last bits of exp.
 *
 * Layouts (float32, or bfloat16 where `bf16` is set: every tensor then, the sums staying in
 * float32), contiguous: q and out [T, H, D] (packed tokens); k_cache and v_cache
 * [KVH, slots, D] (slot = page * page_size + offset); page_table [R, max_pages]. Page ids from
 * `num_pages` on name parked pages, read in place from the host tier's arena of this layer,
 * k_host and v_host [KVH, host_slots, D] (page id - num_pages is the host page).
 * Query j of row r is packed token offsets[r] + j and sees cache entries 0 .. starts[r] + j,
 * the last `window` of them when window > 0; softcap > 0 passes scores through
 * tanh(s / cap) * cap (Gemma 2).
 *
 * With AVX-512 (the build uses -march=native) scores are computed 16 keys at a time, reduced
 * together instead of one horizontal sum per key, and exp is vectorized; elsewhere plain loops.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include "bf16.h"     /* bf16_to_f32, f32_to_bf16 */
#include "simd_exp.h" /* exp16 */

#define BLOCK 16 /* keys scored together */

/* out[j] = q . k[j] for bfloat16 keys */
static void dots_bf16_plain(const float *q, const uint16_t *k, int64_t n, int64_t dim, float *out) {
    for (int64_t j = 0; j < n; ++j) {
        float s = 0.0f;
        for (int64_t d = 0; d < dim; ++d) s += q[d] * bf16_to_f32(k[j * dim + d]);
        out[j] = s;
    }
}

/* out[j] = q . k[j] for j < n <= BLOCK (rows of k `dim` apart) */
static void dots_plain(const float *q, const float *k, int64_t n, int64_t dim, float *out) {
    for (int64_t j = 0; j < n; ++j) {
        float s = 0.0f;
        for (int64_t d = 0; d < dim; ++d) s += q[d] * k[j * dim + d];
        out[j] = s;
    }
}

#ifdef __AVX512F__
static inline __m512 load16_bf16(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static void reduce16(__m512 *v, int64_t n, float *out);

/* out[j] = q . k[j] for j < n <= BLOCK, keys of type T widened by LOAD 16 at a time */
#define DEFINE_DOTS(name, T, LOAD, plain)                                                      \
    static void name(const float *q, const T *k, int64_t n, int64_t dim, float *out) {         \
        if (dim % 16) {                                                                        \
            plain(q, k, n, dim, out);                                                          \
            return;                                                                            \
        }                                                                                      \
        __m512 v[BLOCK];                                                                       \
        for (int j = 0; j < BLOCK; ++j) {                                                      \
            __m512 a = _mm512_setzero_ps();                                                    \
            if (j < n)                                                                         \
                for (int64_t d = 0; d < dim; d += 16)                                          \
                    a = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), LOAD(k + j * dim + d), a);     \
            v[j] = a;                                                                          \
        }                                                                                      \
        reduce16(v, n, out);                                                                   \
    }
DEFINE_DOTS(dots, float, _mm512_loadu_ps, dots_plain)
DEFINE_DOTS(dots_bf16, uint16_t, load16_bf16, dots_bf16_plain)

/* v[0..15] -> out[j] = the sum of v[j]'s lanes, for j < n */
static void reduce16(__m512 *v, int64_t n, float *out) {
    /* 16 vectors -> one vector of their 16 sums: pairs within 128-bit lanes, then lanes */
    __m512 w[8], x[4];
    for (int i = 0; i < 8; ++i)
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {
        __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
        x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88),
                              _mm512_shuffle_f32x4(x[0], x[1], 0xdd));
    __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88),
                              _mm512_shuffle_f32x4(x[2], x[3], 0xdd));
    __m512 r = _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xdd));
    _mm512_mask_storeu_ps(out, (__mmask16)((1u << n) - 1), r);
}
#else
#define dots dots_plain
#define dots_bf16 dots_bf16_plain
#endif

/* scores[g * n + i] <- softmax over i of query head g's scores (n = seen - first) */
static void softmax_rows(float *scores, int64_t group, int64_t n) {
    for (int64_t g = 0; g < group; ++g) {
        float *row = scores + g * n, top = -INFINITY, total = 0.0f;
        for (int64_t i = 0; i < n; ++i) top = row[i] > top ? row[i] : top;
        int64_t i = 0;
#ifdef __AVX512F__
        __m512 sum = _mm512_setzero_ps();
        for (; i + 16 <= n; i += 16) {
            __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + i), _mm512_set1_ps(top)));
            _mm512_storeu_ps(row + i, e);
            sum = _mm512_add_ps(sum, e);
        }
        total = _mm512_reduce_add_ps(sum);
#endif
        for (; i < n; ++i) {
            row[i] = expf(row[i] - top);
            total += row[i];
        }
        float inv = 1.0f / total;
        for (i = 0; i < n; ++i) row[i] *= inv;
    }
}

/* Where one KV head's pages lie: the pool, and the host arena for parked ids; entries of
 * `elem` bytes (4: float32, 2: bfloat16). */
typedef struct {
    const char *pool, *host;
    int64_t num_pages, page_size, dim, elem;
} Pages;

static inline const void *entry(const Pages *p, int64_t page, int64_t offset) {
    int64_t row = p->page_size * p->dim * p->elem;
    const char *base =
        page < p->num_pages ? p->pool + page * row : p->host + (page - p->num_pages) * row;
    return base + offset * p->dim * p->elem;
}

/* Query j of a row, for the `group` query heads sharing one KV head. */
static void one_query(const float *q, float *out, const Pages *kp, const Pages *vp,
                      const int64_t *pages, int64_t first, int64_t seen, int64_t group,
                      float scale, float softcap, float *scores) {
    int64_t n = seen - first, dim = kp->dim, page_size = kp->page_size;
    /* runs of keys inside one page, at most BLOCK long: no division per key */
    for (int64_t i = first; i < seen;) {
        int64_t in_page = (i / page_size + 1) * page_size;
        int64_t end = in_page < seen ? in_page : seen;
        end = end - i > BLOCK ? i + BLOCK : end;
        const void *k = entry(kp, pages[i / page_size], i % page_size);
        for (int64_t g = 0; g < group; ++g) {
            float *s = scores + g * n + i - first;
            if (kp->elem == 2)
                dots_bf16(q + g * dim, (const uint16_t *)k, end - i, dim, s);
            else
                dots(q + g * dim, (const float *)k, end - i, dim, s);
            for (int64_t j = 0; j < end - i; ++j) {
                s[j] *= scale;
                if (softcap > 0.0f) s[j] = tanhf(s[j] / softcap) * softcap;
            }
        }
        i = end;
    }
    softmax_rows(scores, group, n);
    for (int64_t d = 0; d < group * dim; ++d) out[d] = 0.0f;
    for (int64_t i = first; i < seen;) {
        int64_t end = (i / page_size + 1) * page_size;
        end = end < seen ? end : seen;
        const void *v = entry(vp, pages[i / page_size], i % page_size);
        for (; i < end; ++i) {
            for (int64_t g = 0; g < group; ++g) {
                float p = scores[g * n + i - first], *o = out + g * dim;
                if (vp->elem == 2) {
                    const uint16_t *vh = (const uint16_t *)v;
#pragma omp simd
                    for (int64_t d = 0; d < dim; ++d) o[d] += p * bf16_to_f32(vh[d]);
                } else {
                    const float *vv = (const float *)v;
#pragma omp simd
                    for (int64_t d = 0; d < dim; ++d) o[d] += p * vv[d];
                }
            }
            v = (const char *)v + dim * vp->elem;
        }
    }
}

/* Returns 0, or -1 when a scores buffer could not be allocated (nothing is then trusted). */
int paged_attention_short(const void *q, void *out, const void *k_cache, const void *v_cache,
                          int64_t slots, const void *k_host, const void *v_host,
                          int64_t host_slots, const int64_t *page_table, int64_t max_pages,
                          const int64_t *starts, const int64_t *num_queries,
                          const int64_t *offsets, int64_t rows, int64_t heads, int64_t kv_heads,
                          int64_t dim, int64_t page_size, float scale, int64_t window,
                          float softcap, int num_threads, int bf16) {
    int64_t group = heads / kv_heads, elem = bf16 ? 2 : 4;
    /* Few rows (one request decoding): a task per query head instead, so every thread has work;
     * the heads of one KV head then read its pages once each, mostly from cache. */
    int64_t split = rows * kv_heads < 4 * num_threads ? group : 1, per = group / split;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(| : failed)
    for (int64_t t = 0; t < rows * kv_heads * split; ++t) {
        int64_t r = t / (kv_heads * split), kvh = t / split % kv_heads, part = t % split;
        int64_t last = starts[r] + num_queries[r];
        /* the scores, then (bfloat16) the queries and outputs of one query in float32 */
        int64_t wide = bf16 ? 2 * per * dim : 0;
        float *scores = malloc((size_t)(per * (last > 0 ? last : 1) + wide) * sizeof(float));
        if (!scores) {
            failed = 1;
            continue;
        }
        float *qf = scores + per * (last > 0 ? last : 1), *of = qf + per * dim;
        const int64_t *pages = page_table + r * max_pages;
        int64_t num_pages = slots / page_size;
        const char *kc = k_cache, *vc = v_cache, *kh = k_host, *vh = v_host;
        Pages kp = {kc + kvh * slots * dim * elem, kh ? kh + kvh * host_slots * dim * elem : 0,
                    num_pages, page_size, dim, elem};
        Pages vp = {vc + kvh * slots * dim * elem, vh ? vh + kvh * host_slots * dim * elem : 0,
                    num_pages, page_size, dim, elem};
        for (int64_t j = 0; j < num_queries[r]; ++j) {
            int64_t seen = starts[r] + j + 1;
            int64_t first = (window > 0 && seen > window) ? seen - window : 0;
            int64_t at = ((offsets[r] + j) * heads + kvh * group + part * per) * dim; /* [T,H,D] */
            if (!bf16) {
                one_query((const float *)q + at, (float *)out + at, &kp, &vp, pages, first, seen,
                          per, scale, softcap, scores);
                continue;
            }
            const uint16_t *qh = (const uint16_t *)q + at;
            for (int64_t d = 0; d < per * dim; ++d) qf[d] = bf16_to_f32(qh[d]);
            one_query(qf, of, &kp, &vp, pages, first, seen, per, scale, softcap, scores);
            uint16_t *oh = (uint16_t *)out + at;
            for (int64_t d = 0; d < per * dim; ++d) oh[d] = f32_to_bf16(of[d]);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
