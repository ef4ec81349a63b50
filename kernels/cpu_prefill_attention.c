/* Blocked attention for prefill steps: a block of query rows against the paged K/V, chunk by chunk.
 *
 * Why a second kernel: ``cpu_paged_attention.c`` is shaped for decode (few query rows, fp32 dot
 * products); a long prompt's attention is compute-bound, and there it ran about 3x slower than
 * torch's SDPA. Here each work item is (sequence, KV head, block of QB queries): its QB·G rows
 * (G = query heads per KV head, which share K/V under GQA) see the keys in chunks of KC, with
 *   S = (Q·Kᵀ)·scale,  causal mask by absolute position,  online softmax (fp32 running max, sum),
 *   O = O·rescale + P·V.
 * With AVX-512 BF16 both products are ``vdpbf16ps`` (bf16 pairs, fp32 accumulation): the K/V of
 * every (sequence, KV head) is first packed once, per chunk, in the pair-interleaved layouts the
 * instruction reads (K: [D/2][KC][2], V: [KC/2][D][2]), and P is rounded to bf16 (as SDPA's bf16
 * path does). Where the library is built with AMX and Linux grants the tiles (head_dim 32 or 64),
 * both products are tile products instead, 16 rows at a time, from the same packed layouts,
 * several times faster than the vector products. Without BF16 (other
 * CPUs, fp32 activations) the same blocking runs in fp32 on contiguous K/V copies, which the
 * compiler vectorizes.
 *
 * Layouts and arguments: as ``ricllm_paged_attention`` (same contract, same results within bf16
 * rounding): query j of sequence b sits at context_lens[b] - q_len + j and sees keys 0..that.
 * int8 caches are widened (q · scale) as their chunks are packed, so the products see bf16 or fp32
 * as from any cache; sink + window steps go to the paged kernel whole (``ricllm_attention``).
 */
#define _GNU_SOURCE  /* syscall(), to ask Linux for AMX state */
#include "cpu_common.h"
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define PREFILL_BF16_DOT 1
#else
#define PREFILL_BF16_DOT 0
#endif
#if PREFILL_BF16_DOT && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define PREFILL_AMX 1
#else
#define PREFILL_AMX 0
#endif

#define QB 16                    /* queries per work item: each packed K/V chunk serves QB·G rows */
#define KC 32                    /* keys per chunk: two 16-lane vectors of scores per row */
#define RG 4                     /* rows per register tile */
#define PF_MAX_G 8
#define PF_MAX_D 256             /* Gemma 3's heads; a block's row buffers are sized by the actual head_dim */
#define PF_MAX_ROWS (QB * PF_MAX_G)

typedef struct {
    int batch, heads, kv_heads, head_dim, block_size, table_width, group;
    float scale;
    const int32_t *block_tables, *query_start, *context_lens;
    int cache_type;              /* the activations' code, or CACHE_INT8 (cpu_common.h) */
    const int64_t *chunk_base;   /* first packed chunk of each sequence (per KV head: × kv_heads) */
    int amx;                     /* both products in AMX tiles (bf16, head_dim 32 or 64, tiles granted) */
    int min_query_len;           /* sequences with fewer query rows are left to another kernel */
} PrefillShape;

typedef struct { int seq, first; } QueryBlock;

static int query_len(const PrefillShape *s, int b) { return s->query_start[b + 1] - s->query_start[b]; }

static int taken(const PrefillShape *s, int b) { return query_len(s, b) >= s->min_query_len; }

/* The cache row (slot · kv_heads + head) of key ``pos`` of (b, kvh). */
static int64_t cache_row(const PrefillShape *s, int b, int kvh, int pos) {
    const int32_t *table = s->block_tables + (int64_t)b * s->table_width;
    const int64_t slot = (int64_t)table[pos / s->block_size] * s->block_size + pos % s->block_size;
    return slot * s->kv_heads + kvh;
}

/* A key's K or V row as bf16 bits: in place for a bf16 cache, widened and rounded for int8. */
static const uint16_t *bf16_row(const PrefillShape *s, const void *cache, int64_t row, uint16_t *buffer) {
    const int d = s->head_dim;
    if (s->cache_type != CACHE_INT8) return (const uint16_t *)cache + row * d;
    float values[PF_MAX_D];
    load_int8_row(cache, row, d, values);
    for (int i = 0; i < d; i++) buffer[i] = f32_to_bf16(values[i]);
    return buffer;
}

/* Packed chunk c of (b, kvh): KC·D elements of K, then KC·D of V. */
static int64_t chunk_offset(const PrefillShape *s, int b, int kvh, int c) {
    return ((s->chunk_base[b] + c) * s->kv_heads + kvh) * 2 * (int64_t)KC * s->head_dim;
}

