/* Weight-only 4-bit and 8-bit matrix products on AVX-512 (and AMX where the CPU has it) or AVX2.
 *
 * Why: at decode batch sizes a layer's product is ``[M, K] × [K, N]`` with M of 1 to 16, and
 * torch's weight-only kernels spend more time unpacking weights into floats than reading them.
 *
 *   y[m, n] = Σ_g  d[n,g] · Σ_k q[n,k]·x[m,k]  +  c[n,g] · Σ_k x[m,k]        (k in group g of 32)
 *
 * 4-bit (Q4_1's form, w = d·q + c, q in 0..15), by activation rows (``int4_path``):
 * without AMX (AVX-512 VNNI: Zen 4, Xeons before Sapphire Rapids), and on AMX CPUs for 1-13
 * rows: activations quantized to int8 per row and group of 32 (step dx = amax/127, as llama.cpp's
 * Q8_1), dot products on the integer unit (``vpdpbusd``: the nibbles are its unsigned operand,
 * xq its signed one, so nothing needs correcting), y += d·dx·Σq·xq + c·dx·Σxq: the exact
 * product with the quantized activations. Each (16 outputs, group) is widened once into the
 * 8-bit layout's blocks and reused by every row of a panel of 64 (1 row: 1.7x the bf16 dot
 * products it replaces, 32 rows: 3.3x, measured on SmolLM2's shapes).
 * AMX, 14-63 rows: bf16 activations, one tile product per (16 rows, 16 outputs, group), scaled
 * per group in fp32 exactly: a nibble becomes a bf16 number with one OR (``0x4300 | q`` is the
 * bf16 pattern of 128 + q, exactly), so the tiles compute Σ x·(128 + q) and the 128·Σx folds
 * into the group's offset (c − 128·d). AMX, 64 rows and more (prefill chunks): weights
 * dequantized to bf16 (what a dense bf16 copy holds), accumulated over all of K in the tiles.
 * AVX2 (x86-64-v3, no AVX-512): int8 activations as on VNNI, with ``maddubs`` (integer-exact,
 * the VNNI path's results bit for bit). 8-bit as below, emulated (see HAVE_AVX2).
 * 8-bit (Q8_0's form, w = d·q, q in -127..127): activations are quantized to int8 per group of
 * 32 (as llama.cpp does) and each group's dot product runs on the integer unit (``vpdpbusd``,
 * 64 byte pairs per instruction). That unit wants one unsigned operand, so activations enter
 * as xq + 128 and 128·Σq (precomputed, ``offsets``) is subtracted.
 *
 * Weight layout: N in tiles of 16 rows (one AVX-512 lane per row), K in groups of 32.
 * 4-bit: per (tile, group) 16 pairs of k, each 16 bytes, byte r = q[row r][2i] | q[row r][2i+1] << 4
 * (a pair widens to one vector of bf16 pairs, which is also the layout AMX wants for B tiles; two
 * pairs widen to one 8-bit block).
 * 8-bit: per (tile, group) 8 blocks of 4 k, 64 bytes each, lane r = q[row r][4 k] as 4 bytes.
 * Scales: fp16 ``[tiles, groups, 2, 16]`` (d, then c).
 */
#define _GNU_SOURCE  /* syscall(), to ask Linux for AMX state */
#include "cpu_common.h"

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_VNNI 1
#else
#define HAVE_VNNI 0
#endif
#if HAVE_VNNI && defined(__AVX512BF16__)
#define HAVE_BF16_DOT 1
#else
#define HAVE_BF16_DOT 0
#endif
#if HAVE_BF16_DOT && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif
/* AVX2 + FMA + F16C (x86-64-v3) where AVX-512's paths are not built: the ``avx2`` family */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !HAVE_BF16_DOT
#include <immintrin.h>
#define HAVE_AVX2 1
#else
#define HAVE_AVX2 0
#endif

#define GROUP 32
#define TILE 16
#define ROWS_AT_ONCE 8   /* activation rows sharing each unpacked weight group (registers) */
#ifndef PREFETCH_AHEAD
/* Groups (256 weight bytes each) fetched ahead in software: the hardware prefetchers stop at every
 * 4 KB page boundary, and a one-row product has too little arithmetic to hide the misses that
 * restart them (1 row, 2 threads: 1.3-1.5x the weight bytes per second of no prefetch, measured
 * on SmolLM2's shapes; 4 to 16 ahead measure alike) */
#define PREFETCH_AHEAD 8
#endif

/* Calls KERNEL(rows, ...) with ``rows`` a compile-time constant from 1 to ROWS_AT_ONCE: a
 * per-row accumulator array indexed by a runtime count would live on the stack. */
#define ROW_COUNT_DISPATCH(rows, KERNEL, ...)                                                    \
    switch (rows) {                                                                             \
    case 1: KERNEL(1, __VA_ARGS__); break;                                                      \
    case 2: KERNEL(2, __VA_ARGS__); break;                                                      \
    case 3: KERNEL(3, __VA_ARGS__); break;                                                      \
    case 4: KERNEL(4, __VA_ARGS__); break;                                                      \
    case 5: KERNEL(5, __VA_ARGS__); break;                                                      \
    case 6: KERNEL(6, __VA_ARGS__); break;                                                      \
    case 7: KERNEL(7, __VA_ARGS__); break;                                                      \
    default: KERNEL(8, __VA_ARGS__); break;                                                     \
    }

/* Which widths run here: both on AVX2 (x86-64-v3); built for AVX-512, 8-bit needs VNNI, 4-bit BF16 as well. */
int ricllm_quant_gemm_supported(int bits) {
    return bits == 8 ? HAVE_VNNI || HAVE_AVX2 : bits == 4 ? HAVE_BF16_DOT || HAVE_AVX2 : 0;
}

#if HAVE_VNNI
/* A group's 32 activations as fp32 (two vectors), from bf16 or fp32. */
static inline __attribute__((always_inline)) void load_group_avx512(const void *x, int64_t at, int is_bf16,
                                                                  __m512 *low, __m512 *high) {
    if (is_bf16) {
        const uint16_t *src = (const uint16_t *)x + at;
        const __m512i low_words = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src));
        const __m512i high_words = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + 16)));
        *low = _mm512_castsi512_ps(_mm512_slli_epi32(low_words, 16));  /* bf16 is fp32's upper half */
        *high = _mm512_castsi512_ps(_mm512_slli_epi32(high_words, 16));
    } else {
        *low = _mm512_loadu_ps((const float *)x + at);
        *high = _mm512_loadu_ps((const float *)x + at + 16);
    }
}
#endif

/* Per activation row and group: int8 values xq (round half to even of v·(1/scale), scale =
 * amax/127), the scale dx and the sum of what they stand for, dx·Σxq: with it a 4-bit product
 * is Σ (d·q + c)·dx·xq exactly, so its error is the quantized activations' alone, as at 8 bits
 * (the exact Σx would leave c·Σ(x − dx·xq) uncancelled: about twice the error on real layers,
 * whose c is near −8·d). The vector forms compute the same values as the scalar one. */
static void quantize_activations(const void *x, int rows, int k, int is_bf16, int8_t *xq, float *dx, float *sx) {
    const int groups = k / GROUP;
#if HAVE_VNNI
    for (int64_t rg = 0; rg < (int64_t)rows * groups; rg++) {
        __m512 low, high;
        load_group_avx512(x, rg * GROUP, is_bf16, &low, &high);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(low), _mm512_abs_ps(high)));
        const float scale = amax > 0.0f ? amax / 127.0f : 1.0f;
        const __m512 inv = _mm512_set1_ps(1.0f / scale);
        const __m512i q_low = _mm512_cvtps_epi32(_mm512_mul_ps(low, inv));  /* |q| <= 127: no saturation */
        const __m512i q_high = _mm512_cvtps_epi32(_mm512_mul_ps(high, inv));
        _mm_storeu_si128((__m128i *)(xq + rg * GROUP), _mm512_cvtsepi32_epi8(q_low));
        _mm_storeu_si128((__m128i *)(xq + rg * GROUP + 16), _mm512_cvtsepi32_epi8(q_high));
        dx[rg] = scale;
        sx[rg] = scale * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q_low, q_high));
    }
