/* Paged attention for the CPU: every query of a flat batch (prefill chunks and decode tokens)
 * against its sequence's K/V, read in place through the block table.
 *
 * Why a kernel: the torch path first gathers each sequence's K/V into a contiguous copy, then
 * runs SDPA (which repeats K/V per query head under GQA). On a CPU that copy costs more than
 * the attention itself. Here one work item is (sequence, KV head, tile of up to QT queries): it
 * reads each K/V row once for all QT·G query rows of the tile (G = query heads per KV head),
 * with an online softmax in fp32, so the bytes read per step are the context's K/V, once.
 *
 * Layouts (row-major):
 *   q, out        [T, H, D]                  activations, same element type as the cache
 *   k/v cache     [num_blocks, BS, KVH, D]
 *   block_tables  [B, table_width] int32
 *   query_start   [B + 1] int32               sequence b owns queries query_start[b]..[b+1]
 *   context_lens  [B] int32                   query j of b sits at context_len - q_len + j
 *                                             and sees keys 0..that position.
 * Element types: bf16 (uint16 bit patterns) or fp32, chosen by the entry point.
 */
#include "cpu_common.h"

#define QT 8          /* queries per work item: K/V rows are reused across them */
#define KT 32         /* keys per softmax chunk */
#define MAX_G 8       /* query heads per KV head (GQA ratios 1 to 8) */
#define MAX_D 128     /* head_dim; keeps a work item's buffers (~100 KB) on the stack */

typedef struct {
    int batch, heads, kv_heads, head_dim, block_size, table_width;
    float scale;
    const int32_t *block_tables, *query_start, *context_lens;
} Shape;

typedef struct { int seq, first; } Tile;

/* Partial softmax state of one row over a range of keys: running max, sum and unnormalised output. */
typedef struct { float max, sum; } RowState;

/* Keys [key_begin, key_end) of one (sequence, KV head, query tile), every K/V row loaded once for
 * all rows r = query·G + g of the tile. Leaves each row's unnormalised output in acc_out[r] and
 * its (max, sum) in state[r]. ``d`` is a literal at the hot call sites, so the inner loops unroll
 * and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend_range(
        const Shape *s, Tile tile, int kvh, int key_begin, int key_end, const void *q,
        const void *kc, const void *vc, int is_bf16, const int d, float *acc_out, RowState *state) {
    const int g_per_kv = s->heads / s->kv_heads;
    const int q_begin = s->query_start[tile.seq], q_len = s->query_start[tile.seq + 1] - q_begin;
    const int n_q = q_len - tile.first < QT ? q_len - tile.first : QT;
    const int rows = n_q * g_per_kv;
    const int first_pos = s->context_lens[tile.seq] - q_len + tile.first;
    const int32_t *table = s->block_tables + (int64_t)tile.seq * s->table_width;
    float qf[QT * MAX_G][MAX_D], acc[QT * MAX_G][MAX_D], key[KT][MAX_D], val[KT][MAX_D];
    float score[QT * MAX_G][KT], row_max[QT * MAX_G], row_sum[QT * MAX_G];

    for (int r = 0; r < rows; r++) {
        int query = q_begin + tile.first + r / g_per_kv, head = kvh * g_per_kv + r % g_per_kv;
        load_row(q, ((int64_t)query * s->heads + head) * d, d, is_bf16, qf[r]);
        for (int i = 0; i < d; i++) qf[r][i] *= s->scale;
        for (int i = 0; i < d; i++) acc[r][i] = 0.0f;
        row_max[r] = -INFINITY;
        row_sum[r] = 0.0f;
    }
    for (int k0 = key_begin; k0 < key_end; k0 += KT) {
        const int kn = key_end - k0 < KT ? key_end - k0 : KT;
        for (int j = 0; j < KT; j++) {
            if (j >= kn) {  /* zero the tail so the fixed-width score loop reads defined values */
                for (int i = 0; i < d; i++) key[j][i] = 0.0f;
                continue;
            }
            int pos = k0 + j;
            int64_t slot = (int64_t)table[pos / s->block_size] * s->block_size + pos % s->block_size;
            int64_t index = (slot * s->kv_heads + kvh) * d;
            load_row(kc, index, d, is_bf16, key[j]);
            load_row(vc, index, d, is_bf16, val[j]);
        }
        /* scores of every row of the tile against the chunk: S = Q·Kᵀ, vectorized along the keys */
        for (int j = 0; j < KT; j++)
            for (int r = 0; r < rows; r++) {
                float dot = 0.0f;
                for (int i = 0; i < d; i++) dot += qf[r][i] * key[j][i];
                score[r][j] = dot;
            }
        for (int r = 0; r < rows; r++) {
            const int last = first_pos + r / g_per_kv;      /* causal: this row sees keys <= last */
            const int visible = last - k0 + 1 < kn ? last - k0 + 1 : kn;
            if (visible <= 0) continue;
            float chunk_max = -INFINITY;
            for (int j = 0; j < KT; j++) chunk_max = j < visible && score[r][j] > chunk_max ? score[r][j] : chunk_max;
            const float new_max = chunk_max > row_max[r] ? chunk_max : row_max[r];
            const float rescale = exp_approx(row_max[r] - new_max);
            float add = 0.0f;
            for (int j = 0; j < KT; j++) {
                const float e = exp_approx(score[r][j] - new_max);
                score[r][j] = j < visible ? e : 0.0f;
                add += score[r][j];
            }
            row_sum[r] = row_sum[r] * rescale + add;
            float out[MAX_D];
            for (int i = 0; i < d; i++) out[i] = acc[r][i] * rescale;
            for (int j = 0; j < visible; j++) {
                const float p = score[r][j];
                for (int i = 0; i < d; i++) out[i] += p * val[j][i];
            }
            for (int i = 0; i < d; i++) acc[r][i] = out[i];
            row_max[r] = new_max;
        }
    }
    for (int r = 0; r < rows; r++) {
        for (int i = 0; i < d; i++) acc_out[(int64_t)r * d + i] = acc[r][i];
        state[r] = (RowState){row_max[r], row_sum[r]};
    }
}