#if PREFILL_BF16_DOT
static inline int use_bf16_dot(const PrefillShape *s, int is_bf16) { return is_bf16 && s->head_dim % 16 == 0; }
#else
static inline int use_bf16_dot(const PrefillShape *s, int is_bf16) { (void)s; (void)is_bf16; return 0; }
#endif

/* Pack keys [k0, k0+KC) of (b, kvh); keys past the context are zero (the causal mask hides them,
 * and zeros keep 0·V finite). bf16 path: K as [D/2][KC] bf16 pairs, V as [KC/2][D] bf16 pairs;
 * fp32 path: K and V as [KC][D] fp32 rows. */
static void pack_chunk(const PrefillShape *s, int b, int kvh, int c, const void *kc, const void *vc,
                       int is_bf16, void *packed) {
    const int d = s->head_dim, k0 = c * KC, ctx = s->context_lens[b];
    if (use_bf16_dot(s, is_bf16)) {
        uint32_t *kp = packed;
        uint16_t *vp = (uint16_t *)packed + (int64_t)KC * d;
        uint16_t kbuf[PF_MAX_D] __attribute__((aligned(4))), vbuf[PF_MAX_D];
        for (int j = 0; j < KC; j++) {
            const int64_t row = k0 + j < ctx ? cache_row(s, b, kvh, k0 + j) : -1;
            const uint32_t *krow = row < 0 ? NULL : (const uint32_t *)bf16_row(s, kc, row, kbuf);
            const uint16_t *vrow = row < 0 ? NULL : bf16_row(s, vc, row, vbuf);
            for (int p = 0; p < d / 2; p++) kp[p * KC + j] = krow ? krow[p] : 0;
            for (int i = 0; i < d; i++) vp[((j / 2) * d + i) * 2 + j % 2] = vrow ? vrow[i] : 0;
        }
        return;
    }
    float *kf = packed, *vf = (float *)packed + (int64_t)KC * d;
    for (int j = 0; j < KC; j++) {
        if (k0 + j >= ctx) {
            memset(kf + (int64_t)j * d, 0, (size_t)d * sizeof(float));
            memset(vf + (int64_t)j * d, 0, (size_t)d * sizeof(float));
            continue;
        }
        const int64_t row = cache_row(s, b, kvh, k0 + j);
        load_cache_row(kc, row, d, s->cache_type, kf + (int64_t)j * d);
        load_cache_row(vc, row, d, s->cache_type, vf + (int64_t)j * d);
    }
}

/* One work item's rows: r = query·G + g. ``last[r]`` is the last key position row r sees. */
typedef struct {
    int rows, keys;              /* keys: what the block's last query sees */
    int last[PF_MAX_ROWS];
    const void *q[PF_MAX_ROWS];  /* each row's query in the activations */
    int64_t out[PF_MAX_ROWS];    /* each row's element index in the output */
} Rows;

static void block_rows(const PrefillShape *s, QueryBlock blk, int kvh, Rows *rows, const void *q, int is_bf16) {
    const int q_len = query_len(s, blk.seq), n_q = q_len - blk.first < QB ? q_len - blk.first : QB;
    const int first_pos = s->context_lens[blk.seq] - q_len + blk.first;
    const size_t elt = is_bf16 ? 2 : 4;
    rows->rows = n_q * s->group;
    rows->keys = first_pos + n_q;
    for (int r = 0; r < rows->rows; r++) {
        const int query = s->query_start[blk.seq] + blk.first + r / s->group;
        rows->out[r] = ((int64_t)query * s->heads + kvh * s->group + r % s->group) * s->head_dim;
        rows->q[r] = (const char *)q + rows->out[r] * elt;
        rows->last[r] = first_pos + r / s->group;
    }
}

/* Online softmax over one chunk for one row: masks keys past ``visible``, turns the scores into
 * unnormalised probabilities against the new running max, and returns the factor that rescales
 * what the row accumulated before. */
static inline float softmax_chunk(float *score, int visible, float *row_max, float *row_sum) {
    float chunk_max = -INFINITY;
    for (int j = 0; j < KC; j++) chunk_max = j < visible && score[j] > chunk_max ? score[j] : chunk_max;
    const float new_max = chunk_max > *row_max ? chunk_max : *row_max;
    const float rescale = exp_approx(*row_max - new_max);
    float add = 0.0f;
    for (int j = 0; j < KC; j++) {
        score[j] = j < visible ? exp_approx(score[j] - new_max) : 0.0f;
        add += score[j];
    }
    *row_sum = *row_sum * rescale + add;
    *row_max = new_max;
    return rescale;
}

