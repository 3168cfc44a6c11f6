/* bfloat16 <-> float32 for the project's C files (kvcache/paged_attention.c,
 * services/models/fused_ops.c). bfloat16 is the top half of a float32: widening is a shift;
 * narrowing rounds to nearest even, as torch does, and keeps a NaN a NaN. */
#ifndef STRUCTSERVE_BF16_H
#define STRUCTSERVE_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
#endif