#elif HAVE_AVX2
    for (int64_t rg = 0; rg < (int64_t)rows * groups; rg++) {
        __m256 v[4];
        for (int j = 0; j < 4; j++) {
            const int64_t at = rg * GROUP + 8 * j;
            const __m128i words = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + at));
            v[j] = is_bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(words), 16))
                           : _mm256_loadu_ps((const float *)x + at);
        }
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 amax8 = _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1]));
        amax8 = _mm256_max_ps(amax8, _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
        __m128 amax4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
        amax4 = _mm_max_ps(amax4, _mm_movehl_ps(amax4, amax4));
        const float amax = _mm_cvtss_f32(_mm_max_ss(amax4, _mm_movehdup_ps(amax4)));
        const float scale = amax > 0.0f ? amax / 127.0f : 1.0f;
        const __m256 inv = _mm256_set1_ps(1.0f / scale);
        __m256i q[4];
        for (int j = 0; j < 4; j++) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
        /* packs interleave per 128-bit lane: dwords of 4 values come out as q0 q1 q2 q3 (low
         * halves), then the high halves; the permute puts each q's two halves side by side */
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)(xq + rg * GROUP),
                            _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        const __m256i sum8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        __m128i sum4 = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256(sum8, 1));
        sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0x4E));
        sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0xB1));
        dx[rg] = scale;
        sx[rg] = scale * (float)_mm_cvtsi128_si32(sum4);
    }
#else
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < groups; g++) {
            float v[GROUP], amax = 0.0f;
            int sum = 0;
            load_row(x, (int64_t)r * k + g * GROUP, GROUP, is_bf16, v);
            for (int i = 0; i < GROUP; i++) amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
            const float scale = amax > 0.0f ? amax / 127.0f : 1.0f, inv = 1.0f / scale;
            for (int i = 0; i < GROUP; i++) {
                const int8_t q = (int8_t)lrintf(v[i] * inv);
                xq[(int64_t)r * k + g * GROUP + i] = q;
                sum += q;
            }
            dx[(int64_t)r * groups + g] = scale;
            sx[(int64_t)r * groups + g] = scale * (float)sum;
        }
#endif
}

#if HAVE_AMX
/* Per activation row and group: the fp32 sum of its bf16 values (the offsets' factor); fp32
 * activations are rounded to bf16 into ``xb`` first, bf16 ones are used where they lie. */
static const uint16_t *bf16_activations(const void *x, int rows, int k, int is_bf16, uint16_t *xb, float *sx) {
    const uint16_t *src = is_bf16 ? (const uint16_t *)x : xb;
    if (!is_bf16)
        for (int64_t i = 0; i < (int64_t)rows * k; i++) xb[i] = f32_to_bf16(((const float *)x)[i]);
    for (int64_t rg = 0; rg < (int64_t)rows * (k / GROUP); rg++) {
        float sum = 0.0f;
        for (int i = 0; i < GROUP; i++) sum += bf16_to_f32(src[rg * GROUP + i]);
        sx[rg] = sum;
    }
    return src;
}
#endif

#if HAVE_VNNI
/* 8-bit: one (tile, block of up to ROWS_AT_ONCE activation rows): all groups, then store.
 * Inlined per row count (ROW_COUNT_DISPATCH) so the accumulators live in registers. */
static inline __attribute__((always_inline)) void int8_tile(int rows, const uint8_t *w, const uint16_t *scales, const int32_t *offsets, const int8_t *xq,
                      const float *dx, int k, int n, int tile, int out_tile, void *out, int is_bf16) {
    const int groups = k / GROUP, chunk_bytes = 8 * 64;
    const __m512i bias = _mm512_set1_epi8((char)0x80);
    __m512 acc[ROWS_AT_ONCE];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    const uint8_t *wt = w + (int64_t)tile * groups * chunk_bytes;
    const uint16_t *st = scales + (int64_t)tile * groups * 2 * TILE;
    for (int g = 0; g < groups; g++) {
        __m512i blocks[8];
        const uint8_t *wg = wt + (int64_t)g * chunk_bytes;
        for (int line = 0; line < 8; line++)  /* as int4_tile_int8: the prefetchers stop at each page */
            _mm_prefetch((const char *)(wg + PREFETCH_AHEAD * chunk_bytes + 64 * line), _MM_HINT_T0);
        _mm_prefetch((const char *)(st + (int64_t)(g + PREFETCH_AHEAD) * 2 * TILE), _MM_HINT_T0);
        for (int c = 0; c < 8; c++) blocks[c] = _mm512_loadu_si512(wg + c * 64);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(st + (int64_t)g * 2 * TILE)));
        __m512i offset;
        if (rows <= 2) {  /* few rows (the LM head at decode): 128·Σq from the weights in hand, not 12% more bytes */
            offset = _mm512_setzero_si512();
            for (int b = 0; b < 8; b++) offset = _mm512_dpbusd_epi32(offset, bias, blocks[b]);
        } else {
            offset = _mm512_loadu_si512(offsets + ((int64_t)tile * groups + g) * TILE);
        }
        for (int r = 0; r < rows; r++) {
            const int32_t *xg = (const int32_t *)(xq + (int64_t)r * k + g * GROUP);
            __m512i dot = _mm512_setzero_si512();
            for (int b = 0; b < 8; b++)
                dot = _mm512_dpbusd_epi32(dot, _mm512_xor_si512(_mm512_set1_epi32(xg[b]), bias), blocks[b]);
            dot = _mm512_sub_epi32(dot, offset);
            const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(dx[(int64_t)r * groups + g]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) {
        float lane[TILE];
        _mm512_storeu_ps(lane, acc[r]);
        store_row(out, (int64_t)r * n + (int64_t)out_tile * TILE, TILE, is_bf16, lane);
    }
}
#endif

#if HAVE_BF16_DOT
/* The 16 rows' weight pairs (k = 2i, 2i+1) of pair i as bf16 128 + q: 16 nibble bytes widened
 * to dwords, the high nibble moved to the upper word, both ORed with bf16(128)'s pattern. */
static inline __attribute__((always_inline)) __m512i int4_pairs(const uint8_t *bytes) {
    const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)bytes));
    const __m512i split = _mm512_ternarylogic_epi32(d, _mm512_slli_epi32(d, 12), _mm512_set1_epi32(0x000F000F),
                                                    0xA8);  /* (a | b) & c */
    return _mm512_or_si512(split, _mm512_set1_epi32(0x43004300));
}

/* 4-bit weights against int8 activations (VNNI), every row count AMX does not take: one (tile,
 * panel of up to INT8_PANEL activation rows). A (tile, group)'s 16 pairs of k become the 8-bit
 * path's 8 blocks ONCE (lane r of a block holds 4 of row r's nibbles, from one load and three
 * instructions: ``int4_quad_rows``; the activations are reordered to match), and every row of the
 * panel passes them: 8 ``vpdpbusd`` (weights 0..15 as the unsigned operand, xq as the signed one:
 * no correction term), then d·dx·Σq·xq + c·sx, into its total in an L1-resident buffer. */
#define INT8_PANEL 64

/* Four pairs (64 bytes: pair p's 16 row bytes at 16p) with each row's 4 bytes gathered in its
 * dword lane: lane r = (p0[r], p1[r], p2[r], p3[r]). Its low nibbles are k = 0, 2, 4, 6 of the 8
 * the pairs hold, its high nibbles k = 1, 3, 5, 7: two blocks for the activations reordered the
 * same way (``reorder_for_quads``). */