#if PREFILL_BF16_DOT
/* S[r][0:KC] = scale · Q[r]·Kᵀ for NR rows: each packed K pair-vector is loaded once for the tile. */
static inline __attribute__((always_inline)) void scores_tile(const uint32_t *const *q, const int nr, int d,
                                                              const uint32_t *kp, float scale, float *score) {
    __m512 acc[RG][2];
    for (int r = 0; r < RG; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int p = 0; p < d / 2; p++) {
        const __m512bh k_lo = (__m512bh)_mm512_loadu_si512(kp + p * KC);
        const __m512bh k_hi = (__m512bh)_mm512_loadu_si512(kp + p * KC + 16);
        for (int r = 0; r < RG; r++) {
            if (r >= nr) break;
            const __m512bh qp = (__m512bh)_mm512_set1_epi32((int)q[r][p]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qp, k_lo);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qp, k_hi);
        }
    }
    const __m512 sv = _mm512_set1_ps(scale);
    for (int r = 0; r < nr; r++) {
        _mm512_storeu_ps(score + r * KC, _mm512_mul_ps(acc[r][0], sv));
        _mm512_storeu_ps(score + r * KC + 16, _mm512_mul_ps(acc[r][1], sv));
    }
}

/* O[r][dims] = O[r][dims]·rescale[r] + P[r]·V for NR rows and NV 16-wide vectors of dims from ``i0``. */
static inline __attribute__((always_inline)) void pv_tile(const uint32_t *p, const int nr, int d, int i0,
                                                          const int nv, const uint32_t *vp, const float *rescale,
                                                          float *o) {
    __m512 acc[RG][4];
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < nv; v++)
            acc[r][v] = _mm512_mul_ps(_mm512_loadu_ps(o + r * d + i0 + 16 * v), _mm512_set1_ps(rescale[r]));
    for (int jp = 0; jp < KC / 2; jp++) {
        __m512bh vv[4];
        for (int v = 0; v < nv; v++) vv[v] = (__m512bh)_mm512_loadu_si512(vp + jp * d + i0 + 16 * v);
        for (int r = 0; r < RG; r++) {
            if (r >= nr) break;
            const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)p[r * (KC / 2) + jp]);
            for (int v = 0; v < nv; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], pp, vv[v]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int v = 0; v < nv; v++) _mm512_storeu_ps(o + r * d + i0 + 16 * v, acc[r][v]);
}

static inline __attribute__((always_inline)) void scores_rows(const uint32_t *const *q, int nr, int d, const uint32_t *kp, float scale, float *score) {
    switch (nr) {
    case 4: scores_tile(q, 4, d, kp, scale, score); break;
    case 3: scores_tile(q, 3, d, kp, scale, score); break;
    case 2: scores_tile(q, 2, d, kp, scale, score); break;
    default: scores_tile(q, 1, d, kp, scale, score);
    }
}

static inline __attribute__((always_inline)) void pv_rows(const uint32_t *p, int nr, int d, const uint32_t *vp, const float *rescale, float *o) {
    for (int i0 = 0; i0 < d; i0 += 64) {
        const int nv = d - i0 >= 64 ? 4 : (d - i0) / 16;
        if (nr == 4 && nv == 4) pv_tile(p, 4, d, i0, 4, vp, rescale, o);
        else if (nv == 4) pv_tile(p, nr, d, i0, 4, vp, rescale, o);
        else pv_tile(p, nr, d, i0, nv, vp, rescale, o);
    }
}

/* exp_approx's polynomial on 16 lanes; 2^n by scalef. */
static inline __m512 exp_approx_512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

static inline __mmask16 first_lanes(int n) { return n >= 16 ? 0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1); }

/* softmax_chunk on vectors; writes the probabilities as bf16 pairs (what P·V's vdpbf16ps reads). */
static inline float softmax_chunk_512(const float *score, int visible, float *row_max, float *row_sum, uint32_t *p) {
    const __mmask16 lo = first_lanes(visible), hi = first_lanes(visible - 16);
    const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
    const __m512 s_lo = _mm512_mask_loadu_ps(minus_inf, lo, score), s_hi = _mm512_mask_loadu_ps(minus_inf, hi, score + 16);
    const float chunk_max = _mm512_reduce_max_ps(_mm512_max_ps(s_lo, s_hi));
    const float new_max = chunk_max > *row_max ? chunk_max : *row_max;
    const float rescale = exp_approx(*row_max - new_max);
    const __m512 m = _mm512_set1_ps(new_max);
    const __m512 e_lo = _mm512_maskz_mov_ps(lo, exp_approx_512(_mm512_sub_ps(s_lo, m)));
    const __m512 e_hi = _mm512_maskz_mov_ps(hi, exp_approx_512(_mm512_sub_ps(s_hi, m)));
    *row_sum = *row_sum * rescale + _mm512_reduce_add_ps(_mm512_add_ps(e_lo, e_hi));
    *row_max = new_max;
    _mm512_storeu_si512(p, (__m512i)_mm512_cvtne2ps_pbh(e_hi, e_lo));
    return rescale;
}

