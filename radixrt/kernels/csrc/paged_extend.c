/* Paged extend (prefill) attention for CPU: the new tokens of each request attend causally over its cached
 * prefix and themselves, reading K/V from the paged pool in place (no gathered copy, no dense mask).
 *
 * GNU C (vector extensions) + OpenMP, built with paged_decode.c into one library by
 * radixrt/kernels/cpu_decode.py. Shared helpers are in paged_simd.h; types and row widening in paged_extend.h.
 *
 * Layout (all row-major):
 *   q           [T, H, D]           token t at q + t * q_stride (q_stride >= H * D); heads contiguous
 *   k_buf/v_buf [num_slots, KVH, D] contiguous: slot s, kv head h at (s * KVH + h) * D
 *   slot_table  [B, table_stride]   int64; the first seq_lens[b] entries of row b are request b's slots
 *   qo_indptr   [B + 1]             int64; request b's new tokens are q rows [qo_indptr[b], qo_indptr[b+1])
 *   seq_lens    [B]                 int64; prefix + new tokens; new token i of b is at position
 *                                   seq_lens[b] - n_b + i and attends positions <= its own
 *   out         [T, H, D]           contiguous
 * Requests with no new tokens are allowed (nothing to do). GQA: query head h reads kv head h / (H / KVH).
 * With window > 0 a query at position p attends only the positions > p - window.
 *
 * Algorithm (flash attention): work items are (request, kv head, block of up to qb new tokens). An item's
 * R = tokens x G query rows (all G query heads of the kv head share each K/V tile) run over the item's key
 * range (causal, window) in tiles of BK positions: scores as small register-blocked GEMMs (no horizontal
 * sums), the causal / window / tile-end mask only on tiles that need one, an online update of the running
 * max and sum (scores in log2 units, 2^x by a polynomial), then O = alpha * O + P V. Two paths:
 *   float32 (paged_extend_f32.h): every call but the one below. Scores are computed transposed
 *            (S^T = K Q^T), so K and V rows are read in place from a float32 pool, not packed;
 *   bf16     (paged_extend_bf16.h, where the CPU has AVX512-BF16): a bf16 query over bf16 / float8 K/V,
 *            K tiles packed as transposed bf16 pairs and V as key pairs for vdpbf16ps.
 * Precision: float32 inputs stay float32 throughout. bf16 inputs with the AVX512-BF16 instruction (the
 * default where the CPU has it): Q K^T by vdpbf16ps on the bf16 values (exact products, fp32 sums), P
 * rounded to bf16 (nearest-even) for P V by vdpbf16ps, the running sum adding those rounded values; this is
 * what torch's bf16 flash attention does too (P in bf16), at twice the speed of widening to fp32. Without
 * it (or with PAGED_PORTABLE) bf16 rows are widened exactly and everything is fp32. Accumulators, max and
 * sum are fp32; a bf16 output is rounded to nearest-even.
 * Items run under OpenMP dynamic scheduling, the costliest first; qb shrinks when there are too few items
 * to keep every thread busy.
 *
 * Float8 K/V (paged_extend_fp8): e4m3fn / e5m2 codes are widened exactly: to bf16 for a bf16 query on
 * the AVX512-BF16 path (then exactly as bf16 K/V, P rounded to bf16; the K scales, powers of two, multiply
 * the bf16 query exactly), else to fp32 into a staged tile (the K scales fold into the transposed queries);
 * the V scale multiplies the output.
 *
 * Returns 0 on success, 1 for inconsistent qo_indptr / seq_lens (see paged_extend below), 2 if a slot is
 * out of [0, num_slots) (its K/V read as zeros; the output is then unspecified), 3 when out of memory.
 */
#include "paged_extend.h"

/* max(a, b) lane by lane (b where either is NaN). */
static inline vf vmaxf(vf a, vf b) {
#if USE_AVX512
    return (vf)_mm512_max_ps((__m512)a, (__m512)b);
#else
    return vmax(a, b);
#endif
}

/* 2^x for x <= 0 (-inf gives 0): exp2v of paged_simd.h, with the AVX-512 rounding and scaling
 * instructions when there are (two ops instead of six). */
