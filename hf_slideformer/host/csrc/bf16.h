/* bf16 <-> fp32 on the host, shared by the host AdamW kernels (host_adam.c, host_adam8.c).
 *
 * bf16_to_f32 is exact; f32_to_bf16 rounds to nearest even, as torch's cast does, and keeps a NaN
 * a (quiet) NaN. */
#ifndef SLIDE_BF16_H
#define SLIDE_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)0x7fc0;   /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#endif