/* One chunk for every row of the block, bf16 products; ``d`` is a literal at the hot call site. */
static inline __attribute__((always_inline)) void attend_chunk_bf16(
        const PrefillShape *s, const Rows *rows, int k0, const void *packed, const int d, float *o,
        float *row_max, float *row_sum) {
    const uint32_t *kp = packed, *vp = (const uint32_t *)((const uint16_t *)packed + (int64_t)KC * d);
    float score[RG * KC], rescale[RG];
    uint32_t p[RG * KC / 2];
    for (int r0 = 0; r0 < rows->rows; r0 += RG) {
        const int nr = rows->rows - r0 < RG ? rows->rows - r0 : RG;
        scores_rows((const uint32_t *const *)(rows->q + r0), nr, d, kp, s->scale, score);
        for (int r = 0; r < nr; r++)
            rescale[r] = softmax_chunk_512(score + r * KC, rows->last[r0 + r] - k0 + 1, row_max + r0 + r,
                                           row_sum + r0 + r, p + r * (KC / 2));
        pv_rows(p, nr, d, vp, rescale, o + (int64_t)r0 * d);
    }
}

static void attend_chunk_bf16_any(const PrefillShape *s, const Rows *rows, int k0, const void *packed, float *o,
                                  float *row_max, float *row_sum) {
    if (s->head_dim == 64) attend_chunk_bf16(s, rows, k0, packed, 64, o, row_max, row_sum);
    else attend_chunk_bf16(s, rows, k0, packed, s->head_dim, o, row_max, row_sum);
}
#endif

#if PREFILL_AMX

/* Eight tiles of 16 rows × 64 bytes (the intrinsics want literal numbers): tmm0/tmm1 = S for keys
 * 0-15/16-31 [16 rows, 16] fp32; tmm2 = A (Q rows × 32 dims, or P rows × 32 keys, bf16);
 * tmm3 = B (16 pairs of K dims, or of V keys); tmm4-7 = this chunk's P·V, 16 dims each. Set per
 * work item: other AMX code (oneDNN's, the quantized products) may have run on this thread. */
static void prefill_tiles_configure(void) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.rows[t] = 16;
        config.bytes_per_row[t] = 64;
    }
    /* gcc's ldtilecfg names only 8 bytes of the config as read: keep all 64 stores */
    __asm__ __volatile__("" : : "r"(&config) : "memory");
    _tile_loadconfig(&config);
}

/* S[16][KC] = Q·Kᵀ (unscaled) for one tile of 16 rows (``qp``: [16][d] bf16, d = 32 or 64). */
static inline void scores_amx(const uint16_t *qp, int d, const uint32_t *kp, float *score) {
    _tile_zero(0);
    _tile_zero(1);
    for (int dims = 0; dims < d; dims += 32) {
        _tile_loadd(2, qp + dims, d * 2);
        _tile_loadd(3, kp + (dims / 2) * KC, KC * 4);
        _tile_dpbf16ps(0, 2, 3);
        _tile_loadd(3, kp + (dims / 2) * KC + 16, KC * 4);
        _tile_dpbf16ps(1, 2, 3);
    }
    _tile_stored(0, score, KC * 4);
    _tile_stored(1, score + 16, KC * 4);
}

/* pv[16][d] = P·V for one tile of 16 rows (``p``: [16][KC] bf16, V packed [KC/2][d][2]). */
static inline void pv_amx(const uint32_t *p, int d, const uint32_t *vp, float *pv) {
    _tile_loadd(2, p, KC * 2);
    _tile_zero(4);
    _tile_loadd(3, vp, d * 4);
    _tile_dpbf16ps(4, 2, 3);
    _tile_stored(4, pv, d * 4);
    _tile_zero(5);
    _tile_loadd(3, vp + 16, d * 4);
    _tile_dpbf16ps(5, 2, 3);
    _tile_stored(5, pv + 16, d * 4);
    if (d == 32) return;
    _tile_zero(6);
    _tile_loadd(3, vp + 32, d * 4);
    _tile_dpbf16ps(6, 2, 3);
    _tile_stored(6, pv + 32, d * 4);
    _tile_zero(7);
    _tile_loadd(3, vp + 48, d * 4);
    _tile_dpbf16ps(7, 2, 3);
    _tile_stored(7, pv + 48, d * 4);
}