static inline __attribute__((always_inline)) __m512i int4_quad_rows(const uint8_t *pairs) {
    const __m512i raw = _mm512_loadu_si512((const void *)pairs);
    /* dwords: lane L gets (p0, p1, p2, p3)'s dword L; then in each lane a 4x4 byte transpose
     * (AVX-512 F/BW only: vpermb would save one instruction where VBMI exists) */
    const __m512i dword_idx = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    const __m512i by_lane = _mm512_permutexvar_epi32(dword_idx, raw);
    const __m512i byte_idx = _mm512_set4_epi32(0x0F0B0703, 0x0E0A0602, 0x0D090501, 0x0C080400);
    return _mm512_shuffle_epi8(by_lane, byte_idx);
}


static void int4_tile_int8(const uint8_t *w, const uint16_t *scales, const int8_t *xq, const float *dx,
                           const float *sx, int rows, int k, int n, int tile, int out_tile, void *out, int is_bf16) {
    const int groups = k / GROUP, group_bytes = GROUP / 2 * TILE;
    const uint8_t *wt = w + (int64_t)tile * groups * group_bytes;
    const uint16_t *st = scales + (int64_t)tile * groups * 2 * TILE;
    __m512 totals[INT8_PANEL];
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int r = 0; r < rows; r++) totals[r] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        const uint8_t *wg = wt + (int64_t)g * group_bytes;
        for (int line = 0; line < 4; line++)  /* past the last group: the next tile's (never a fault) */
            _mm_prefetch((const char *)(wg + PREFETCH_AHEAD * group_bytes + 64 * line), _MM_HINT_T0);
        _mm_prefetch((const char *)(st + (int64_t)(g + PREFETCH_AHEAD) * 2 * TILE), _MM_HINT_T0);
        __m512i blocks[GROUP / 4];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            const __m512i quad = int4_quad_rows(wg + 64 * j);
            blocks[2 * j] = _mm512_and_si512(quad, nibble);
            blocks[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(quad, 4), nibble);
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(st + (int64_t)g * 2 * TILE)));
        const __m512 c = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(st + (int64_t)g * 2 * TILE + TILE)));
        for (int r = 0; r < rows; r++) {
            const int32_t *xg = (const int32_t *)(xq + (int64_t)r * k + g * GROUP);
            __m512i dot[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
#pragma GCC unroll 8
            for (int b = 0; b < GROUP / 4; b++)  /* two chains: the products' latency overlaps */
                dot[b % 2] = _mm512_dpbusd_epi32(dot[b % 2], blocks[b], _mm512_set1_epi32(xg[b]));
            const __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(dot[0], dot[1]));
            const int64_t rg = (int64_t)r * groups + g;
            totals[r] = _mm512_fmadd_ps(sum, _mm512_mul_ps(d, _mm512_set1_ps(dx[rg])), totals[r]);
            totals[r] = _mm512_fmadd_ps(c, _mm512_set1_ps(sx[rg]), totals[r]);
        }
    }
    for (int r = 0; r < rows; r++) {
        float lane[TILE];
        _mm512_storeu_ps(lane, totals[r]);
        store_row(out, (int64_t)r * n + (int64_t)out_tile * TILE, TILE, is_bf16, lane);
    }
}
#endif

#ifndef AMX_MIN_ROWS
/* From here on a tile product per (16 rows, group) beats int8 activations on VNNI (measured on
 * SmolLM2's shapes: AMX is 1.3x slower at 8 rows, even at 14, 1.1x faster at 16) */
#define AMX_MIN_ROWS 14
#endif
#ifndef AMX_PANEL
#define AMX_PANEL 256    /* activation rows kept in cache while every weight tile passes */
#endif
#ifndef AMX_DEQUANTIZED_ROWS
/* From here on (prefill chunks) the weights are dequantized to bf16 before the tile products, as
 * a dense copy would hold them: several times faster than applying the exact per-group scales. */
#define AMX_DEQUANTIZED_ROWS 64
#endif

#if HAVE_AMX
/* Tiles (the intrinsics want literal numbers): two groups in flight, so one group's tile
 * product overlaps the other's store and scaling. tmm0/tmm3 = A, activations [rows, 32 k] bf16;
 * tmm1/tmm4 = B, a group's weights as 16 k pairs × 16 output rows; tmm2/tmm5 = C, [rows, 16] fp32. */
static void amx_configure(int rows) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 6; t++) {
        config.rows[t] = t % 3 == 1 ? 16 : rows;
        config.bytes_per_row[t] = 64;
    }
    /* gcc's ldtilecfg names only 8 bytes of the config as read: keep all 64 stores */
    __asm__ __volatile__("" : : "r"(&config) : "memory");
    _tile_loadconfig(&config);
}

/* Adds group g's scaled products (``products``: [16 rows, 16] fp32) to the rows' totals. */
static inline __attribute__((always_inline)) void amx_accumulate(__m512 *total, const float *products,
                                                               const uint16_t *group_scales, const float *sx,
                                                               int groups, int rows) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)group_scales));
    const __m512 c = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(group_scales + TILE)));
    const __m512 offset = _mm512_fmadd_ps(d, _mm512_set1_ps(-128.0f), c);  /* c − 128·d */
#pragma GCC unroll 16
    for (int r = 0; r < 16; r++) {  /* rows past ``rows`` compute garbage that is never stored */
        const float row_sum = r < rows ? sx[(int64_t)r * groups] : 0.0f;
        total[r] = _mm512_fmadd_ps(_mm512_load_ps(products + r * 16), d, total[r]);
        total[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(row_sum), total[r]);
    }
}

/* 4-bit on AMX: one tile of 16 weight rows against all M activation rows. Its weights are
 * widened once into ``expanded`` (bf16 128 + q, a 1 KB B tile per group); then per block of up
 * to 16 activation rows and per group, one tile product gives the group's dot products, which
 * are scaled and offset per output row in fp32 exactly as the per-row path does. */
static void int4_tile_amx(const uint8_t *w, const uint16_t *scales, const uint16_t *xb, const float *sx, int m,
                          int k, int n, int tile, void *out, int is_bf16, uint8_t *expanded, float *products) {
    const int groups = k / GROUP, group_bytes = GROUP / 2 * TILE;
    const uint8_t *wt = w + (int64_t)tile * groups * group_bytes;
    const uint16_t *st = scales + (int64_t)tile * groups * 2 * TILE;
    for (int g = 0; g < groups; g++)
        for (int i = 0; i < GROUP / 2; i++)
            _mm512_store_si512(expanded + ((int64_t)g * 16 + i) * 64, int4_pairs(wt + (int64_t)g * group_bytes + i * TILE));
    int configured = 0;  /* other AMX code (oneDNN's) may have run on this thread since the last call */
    for (int first = 0; first < m; first += 16) {
        const int rows = m - first < 16 ? m - first : 16;
        const uint16_t *xr = xb + (int64_t)first * k;
        const float *sr = sx + (int64_t)first * groups;
        if (rows != configured) amx_configure(configured = rows);
        __m512 total[16];
        for (int r = 0; r < 16; r++) total[r] = _mm512_setzero_ps();
        int g = 0;
        for (; g + 1 < groups; g += 2) {
            if (first == 0)  /* the next tile's weights (a prefetch never faults, even past the end) */
                for (int line = 0; line < 2 * group_bytes; line += 64)
                    _mm_prefetch((const char *)(wt + (int64_t)(groups + g) * group_bytes + line), _MM_HINT_T0);
            _tile_loadd(0, xr + g * GROUP, k * 2);
            _tile_loadd(1, expanded + (int64_t)g * 1024, 64);
            _tile_zero(2);
            _tile_dpbf16ps(2, 0, 1);
            _tile_loadd(3, xr + (g + 1) * GROUP, k * 2);
            _tile_loadd(4, expanded + (int64_t)(g + 1) * 1024, 64);
            _tile_zero(5);
            _tile_dpbf16ps(5, 3, 4);
            _tile_stored(2, products, 64);
            _tile_stored(5, products + 256, 64);
            amx_accumulate(total, products, st + (int64_t)g * 2 * TILE, sr + g, groups, rows);
            amx_accumulate(total, products + 256, st + (int64_t)(g + 1) * 2 * TILE, sr + g + 1, groups, rows);
        }
        if (g < groups) {
            _tile_loadd(0, xr + g * GROUP, k * 2);
            _tile_loadd(1, expanded + (int64_t)g * 1024, 64);
            _tile_zero(2);
            _tile_dpbf16ps(2, 0, 1);
            _tile_stored(2, products, 64);
            amx_accumulate(total, products, st + (int64_t)g * 2 * TILE, sr + g, groups, rows);
        }
        for (int r = 0; r < rows; r++) {
            float lane[TILE];
            _mm512_storeu_ps(lane, total[r]);
            store_row(out, (int64_t)(first + r) * n + (int64_t)tile * TILE, TILE, is_bf16, lane);
        }
    }
}

