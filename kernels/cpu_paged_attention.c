/* Paged attention for the CPU, shaped for decode and short chunks: every query of a flat batch
 * against its sequence's K/V, read in place through the block table.
 *
 * Why a kernel: the torch path first gathers each sequence's K/V into a contiguous copy, then
 * runs SDPA (which repeats K/V per query head under GQA); on a CPU that copy costs more than the
 * attention itself. Here one work item is (sequence, KV head, tile of up to QT queries, range of
 * keys): it reads each K/V row once for all QT·G query rows of the tile (G = query heads per KV
 * head), with an online softmax in fp32 (running max and sum), so a step reads the context's K/V
 * once. Steps with a chunk of 65+ queries go to cpu_prefill_attention.c instead.
 *
 * Decode does little arithmetic per K/V byte, so the vector path (AVX-512 or AVX2, W fp32 lanes)
 * is built to spend few instructions per key and to keep no fp32 copy of K/V (the previous
 * version converted each row into ~96 KB of stack buffers and summed every dot product
 * horizontally; 32 decodes of 320 keys ran at a third of the memory bandwidth):
 *  - a bf16 value is the top half of an fp32 one, so 2W bf16 (one vector load) become two fp32
 *    vectors by a shift and a mask, the even elements and the odd ones, right where they are
 *    used. Rows are held in that "pair order" throughout (Q, K, V, the accumulators; fp32 rows in
 *    their own order), which changes no dot product, and put back in order only when the output
 *    row is written;
 *  - the rows of one query that share a KV head (G under GQA, in blocks of at most RB_MAX, so
 *    their partial sums fit the registers) take each K and V row from one load: scores as W-lane
 *    partial sums per key, folded as they come into one vector of W keys' scores by a
 *    transposing add tree (not a horizontal sum per dot product), the online softmax on those
 *    vectors, and P·V as fp32 FMAs. The probabilities stay fp32: bf16 probabilities flip greedy
 *    answers (see cpu_prefill_attention.c), and vdpbf16ps for Q·K measured slower than
 *    convert-and-FMA on Sapphire Rapids (two cycles an instruction);
 *  - block-table lookups walk the blocks (no division per key), nothing is zeroed per chunk (a
 *    chunk's tail points at a zero row and is masked), and the work item's state is its rows.
 * K/V rows are prefetched in software two chunks ahead (``prefetch_keys``).
 * Other CPUs, and head dims that are no multiple of 2W, take the portable path: the same
 * algorithm in plain C through fp32 row buffers, which the compiler vectorizes.
 *
 * int8 caches (cache_type CACHE_INT8: a row is D int8 values and its fp32 scale, cpu_common.h) are
 * widened to fp32 in registers the same way and scaled there. Sink + window retention (``sinks``,
 * ``windows``: per sequence, NULL when no sequence of the step has one; ricllm/kv_window.py):
 * query p sees key j iff j < sinks or j > p - window, so a work item walks two segments of keys,
 * the sinks and the window, and never touches the blocks in between (their table entries are -1).
 *
 * Layouts (row-major):
 *   q, out        [T, H, D]                  activations (bf16 or fp32)
 *   k/v cache     [num_blocks, BS, KVH, D]   the activations' type, or int8 rows of D + 4 bytes
 *   block_tables  [B, table_width] int32
 *   query_start   [B + 1] int32               sequence b owns queries query_start[b]..[b+1]
 *   context_lens  [B] int32                   query j of b sits at context_len - q_len + j
 *                                             and sees keys 0..that position.
 * Element types: bf16 (uint16 bit patterns) or fp32 activations (is_bf16), and the cache's
 * (cache_type: the activations' code, or CACHE_INT8), chosen by the entry point.
 */
#include "cpu_common.h"

#define QT 8          /* queries per work item: K/V rows are reused across them */
#define MAX_G 8       /* query heads per KV head (GQA ratios 1 to 8) */
#define MAX_D 256     /* head_dim (Gemma 3's heads are 256 wide); a work item's row buffers are sized by
                       * the actual head_dim, so narrower heads keep small stack frames */
#define MAX_ROWS (QT * MAX_G)

typedef struct {
    int batch, heads, kv_heads, head_dim, block_size, table_width;
    float scale;
    const int32_t *block_tables, *query_start, *context_lens;
    int cache_type;
    int64_t row_bytes;                /* one (token, KV head) row of the cache */
    const int32_t *sinks, *windows;   /* per sequence, or NULL: every key is kept */
} Shape;

/* The keys a tile's queries may see within [key_begin, key_end), as at most two segments of
 * positions: the sinks, and the window of its first query (the windows of later queries start
 * later: masked per row, ``visible_from``). Without a window, one segment: the whole range. */
typedef struct { int begin[2], end[2], windowed[2], count, window; } Segments;