/* softmax_chunk_512 for a tile of 16 rows, the running max, sum and rescale factors as vectors
 * (one exp for all 16 rescales): scales the scores, writes P as bf16 pairs and ``rescale``. */
static inline void softmax_tile(float *score, __m512 scale, const Rows *rows, int r0, int k0, float *row_max,
                                float *row_sum, float *rescale, uint32_t *p) {
    const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
    __mmask16 lo[16], hi[16];
    float chunk_max[16];
    for (int r = 0; r < 16; r++) {
        const int visible = rows->last[r0 + r < rows->rows ? r0 + r : r0] - k0 + 1;
        lo[r] = first_lanes(visible), hi[r] = first_lanes(visible - 16);
        const __m512 s_lo = _mm512_mask_mul_ps(minus_inf, lo[r], _mm512_loadu_ps(score + r * KC), scale);
        const __m512 s_hi = _mm512_mask_mul_ps(minus_inf, hi[r], _mm512_loadu_ps(score + r * KC + 16), scale);
        _mm512_storeu_ps(score + r * KC, s_lo);
        _mm512_storeu_ps(score + r * KC + 16, s_hi);
        chunk_max[r] = _mm512_reduce_max_ps(_mm512_max_ps(s_lo, s_hi));
    }
    const __m512 old_max = _mm512_loadu_ps(row_max), new_max = _mm512_max_ps(old_max, _mm512_loadu_ps(chunk_max));
    const __m512 factor = exp_approx_512(_mm512_sub_ps(old_max, new_max));
    _mm512_storeu_ps(rescale, factor);
    _mm512_storeu_ps(row_max, new_max);
    float added[16], maxima[16];
    _mm512_storeu_ps(maxima, new_max);
    for (int r = 0; r < 16; r++) {
        const __m512 m = _mm512_set1_ps(maxima[r]);
        const __m512 e_lo = _mm512_maskz_mov_ps(lo[r], exp_approx_512(_mm512_sub_ps(_mm512_loadu_ps(score + r * KC), m)));
        const __m512 e_hi = _mm512_maskz_mov_ps(hi[r], exp_approx_512(_mm512_sub_ps(_mm512_loadu_ps(score + r * KC + 16), m)));
        added[r] = _mm512_reduce_add_ps(_mm512_add_ps(e_lo, e_hi));
        _mm512_storeu_si512(p + r * (KC / 2), (__m512i)_mm512_cvtne2ps_pbh(e_hi, e_lo));
    }
    _mm512_storeu_ps(row_sum, _mm512_fmadd_ps(_mm512_loadu_ps(row_sum), factor, _mm512_loadu_ps(added)));
}

/* One chunk for every row of the block in tiles of 16 rows (``qp`` zero-padded to whole tiles;
 * a padding row copies its tile's first row's mask, so its softmax stays finite, and is dropped). */
static void attend_chunk_amx(const PrefillShape *s, const Rows *rows, int k0, const void *packed,
                             const uint16_t *qp, float *o, float *row_max, float *row_sum) {
    const int d = s->head_dim;
    const uint32_t *kp = packed, *vp = (const uint32_t *)((const uint16_t *)packed + (int64_t)KC * d);
    float score[16 * KC], pv[16 * 64], rescale[16];
    uint32_t p[16 * KC / 2];
    const __m512 scale = _mm512_set1_ps(s->scale);
    for (int r0 = 0; r0 < rows->rows; r0 += 16) {
        scores_amx(qp + (int64_t)r0 * d, d, kp, score);
        softmax_tile(score, scale, rows, r0, k0, row_max + r0, row_sum + r0, rescale, p);
        pv_amx(p, d, vp, pv);
        for (int r = 0; r < 16 && r0 + r < rows->rows; r++) {
            float *out = o + (int64_t)(r0 + r) * d;
            const __m512 factor = _mm512_set1_ps(rescale[r]);
            for (int i = 0; i < d; i += 16)
                _mm512_storeu_ps(out + i, _mm512_fmadd_ps(_mm512_loadu_ps(out + i), factor,
                                                           _mm512_loadu_ps(pv + r * d + i)));
        }
    }
}

/* The block's query rows as whole tiles: [rows rounded up to 16][d] bf16, the padding zero. */
static void pack_queries(const PrefillShape *s, const Rows *rows, uint16_t *qp) {
    const int d = s->head_dim, padded = (rows->rows + 15) / 16 * 16;
    for (int r = 0; r < padded; r++) {
        if (r < rows->rows) memcpy(qp + (int64_t)r * d, rows->q[r], (size_t)d * 2);
        else memset(qp + (int64_t)r * d, 0, (size_t)d * 2);
    }
}
#endif