/* The 16 rows' weights of pair i, group g, dequantized: bf16(d·q + c) for k = 2i (low word) and
 * 2i + 1 (high word), the weights a dense bf16 copy of the layer would hold. */
static inline __attribute__((always_inline)) __m512i int4_dequantized_pairs(const uint8_t *bytes, __m512 d, __m512 c) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)bytes));
    const __m512 low = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0x0F))), d, c);
    const __m512 high = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), d, c);
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(high, low));
}

/* Tiles for the dequantized path: a 2×2 block, so each tile load feeds two products.
 * tmm0/tmm1 = A for rows 0-15 / 16-31 of a block; tmm2/tmm3 = B for the two weight tiles;
 * tmm4..7 = C for (A0, B0), (A0, B1), (A1, B0), (A1, B1). */
static void amx_configure_blocked(int rows0, int rows1) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    const int rows[8] = {rows0, rows1, 16, 16, rows0, rows0, rows1, rows1};
    for (int t = 0; t < 8; t++) {
        config.rows[t] = rows[t];
        config.bytes_per_row[t] = rows[t] ? 64 : 0;
    }
    __asm__ __volatile__("" : : "r"(&config) : "memory");  /* see amx_configure */
    _tile_loadconfig(&config);
}

static void int4_dequantize_tile(const uint8_t *w, const uint16_t *scales, int groups, int tile, uint8_t *expanded) {
    const int group_bytes = GROUP / 2 * TILE;
    const uint8_t *wt = w + (int64_t)tile * groups * group_bytes;
    const uint16_t *st = scales + (int64_t)tile * groups * 2 * TILE;
    for (int g = 0; g < groups; g++) {
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(st + (int64_t)g * 2 * TILE)));
        const __m512 c = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(st + (int64_t)g * 2 * TILE + TILE)));
        for (int i = 0; i < GROUP / 2; i++)
            _mm512_store_si512(expanded + ((int64_t)g * 16 + i) * 64,
                               int4_dequantized_pairs(wt + (int64_t)g * group_bytes + i * TILE, d, c));
    }
}

static void store_products(const float *products, int rows, int first_row, int n, int tile, void *out, int is_bf16) {
    for (int r = 0; r < rows; r++)
        store_row(out, (int64_t)(first_row + r) * n + (int64_t)tile * TILE, TILE, is_bf16, products + r * 16);
}

/* 4-bit on AMX for many rows (prefill): weights dequantized to bf16 once per (panel, pair of
 * tiles), as a dense copy would hold them, so the products accumulate over the whole K in
 * AMX's own registers, with no per-group work on the vector unit. ``tiles`` is 1 or 2. */
static void int4_tiles_amx_dequantized(const uint8_t *w, const uint16_t *scales, const uint16_t *xb, int m, int k,
                                       int n, int tile, int tiles, void *out, int is_bf16, uint8_t *expanded,
                                       float *products) {
    const int groups = k / GROUP;
    uint8_t *expanded1 = expanded + (size_t)groups * 1024;
    int4_dequantize_tile(w, scales, groups, tile, expanded);
    if (tiles == 2) int4_dequantize_tile(w, scales, groups, tile + 1, expanded1);
    int configured = -1;
    for (int first = 0; first < m; first += 32) {
        const int rows0 = m - first < 16 ? m - first : 16, rest = m - first - 16;
        const int rows1 = rest <= 0 ? 0 : rest < 16 ? rest : 16;
        if (rows0 * 32 + rows1 != configured) {
            amx_configure_blocked(rows0, rows1);
            configured = rows0 * 32 + rows1;
        }
        const uint16_t *x0 = xb + (int64_t)first * k, *x1 = x0 + (int64_t)16 * k;
        _tile_zero(4);
        if (tiles == 2) _tile_zero(5);
        if (rows1) _tile_zero(6);
        if (rows1 && tiles == 2) _tile_zero(7);
        for (int g = 0; g < groups; g++) {
            _tile_loadd(0, x0 + g * GROUP, k * 2);
            _tile_loadd(2, expanded + (int64_t)g * 1024, 64);
            _tile_dpbf16ps(4, 0, 2);
            if (tiles == 2) {
                _tile_loadd(3, expanded1 + (int64_t)g * 1024, 64);
                _tile_dpbf16ps(5, 0, 3);
            }
            if (rows1) {
                _tile_loadd(1, x1 + g * GROUP, k * 2);
                _tile_dpbf16ps(6, 1, 2);
                if (tiles == 2) _tile_dpbf16ps(7, 1, 3);
            }
        }
        _tile_stored(4, products, 64);
        store_products(products, rows0, first, n, tile, out, is_bf16);
        if (tiles == 2) {
            _tile_stored(5, products, 64);
            store_products(products, rows0, first, n, tile + 1, out, is_bf16);
        }
        if (rows1) {
            _tile_stored(6, products, 64);
            store_products(products, rows1, first + 16, n, tile, out, is_bf16);
            if (tiles == 2) {
                _tile_stored(7, products, 64);
                store_products(products, rows1, first + 16, n, tile + 1, out, is_bf16);
            }
        }
    }
}

static int int4_gemm_amx(const uint16_t *xb, const float *sx, const uint8_t *w, const uint16_t *scales, void *out,
                         int m, int k, int n, int is_bf16, int num_threads, const TeamWork *team) {
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        uint8_t *expanded = aligned_alloc(64, (size_t)(k / GROUP) * 2048 + 2048);
        if (!expanded) {
            failed = 1;
        } else {
            /* Panels of AMX_PANEL rows, each against every tile: a panel's activations stay in
             * cache across the tiles (a prefill of 2048 rows would otherwise stream from memory
             * once per tile); each (panel, tile) widens its weights again, which costs little. */
            const int panels = (m + AMX_PANEL - 1) / AMX_PANEL, groups = k / GROUP, tiles = n / TILE;
            const size_t out_row = (size_t)n * (is_bf16 ? 2 : 4);
            float *products = (float *)(expanded + (size_t)groups * 2048);
            /* the exact path also reads the rows past a partial block: zeros there, never stale
             * bytes (a denormal or NaN pattern would cost a microcode assist per instruction) */
            memset(products, 0, 2048);
            team_before(team);
            if (m >= AMX_DEQUANTIZED_ROWS) {
#pragma omp for schedule(static) collapse(2)
                for (int p = 0; p < panels; p++)
                    for (int t = 0; t < tiles; t += 2) {
                        const int first = p * AMX_PANEL, rows = m - first < AMX_PANEL ? m - first : AMX_PANEL;
                        int4_tiles_amx_dequantized(w, scales, xb + (int64_t)first * k, rows, k, n, t,
                                                   t + 1 < tiles ? 2 : 1, (char *)out + first * out_row, is_bf16,
                                                   expanded, products);
                    }
            } else {
#pragma omp for schedule(static) collapse(2)
                for (int p = 0; p < panels; p++)
                    for (int t = 0; t < tiles; t++) {
                        const int first = p * AMX_PANEL, rows = m - first < AMX_PANEL ? m - first : AMX_PANEL;
                        int4_tile_amx(w, scales, xb + (int64_t)first * k, sx + (int64_t)first * groups, rows, k,
                                      n, t, (char *)out + first * out_row, is_bf16, expanded, products);
                    }
            }
            team_after(team);
            _tile_release();
            free(expanded);
        }
    }
    return failed ? -2 : 0;
}
#endif

