/* Weight-only 4-bit and 8-bit matrix products for small batches, on AVX-512.
 *
 * Why: at decode batch sizes a layer's product is ``[M, K] × [K, N]`` with M of 1 to 16, and
 * torch's weight-only kernels spend more time unpacking weights into floats than reading them.
 *
 *   y[m, n] = Σ_g  d[n,g] · Σ_k q[n,k]·x[m,k]  +  c[n,g] · Σ_k x[m,k]        (k in group g of 32)
 *
 * 4-bit (Q4_1's form, w = d·q + c, q in 0..15): the activations stay bf16 and the dot products
 * run on the bf16 unit (``vdpbf16ps``, 32 products per instruction, accumulated in fp32), so
 * the only rounding is the fp32 accumulation's. A nibble becomes a bf16 number with one OR:
 * ``0x4300 | q`` is the bf16 pattern of 128 + q, exactly, so the kernel computes
 * Σ x·(128 + q) and folds the 128·Σx into the group's offset (c − 128·d).
 * 8-bit (Q8_0's form, w = d·q, q in -127..127): activations are quantized to int8 per group of
 * 32 (as llama.cpp does) and each group's dot product runs on the integer unit (``vpdpbusd``,
 * 64 byte pairs per instruction). That unit wants one unsigned operand, so activations enter
 * as xq + 128 and 128·Σq (precomputed, ``offsets``) is subtracted.
 *
 * Weight layout: N in tiles of 16 rows (one AVX-512 lane per row), K in groups of 32, and in a
 * group 8 blocks of 4 k. Lane r of a block holds q[row r][4 k] as 4 bytes. 4-bit: 4 chunks of
 * 64 bytes per (tile, group), chunk c holding block c in the low nibbles and block c+4 in the
 * high ones; 8-bit: 8 chunks. Scales: fp16 ``[tiles, groups, 2, 16]`` (d, then c).
 */
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

#define GROUP 32
#define TILE 16
#define ROWS_AT_ONCE 8   /* activation rows sharing each unpacked weight group (registers) */

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

/* Which widths run here: 8-bit needs AVX-512 VNNI, 4-bit AVX-512 BF16 as well. */
int ricllm_quant_gemm_supported(int bits) { return bits == 8 ? HAVE_VNNI : bits == 4 ? HAVE_BF16_DOT : 0; }

/* Per activation row and group: int8 values, their scale and the exact fp32 sum. */
static void quantize_activations(const void *x, int rows, int k, int is_bf16, int8_t *xq, float *dx, float *sx) {
    const int groups = k / GROUP;
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < groups; g++) {
            float v[GROUP], amax = 0.0f, sum = 0.0f;
            load_row(x, (int64_t)r * k + g * GROUP, GROUP, is_bf16, v);
            for (int i = 0; i < GROUP; i++) {
                amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
                sum += v[i];
            }
            const float scale = amax > 0.0f ? amax / 127.0f : 1.0f, inv = 1.0f / scale;
            for (int i = 0; i < GROUP; i++) xq[(int64_t)r * k + g * GROUP + i] = (int8_t)lrintf(v[i] * inv);
            dx[(int64_t)r * groups + g] = scale;
            sx[(int64_t)r * groups + g] = sum;
        }
}

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

#if HAVE_VNNI
/* 8-bit: one (tile, block of up to ROWS_AT_ONCE activation rows): all groups, then store.
 * Inlined per row count (ROW_COUNT_DISPATCH) so the accumulators live in registers. */
static inline __attribute__((always_inline)) void int8_tile(int rows, const uint8_t *w, const uint16_t *scales, const int32_t *offsets, const int8_t *xq,
                      const float *dx, int k, int n, int tile, void *out, int is_bf16) {
    const int groups = k / GROUP, chunk_bytes = 8 * 64;
    const __m512i bias = _mm512_set1_epi8((char)0x80);
    __m512 acc[ROWS_AT_ONCE];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    const uint8_t *wt = w + (int64_t)tile * groups * chunk_bytes;
    const uint16_t *st = scales + (int64_t)tile * groups * 2 * TILE;
    for (int g = 0; g < groups; g++) {
        __m512i blocks[8];
        for (int c = 0; c < 8; c++) blocks[c] = _mm512_loadu_si512(wt + (int64_t)g * chunk_bytes + c * 64);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(st + (int64_t)g * 2 * TILE)));
        const __m512i offset = _mm512_loadu_si512(offsets + ((int64_t)tile * groups + g) * TILE);
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
        store_row(out, (int64_t)r * n + (int64_t)tile * TILE, TILE, is_bf16, lane);
    }
}
#endif

#if HAVE_BF16_DOT
/* 4-bit: one (tile, half of 8 weight rows, block of up to ROWS_AT_ONCE activation rows).
 * A chunk's 32 bytes for rows 8h..8h+7, widened to 16-bit words, give two vectors of bf16
 * weight pairs (low nibbles: k = 4c..4c+3, high: k = 16+4c..): dword lane 2r+p holds
 * row r's pair p, so its activation pair comes from one 64-bit broadcast. Each row's sum
 * is spread over two lanes until the end, and its scales are duplicated to match. */