static Segments segments(const Shape *s, int seq, int first_pos, int key_begin, int key_end) {
    const int window = s->windows ? s->windows[seq] : 0;
    if (window <= 0) return (Segments){{key_begin, 0}, {key_end, 0}, {0, 0}, key_begin < key_end, 0};
    const int sinks = s->sinks[seq], low = first_pos - window + 1;
    Segments g = {{0, 0}, {0, 0}, {0, 0}, 0, window};
    const int sink_end = key_end < sinks ? key_end : sinks;
    if (key_begin < sink_end) g.begin[g.count] = key_begin, g.end[g.count++] = sink_end;
    int from = key_begin > sinks ? key_begin : sinks;
    from = from > low ? from : low;
    if (from < key_end) g.begin[g.count] = from, g.end[g.count] = key_end, g.windowed[g.count++] = 1;
    return g;
}

/* The first lane of a chunk (keys from k0, in segment ``seg``) that the query at position p sees. */
static inline int visible_from(const Segments *g, int seg, int p, int k0) {
    if (!g->windowed[seg]) return 0;
    const int lo = p - g->window + 1 - k0;
    return lo > 0 ? lo : 0;
}

typedef struct { int seq, first; } Tile;

/* Partial softmax state of one row over a range of keys: running max, sum and unnormalised output. */
typedef struct { float max, sum; } RowState;

/* What a work item needs to know of its tile. */
typedef struct {
    int rows, g_per_kv, q_begin, first_pos;
    const int32_t *table;
} TileInfo;

static TileInfo tile_info(const Shape *s, Tile tile) {
    const int q_begin = s->query_start[tile.seq], q_len = s->query_start[tile.seq + 1] - q_begin;
    const int n_q = q_len - tile.first < QT ? q_len - tile.first : QT, g = s->heads / s->kv_heads;
    return (TileInfo){n_q * g, g, q_begin + tile.first, s->context_lens[tile.seq] - q_len + tile.first,
                      s->block_tables + (int64_t)tile.seq * s->table_width};
}

static inline int64_t q_index(const Shape *s, TileInfo ti, int kvh, int r) {  /* row r of a tile: q/out element */
    return ((int64_t)(ti.q_begin + r / ti.g_per_kv) * s->heads + kvh * ti.g_per_kv + r % ti.g_per_kv) * s->head_dim;
}

/* Walks a sequence's keys through its block table: the (token, KV head) row of each key, in the
 * units K/V rows are indexed by, without a division per key. */
typedef struct { const int32_t *table; int block, offset, block_size, kv_heads, kvh; } KeyWalk;

static inline KeyWalk key_walk(const Shape *s, const int32_t *table, int kvh, int pos) {
    return (KeyWalk){table, pos / s->block_size, pos % s->block_size, s->block_size, s->kv_heads, kvh};
}

static inline int64_t key_walk_next(KeyWalk *w) {  /* the current key's row, then step to the next key */
    const int64_t row = ((int64_t)w->table[w->block] * w->block_size + w->offset) * w->kv_heads + w->kvh;
    if (++w->offset == w->block_size) w->offset = 0, w->block++;
    return row;
}

/* ---------------------------------------------------------------------------------------------
 * Vector path: W fp32 lanes, rows in pair order (see the header).
 */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define W 16
#define RB_MAX 4      /* rows whose products share each K/V load: registers for their partial sums */
typedef __m512 vf;
typedef __m512i vi;
#define vzero _mm512_setzero_ps
#define vset1 _mm512_set1_ps
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vadd _mm512_add_ps
#define vmul _mm512_mul_ps
#define vmax _mm512_max_ps
#define vfma _mm512_fmadd_ps                 /* a·b + c */
#define vfnma _mm512_fnmadd_ps               /* c - a·b */
#define vunpacklo _mm512_unpacklo_ps
#define vunpackhi _mm512_unpackhi_ps
#define vshuffle _mm512_shuffle_ps
#define vround(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vreduce_max _mm512_reduce_max_ps
#define vreduce_add _mm512_reduce_add_ps
#define iload(p) _mm512_loadu_si512((const void *)(p))
#define istore(p, x) _mm512_storeu_si512((void *)(p), x)
#define iset1 _mm512_set1_epi32
#define iadd _mm512_add_epi32
#define iand _mm512_and_si512
#define ior _mm512_or_si512
#define ishl _mm512_slli_epi32
#define ishr _mm512_srli_epi32
#define as_f _mm512_castsi512_ps
#define as_i _mm512_castps_si512
#define f_to_i _mm512_cvtps_epi32
#define i_to_f _mm512_cvtepi32_ps
#define israi _mm512_srai_epi32
/* 2W int8 values as int16, lane k of the 32-bit view holding elements 2k (low) and 2k + 1 (high) */
#define widen_int8(p) _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(p)))
/* W int8 values as int32, in order */
#define widen_int8_run(p) _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p)))