#if HAVE_AVX2
/* AVX2 (x86-64-v3: every AVX2 server). 4-bit: int8 activations as on VNNI (below), every row
 * count (fp32 FMAs on bf16 activations for 1-2 rows, once here, took 2.4x as long in a one-stream
 * decode step of SmolLM2: compute-bound on widening every nibble to fp32). 8-bit: int8 products as
 * on VNNI, emulated with |w| · sign(x, w) (``maddubs``, never saturating: |w|, |x| ≤ 127) and pairwise
 * sums (``madd``): integer-exact, so the results are the AVX-512 path's, bit for bit. */
#define AVX2_PANEL 32     /* activation rows per pass over a tile's widened weights */
#define AVX2_INT8_ROWS 4  /* activation rows sharing each loaded weight group (registers) */
#define INT8_AVX2_DISPATCH(rows, ...)                                                           \
    switch (rows) {                                                                             \
    case 1: int8_tile_avx2(1, __VA_ARGS__); break;                                              \
    case 2: int8_tile_avx2(2, __VA_ARGS__); break;                                              \
    case 3: int8_tile_avx2(3, __VA_ARGS__); break;                                              \
    default: int8_tile_avx2(4, __VA_ARGS__); break;                                             \
    }

/* A (tile, group)'s fp16 scales as fp32: d and c of outputs 0-7 and 8-15. */
typedef struct { __m256 d_low, d_high, c_low, c_high; } GroupScales;

static inline __attribute__((always_inline)) GroupScales group_scales_avx2(const uint16_t *sg) {
    return (GroupScales){_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sg)),
                         _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sg + 8))),
                         _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sg + TILE))),
                         _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sg + TILE + 8)))};
}

/* 8-bit: one (tile, block of up to AVX2_INT8_ROWS rows), the same sums and scaling as int8_tile.
 * Each block of weights is loaded, and its |w| taken, once for the rows (their sums in registers),
 * and fetched ahead in software as int8_tile's: the one-row LM head streams 28 MB across pages. */
static inline __attribute__((always_inline)) void int8_tile_avx2(int rows, const uint8_t *w, const uint16_t *scales,
                                                               const int8_t *xq, const float *dx, int k, int n,
                                                               int tile, int out_tile, void *out, int is_bf16) {
    const int groups = k / GROUP, chunk_bytes = 8 * 64;
    __m256 acc[AVX2_INT8_ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const uint8_t *wt = w + (int64_t)tile * groups * chunk_bytes;
    const uint16_t *st = scales + (int64_t)tile * groups * 2 * TILE;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int g = 0; g < groups; g++) {
        const uint8_t *wg = wt + (int64_t)g * chunk_bytes;
        for (int line = 0; line < 8; line++)  /* past the last group: the next tile's (never a fault) */
            _mm_prefetch((const char *)(wg + PREFETCH_AHEAD * chunk_bytes + 64 * line), _MM_HINT_T0);
        _mm_prefetch((const char *)(st + (int64_t)(g + PREFETCH_AHEAD) * 2 * TILE), _MM_HINT_T0);
        const __m256 d_low = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(st + (int64_t)g * 2 * TILE)));
        const __m256 d_high = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(st + (int64_t)g * 2 * TILE + 8)));
        __m256i dot_low[AVX2_INT8_ROWS], dot_high[AVX2_INT8_ROWS];
        for (int r = 0; r < rows; r++) dot_low[r] = dot_high[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int b = 0; b < 8; b++) {  /* per dword lane: Σ of its 4 byte products, |w| · sign(x, w) */
            const __m256i w_low = _mm256_loadu_si256((const __m256i *)(wg + b * 64));
            const __m256i w_high = _mm256_loadu_si256((const __m256i *)(wg + b * 64 + 32));
            const __m256i abs_low = _mm256_abs_epi8(w_low), abs_high = _mm256_abs_epi8(w_high);
            for (int r = 0; r < rows; r++) {
                const __m256i x = _mm256_set1_epi32(((const int32_t *)(xq + (int64_t)r * k + g * GROUP))[b]);
                dot_low[r] = _mm256_add_epi32(dot_low[r], _mm256_madd_epi16(
                    _mm256_maddubs_epi16(abs_low, _mm256_sign_epi8(x, w_low)), ones));
                dot_high[r] = _mm256_add_epi32(dot_high[r], _mm256_madd_epi16(
                    _mm256_maddubs_epi16(abs_high, _mm256_sign_epi8(x, w_high)), ones));
            }
        }
        for (int r = 0; r < rows; r++) {
            const __m256 row_scale = _mm256_set1_ps(dx[(int64_t)r * groups + g]);
            acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_low[r]), _mm256_mul_ps(d_low, row_scale), acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_high[r]), _mm256_mul_ps(d_high, row_scale), acc[r][1]);
        }
    }
    for (int r = 0; r < rows; r++) {
        float lane[TILE];
        _mm256_storeu_ps(lane, acc[r][0]);
        _mm256_storeu_ps(lane + 8, acc[r][1]);
        store_row(out, (int64_t)r * n + (int64_t)out_tile * TILE, TILE, is_bf16, lane);
    }
}

/* 4-bit against int8 activations on AVX2: as on VNNI, each (tile, group) widened ONCE into 8
 * blocks of 4 k per output (an L1 buffer: 16 registers would be all of AVX2's), which every row of
 * the panel passes. The weights (0..15) are ``maddubs``' unsigned operand, xq its signed one: a
 * pair of products is at most 2·15·127, so the 8 blocks' pair sums add up in int16 without
 * saturating (8·3810 < 32768) before one ``madd`` widens them: integer-exact, and scaled in the
 * VNNI path's order, so the results are the AVX-512 family's, bit for bit.
 * A block is widened as the VNNI path's ``int4_quad_rows`` does it, in AVX2's 128-bit lanes: four
 * pairs (64 bytes) gather each row's 4 bytes into its dword with 8 byte and word shuffles, and the
 * low and the high nibbles of those dwords are two blocks, for activations reordered to match
 * (``reorder_for_quads_avx2``): per group, half the instructions of widening each block from two
 * 8-byte loads of its rows' bytes. The two vectors of a tile's outputs hold rows 0-3 and 8-11, and
 * 4-7 and 12-15 (``QUAD_ROWS``): the order the lane-local shuffles leave them in; the scales are
 * read in that order and the totals stored back in place. */
static const int QUAD_ROWS[2][8] = {{0, 1, 2, 3, 8, 9, 10, 11}, {4, 5, 6, 7, 12, 13, 14, 15}};

/* Pairs p0..p3 (``pairs``: pair p's 16 row bytes at 16p) as dwords (p0[r], p2[r], p1[r], p3[r]):
 * rows QUAD_ROWS[0] in ``*first``, QUAD_ROWS[1] in ``*second``. */