/* One chunk for every row of the block, fp32 products (the portable path). */
static void attend_chunk_f32(const PrefillShape *s, const Rows *rows, int k0, const void *packed,
                             const float *qf, float *o, float *row_max, float *row_sum) {
    const int d = s->head_dim;
    const float *kf = packed, *vf = (const float *)packed + (int64_t)KC * d;
    for (int r = 0; r < rows->rows; r++) {
        float score[KC];
        for (int j = 0; j < KC; j++) {
            float dot = 0.0f;
            for (int i = 0; i < d; i++) dot += qf[(int64_t)r * d + i] * kf[(int64_t)j * d + i];
            score[j] = dot * s->scale;
        }
        const int visible = rows->last[r] - k0 + 1;
        const float rescale = softmax_chunk(score, visible, row_max + r, row_sum + r);
        float *out = o + (int64_t)r * d;
        for (int i = 0; i < d; i++) out[i] *= rescale;
        for (int j = 0; j < KC && j < visible; j++)
            for (int i = 0; i < d; i++) out[i] += score[j] * vf[(int64_t)j * d + i];
    }
}

/* A whole work item: every chunk up to the block's last query, then the normalised rows. */
static void attend_block(const PrefillShape *s, QueryBlock blk, int kvh, const void *q, const void *packed_all,
                         void *out, int is_bf16) {
    const int d = s->head_dim;
    const size_t elt = use_bf16_dot(s, is_bf16) ? 2 : 4;
    Rows rows;
    /* QB·G rows, and the AMX path's bf16 queries padded to 16 rows (half as many bytes) fit qf */
    float o[QB * s->group * d], qf[QB * s->group * d], row_max[PF_MAX_ROWS + 16], row_sum[PF_MAX_ROWS + 16];
    block_rows(s, blk, kvh, &rows, q, is_bf16);
#if PREFILL_AMX
    uint16_t *qp = (uint16_t *)qf;  /* the AMX path reads bf16 queries, never fp32 ones */
    if (s->amx) {
        prefill_tiles_configure();
        pack_queries(s, &rows, qp);
        for (int r = rows.rows; r < rows.rows + 16; r++) row_max[r] = -INFINITY, row_sum[r] = 0.0f;
    }
#endif
    for (int r = 0; r < rows.rows; r++) {
        row_max[r] = -INFINITY;
        row_sum[r] = 0.0f;
        if (!use_bf16_dot(s, is_bf16)) load_row(rows.q[r], 0, d, is_bf16, qf + (int64_t)r * d);
    }
    memset(o, 0, (size_t)rows.rows * d * sizeof(float));
    for (int c = 0; c * KC < rows.keys; c++) {
        const char *packed = (const char *)packed_all + chunk_offset(s, blk.seq, kvh, c) * elt;
#if PREFILL_AMX
        if (s->amx) {
            attend_chunk_amx(s, &rows, c * KC, packed, qp, o, row_max, row_sum);
            continue;
        }
#endif
#if PREFILL_BF16_DOT
        if (use_bf16_dot(s, is_bf16)) {
            attend_chunk_bf16_any(s, &rows, c * KC, packed, o, row_max, row_sum);
            continue;
        }
#endif
        attend_chunk_f32(s, &rows, c * KC, packed, qf, o, row_max, row_sum);
    }
#if PREFILL_AMX
    if (s->amx) _tile_release();  /* as the quantized products do: no tile state left for Linux to save */
#endif
    for (int r = 0; r < rows.rows; r++) {
        float *row = o + (int64_t)r * d;
        const float inv = 1.0f / row_sum[r];
        for (int i = 0; i < d; i++) row[i] *= inv;
        store_row(out, rows.out[r], d, is_bf16, row);
    }
}

/* Query blocks, longest context first so the dynamic schedule ends with the short items. */
static QueryBlock *query_blocks(const PrefillShape *s, int *count) {
    int n = 0;
    for (int b = 0; b < s->batch; b++) n += taken(s, b) ? (query_len(s, b) + QB - 1) / QB : 0;
    QueryBlock *blocks = malloc((size_t)(n > 0 ? n : 1) * sizeof(QueryBlock));
    if (!blocks) return NULL;
    int t = 0;
    for (int b = 0; b < s->batch; b++)
        for (int first = (query_len(s, b) - 1) / QB * QB; taken(s, b) && first >= 0; first -= QB)
            blocks[t++] = (QueryBlock){b, first};
    *count = n;
    return blocks;
}

/* Whether bf16 prefill steps (head_dim 32 or 64) attend in AMX tiles here: built with AMX, granted by Linux. */
int ricllm_prefill_attention_uses_amx(void) {
#if PREFILL_AMX
    return ricllm_amx_usable();
#else
    return 0;
#endif
}