static inline __attribute__((always_inline)) void int4_half_tile(int rows, const uint8_t *w, const uint16_t *scales,
                           const uint16_t *xb, const float *sx, int k, int n, int tile, int half, void *out,
                           int is_bf16) {
    const int groups = k / GROUP, chunk_bytes = 4 * 64;
    const __m512i low_nibble = _mm512_set1_epi16(0x000F), bf16_128 = _mm512_set1_epi16(0x4300);
    const __m512i pairs = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    __m512 total[ROWS_AT_ONCE];
    for (int r = 0; r < rows; r++) total[r] = _mm512_setzero_ps();
    const uint8_t *wt = w + (int64_t)tile * groups * chunk_bytes + half * 32;
    const uint16_t *st = scales + (int64_t)tile * groups * 2 * TILE + half * 8;
    for (int g = 0; g < groups; g++) {
        __m512i weights[8];
        for (int c = 0; c < 4; c++) {
            const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(wt + (int64_t)g * chunk_bytes + c * 64)));
            weights[c] = _mm512_ternarylogic_epi32(bytes, low_nibble, bf16_128, 0xEA);  /* (a & b) | c */
            weights[c + 4] = _mm512_or_si512(_mm512_srli_epi16(bytes, 4), bf16_128);
        }
        const __m512 d8 = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(st + (int64_t)g * 2 * TILE))));
        const __m512 c8 = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(st + (int64_t)g * 2 * TILE + TILE))));
        const __m512 d = _mm512_permutexvar_ps(pairs, d8);
        /* c − 128·d, halved: each row's two lanes add it once between them (both exact scalings) */
        const __m512 offset = _mm512_mul_ps(_mm512_permutexvar_ps(pairs, _mm512_fmadd_ps(d8, _mm512_set1_ps(-128.0f), c8)),
                                            _mm512_set1_ps(0.5f));
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            const uint16_t *xg = xb + (int64_t)r * k + g * GROUP;
            __m512 dot[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};  /* two chains: half the latency */
#pragma GCC unroll 8
            for (int b = 0; b < 8; b++) {
                int64_t four;
                memcpy(&four, xg + 4 * b, sizeof four);  /* weights[b] holds k = 4b..4b+3 */
                dot[b & 1] = _mm512_dpbf16_ps(dot[b & 1], (__m512bh)weights[b], (__m512bh)_mm512_set1_epi64(four));
            }
            total[r] = _mm512_fmadd_ps(_mm512_add_ps(dot[0], dot[1]), d, total[r]);
            total[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(sx[(int64_t)r * groups + g]), total[r]);
        }
    }
    const __m512i evens = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 14, 12, 10, 8, 6, 4, 2, 0);
    for (int r = 0; r < rows; r++) {
        float lane[TILE];
        const __m512 summed = _mm512_add_ps(total[r], _mm512_permute_ps(total[r], 0xB1));  /* swap lane pairs */
        _mm512_storeu_ps(lane, _mm512_permutexvar_ps(evens, summed));
        store_row(out, (int64_t)r * n + (int64_t)tile * TILE + half * 8, 8, is_bf16, lane);
    }
}
#endif

/* out[M, N] = x[M, K] · Wᵀ. ``scratch`` holds M·K bytes + 2·M·K/32 floats (8-bit) or
 * 2·M·K bytes + M·K/32 floats (4-bit). Returns -3 where the CPU lacks the instructions
 * (``ricllm_quant_gemm_supported``; the caller uses torch's kernels). */
int ricllm_quant_gemm(const void *x, const uint8_t *w, const uint16_t *scales, const int32_t *offsets,
                      int bits, void *out, int m, int k, int n, int is_bf16, void *scratch, int num_threads) {
    if (k % GROUP != 0 || n % TILE != 0 || (bits != 4 && bits != 8)) return -1;
    if (!ricllm_quant_gemm_supported(bits)) return -3;
    const int groups = k / GROUP, tiles = n / TILE, row_blocks = (m + ROWS_AT_ONCE - 1) / ROWS_AT_ONCE;
    const size_t out_row = (size_t)n * (is_bf16 ? 2 : 4);
#if HAVE_BF16_DOT
    if (bits == 4) {
        uint16_t *xb_scratch = scratch;
        float *sx = (float *)(xb_scratch + (int64_t)m * k);
        const uint16_t *xb = bf16_activations(x, m, k, is_bf16, xb_scratch, sx);
#pragma omp parallel for num_threads(num_threads) schedule(static) collapse(3)
        for (int rb = 0; rb < row_blocks; rb++)
            for (int t = 0; t < tiles; t++)
                for (int half = 0; half < 2; half++) {
                    const int first = rb * ROWS_AT_ONCE, rows = m - first < ROWS_AT_ONCE ? m - first : ROWS_AT_ONCE;
                    ROW_COUNT_DISPATCH(rows, int4_half_tile, w, scales, xb + (int64_t)first * k,
                                       sx + (int64_t)first * groups, k, n, t, half, (char *)out + first * out_row,
                                       is_bf16);
                }
        return 0;
    }
#endif
#if HAVE_VNNI
    int8_t *xq = scratch;
    float *dx = (float *)(xq + (int64_t)m * k), *sx = dx + (int64_t)m * groups;
    quantize_activations(x, m, k, is_bf16, xq, dx, sx);
#pragma omp parallel for num_threads(num_threads) schedule(static) collapse(2)
    for (int rb = 0; rb < row_blocks; rb++)
        for (int t = 0; t < tiles; t++) {
            const int first = rb * ROWS_AT_ONCE, rows = m - first < ROWS_AT_ONCE ? m - first : ROWS_AT_ONCE;
            ROW_COUNT_DISPATCH(rows, int8_tile, w, scales, offsets, xq + (int64_t)first * k,
                               dx + (int64_t)first * groups, k, n, t, (char *)out + first * out_row, is_bf16);
        }
    return 0;
#else
    (void)x; (void)w; (void)scales; (void)offsets; (void)out; (void)is_bf16; (void)scratch; (void)num_threads;
    (void)out_row; (void)groups; (void)tiles; (void)row_blocks;
    return -3;
#endif
}