static inline __attribute__((always_inline)) void int4_quads_avx2(const uint8_t *pairs, __m256i *first,
                                                                __m256i *second) {
    const __m256i p01 = _mm256_loadu_si256((const __m256i *)pairs);         /* p0 | p1 */
    const __m256i p23 = _mm256_loadu_si256((const __m256i *)(pairs + 32));  /* p2 | p3 */
    const __m256i low = _mm256_unpacklo_epi8(p01, p23);   /* (p0, p2)[0..7] | (p1, p3)[0..7] */
    const __m256i high = _mm256_unpackhi_epi8(p01, p23);  /* (p0, p2)[8..15] | (p1, p3)[8..15] */
    const __m256i even = _mm256_permute2x128_si256(low, high, 0x20);  /* (p0, p2)[0..7] | [8..15] */
    const __m256i odd = _mm256_permute2x128_si256(low, high, 0x31);   /* (p1, p3)[0..7] | [8..15] */
    *first = _mm256_unpacklo_epi16(even, odd);   /* rows 0-3 | 8-11 */
    *second = _mm256_unpackhi_epi16(even, odd);  /* rows 4-7 | 12-15 */
}

/* Each 8 activations as k = 0, 4, 2, 6, 1, 5, 3, 7: the order of ``int4_quads_avx2``' low nibbles,
 * then its high ones (``count``: a multiple of 16). */
static void reorder_for_quads_avx2(int8_t *xq, int64_t count) {
    const __m128i order = _mm_setr_epi8(0, 4, 2, 6, 1, 5, 3, 7, 8, 12, 10, 14, 9, 13, 11, 15);
    for (int64_t at = 0; at < count; at += 16)
        _mm_storeu_si128((__m128i *)(xq + at), _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(xq + at)), order));
}

/* 16 fp16 values (one per row of a tile) as fp32 in QUAD_ROWS' order. */
static inline __attribute__((always_inline)) void quad_rows_f16(const uint16_t *values, __m256 *first,
                                                              __m256 *second) {
    const __m256i halves = _mm256_permute4x64_epi64(_mm256_loadu_si256((const __m256i *)values), 0xD8);
    *first = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));
    *second = _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1));
}

static void int4_tile_avx2_int8(const uint8_t *w, const uint16_t *scales, const int8_t *xq, const float *dx,
                                const float *sx, int rows, int k, int n, int tile, int out_tile, void *out,
                                int is_bf16) {
    const int groups = k / GROUP, group_bytes = GROUP / 2 * TILE;
    const uint8_t *wt = w + (int64_t)tile * groups * group_bytes;
    const uint16_t *st = scales + (int64_t)tile * groups * 2 * TILE;
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    __m256i blocks[GROUP / 4][2];  /* [block][QUAD_ROWS half]: stays in L1 */
    __m256 totals[AVX2_PANEL][2];
    for (int r = 0; r < rows; r++) totals[r][0] = totals[r][1] = _mm256_setzero_ps();
    for (int g = 0; g < groups; g++) {
        const uint8_t *wg = wt + (int64_t)g * group_bytes;
        for (int line = 0; line < 4; line++)  /* as int4_tile_int8: the prefetchers stop at each page */
            _mm_prefetch((const char *)(wg + PREFETCH_AHEAD * group_bytes + 64 * line), _MM_HINT_T0);
        _mm_prefetch((const char *)(st + (int64_t)(g + PREFETCH_AHEAD) * 2 * TILE), _MM_HINT_T0);
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            __m256i quads[2];
            int4_quads_avx2(wg + 64 * j, &quads[0], &quads[1]);
            for (int h = 0; h < 2; h++) {
                blocks[2 * j][h] = _mm256_and_si256(quads[h], nibble);
                blocks[2 * j + 1][h] = _mm256_and_si256(_mm256_srli_epi16(quads[h], 4), nibble);
            }
        }
        GroupScales gs;
        quad_rows_f16(st + (int64_t)g * 2 * TILE, &gs.d_low, &gs.d_high);
        quad_rows_f16(st + (int64_t)g * 2 * TILE + TILE, &gs.c_low, &gs.c_high);
        for (int r = 0; r < rows; r++) {
            const int32_t *xg = (const int32_t *)(xq + (int64_t)r * k + g * GROUP);
            __m256i pairs_low = _mm256_setzero_si256(), pairs_high = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int b = 0; b < GROUP / 4; b++) {
                const __m256i x = _mm256_set1_epi32(xg[b]);
                pairs_low = _mm256_add_epi16(pairs_low, _mm256_maddubs_epi16(blocks[b][0], x));
                pairs_high = _mm256_add_epi16(pairs_high, _mm256_maddubs_epi16(blocks[b][1], x));
            }
            const __m256i ones = _mm256_set1_epi16(1);
            const __m256 dot_low = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs_low, ones));
            const __m256 dot_high = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs_high, ones));
            const int64_t rg = (int64_t)r * groups + g;
            const __m256 row_scale = _mm256_set1_ps(dx[rg]), row_sum = _mm256_set1_ps(sx[rg]);
            totals[r][0] = _mm256_fmadd_ps(dot_low, _mm256_mul_ps(gs.d_low, row_scale), totals[r][0]);
            totals[r][1] = _mm256_fmadd_ps(dot_high, _mm256_mul_ps(gs.d_high, row_scale), totals[r][1]);
            totals[r][0] = _mm256_fmadd_ps(gs.c_low, row_sum, totals[r][0]);
            totals[r][1] = _mm256_fmadd_ps(gs.c_high, row_sum, totals[r][1]);
        }
    }
    for (int r = 0; r < rows; r++) {
        float lane[TILE], halves[2][8];
        _mm256_storeu_ps(halves[0], totals[r][0]);
        _mm256_storeu_ps(halves[1], totals[r][1]);
        for (int h = 0; h < 2; h++)
            for (int i = 0; i < 8; i++) lane[QUAD_ROWS[h][i]] = halves[h][i];
        store_row(out, (int64_t)r * n + (int64_t)out_tile * TILE, TILE, is_bf16, lane);
    }
}

/* One activation row (a one-stream decode step): no row shares a widened block, so each 32 bytes
 * of weights (pairs 2j and 2j+1, one per 128-bit lane) are used where they are loaded, with no
 * transpose: their low and high nibbles interleaved give each row's (k, k + 1) byte pair in a
 * word, rows 0-7 (``unpacklo``) and 8-15 (``unpackhi``), against (x[4j], x[4j+1]) in lane 0 and
 * (x[4j+2], x[4j+3]) in lane 1. The lanes' int16 sums (at most 8·3810 each) are widened and added
 * per group: the same integers as the quads' path, scaled in its order, so the same results. About
 * two thirds of its instructions per byte, on activations in their own order. */