static void attend_range_any(const Shape *s, Tile tile, int kvh, int key_begin, int key_end,
                             const void *q, const void *kc, const void *vc, int is_bf16,
                             float *acc_out, RowState *state) {
    switch (s->head_dim) {
    case 64: attend_range(s, tile, kvh, key_begin, key_end, q, kc, vc, is_bf16, 64, acc_out, state); break;
    case 128: attend_range(s, tile, kvh, key_begin, key_end, q, kc, vc, is_bf16, 128, acc_out, state); break;
    default: attend_range(s, tile, kvh, key_begin, key_end, q, kc, vc, is_bf16, s->head_dim, acc_out, state);
    }
}

static int tile_rows(const Shape *s, Tile tile) {
    int q_len = s->query_start[tile.seq + 1] - s->query_start[tile.seq];
    return (q_len - tile.first < QT ? q_len - tile.first : QT) * (s->heads / s->kv_heads);
}

static int tile_keys(const Shape *s, Tile tile) {  /* keys seen by the tile's last query */
    int q_len = s->query_start[tile.seq + 1] - s->query_start[tile.seq];
    int n_q = q_len - tile.first < QT ? q_len - tile.first : QT;
    return s->context_lens[tile.seq] - q_len + tile.first + n_q;
}

/* Merge the partial states of the splits of one (tile, KV head) and write the output rows. */
static void merge_and_store(const Shape *s, Tile tile, int kvh, int splits, int64_t split_stride,
                            const float *acc, const RowState *state, void *out, int is_bf16) {
    const int d = s->head_dim, rows = tile_rows(s, tile), g_per_kv = s->heads / s->kv_heads;
    const int q_begin = s->query_start[tile.seq];
    for (int r = 0; r < rows; r++) {
        float m = -INFINITY, total = 0.0f, row[MAX_D];
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
        int query = q_begin + tile.first + r / g_per_kv, head = kvh * g_per_kv + r % g_per_kv;
        store_row(out, ((int64_t)query * s->heads + head) * d, d, is_bf16, row);
    }
}

/* Returns 0, or a negative code for a shape the kernel does not take (the caller falls back).
 * Work: (tile, KV head, split of the keys). Few sequences with long contexts do not fill the
 * threads on their own, so the keys are split (each split at least MIN_SPLIT_KEYS) and the
 * partial softmax states merged by log-sum-exp. */
#define MIN_SPLIT_KEYS 128
int ricllm_paged_attention(const void *q, const void *k_cache, const void *v_cache, void *out,
                           const int32_t *block_tables, const int32_t *query_start,
                           const int32_t *context_lens, int batch, int heads, int kv_heads,
                           int head_dim, int block_size, int table_width, float scale,
                           int is_bf16, int num_threads) {
    if (heads % kv_heads != 0 || heads / kv_heads > MAX_G || head_dim > MAX_D) return -1;
    Shape s = {batch, heads, kv_heads, head_dim, block_size, table_width, scale,
               block_tables, query_start, context_lens};
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
    if (splits < 1) splits = 1;
    const int64_t split_stride = max_rows;  /* partial rows kept per (tile, KV head, split) */
    float *acc = malloc((size_t)base_items * splits * split_stride * head_dim * sizeof(float));
    RowState *state = malloc((size_t)base_items * splits * split_stride * sizeof(RowState));
    if (!acc || !state) { free(tiles); free(acc); free(state); return -2; }
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < base_items * splits; item++) {
            const int base = item / splits, split = item % splits;
            const Tile tile = tiles[base / kv_heads];
            const int keys = tile_keys(&s, tile);
            const int begin = (int)((int64_t)keys * split / splits), end = (int)((int64_t)keys * (split + 1) / splits);
            const int64_t slot = ((int64_t)base * splits + split) * split_stride;
            attend_range_any(&s, tile, base % kv_heads, begin, end, q, k_cache, v_cache, is_bf16,
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
    free(acc);
    free(state);
    return 0;
}