static inline vf exp2_np(vf x) {
#if USE_AVX512
    x = vmaxf(x, (vf){0} - 150.0f); /* 2^-150 scales to 0 */
    const vf n = (vf)_mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const vf f = x - n;
    vf p = f * 1.535336188319500e-4f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    return (vf)_mm512_scalef_ps((__m512)p, (__m512)n);
#else
    return exp2v(x);
#endif
}

/* out rows of the item = O / l (o: [rows, W], lsum: [rows]), rounded to bf16 when needed. */
static void store_rows(const job_t* job, const item_t* it, const float* o_rows, const float* lsum, int64_t G,
                       int64_t W) {
    const int64_t D = job->D, H = job->H, elem = job->bf16 ? 2 : 4;
    const int64_t t0 = job->qo_indptr[it->b] + it->q0;
    for (int64_t r = 0; r < it->nq * G; r++) {
        const float l = lsum[r], vs = job->v_scale ? job->v_scale[it->h] : 1.0f;
        const float inv_l = l > 0.0f ? vs / l : 0.0f;
        char* dst = job->out + ((t0 + r / G) * H + it->h * G + r % G) * D * elem;
        const float* o = o_rows + r * W;
        for (int64_t d = 0; d < D; d += VL) {
            const int64_t cnt = D - d < VL ? D - d : VL;
            vf x;
            memcpy(&x, o + d, sizeof x);
            x *= inv_l;
            if (job->bf16) {
                const vh y = __builtin_convertvector(round_bf16_high(x) >> 16, vh);
                memcpy(dst + 2 * d, &y, (size_t)cnt * 2);
            } else {
                memcpy(dst + 4 * d, &x, (size_t)cnt * 4);
            }
        }
    }
}

#include "paged_extend_f32.h"
#if USE_DPBF16
#include "paged_extend_bf16.h"
#endif

static void run_item(job_t* job, const item_t* it) {
#if USE_DPBF16
    if (job->bf16 && job->kt != KV_F32) {
        run_item_bf16(job, it);
        return;
    }
#endif
    run_item_f32(job, it);
}

static int cost_desc(const void* a, const void* b) {
    const int64_t x = ((const item_t*)a)->cost, y = ((const item_t*)b)->cost;
    return (x < y) - (x > y);
}

/* Checks qo_indptr (non-decreasing from >= 0, last <= num_tokens) and seq_lens (n_b <= seq_lens[b] <=
 * table_width) and cuts the work into items; returns 1 when inconsistent, 3 when out of memory. */
static int paged_extend(const void* q, int64_t q_stride, int64_t num_tokens, const void* k_buf, const void* v_buf,
                        int64_t num_slots, const int64_t* slot_table, int64_t table_stride, int64_t table_width,
                        const int64_t* qo_indptr, const int64_t* seq_lens, int64_t B, int64_t H, int64_t KVH,
                        int64_t D, float scale, int64_t window, void* out, int nthreads, int bf16, int kt,
                        const float* k_scale, const float* v_scale) {
    if (B <= 0 || H <= 0 || D <= 0 || KVH <= 0 || H % KVH) return B <= 0 ? 0 : 1;
    const int64_t G = H / KVH;
    if (qo_indptr[0] < 0 || qo_indptr[B] > num_tokens) return 1;
    int64_t total_tokens = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = qo_indptr[b + 1] - qo_indptr[b];
        if (n < 0 || seq_lens[b] < n || seq_lens[b] > table_width) return 1;
        total_tokens += n;
    }
    int nt = nthreads < 1 ? 1 : nthreads;
    /* tokens per item: ~ROWS_TARGET rows, fewer when that leaves threads idle */
    int64_t qb = ROWS_TARGET / G < 1 ? 1 : ROWS_TARGET / G;
    qb = qb > QB_MAX ? QB_MAX : qb;
    while (qb > 4 && nt > 1 && KVH * ((total_tokens + qb - 1) / qb) < 4 * nt) qb /= 2;
    int64_t nitems = 0;
    for (int64_t b = 0; b < B; b++) nitems += KVH * ((qo_indptr[b + 1] - qo_indptr[b] + qb - 1) / qb);
    item_t* items = thread_buffer(1, (size_t)(nitems > 0 ? nitems : 1) * sizeof(item_t));
    if (!items) return 3;
    int64_t k = 0, work = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = qo_indptr[b + 1] - qo_indptr[b];
        for (int64_t q0 = 0; q0 < n; q0 += qb) {
            const int64_t nq = n - q0 < qb ? n - q0 : qb;
            int64_t keys = seq_lens[b] - n + q0 + nq; /* keys of the item's last token */
            if (window > 0 && keys > window + nq) keys = window + nq;
            for (int64_t h = 0; h < KVH; h++) items[k++] = (item_t){b, h, q0, nq, nq * G * keys};
            work += KVH * nq * G * keys;
        }
    }
    qsort(items, (size_t)nitems, sizeof(item_t), cost_desc);
    job_t job = {q, k_buf, v_buf, slot_table, qo_indptr, seq_lens, q_stride, num_slots, table_stride, H, KVH, D,
                 window, qb, scale * LOG2E, bf16, kt, k_scale, v_scale, out, 0};
    if (work < MIN_PARALLEL || nitems < 2) nt = 1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) if (nt > 1)
    for (int64_t i = 0; i < nitems; i++) run_item(&job, &items[i]);
    return job.err;
}

