/* Shared by ricllm's CPU kernels: bf16 <-> fp32, a vectorizable exp, row loads and stores.
 * Element types are bf16 (uint16 bit patterns) or fp32, chosen per call by an ``is_bf16`` flag. */
#ifndef RICLLM_CPU_COMMON_H
#define RICLLM_CPU_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* Buffers the kernels stream through start on a cache line: malloc's 16-byte alignment makes every
 * 64-byte vector load of a row straddle two lines (a 128-byte bf16 row then touches three). Over-
 * allocated from malloc rather than aligned_alloc, whose split-off heads and tails stayed in glibc's
 * heap (+10-25 MB of peak RSS over a run); the block's own address sits just before the aligned one. */
#define CACHE_LINE 64
static inline void *alloc_lines(size_t bytes) {
    char *raw = malloc(bytes + CACHE_LINE);
    if (!raw) return NULL;
    char *aligned = raw + CACHE_LINE - (uintptr_t)raw % CACHE_LINE;  /* >= 16 bytes in: room for the address */
    ((void **)aligned)[-1] = raw;
    return aligned;
}
static inline void free_lines(void *aligned) {
    if (aligned) free(((void **)aligned)[-1]);
}

/* This thread's number in its team, and the team's size (0 and 1 outside a parallel region). */
static inline int team_thread(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}
static inline int team_size(void) {
#ifdef _OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}

/* Work that rides in another kernel's team (the decoder stack's LoRA updates, in the team of the
 * projection's product): every thread runs ``before`` ahead of its share of the kernel, and
 * ``after`` once every thread has done its share and ``before``, so ``after`` may read what both
 * wrote. Each is given the thread's number and the team's size. A NULL TeamWork: none. */
typedef struct {
    void (*before)(const void *context, int thread, int threads);
    void (*after)(const void *context, int thread, int threads);
    const void *context;
} TeamWork;

static inline void team_before(const TeamWork *work) {
    if (work) work->before(work->context, team_thread(), team_size());
}
static inline void team_after(const TeamWork *work) {
    if (work) work->after(work->context, team_thread(), team_size());
}

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits += 0x7FFF + ((bits >> 16) & 1); /* round to nearest even */
    return (uint16_t)(bits >> 16);
}

/* IEEE half to float, exactly (the packed weights' scales are fp16). */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    uint32_t bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000u | (mantissa << 13);  /* inf, nan */
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else {  /* subnormal: shift the mantissa up to its leading 1 */
        uint32_t m = mantissa, shifts = 0;
        while (!(m & 0x400)) { m <<= 1; shifts++; }
        bits = sign | ((113 - shifts) << 23) | ((m & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* What storing x in the activation type does to it: bf16 rounding, or nothing for fp32. */
static inline __attribute__((always_inline)) float round_to(float x, int is_bf16) {
    return is_bf16 ? bf16_to_f32(f32_to_bf16(x)) : x;
}

static inline __attribute__((always_inline)) float load_at(const void *base, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

static inline __attribute__((always_inline)) void store_at(void *base, int64_t i, int is_bf16, float x) {
    if (is_bf16) ((uint16_t *)base)[i] = f32_to_bf16(x);
    else ((float *)base)[i] = x;
}

/* exp(x) by range reduction and Cephes' degree-6 polynomial (relative error ~2e-7): unlike
 * libm's expf it has no branches, so the compiler vectorizes the softmax loops. Inputs below
 * -87 give ~1e-38 instead of 0, which is harmless: they only ever scale zeros or add to a sum
 * of which the largest term is 1. */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = rintf(x * 1.44269504088896341f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline __attribute__((always_inline)) void load_row(const void *base, int64_t index, int d, int is_bf16, float *dst) {
    if (is_bf16) {
        const uint16_t *src = (const uint16_t *)base + index;
        for (int i = 0; i < d; i++) dst[i] = bf16_to_f32(src[i]);
    } else {
        memcpy(dst, (const float *)base + index, (size_t)d * sizeof(float));
    }
}

static inline __attribute__((always_inline)) void store_row(void *base, int64_t index, int d, int is_bf16, const float *src) {
    if (is_bf16) {
        uint16_t *dst = (uint16_t *)base + index;
        for (int i = 0; i < d; i++) dst[i] = f32_to_bf16(src[i]);
    } else {
        memcpy((float *)base + index, src, (size_t)d * sizeof(float));
    }
}

/* A KV cache's element type (ricllm/cache/kv_format.py): the activations' (fp32 or bf16, whose
 * codes are their is_bf16 flag), or int8 rows: d signed bytes, then the row's fp32 scale
 * max|x| / 127, one row of d + 4 bytes per (token, KV head). */
enum { CACHE_FP32 = 0, CACHE_BF16 = 1, CACHE_INT8 = 2 };
#define INT8_ROW_EXTRA 4

static inline int64_t int8_row_bytes(int d) { return (int64_t)d + INT8_ROW_EXTRA; }

/* Row ``row`` (slot · kv_heads + head) of an int8 cache from fp32 values: round half to even
 * (lrintf in the default rounding mode), as ``kv_format.quantize_rows`` does. */
static inline void store_int8_row(void *cache, int64_t row, int d, const float *x) {
    int8_t *dst = (int8_t *)cache + row * int8_row_bytes(d);
    float amax = 0.0f;
    for (int i = 0; i < d; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    const float scale = amax / 127.0f, inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
    for (int i = 0; i < d; i++) {
        const long q = lrintf(x[i] * inverse);
        dst[i] = (int8_t)(q > 127 ? 127 : q < -127 ? -127 : q);
    }
    memcpy(dst + d, &scale, sizeof scale);
}

/* Row ``row`` of an int8 cache as fp32 values, q · scale. */
static inline __attribute__((always_inline)) void load_int8_row(const void *cache, int64_t row, int d, float *dst) {
    const int8_t *src = (const int8_t *)cache + row * int8_row_bytes(d);
    float scale;
    memcpy(&scale, src + d, sizeof scale);
    for (int i = 0; i < d; i++) dst[i] = (float)src[i] * scale;
}

/* Row ``row`` (slot · kv_heads + head) of a cache of any type, as fp32. */
static inline __attribute__((always_inline)) void load_cache_row(const void *cache, int64_t row, int d,
                                                                 int cache_type, float *dst) {
    if (cache_type == CACHE_INT8) load_int8_row(cache, row, d, dst);
    else load_row(cache, row * d, d, cache_type, dst);
}

static inline __attribute__((always_inline)) void store_cache_row(void *cache, int64_t row, int d, int cache_type,
                                                                  const float *src) {
    if (cache_type == CACHE_INT8) store_int8_row(cache, row, d, src);
    else store_row(cache, row * d, d, cache_type, src);
}

#if defined(__AMX_TILE__) && defined(__linux__) && defined(_GNU_SOURCE)
#include <sys/syscall.h>
#include <unistd.h>

/* Linux gives a process AMX's tile registers only once it asks (arch_prctl, once per process). */
static inline int ricllm_amx_usable(void) {
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return state;
}

/* What LDTILECFG reads: palette 1, then per tile its bytes per row and its rows. */
typedef struct __attribute__((aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} TileConfig;
#endif

#endif
