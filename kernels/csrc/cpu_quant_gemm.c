/* Weight-only 4-bit and 8-bit matrix products for small batches, on AVX-512 VNNI.
 *
 * Why: at decode batch sizes a layer's product is ``[M, K] × [K, N]`` with M of 1 to 16, and
 * torch's weight-only kernels spend more time unpacking weights into floats than reading them.
 * Here the activations are quantized to int8 per group of 32 (as llama.cpp does for its Q4/Q8
 * dot products) and each group's dot product runs on the integer unit: ``vpdpbusd`` multiplies
 * 64 byte pairs per instruction.
 *
 *   y[m, n] = Σ_g  d[n,g] · dx[m,g] · Σ_k q[n,k]·xq[m,k]  +  c[n,g] · Σ_k x[m,k]     (k in group g)
 *
 * 4-bit (Q4_1's form): w = d·q + c with q in 0..15 (c is the group minimum);
 * 8-bit (Q8_0's form): w = d·q with q in -127..127 and c = 0; the integer unit wants one
 * unsigned operand, so activations enter as xq + 128 and 128·Σq is subtracted.
 *
 * Weight layout: N in tiles of 16 rows (one AVX-512 lane per row), K in groups of 32, and in a
 * group 8 blocks of 4 k. Lane r of a block holds q[row r][4 k] as 4 bytes, so one broadcast of
 * 4 activation bytes feeds all 16 rows. 4-bit: 4 chunks of 64 bytes per (tile, group), chunk c
 * holding block c in the low nibbles and block c+4 in the high ones; 8-bit: 8 chunks.
 * Scales: fp16 ``[tiles, groups, 2, 16]`` (d, then c; 8-bit keeps 128·Σq as c, in int32).
 */
#include "cpu_common.h"

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_VNNI 1
#else
#define HAVE_VNNI 0
#endif

#define GROUP 32
#define TILE 16
#define ROWS_AT_ONCE 8   /* activation rows sharing each unpacked weight group (registers) */

int ricllm_quant_gemm_supported(void) { return HAVE_VNNI; }

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

#if HAVE_VNNI
/* One (tile, block of up to ROWS_AT_ONCE activation rows): all groups, then store. */
static void gemm_tile(const uint8_t *w, const uint16_t *scales, const int32_t *offsets, int bits,
                      const int8_t *xq, const float *dx, const float *sx, int rows, int k, int n, int tile,
                      void *out, int is_bf16) {
    const int groups = k / GROUP, chunk_bytes = bits == 4 ? 4 * 64 : 8 * 64;
    const __m512i low_nibbles = _mm512_set1_epi8(0x0F), bias = _mm512_set1_epi8((char)0x80);
    __m512 acc[ROWS_AT_ONCE];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    const uint8_t *wt = w + (int64_t)tile * groups * chunk_bytes;
    const uint16_t *st = scales + (int64_t)tile * groups * 2 * TILE;
    for (int g = 0; g < groups; g++) {
        __m512i blocks[8];
        if (bits == 4) {
            for (int c = 0; c < 4; c++) {
                const __m512i packed = _mm512_loadu_si512(wt + (int64_t)g * chunk_bytes + c * 64);
                blocks[c] = _mm512_and_si512(packed, low_nibbles);
                blocks[c + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_nibbles);
            }
        } else {
            for (int c = 0; c < 8; c++) blocks[c] = _mm512_loadu_si512(wt + (int64_t)g * chunk_bytes + c * 64);
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(st + (int64_t)g * 2 * TILE)));
        for (int r = 0; r < rows; r++) {
            const int32_t *xg = (const int32_t *)(xq + (int64_t)r * k + g * GROUP);
            __m512i dot = _mm512_setzero_si512();
            for (int b = 0; b < 8; b++) {
                const __m512i xb = _mm512_set1_epi32(xg[b]);
                /* 4-bit: weights are the unsigned operand; 8-bit: activations, shifted by 128 */
                dot = bits == 4 ? _mm512_dpbusd_epi32(dot, blocks[b], xb)
                                : _mm512_dpbusd_epi32(dot, _mm512_xor_si512(xb, bias), blocks[b]);
            }
            const float scale = dx[(int64_t)r * groups + g];
            if (bits == 4) {
                const __m512 c = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(st + (int64_t)g * 2 * TILE + TILE)));
                acc[r] = _mm512_fmadd_ps(c, _mm512_set1_ps(sx[(int64_t)r * groups + g]), acc[r]);
            } else {
                dot = _mm512_sub_epi32(dot, _mm512_loadu_si512(offsets + ((int64_t)tile * groups + g) * TILE));
            }
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(scale)), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) {
        float lane[TILE];
        _mm512_storeu_ps(lane, acc[r]);
        store_row(out, (int64_t)r * n + (int64_t)tile * TILE, TILE, is_bf16, lane);
    }
}
#endif

/* out[M, N] = x[M, K] · Wᵀ. ``scratch`` holds M·K bytes + 2·M·K/32 floats. Returns -3 where the
 * CPU lacks AVX-512 VNNI (the caller uses torch's kernels). */
int ricllm_quant_gemm(const void *x, const uint8_t *w, const uint16_t *scales, const int32_t *offsets,
                      int bits, void *out, int m, int k, int n, int is_bf16, void *scratch, int num_threads) {
#if HAVE_VNNI
    if (k % GROUP != 0 || n % TILE != 0 || (bits != 4 && bits != 8)) return -1;
    int8_t *xq = scratch;
    float *dx = (float *)(xq + (int64_t)m * k), *sx = dx + (int64_t)m * (k / GROUP);
    quantize_activations(x, m, k, is_bf16, xq, dx, sx);
    const int tiles = n / TILE, row_blocks = (m + ROWS_AT_ONCE - 1) / ROWS_AT_ONCE;
#pragma omp parallel for num_threads(num_threads) schedule(static) collapse(2)
    for (int rb = 0; rb < row_blocks; rb++)
        for (int t = 0; t < tiles; t++) {
            const int first = rb * ROWS_AT_ONCE, rows = m - first < ROWS_AT_ONCE ? m - first : ROWS_AT_ONCE;
            gemm_tile(w, scales, offsets, bits, xq + (int64_t)first * k, dx + (int64_t)first * (k / GROUP),
                      sx + (int64_t)first * (k / GROUP), rows, k, n, t,
                      (char *)out + (int64_t)first * n * (is_bf16 ? 2 : 4), is_bf16);
        }
    return 0;
#else
    (void)x; (void)w; (void)scales; (void)offsets; (void)bits; (void)out; (void)m; (void)k; (void)n;
    (void)is_bf16; (void)scratch; (void)num_threads;
    return -3;
#endif
}