int paged_extend_bf16(const uint16_t* q, int64_t q_stride, int64_t num_tokens, const uint16_t* k_buf,
                      const uint16_t* v_buf, int64_t num_slots, const int64_t* slot_table, int64_t table_stride,
                      int64_t table_width, const int64_t* qo_indptr, const int64_t* seq_lens, int64_t batch,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale, int64_t window,
                      uint16_t* out, int nthreads) {
    return paged_extend(q, q_stride, num_tokens, k_buf, v_buf, num_slots, slot_table, table_stride, table_width,
                        qo_indptr, seq_lens, batch, num_heads, num_kv_heads, head_dim, scale, window, out, nthreads,
                        1, KV_BF16, NULL, NULL);
}

int paged_extend_f32(const float* q, int64_t q_stride, int64_t num_tokens, const float* k_buf, const float* v_buf,
                     int64_t num_slots, const int64_t* slot_table, int64_t table_stride, int64_t table_width,
                     const int64_t* qo_indptr, const int64_t* seq_lens, int64_t batch, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim, float scale, int64_t window, float* out,
                     int nthreads) {
    return paged_extend(q, q_stride, num_tokens, k_buf, v_buf, num_slots, slot_table, table_stride, table_width,
                        qo_indptr, seq_lens, batch, num_heads, num_kv_heads, head_dim, scale, window, out, nthreads,
                        0, KV_F32, NULL, NULL);
}

/* Float8 K/V (kv_kind KV_E4M3 or KV_E5M2, see paged_decode_fp8) with a bf16 (q_bf16 1) or f32 query and
 * output: rows are widened to fp32 as they are packed (the fp32 GEMMs), the K scales fold into the
 * queries and the V scale into the output. */
int paged_extend_fp8(const void* q, int64_t q_stride, int64_t num_tokens, const uint8_t* k_buf,
                     const uint8_t* v_buf, int64_t num_slots, const int64_t* slot_table, int64_t table_stride,
                     int64_t table_width, const int64_t* qo_indptr, const int64_t* seq_lens, int64_t batch,
                     int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale, int64_t window,
                     void* out, int nthreads, int q_bf16, int kv_kind, const float* k_scale, const float* v_scale) {
    if (kv_kind != KV_E4M3 && kv_kind != KV_E5M2) return 1;
    return paged_extend(q, q_stride, num_tokens, k_buf, v_buf, num_slots, slot_table, table_stride, table_width,
                        qo_indptr, seq_lens, batch, num_heads, num_kv_heads, head_dim, scale, window, out, nthreads,
                        q_bf16 != 0, kv_kind, k_scale, v_scale);
}