static void int4_tile_avx2_one_row(const uint8_t *w, const uint16_t *scales, const int8_t *xq, const float *dx,
                                   const float *sx, int rows, int k, int n, int tile, int out_tile, void *out,
                                   int is_bf16) {
    (void)rows; (void)n;  /* one row, and its outputs start the row */
    const int groups = k / GROUP, group_bytes = GROUP / 2 * TILE;
    const uint8_t *wt = w + (int64_t)tile * groups * group_bytes;
    const uint16_t *st = scales + (int64_t)tile * groups * 2 * TILE;
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i pair_of_lane = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                                  2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
    __m256 total_low = _mm256_setzero_ps(), total_high = _mm256_setzero_ps();
    for (int g = 0; g < groups; g++) {
        const uint8_t *wg = wt + (int64_t)g * group_bytes;
        for (int line = 0; line < 4; line++)  /* as int4_tile_int8: the prefetchers stop at each page */
            _mm_prefetch((const char *)(wg + PREFETCH_AHEAD * group_bytes + 64 * line), _MM_HINT_T0);
        _mm_prefetch((const char *)(st + (int64_t)(g + PREFETCH_AHEAD) * 2 * TILE), _MM_HINT_T0);
        const int32_t *xg = (const int32_t *)(xq + (int64_t)g * GROUP);
        __m256i rows_low = _mm256_setzero_si256(), rows_high = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int j = 0; j < GROUP / 4; j++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(wg + 32 * j));
            const __m256i low = _mm256_and_si256(v, nibble), high = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
            const __m256i x = _mm256_shuffle_epi8(_mm256_set1_epi32(xg[j]), pair_of_lane);
            rows_low = _mm256_add_epi16(rows_low, _mm256_maddubs_epi16(_mm256_unpacklo_epi8(low, high), x));
            rows_high = _mm256_add_epi16(rows_high, _mm256_maddubs_epi16(_mm256_unpackhi_epi8(low, high), x));
        }
        const __m256 dot_low = _mm256_cvtepi32_ps(_mm256_add_epi32(
            _mm256_cvtepi16_epi32(_mm256_castsi256_si128(rows_low)), _mm256_cvtepi16_epi32(_mm256_extracti128_si256(rows_low, 1))));
        const __m256 dot_high = _mm256_cvtepi32_ps(_mm256_add_epi32(
            _mm256_cvtepi16_epi32(_mm256_castsi256_si128(rows_high)),
            _mm256_cvtepi16_epi32(_mm256_extracti128_si256(rows_high, 1))));
        const GroupScales gs = group_scales_avx2(st + (int64_t)g * 2 * TILE);
        const __m256 row_scale = _mm256_set1_ps(dx[g]), row_sum = _mm256_set1_ps(sx[g]);
        total_low = _mm256_fmadd_ps(dot_low, _mm256_mul_ps(gs.d_low, row_scale), total_low);
        total_high = _mm256_fmadd_ps(dot_high, _mm256_mul_ps(gs.d_high, row_scale), total_high);
        total_low = _mm256_fmadd_ps(gs.c_low, row_sum, total_low);
        total_high = _mm256_fmadd_ps(gs.c_high, row_sum, total_high);
    }
    float lane[TILE];
    _mm256_storeu_ps(lane, total_low);
    _mm256_storeu_ps(lane + 8, total_high);
    store_row(out, (int64_t)out_tile * TILE, TILE, is_bf16, lane);
}
#endif

#if HAVE_BF16_DOT
/* Each 8 activations as k = 0, 2, 4, 6, 1, 3, 5, 7: the order of ``int4_quad_rows``' two blocks
 * (``count``: a multiple of 16). */
static void reorder_for_quads(int8_t *xq, int64_t count) {
    const __m128i order = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
    for (int64_t at = 0; at < count; at += 16)
        _mm_storeu_si128((__m128i *)(xq + at), _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(xq + at)), order));
}
#endif

#if HAVE_BF16_DOT || HAVE_AVX2
/* One (tile, panel of activation rows) of 4-bit weights against int8 activations: the VNNI or the AVX2 form.
 * ``tile``: the weight's tile; ``out_tile``: which 16 columns of ``out`` (``n`` wide) its outputs fill. */
typedef void (*Int4Tile)(const uint8_t *w, const uint16_t *scales, const int8_t *xq, const float *dx,
                         const float *sx, int rows, int k, int n, int tile, int out_tile, void *out, int is_bf16);

/* (panel of ``panel_rows`` rows, tile) pairs across the threads, panel-major: a panel's activations
 * stay in L1 while the layer's weights (a few hundred KB, in L2) pass, and each output row is written
 * whole (5-8% faster from 128 rows than tile-major). ``out`` holds ``count`` tiles of columns: the
 * weight's tiles ``tiles`` in that order (NULL: every tile, in order). */
static void int4_panels(Int4Tile tile_product, int panel_rows, const int8_t *xq, const float *dx, const float *sx,
                        const uint8_t *w, const uint16_t *scales, void *out, int m, int k, const int32_t *tiles,
                        int count, int is_bf16, int num_threads, const TeamWork *team) {
    const int groups = k / GROUP, n = count * TILE, panels = (m + panel_rows - 1) / panel_rows;
    const size_t out_row = (size_t)n * (is_bf16 ? 2 : 4);
#pragma omp parallel num_threads(num_threads)
    {
        team_before(team);
#pragma omp for schedule(static) collapse(2) nowait
        for (int p = 0; p < panels; p++)
            for (int j = 0; j < count; j++) {
                const int first = p * panel_rows, rows = m - first < panel_rows ? m - first : panel_rows;
                tile_product(w, scales, xq + (int64_t)first * k, dx + (int64_t)first * groups,
                             sx + (int64_t)first * groups, rows, k, n, tiles ? tiles[j] : j, j,
                             (char *)out + first * out_row, is_bf16);
            }
        if (team) {  /* the additions read every thread's tiles; without a team the region ends as a parallel for */
#pragma omp barrier
            team_after(team);
        }
    }
}
#endif

/* The 4-bit paths, by activation rows (``ricllm_quant_gemm_int4_path`` names them to callers). */
enum { INT4_AVX2_INT8, INT4_VNNI_INT8, INT4_AMX_TILES, INT4_AMX_DEQUANTIZED };

static int int4_path(int m) {
#if HAVE_AVX2
    (void)m;
    return INT4_AVX2_INT8;
#else
#if HAVE_AMX
    if (m >= AMX_MIN_ROWS && ricllm_amx_usable())
        return m >= AMX_DEQUANTIZED_ROWS ? INT4_AMX_DEQUANTIZED : INT4_AMX_TILES;
#endif
    (void)m;
    return INT4_VNNI_INT8;
#endif
}

/* Which 4-bit path runs for m activation rows here (the enum's order), -3 where none does. */
int ricllm_quant_gemm_int4_path(int m) {
    return ricllm_quant_gemm_supported(4) ? int4_path(m) : -3;
}

#if HAVE_BF16_DOT || HAVE_AVX2
/* 4-bit, on the activations its path takes: int8 per group (VNNI, AVX2), or bf16 with each
 * group's fp32 sum (AMX tiles: every tile, ``tiles`` NULL). */
static int int4_gemm(const void *x, const uint8_t *w, const uint16_t *scales, void *out, int m, int k, int n,
                     const int32_t *tiles, int count, int is_bf16, void *scratch, int num_threads,
                     const TeamWork *team) {
    const int groups = k / GROUP;
#if HAVE_AMX
    if (int4_path(m) != INT4_VNNI_INT8) {
        float *sx = (float *)((uint16_t *)scratch + (int64_t)m * k);
        const uint16_t *xb = bf16_activations(x, m, k, is_bf16, scratch, sx);
        return int4_gemm_amx(xb, sx, w, scales, out, m, k, n, is_bf16, num_threads, team);
    }
#endif
    (void)n;
#if HAVE_BF16_DOT
    int8_t *xq = scratch;
    float *dx = (float *)(xq + (int64_t)m * k), *sx = dx + (int64_t)m * groups;
    quantize_activations(x, m, k, is_bf16, xq, dx, sx);
    reorder_for_quads(xq, (int64_t)m * k);
    int4_panels(int4_tile_int8, INT8_PANEL, xq, dx, sx, w, scales, out, m, k, tiles, count, is_bf16, num_threads,
                team);
    return 0;
#else
    int8_t *xq = scratch;
    float *dx = (float *)(xq + (int64_t)m * k), *sx = dx + (int64_t)m * groups;
    quantize_activations(x, m, k, is_bf16, xq, dx, sx);
    if (m == 1) {
        int4_panels(int4_tile_avx2_one_row, 1, xq, dx, sx, w, scales, out, m, k, tiles, count, is_bf16, num_threads,
                    team);
        return 0;
    }
    reorder_for_quads_avx2(xq, (int64_t)m * k);
    int4_panels(int4_tile_avx2_int8, AVX2_PANEL, xq, dx, sx, w, scales, out, m, k, tiles, count, is_bf16,
                num_threads, team);
    return 0;
#endif
}
#endif