/* The sequences of at least ``min_query_len`` queries (the others' rows are left as they are).
 * Returns 0, or a negative code: -1 for a shape the kernel does not take (odd head_dim, more than
 * 8 query heads per KV head, head_dim over 256), -2 when out of memory. */
static int prefill_attention_taking(const void *q, const void *k_cache, const void *v_cache, void *out,
                                    const int32_t *block_tables, const int32_t *query_start,
                                    const int32_t *context_lens, int batch, int heads, int kv_heads,
                                    int head_dim, int block_size, int table_width, float scale,
                                    int is_bf16, int cache_type, int num_threads, int min_query_len) {
    if (heads % kv_heads != 0 || heads / kv_heads > PF_MAX_G || head_dim > PF_MAX_D || head_dim % 2 != 0) return -1;
    if (cache_type != CACHE_INT8 && cache_type != is_bf16) return -1;  /* exact caches hold the activations' type */
    int64_t *chunk_base = malloc((size_t)(batch + 1) * sizeof(int64_t));
    if (!chunk_base) return -2;
    PrefillShape s = {batch, heads, kv_heads, head_dim, block_size, table_width, heads / kv_heads, scale,
                      block_tables, query_start, context_lens, cache_type, chunk_base, 0, min_query_len};
    chunk_base[0] = 0;
    for (int b = 0; b < batch; b++) chunk_base[b + 1] = chunk_base[b] + (taken(&s, b) ? (context_lens[b] + KC - 1) / KC : 0);
#if PREFILL_AMX
    s.amx = use_bf16_dot(&s, is_bf16) && (head_dim == 32 || head_dim == 64) && ricllm_amx_usable();
#endif
    const size_t elt = use_bf16_dot(&s, is_bf16) ? 2 : 4;
    const int64_t chunks = chunk_base[batch];
    void *packed = alloc_lines((size_t)(chunks > 0 ? chunks : 1) * kv_heads * 2 * KC * head_dim * elt);
    int n_blocks = 0;
    QueryBlock *blocks = query_blocks(&s, &n_blocks);
    if (!packed || !blocks) { free(chunk_base); free_lines(packed); free(blocks); return -2; }
    int *chunk_seq = malloc((size_t)(chunks > 0 ? chunks : 1) * sizeof(int));
    if (!chunk_seq) { free(chunk_base); free_lines(packed); free(blocks); return -2; }
    for (int b = 0; b < batch; b++)
        for (int64_t c = chunk_base[b]; c < chunk_base[b + 1]; c++) chunk_seq[c] = b;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t item = 0; item < chunks * kv_heads; item++) {
            const int64_t chunk = item / kv_heads;
            const int b = chunk_seq[chunk], kvh = (int)(item % kv_heads);
            const int c = (int)(chunk - chunk_base[b]);
            pack_chunk(&s, b, kvh, c, k_cache, v_cache, is_bf16,
                       (char *)packed + chunk_offset(&s, b, kvh, c) * elt);
        }
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < n_blocks * kv_heads; item++)
            attend_block(&s, blocks[item / kv_heads], item % kv_heads, q, packed, out, is_bf16);
    }
    free(chunk_seq);
    free(chunk_base);
    free_lines(packed);
    free(blocks);
    return 0;
}

/* Every sequence of the batch (the contract of ricllm_paged_attention, without windows: -1). */
int ricllm_prefill_attention(const void *q, const void *k_cache, const void *v_cache, void *out,
                             const int32_t *block_tables, const int32_t *query_start,
                             const int32_t *context_lens, int batch, int heads, int kv_heads,
                             int head_dim, int block_size, int table_width, float scale,
                             int is_bf16, int cache_type, const int32_t *sinks, const int32_t *windows,
                             int num_threads) {
    (void)sinks;
    if (windows) return -1;
    return prefill_attention_taking(q, k_cache, v_cache, out, block_tables, query_start, context_lens, batch, heads,
                                    kv_heads, head_dim, block_size, table_width, scale, is_bf16, cache_type,
                                    num_threads, 0);
}

int ricllm_paged_attention(const void *q, const void *k_cache, const void *v_cache, void *out,
                           const int32_t *block_tables, const int32_t *query_start,
                           const int32_t *context_lens, int batch, int heads, int kv_heads,
                           int head_dim, int block_size, int table_width, float scale,
                           int is_bf16, int cache_type, const int32_t *sinks, const int32_t *windows,
                           int num_threads);

/* The paged kernel on the sequences of fewer than ``below`` queries (the decodes beside a prompt
 * chunk): their query rows, tables and lengths gathered into a batch of their own, their output
 * rows scattered back. So this kernel never packs a decode's whole context for one query row. */
