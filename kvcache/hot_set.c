/* The hot set's routing of one layer's Quest selection for one request (kvcache/hot_set.py).

   The same LRU as the plain twin (`DictHotSet`, dicts), over arrays: per KV head, `ways`
   slots (the host slot a way holds, -1: empty) and stamps (a counter, larger: used later).
   Hits are refreshed in the order chosen; misses then take the highest empty way, else the
   least recently used way not touched this step; misses beyond that are read but not kept.
   Written here because this runs once per layer per step for every offloaded request, and a
   Python loop over ~100 choices a layer was a third of the tier's overhead. */

#include <stdint.h>
#include <stdlib.h>

enum { CELLS, MISS_POS, HOST_CELLS, FILL_FROM, FILL_INTO, LATE, ROWS };
enum { N_MISSES, N_FILLS, N_LATE };
enum { RESIDENT, HITS, MISSES };

void hot_set_route(const int64_t *ids, int64_t kv_heads, int64_t k, int64_t *slots,
                   int64_t *stamps, int64_t ways, const int64_t *pages, int64_t *clock,
                   int64_t *tally, int64_t num_pages, int64_t host_capacity, int64_t *routes,
                   int64_t stride, int64_t offset, int64_t *counts, int64_t *scratch) {
    /* ids [kv_heads, k]; slots, stamps [kv_heads, ways] of this layer; pages [ways]: the pool
       page of each way; routes [ROWS, stride]: this row's cells from `offset`; misses, fills
       and late (unkept) misses appended at `counts`; scratch: k int64 for one head's misses. */
    int64_t *cells = routes + CELLS * stride, *miss_pos = routes + MISS_POS * stride;
    int64_t *host = routes + HOST_CELLS * stride, *late = routes + LATE * stride;
    int64_t *fill_from = routes + FILL_FROM * stride, *fill_into = routes + FILL_INTO * stride;
    for (int64_t h = 0; h < kv_heads; h++) {
        const int64_t *chosen = ids + h * k;
        int64_t *slot_of = slots + h * ways, *stamp_of = stamps + h * ways;
        int64_t base = h * num_pages, start = *clock, missed = 0;
        for (int64_t j = 0; j < k; j++) {
            int64_t pos = offset + h * k + j, page = chosen[j];
            if (page < num_pages) {
                cells[pos] = base + page;
                tally[RESIDENT]++;
                continue;
            }
            int64_t way = -1;
            for (int64_t w = 0; w < ways; w++)
                if (slot_of[w] == page - num_pages) {
                    way = w;
                    break;
                }
            if (way < 0) {
                scratch[missed++] = j;
                cells[pos] = base; /* overwritten: a filled way's cell, or the late copy */
                continue;
            }
            stamp_of[way] = ++*clock;
            cells[pos] = base + pages[way];
            tally[HITS]++;
        }
        for (int64_t i = 0; i < missed; i++) {
            int64_t pos = offset + h * k + scratch[i], slot = chosen[scratch[i]] - num_pages;
            int64_t m = counts[N_MISSES]++;
            miss_pos[m] = pos;
            host[m] = h * host_capacity + slot;
            tally[MISSES]++;
            int64_t way = -1;
            for (int64_t w = ways - 1; w >= 0 && way < 0; w--) /* an empty way first */
                if (slot_of[w] < 0) way = w;
            if (way < 0) /* every way holds a page: the least recently used, not touched now */
                for (int64_t w = 0; w < ways; w++)
                    if (stamp_of[w] <= start && (way < 0 || stamp_of[w] < stamp_of[way])) way = w;
            if (way < 0) {
                late[counts[N_LATE]++] = m;
                continue;
            }
            slot_of[way] = slot;
            stamp_of[way] = ++*clock;
            cells[pos] = base + pages[way];
            int64_t f = counts[N_FILLS]++;
            fill_from[f] = m;
            fill_into[f] = base + pages[way];
        }
    }
}

/* CPU only: the copies `kvcache.tier_read._copy_route` makes with a route, in one pass
   instead of its tensor ops: the kept misses from the host arena into their hot-set cells, then
   every choice into `out` (misses straight from the arena, the rest from the pool). A cell is
   `cell_bytes` contiguous bytes in each of the four arrays (one KV head of one page). */
int hot_set_copy(char *out_k, char *out_v, char *pool_k, char *pool_v, const char *host_k,
                  const char *host_v, int64_t cell_bytes, const int64_t *routes, int64_t stride,
                  int64_t n, const int64_t *counts, int threads) {
    const int64_t *cells = routes + CELLS * stride, *miss_pos = routes + MISS_POS * stride;
    const int64_t *host = routes + HOST_CELLS * stride;
    const int64_t *fill_from = routes + FILL_FROM * stride, *fill_into = routes + FILL_INTO * stride;
    int64_t misses = counts[N_MISSES], fills = counts[N_FILLS];
    char *from_host = calloc(n > 0 ? n : 1, 1); /* 1: choice i is a miss */
    if (from_host == NULL) return -1;
    for (int64_t m = 0; m < misses; m++) from_host[miss_pos[m]] = 1;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static) nowait /* the loops write disjoint cells: no barrier */
        for (int64_t f = 0; f < fills; f++) {
            int64_t src = host[fill_from[f]] * cell_bytes, dst = fill_into[f] * cell_bytes;
            __builtin_memcpy(pool_k + dst, host_k + src, cell_bytes);
            __builtin_memcpy(pool_v + dst, host_v + src, cell_bytes);
        }
#pragma omp for schedule(static) nowait
        for (int64_t m = 0; m < misses; m++) {
            int64_t src = host[m] * cell_bytes, dst = miss_pos[m] * cell_bytes;
            __builtin_memcpy(out_k + dst, host_k + src, cell_bytes);
            __builtin_memcpy(out_v + dst, host_v + src, cell_bytes);
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++) {
            if (from_host[i]) continue;
            int64_t src = cells[i] * cell_bytes, dst = i * cell_bytes;
            __builtin_memcpy(out_k + dst, pool_k + src, cell_bytes);
            __builtin_memcpy(out_v + dst, pool_v + src, cell_bytes);
        }
    }
    free(from_host);
    return 0;
}