/* The products of ``count`` tiles of 16 outputs into ``out [M, 16·count]``: the weight's tiles
 * ``tiles`` in that order, or (NULL) every tile in order; the team also does ``team`` (NULL: nothing
 * else). */
static int quant_gemm_tiles(const void *x, const uint8_t *w, const uint16_t *scales, const int32_t *offsets,
                            int bits, void *out, int m, int k, int n, const int32_t *tiles, int count,
                            int is_bf16, void *scratch, int num_threads, const TeamWork *team) {
#if HAVE_BF16_DOT || HAVE_AVX2
    if (bits == 4) return int4_gemm(x, w, scales, out, m, k, n, tiles, count, is_bf16, scratch, num_threads, team);
#endif
#if HAVE_VNNI || HAVE_AVX2
    const int groups = k / GROUP, n_out = count * TILE;
    const size_t out_row = (size_t)n_out * (is_bf16 ? 2 : 4);
    int8_t *xq = scratch;
    float *dx = (float *)(xq + (int64_t)m * k), *sx = dx + (int64_t)m * groups;
    quantize_activations(x, m, k, is_bf16, xq, dx, sx);
#if HAVE_VNNI
    const int rows_at_once = ROWS_AT_ONCE;
#else
    const int rows_at_once = AVX2_INT8_ROWS;
    (void)offsets;  /* signed products need no correction */
#endif
    const int row_blocks = (m + rows_at_once - 1) / rows_at_once;
    (void)n;
    /* tile-major: a tile's weights stay in L1 while every block of rows passes (the LM head's
     * 28 MB would otherwise stream from memory once per block) */
#pragma omp parallel num_threads(num_threads)
    {
        team_before(team);
#pragma omp for schedule(static) collapse(2) nowait
        for (int j = 0; j < count; j++)
            for (int rb = 0; rb < row_blocks; rb++) {
                const int t = tiles ? tiles[j] : j;
                const int first = rb * rows_at_once, rows = m - first < rows_at_once ? m - first : rows_at_once;
#if HAVE_VNNI
                ROW_COUNT_DISPATCH(rows, int8_tile, w, scales, offsets, xq + (int64_t)first * k,
                                   dx + (int64_t)first * groups, k, n_out, t, j, (char *)out + first * out_row,
                                   is_bf16);
#else
                INT8_AVX2_DISPATCH(rows, w, scales, xq + (int64_t)first * k, dx + (int64_t)first * groups, k,
                                   n_out, t, j, (char *)out + first * out_row, is_bf16);
#endif
            }
        if (team) {  /* the additions read every thread's tiles; without a team the region ends as a parallel for */
#pragma omp barrier
            team_after(team);
        }
    }
    return 0;
#else
    (void)x; (void)w; (void)scales; (void)offsets; (void)bits; (void)out; (void)m; (void)k; (void)n; (void)tiles;
    (void)count; (void)is_bf16; (void)scratch; (void)num_threads; (void)team;
    return -3;
#endif
}

/* ``ricllm_quant_gemm`` whose team also does ``team`` (cpu_common.h; NULL: nothing else): its
 * ``after`` sees the whole product in ``out``. A call that fails runs neither half. */
int ricllm_quant_gemm_with(const void *x, const uint8_t *w, const uint16_t *scales, const int32_t *offsets,
                           int bits, void *out, int m, int k, int n, int is_bf16, void *scratch, int num_threads,
                           const TeamWork *team) {
    if (k % GROUP != 0 || n % TILE != 0 || (bits != 4 && bits != 8)) return -1;
    if (!ricllm_quant_gemm_supported(bits)) return -3;
    return quant_gemm_tiles(x, w, scales, offsets, bits, out, m, k, n, NULL, n / TILE, is_bf16, scratch,
                            num_threads, team);
}

/* out[M, N] = x[M, K] · Wᵀ. ``scratch`` holds M·K bytes + 2·M·K/32 floats (8-bit, and 4-bit's
 * int8 paths) or 2·M·K bytes + M·K/32 floats (4-bit, enough for either). Returns -3 where the
 * CPU lacks the instructions (``ricllm_quant_gemm_supported``; the caller uses torch's kernels). */
int ricllm_quant_gemm(const void *x, const uint8_t *w, const uint16_t *scales, const int32_t *offsets,
                      int bits, void *out, int m, int k, int n, int is_bf16, void *scratch, int num_threads) {
    return ricllm_quant_gemm_with(x, w, scales, offsets, bits, out, m, k, n, is_bf16, scratch, num_threads, NULL);
}

/* out[M, 16·count] = the columns of x · Wᵀ in the weight's tiles ``tiles`` (16 outputs each), in that
 * order: an LM head's products for the tokens a constraint allows, not the vocabulary's. Each output
 * is what ``ricllm_quant_gemm`` gives it, bit for bit, for any M on the same path: its sums run over
 * its own weights and its row's int8 activations whatever else is computed beside it. ``scratch`` as
 * ``ricllm_quant_gemm``'s. Returns -1 for a tile outside the weight, -2 where M rows take a 4-bit AMX
 * path (the caller computes the whole product there), -3 where the CPU lacks the instructions. */
int ricllm_quant_gemm_tiles(const void *x, const uint8_t *w, const uint16_t *scales, const int32_t *offsets,
                            int bits, void *out, int m, int k, int n, const int32_t *tiles, int count, int is_bf16,
                            void *scratch, int num_threads) {
    if (k % GROUP != 0 || n % TILE != 0 || (bits != 4 && bits != 8) || count < 1) return -1;
    for (int j = 0; j < count; j++)
        if (tiles[j] < 0 || tiles[j] >= n / TILE) return -1;
    if (!ricllm_quant_gemm_supported(bits)) return -3;
    if (bits == 4 && int4_path(m) >= INT4_AMX_TILES) return -2;
    return quant_gemm_tiles(x, w, scales, offsets, bits, out, m, k, n, tiles, count, is_bf16, scratch, num_threads,
                            NULL);
}

/* Rows ``ids`` of a packed weight, dequantized (d·q + c in fp32, then the output type): what a
 * dense copy of the weight would hold, for a tied embedding served from its packed LM head.
 * Returns -1 for an id outside [0, n). */
int ricllm_quant_rows(const uint8_t *w, const uint16_t *scales, int bits, const int64_t *ids, int count, int k,
                      int n, void *out, int is_bf16) {
    const int groups = k / GROUP;
    for (int i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= n) return -1;
    for (int i = 0; i < count; i++) {
        const int64_t tile = ids[i] / TILE, lane = ids[i] % TILE;
        for (int g = 0; g < groups; g++) {
            const uint16_t *st = scales + (tile * groups + g) * 2 * TILE;
            const float d = f16_to_f32(st[lane]), c = f16_to_f32(st[TILE + lane]);
            float values[GROUP];
            if (bits == 4) {
                const uint8_t *pairs = w + (tile * groups + g) * (GROUP / 2 * TILE);
                for (int p = 0; p < GROUP / 2; p++) {
                    const uint8_t byte = pairs[p * TILE + lane];
                    values[2 * p] = d * (float)(byte & 0x0F) + c;
                    values[2 * p + 1] = d * (float)(byte >> 4) + c;
                }
            } else {
                const int8_t *blocks = (const int8_t *)w + (tile * groups + g) * (8 * 64);
                for (int b = 0; b < 8; b++)
                    for (int j = 0; j < 4; j++) values[4 * b + j] = d * (float)blocks[b * 64 + lane * 4 + j];
            }
            store_row(out, (int64_t)i * k + g * GROUP, GROUP, is_bf16, values);
        }
    }
    return 0;
}

/* Whether the batched products run on AMX tiles here: built with AMX (not disabled at build time by
 * RICLLM_NO_AMX) and granted by the kernel. */
int ricllm_quant_gemm_uses_amx(void) {
#if HAVE_AMX
    return ricllm_amx_usable();
#else
    return 0;
#endif
}