static int paged_attention_below(const char *q, const void *k_cache, const void *v_cache, char *out,
                                 const int32_t *block_tables, const int32_t *query_start, const int32_t *context_lens,
                                 int batch, int heads, int kv_heads, int head_dim, int block_size, int table_width,
                                 float scale, int is_bf16, int cache_type, int num_threads, int below) {
    const size_t row = (size_t)heads * head_dim * (is_bf16 ? 2 : 4);
    int n = 0, rows = 0;
    for (int b = 0; b < batch; b++)
        if (query_start[b + 1] - query_start[b] < below) n++, rows += query_start[b + 1] - query_start[b];
    if (n == 0) return 0;
    int32_t *starts = malloc((size_t)(n + 1) * 4), *lens = malloc((size_t)n * 4), *tables = malloc((size_t)n * table_width * 4);
    char *q_part = alloc_lines((size_t)rows * row), *out_part = alloc_lines((size_t)rows * row);
    int code = -2;
    if (starts && lens && tables && q_part && out_part) {
        starts[0] = 0;
        for (int b = 0, i = 0; b < batch; b++) {
            const int q_len = query_start[b + 1] - query_start[b];
            if (q_len >= below) continue;
            memcpy(tables + (int64_t)i * table_width, block_tables + (int64_t)b * table_width, (size_t)table_width * 4);
            memcpy(q_part + starts[i] * row, q + query_start[b] * row, q_len * row);
            lens[i] = context_lens[b];
            starts[i + 1] = starts[i] + q_len;
            i++;
        }
        code = ricllm_paged_attention(q_part, k_cache, v_cache, out_part, tables, starts, lens, n, heads, kv_heads,
                                      head_dim, block_size, table_width, scale, is_bf16, cache_type, NULL, NULL,
                                      num_threads);
        for (int b = 0, i = 0; code == 0 && b < batch; b++)
            if (query_start[b + 1] - query_start[b] < below) {
                memcpy(out + query_start[b] * row, out_part + starts[i] * row, (starts[i + 1] - starts[i]) * row);
                i++;
            }
    }
    free(starts);
    free(lens);
    free(tables);
    free_lines(q_part);
    free_lines(out_part);
    return code;
}

/* Which kernel attends a step: this one for the sequences that bring PREFILL_MIN_QUERIES query rows
 * or more where the products run in bf16; the decode-shaped paged kernel for the rest, and for every
 * sequence of fp32 steps (its fp32 dot products beat this kernel's portable path, measured).
 * 65, not 16: up to 64 rows (the small prefills the decoder stack serves in both runtimes) the paged
 * kernel keeps what was computed before this kernel existed, bit for bit: a prompt's logits are then
 * the same whether its prefix came from the cache (a short tail) or not, and the same in both
 * runtimes. At 16 the two kernels' roundings (this one's P·V runs on bf16 probabilities) differed
 * enough to flip SmolLM2's greedy answer to a 37-token chat prompt and to make a cached prompt
 * decode differently from an uncached one (tests/test_smollm2.py, tests/test_structured.py). */
#define PREFILL_MIN_QUERIES 65
int ricllm_attention(const void *q, const void *k_cache, const void *v_cache, void *out,
                     const int32_t *block_tables, const int32_t *query_start, const int32_t *context_lens,
                     int batch, int heads, int kv_heads, int head_dim, int block_size, int table_width,
                     float scale, int is_bf16, int cache_type, const int32_t *sinks, const int32_t *windows,
                     int num_threads) {
    int longest = 0;
    for (int b = 0; b < batch; b++)
        longest = query_start[b + 1] - query_start[b] > longest ? query_start[b + 1] - query_start[b] : longest;
    const PrefillShape s = {.head_dim = head_dim};
    if (longest < PREFILL_MIN_QUERIES || !use_bf16_dot(&s, is_bf16) || windows)
        return ricllm_paged_attention(q, k_cache, v_cache, out, block_tables, query_start, context_lens, batch, heads,
                                      kv_heads, head_dim, block_size, table_width, scale, is_bf16, cache_type, sinks,
                                      windows, num_threads);
    const int code = prefill_attention_taking(q, k_cache, v_cache, out, block_tables, query_start, context_lens,
                                              batch, heads, kv_heads, head_dim, block_size, table_width, scale,
                                              is_bf16, cache_type, num_threads, PREFILL_MIN_QUERIES);
    if (code != 0) return code;
    return paged_attention_below(q, k_cache, v_cache, out, block_tables, query_start, context_lens, batch, heads,
                                 kv_heads, head_dim, block_size, table_width, scale, is_bf16, cache_type, num_threads,
                                 PREFILL_MIN_QUERIES);
}