/* x in lanes below n, fill above */
static inline vf vfirst(vf x, int n, vf fill) {
    return _mm512_mask_blend_ps(n >= W ? 0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1), fill, x);
}

/* The last levels of the transposing add tree (see block_scores): u[n] holds, per 128-bit lane,
 * keys 4n..4n+3 summed within that lane; the result, lane j: key j summed over the lanes. */
static inline vf fold_quads(const vf u[W / 4]) {
    const vf w0 = vadd(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    const vf w1 = vadd(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    return vadd(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define W 8
#define RB_MAX 3
typedef __m256 vf;
typedef __m256i vi;
#define vzero _mm256_setzero_ps
#define vset1 _mm256_set1_ps
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vadd _mm256_add_ps
#define vmul _mm256_mul_ps
#define vmax _mm256_max_ps
#define vfma _mm256_fmadd_ps
#define vfnma _mm256_fnmadd_ps
#define vunpacklo _mm256_unpacklo_ps
#define vunpackhi _mm256_unpackhi_ps
#define vshuffle _mm256_shuffle_ps
#define vround(x) _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define iload(p) _mm256_loadu_si256((const __m256i *)(p))
#define istore(p, x) _mm256_storeu_si256((__m256i *)(p), x)
#define iset1 _mm256_set1_epi32
#define iadd _mm256_add_epi32
#define iand _mm256_and_si256
#define ior _mm256_or_si256
#define ishl _mm256_slli_epi32
#define ishr _mm256_srli_epi32
#define as_f _mm256_castsi256_ps
#define as_i _mm256_castps_si256
#define f_to_i _mm256_cvtps_epi32
#define i_to_f _mm256_cvtepi32_ps
#define israi _mm256_srai_epi32
#define widen_int8(p) _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p)))
#define widen_int8_run(p) _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p)))

static inline vf vfirst(vf x, int n, vf fill) {
    const vi lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_blendv_ps(fill, x, as_f(_mm256_cmpgt_epi32(iset1(n), lane)));
}

static inline float vreduce_max(vf x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline float vreduce_add(vf x) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}

static inline vf fold_quads(const vf u[W / 4]) {
    return vadd(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31));
}
#else
#define W 0           /* no vector path: every shape takes the portable one */
#endif

#if W
#define KT (2 * W)    /* keys per softmax chunk: two vectors of scores per row */

static const float zero_row[MAX_D] __attribute__((aligned(64)));  /* stands in past a chunk's last key */

/* exp_approx (cpu_common.h) on W lanes. */
static inline vf vexp(vf x) {
    x = vmax(x, vset1(-87.0f));
    const vf n = vround(vmul(x, vset1(1.44269504088896341f)));
    vf r = vfnma(n, vset1(0.693359375f), x);
    r = vfma(n, vset1(2.12194440e-4f), r);
    vf p = vset1(1.9875691500e-4f);
    p = vfma(p, r, vset1(1.3981999507e-3f));
    p = vfma(p, r, vset1(8.3334519073e-3f));
    p = vfma(p, r, vset1(4.1665795894e-2f));
    p = vfma(p, r, vset1(1.6666665459e-1f));
    p = vfma(p, r, vset1(5.0000001201e-1f));
    p = vfma(vmul(p, r), r, vadd(r, vset1(1.0f)));
    return vmul(p, as_f(ishl(iadd(f_to_i(n), iset1(127)), 23)));
}

/* Elements [2W·c, 2W·c + 2W) of a row as two fp32 vectors in pair order. Every K/V row is read
 * through here: another cache element type (int8 with a scale per (token, head) row) is one more
 * case, which must give the activations' order. */
static inline __attribute__((always_inline)) void read_pair(const void *row, int c, int is_bf16, vf *lo, vf *hi) {
    if (is_bf16) {  /* lane k holds elements 2k (low half) and 2k + 1 (high half) */
        const vi x = iload((const uint16_t *)row + 2 * W * c);
        *lo = as_f(ishl(x, 16));
        *hi = as_f(iand(x, iset1((int)0xFFFF0000u)));
    } else {
        *lo = vload((const float *)row + 2 * W * c);
        *hi = vload((const float *)row + 2 * W * c + W);
    }
}

/* An int8 cache read beside fp32 activations: rows in their own order (halves), not pair order. */
#define INT8_IN_ORDER (CACHE_INT8 + 1)

/* read_pair for a K or V row of the cache, in the activations' order: int8 rows widen in registers
 * (beside bf16 activations by a sign-extending shift pair, as bf16 pairs are split; beside fp32
 * ones in order, INT8_IN_ORDER) and are scaled by their row's scale. */
static inline __attribute__((always_inline)) void read_kv_pair(const void *row, int c, int kv_type, const int d,
                                                               vf *lo, vf *hi) {
    if (kv_type != CACHE_INT8 && kv_type != INT8_IN_ORDER) {
        read_pair(row, c, kv_type, lo, hi);
        return;
    }
    float scale;
    memcpy(&scale, (const int8_t *)row + d, sizeof scale);
    const int8_t *at = (const int8_t *)row + 2 * W * c;
    if (kv_type == INT8_IN_ORDER) {
        *lo = vmul(i_to_f(widen_int8_run(at)), vset1(scale));
        *hi = vmul(i_to_f(widen_int8_run(at + W)), vset1(scale));
        return;
    }
    const vi x = widen_int8(at);
    *lo = vmul(i_to_f(israi(ishl(x, 16), 16)), vset1(scale));
    *hi = vmul(i_to_f(israi(x, 16)), vset1(scale));
}

/* read_pair's inverse, rounding to bf16 to nearest even (as f32_to_bf16). */
static inline void write_pair(void *row, int c, int is_bf16, vf lo, vf hi) {
    if (is_bf16) {
        const vi one = iset1(1), half = iset1(0x7FFF);
        const vi l = iadd(as_i(lo), iadd(half, iand(ishr(as_i(lo), 16), one)));
        const vi h = iadd(as_i(hi), iadd(half, iand(ishr(as_i(hi), 16), one)));
        istore((uint16_t *)row + 2 * W * c, ior(ishr(l, 16), iand(h, iset1((int)0xFFFF0000u))));
    } else {
        vstore((float *)row + 2 * W * c, lo);
        vstore((float *)row + 2 * W * c + W, hi);
    }
}

/* The W-lane partial dot products of rb query rows (qf: fp32, pair order, scaled) with one key. */
static inline __attribute__((always_inline)) void key_dots(const float *qf, const void *krow, int kv_type,
                                                           const int d, const int rb, vf dot[RB_MAX]) {
    for (int r = 0; r < rb; r++) dot[r] = vzero();
    for (int c = 0; c < d / (2 * W); c++) {
        vf lo, hi;
        read_kv_pair(krow, c, kv_type, d, &lo, &hi);
        for (int r = 0; r < rb; r++) {
            const float *qr = qf + r * d + 2 * W * c;
            dot[r] = vfma(vload(qr + W), hi, vfma(vload(qr), lo, dot[r]));
        }
    }
}

/* The scores of rb rows against ``halves`` vectors of W keys: per key a W-lane partial dot
 * product, folded as they come by a transposing add tree (a horizontal sum per dot product
 * would cost as much as the product), so a K row is read once for the rb rows and few partial
 * sums are live at a time. */
static inline __attribute__((always_inline)) void block_scores(const float *qf, const void *const *krow, int halves,
                                                               int kv_type, const int d, const int rb,
                                                               vf score[RB_MAX][KT / W]) {
    for (int h = 0; h < halves; h++) {
        vf u[RB_MAX][W / 4];
        for (int n = 0; n < W / 4; n++) {
            vf t[RB_MAX][2];
            for (int m = 0; m < 2; m++) {
                vf a[RB_MAX], b[RB_MAX];
                const int j = h * W + 4 * n + 2 * m;
                key_dots(qf, krow[j], kv_type, d, rb, a);
                key_dots(qf, krow[j + 1], kv_type, d, rb, b);
                /* per 128-bit lane: keys a, b interleaved, lanes 0+2 and 1+3 summed */
                for (int r = 0; r < rb; r++) t[r][m] = vadd(vunpacklo(a[r], b[r]), vunpackhi(a[r], b[r]));
            }
            for (int r = 0; r < rb; r++)  /* per 128-bit lane: keys 4n..4n+3, summed within the lane */
                u[r][n] = vadd(vshuffle(t[r][0], t[r][1], 0x44), vshuffle(t[r][0], t[r][1], 0xEE));
        }
        for (int r = 0; r < rb; r++) score[r][h] = fold_quads(u[r]);
    }
}

/* The online softmax over one chunk's scores of a row (lanes outside [from, visible) masked):
 * returns the factor the row's output so far is rescaled by, leaves the probabilities in prob. */
static inline __attribute__((always_inline)) float softmax_chunk(vf score[KT / W], int from, int visible,
                                                                 float *row_max, float *row_sum, float *prob) {
    vf m = vset1(-INFINITY);
    for (int h = 0; h < KT / W; h++) {
        score[h] = vfirst(score[h], visible - h * W, vset1(-INFINITY));
        if (from > h * W) score[h] = vfirst(vset1(-INFINITY), from - h * W, score[h]);  /* below a window */
        m = vmax(m, score[h]);
    }
    const float chunk_max = vreduce_max(m);
    const float new_max = chunk_max > *row_max ? chunk_max : *row_max;
    /* exp_approx(0) is exactly 1: no exp on the (serial) path where the max stands, the usual case */
    const float rescale = new_max > *row_max ? exp_approx(*row_max - new_max) : 1.0f;
    vf sum = vzero();
    for (int h = 0; h < KT / W; h++) {
        vf e = vfirst(vexp(vadd(score[h], vset1(-new_max))), visible - h * W, vzero());
        if (from > h * W) e = vfirst(vzero(), from - h * W, e);
        sum = vadd(sum, e);
        vstore(prob + h * W, e);
    }
    *row_sum = *row_sum * rescale + vreduce_add(sum);
    *row_max = new_max;
    return rescale;
}

/* One chunk for rb rows of one query (they see the same keys): scores, softmax, and
 * O = O·rescale + P·V with the probabilities in fp32, each V row read once for the rb rows. */
static inline __attribute__((always_inline)) void attend_chunk(
        const float *qf, const void *const *krow, const void *const *vrow, int from, int visible, int kv_type,
        const int d, const int rb, float *acc, float *row_max, float *row_sum) {
    vf score[RB_MAX][KT / W];
    float prob[RB_MAX][KT] __attribute__((aligned(64))), rescale[RB_MAX];
    const int halves = visible > W ? 2 : 1;
    block_scores(qf, krow, halves, kv_type, d, rb, score);
    for (int r = 0; r < rb; r++) {
        if (halves == 1) score[r][1] = vset1(-INFINITY);
        rescale[r] = softmax_chunk(score[r], from, visible, &row_max[r], &row_sum[r], prob[r]);
    }
    for (int c = 0; c < d / (2 * W); c++) {
        vf lo[RB_MAX], hi[RB_MAX];
        for (int r = 0; r < rb; r++) {
            lo[r] = vmul(vload(acc + r * d + 2 * W * c), vset1(rescale[r]));
            hi[r] = vmul(vload(acc + r * d + 2 * W * c + W), vset1(rescale[r]));
        }
        for (int j = from; j < visible; j++) {
            vf v_lo, v_hi;
            read_kv_pair(vrow[j], c, kv_type, d, &v_lo, &v_hi);
            for (int r = 0; r < rb; r++) {
                const vf p = vset1(prob[r][j]);
                lo[r] = vfma(p, v_lo, lo[r]);
                hi[r] = vfma(p, v_hi, hi[r]);
            }
        }
        for (int r = 0; r < rb; r++) {
            vstore(acc + r * d + 2 * W * c, lo[r]);
            vstore(acc + r * d + 2 * W * c + W, hi[r]);
        }
    }
}

/* rb and d literal: every loop over a block's rows and a row's vectors unrolls, and the partial
 * sums stay in registers. */
#define ATTEND_CHUNK_RB(D)                                                                                \
    switch (rb) {                                                                                         \
    case 1: attend_chunk(qf, krow, vrow, from, visible, kv_type, D, 1, acc, row_max, row_sum); return;    \
    case 2: attend_chunk(qf, krow, vrow, from, visible, kv_type, D, 2, acc, row_max, row_sum); return;    \
    case 3: attend_chunk(qf, krow, vrow, from, visible, kv_type, D, 3, acc, row_max, row_sum); return;    \
    default: attend_chunk(qf, krow, vrow, from, visible, kv_type, D, RB_MAX, acc, row_max, row_sum); return; \
    }
static void attend_chunk_any(const float *qf, const void *const *krow, const void *const *vrow, int from,
                             int visible, int kv_type, int d, int rb, float *acc, float *row_max, float *row_sum) {
    if (d == 64) ATTEND_CHUNK_RB(64)
    if (d == 128) ATTEND_CHUNK_RB(128)
    if (d == 256) ATTEND_CHUNK_RB(256)
    ATTEND_CHUNK_RB(d)
}

/* K/V rows are fetched this many keys ahead of the chunk being attended: a sequence's blocks lie
 * anywhere in the pool, and the hardware prefetchers stop at each block's (and page's) end. They
 * are fetched into L2, not L1: a chunk's 16 keys are 64 lines of K and V, more misses than L1 keeps
 * in flight, and prefetches into L1 held up the loads behind them. On an AMD EPYC Zen 4, SmolLM2's
 * attention for 32 decodes against 320 keys (30 layers, 2 threads) took 23 ms instead of 34 (avx2
 * family; avx512: 20-24 instead of 37), and one decode against 320 keys 0.65 ms instead of 0.70. */
#define KEYS_AHEAD (4 * KT)
#define KV_PREFETCH _MM_HINT_T1

/* Prefetches the K and V rows of up to ``count`` keys from ``pos`` (stopping at ``end``), advancing
 * ``ahead``; returns the next position to prefetch. */
static inline int prefetch_keys(const Shape *s, KeyWalk *ahead, int pos, int end, int count, const void *kc,
                                const void *vc) {
    for (const int stop = pos + count < end ? pos + count : end; pos < stop; pos++) {
        const int64_t index = key_walk_next(ahead) * s->row_bytes;
        for (int64_t line = 0; line < s->row_bytes; line += 64) {
            _mm_prefetch((const char *)kc + index + line, KV_PREFETCH);
            _mm_prefetch((const char *)vc + index + line, KV_PREFETCH);
        }
    }
    return pos;
}

/* Keys [key_begin, key_end) of one (tile, KV head). Leaves each row's unnormalised output in
 * acc[r] (pair order) and its (max, sum) in state[r]. The G rows of a query are attended in
 * blocks of at most RB_MAX. */
static void attend_vec(const Shape *s, Tile tile, int kvh, int key_begin, int key_end, const void *q,
                       const void *kc, const void *vc, int is_bf16, float *acc, RowState *state) {
    const TileInfo ti = tile_info(s, tile);
    const int d = s->head_dim, g = ti.g_per_kv, elem = is_bf16 ? 2 : 4;
    const int kv_type = s->cache_type == CACHE_INT8 && !is_bf16 ? INT8_IN_ORDER : s->cache_type;
    const int blocks = (g + RB_MAX - 1) / RB_MAX;
    const Segments seg = segments(s, tile.seq, ti.first_pos, key_begin, key_end);
    float qf[ti.rows * d] __attribute__((aligned(64)));
    float row_max[MAX_ROWS], row_sum[MAX_ROWS];
    const void *krow[KT], *vrow[KT];

    for (int r = 0; r < ti.rows; r++) {
        const void *row = (const char *)q + q_index(s, ti, kvh, r) * elem;
        for (int c = 0; c < d / (2 * W); c++) {
            vf lo, hi;
            read_pair(row, c, is_bf16, &lo, &hi);
            vstore(qf + r * d + 2 * W * c, vmul(lo, vset1(s->scale)));
            vstore(qf + r * d + 2 * W * c + W, vmul(hi, vset1(s->scale)));
        }
        for (int i = 0; i < d; i += W) vstore(acc + r * d + i, vzero());
        row_max[r] = -INFINITY;
        row_sum[r] = 0.0f;
    }
    for (int sg = 0; sg < seg.count; sg++) {
        KeyWalk walk = key_walk(s, ti.table, kvh, seg.begin[sg]), ahead = walk;
        int ahead_pos = prefetch_keys(s, &ahead, seg.begin[sg], seg.end[sg], KEYS_AHEAD - KT, kc, vc);
        for (int k0 = seg.begin[sg]; k0 < seg.end[sg]; k0 += KT) {
            const int kn = seg.end[sg] - k0 < KT ? seg.end[sg] - k0 : KT;
            for (int j = 0; j < KT; j++) {  /* past the last key: a zero row, scored and then masked */
                const int64_t index = j < kn ? key_walk_next(&walk) * s->row_bytes : -1;
                krow[j] = index < 0 ? (const void *)zero_row : (const char *)kc + index;
                vrow[j] = index < 0 ? (const void *)zero_row : (const char *)vc + index;
            }
            ahead_pos = prefetch_keys(s, &ahead, ahead_pos, seg.end[sg], KT, kc, vc);
            for (int query = 0; query < ti.rows / g; query++) {
                const int p = ti.first_pos + query, visible = p - k0 + 1 < kn ? p - k0 + 1 : kn;  /* causal */
                const int from = visible_from(&seg, sg, p, k0);
                if (visible <= from) continue;
                for (int b = 0, r = query * g; b < blocks; b++) {  /* even blocks: 8 rows -> 4 + 4 or 3 + 3 + 2 */
                    const int rb = (query * g + g - r + blocks - b - 1) / (blocks - b);
                    attend_chunk_any(qf + r * d, krow, vrow, from, visible, kv_type, d, rb, acc + r * d, row_max + r,
                                     row_sum + r);
                    r += rb;
                }
            }
        }
    }
    for (int r = 0; r < ti.rows; r++) state[r] = (RowState){row_max[r], row_sum[r]};
}
#endif

/* ---------------------------------------------------------------------------------------------
 * Portable path: rows in their own order, one key row at a time through fp32 buffers.
 */
#define PKT 32        /* keys per softmax chunk */

static inline __attribute__((always_inline)) void attend_portable(
        const Shape *s, Tile tile, int kvh, int key_begin, int key_end, const void *q,
        const void *kc, const void *vc, int is_bf16, const int d, float *acc, RowState *state) {
    const TileInfo ti = tile_info(s, tile);
    const Segments seg = segments(s, tile.seq, ti.first_pos, key_begin, key_end);
    float qf[ti.rows * d], key[PKT][d], val[PKT][d];
    float score[MAX_ROWS][PKT], row_max[MAX_ROWS], row_sum[MAX_ROWS];

    for (int r = 0; r < ti.rows; r++) {
        const int64_t index = q_index(s, ti, kvh, r);
        load_row(q, index, d, is_bf16, qf + r * d);
        for (int i = 0; i < d; i++) qf[r * d + i] *= s->scale;
        for (int i = 0; i < d; i++) acc[r * d + i] = 0.0f;
        row_max[r] = -INFINITY;
        row_sum[r] = 0.0f;
    }
    for (int sg = 0; sg < seg.count; sg++) {
        KeyWalk walk = key_walk(s, ti.table, kvh, seg.begin[sg]);
        for (int k0 = seg.begin[sg]; k0 < seg.end[sg]; k0 += PKT) {
            const int kn = seg.end[sg] - k0 < PKT ? seg.end[sg] - k0 : PKT;
            for (int j = 0; j < kn; j++) {
                const int64_t row = key_walk_next(&walk);
                load_cache_row(kc, row, d, s->cache_type, key[j]);
                load_cache_row(vc, row, d, s->cache_type, val[j]);
            }
            for (int r = 0; r < ti.rows; r++) {
                const int last = ti.first_pos + r / ti.g_per_kv;
                const int visible = last - k0 + 1 < kn ? last - k0 + 1 : kn, from = visible_from(&seg, sg, last, k0);
                if (visible <= from) continue;
                float chunk_max = -INFINITY;
                for (int j = from; j < visible; j++) {
                    float dot = 0.0f;
                    for (int i = 0; i < d; i++) dot += qf[r * d + i] * key[j][i];
                    score[r][j] = dot;
                    chunk_max = dot > chunk_max ? dot : chunk_max;
                }
                const float new_max = chunk_max > row_max[r] ? chunk_max : row_max[r];
                const float rescale = exp_approx(row_max[r] - new_max);
                float add = 0.0f;
                for (int j = from; j < visible; j++) add += score[r][j] = exp_approx(score[r][j] - new_max);
                row_sum[r] = row_sum[r] * rescale + add;
                row_max[r] = new_max;
                float *ar = acc + r * d;
                for (int i = 0; i < d; i++) ar[i] *= rescale;
                for (int j = from; j < visible; j++)
                    for (int i = 0; i < d; i++) ar[i] += score[r][j] * val[j][i];
            }
        }
    }
    for (int r = 0; r < ti.rows; r++) state[r] = (RowState){row_max[r], row_sum[r]};
}

/* Whether head_dim takes the vector path (whose rows are then in pair order). */
static inline int vector_path(int head_dim) {
#if W
    return head_dim % (2 * W) == 0;
#else
    (void)head_dim;
    return 0;
#endif
}

static void attend_range(const Shape *s, Tile tile, int kvh, int key_begin, int key_end, const void *q,
                         const void *kc, const void *vc, int is_bf16, float *acc, RowState *state) {
#if W
    if (vector_path(s->head_dim)) {
        attend_vec(s, tile, kvh, key_begin, key_end, q, kc, vc, is_bf16, acc, state);
        return;
    }
#endif
    switch (s->head_dim) {
    case 64: attend_portable(s, tile, kvh, key_begin, key_end, q, kc, vc, is_bf16, 64, acc, state); break;
    case 128: attend_portable(s, tile, kvh, key_begin, key_end, q, kc, vc, is_bf16, 128, acc, state); break;
    default: attend_portable(s, tile, kvh, key_begin, key_end, q, kc, vc, is_bf16, s->head_dim, acc, state);
    }
}

static int tile_rows(const Shape *s, Tile tile) { return tile_info(s, tile).rows; }

static int tile_keys(const Shape *s, Tile tile) {  /* keys seen by the tile's last query */
    const TileInfo ti = tile_info(s, tile);
    return ti.first_pos + ti.rows / ti.g_per_kv;
}

/* Merge the partial states of the splits of one (tile, KV head) and write the output rows. */
static void merge_and_store(const Shape *s, Tile tile, int kvh, int splits, int64_t split_stride,
                            const float *acc, const RowState *state, void *out, int is_bf16) {
    const int d = s->head_dim;
    const TileInfo ti = tile_info(s, tile);
    for (int r = 0; r < ti.rows; r++) {
        float m = -INFINITY, total = 0.0f, row[d] __attribute__((aligned(64)));
        for (int p = 0; p < splits; p++) m = state[p * split_stride + r].max > m ? state[p * split_stride + r].max : m;
        for (int i = 0; i < d; i++) row[i] = 0.0f;
        for (int p = 0; p < splits; p++) {
            RowState st = state[p * split_stride + r];
            if (st.sum == 0.0f) continue;  /* a split this row sees no key of */
            float w = exp_approx(st.max - m);
            total += st.sum * w;
            const float *a = acc + (p * split_stride + r) * d;
            for (int i = 0; i < d; i++) row[i] += w * a[i];
        }
        for (int i = 0; i < d; i++) row[i] /= total;
        const int64_t index = q_index(s, ti, kvh, r);
#if W
        if (vector_path(d)) {
            void *dst = (char *)out + index * (is_bf16 ? 2 : 4);
            for (int c = 0; c < d / (2 * W); c++) write_pair(dst, c, is_bf16, vload(row + 2 * W * c), vload(row + 2 * W * c + W));
            continue;
        }
#endif
        store_row(out, index, d, is_bf16, row);
    }
}

/* Returns 0, or a negative code for a shape the kernel does not take (the caller falls back).
 * Work: (tile, KV head, split of the keys). Few sequences with long contexts do not fill the
 * threads on their own, so the keys are split (each split at least MIN_SPLIT_KEYS) and the
 * partial softmax states merged by log-sum-exp. Windowed steps are not split: a split of the
 * whole range would mostly fall between the sinks and the window. */
#define MIN_SPLIT_KEYS 128
int ricllm_paged_attention(const void *q, const void *k_cache, const void *v_cache, void *out,
                           const int32_t *block_tables, const int32_t *query_start,
                           const int32_t *context_lens, int batch, int heads, int kv_heads,
                           int head_dim, int block_size, int table_width, float scale,
                           int is_bf16, int cache_type, const int32_t *sinks, const int32_t *windows,
                           int num_threads) {
    if (heads % kv_heads != 0 || heads / kv_heads > MAX_G || head_dim > MAX_D) return -1;
    if (cache_type != CACHE_INT8 && cache_type != is_bf16) return -1;  /* exact caches hold the activations' type */
    const int64_t row_bytes = cache_type == CACHE_INT8 ? int8_row_bytes(head_dim) : (int64_t)head_dim * (is_bf16 ? 2 : 4);
    Shape s = {batch, heads, kv_heads, head_dim, block_size, table_width, scale,
               block_tables, query_start, context_lens, cache_type, row_bytes, windows ? sinks : NULL, windows};
    int n_tiles = 0, max_keys = 0, max_rows = 0;
    for (int b = 0; b < batch; b++) n_tiles += (query_start[b + 1] - query_start[b] + QT - 1) / QT;
    if (n_tiles == 0) return 0;
    Tile *tiles = malloc((size_t)n_tiles * sizeof(Tile));
    if (!tiles) return -2;
    int t = 0;
    for (int b = 0; b < batch; b++)
        for (int first = 0; first < query_start[b + 1] - query_start[b]; first += QT) {
            tiles[t] = (Tile){b, first};
            max_keys = tile_keys(&s, tiles[t]) > max_keys ? tile_keys(&s, tiles[t]) : max_keys;
            max_rows = tile_rows(&s, tiles[t]) > max_rows ? tile_rows(&s, tiles[t]) : max_rows;
            t++;
        }
    const int base_items = n_tiles * kv_heads;
    int splits = (4 * num_threads + base_items - 1) / base_items;
    if (splits > max_keys / MIN_SPLIT_KEYS) splits = max_keys / MIN_SPLIT_KEYS;
    /* a count of items the threads divide evenly where one is near: 3 KV heads in 3 splits on 2
     * threads leave one thread idle for a ninth of the work (one decode, 448-640 keys: ~7% slower) */
    for (int fewer = splits - 1; fewer >= 1 && (base_items * splits) % num_threads != 0; fewer--)
        if ((base_items * fewer) % num_threads == 0) splits = fewer;
    if (splits < 1 || windows) splits = 1;
    const int64_t split_stride = max_rows;  /* partial rows kept per (tile, KV head, split) */
    float *acc = alloc_lines((size_t)base_items * splits * split_stride * head_dim * sizeof(float));
    RowState *state = malloc((size_t)base_items * splits * split_stride * sizeof(RowState));
    if (!acc || !state) { free(tiles); free_lines(acc); free(state); return -2; }
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < base_items * splits; item++) {
            const int base = item / splits, split = item % splits;
            const Tile tile = tiles[base / kv_heads];
            const int keys = tile_keys(&s, tile);
            const int begin = (int)((int64_t)keys * split / splits), end = (int)((int64_t)keys * (split + 1) / splits);
            const int64_t slot = ((int64_t)base * splits + split) * split_stride;
            attend_range(&s, tile, base % kv_heads, begin, end, q, k_cache, v_cache, is_bf16,
                         acc + slot * head_dim, state + slot);
        }
#pragma omp for schedule(dynamic, 4)
        for (int base = 0; base < base_items; base++) {
            const int64_t slot = (int64_t)base * splits * split_stride;
            merge_and_store(&s, tiles[base / kv_heads], base % kv_heads, splits, split_stride,
                            acc + slot * head_dim, state + slot, out, is_bf16);
        }
    }
    free(tiles);
    free_lines(acc);
    free(state);
    return 0;
}
