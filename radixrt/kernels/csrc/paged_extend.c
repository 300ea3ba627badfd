/* Paged extend (prefill) attention for CPU: the new tokens of each request attend causally over its cached
 * prefix and themselves, reading K/V from the paged pool in place (no gathered copy, no dense mask).
 *
 * GNU C (vector extensions) + OpenMP, built with paged_decode.c into one library by
 * radixrt/kernels/cpu_decode.py. Shared helpers are in paged_simd.h; types and tile packing in paged_extend.h.
 *
 * Layout (all row-major):
 *   q           [T, H, D]           token t at q + t * q_stride (q_stride >= H * D); heads contiguous
 *   k_buf/v_buf [num_slots, KVH, D] contiguous: slot s, kv head h at (s * KVH + h) * D
 *   slot_table  [B, table_stride]   int64; the first seq_lens[b] entries of row b are request b's slots
 *   qo_indptr   [B + 1]             int64; request b's new tokens are q rows [qo_indptr[b], qo_indptr[b+1])
 *   seq_lens    [B]                 int64; prefix + new tokens; new token i of b is at position
 *                                   seq_lens[b] - n_b + i and attends positions <= its own
 *   out         [T, H, D]           contiguous
 * Requests with no new tokens are allowed (nothing to do). GQA: query head h reads kv head h / (H / KVH). With window > 0 a query at position p attends only the
 * positions > p - window.
 *
 * Algorithm (flash attention): work items are (request, kv head, block of up to qb new tokens). An item's
 * R = tokens x G query rows (all G query heads of the kv head share each K/V tile) run over the item's key
 * range (causal, window) in tiles of BK positions:
 *   pack     the tile's K rows, gathered through the slot table, transposed to [D][BK]; V rows to [BK][D];
 *   scores   S[R, BK] = Q K^T, register-blocked RB rows x BK keys (a small GEMM: no horizontal sums);
 *   softmax  causal / window / tile-end mask (only on tiles that need one), online update of the running
 *            max and sum, VL rows at a time (VL: 16 floats with AVX-512, 8 on AVX2); scores in log2 units, 2^x by a polynomial;
 *   values   O[R, D] = alpha * O + P V, register-blocked RB rows x 64 columns.
 * Precision: float32 inputs stay float32 throughout. bf16 inputs with the AVX512-BF16 instruction (the
 * default where the CPU has it): Q K^T by vdpbf16ps on the bf16 values (exact products, fp32 sums), P
 * rounded to bf16 (nearest-even) for P V by vdpbf16ps, the running sum adding those rounded values; this is
 * what torch's bf16 flash attention does too (P in bf16), at twice the speed of widening to fp32. Without
 * it (or with PAGED_PORTABLE) bf16 rows are widened exactly and everything is fp32. Accumulators, max and
 * sum are fp32; a bf16 output is rounded to nearest-even.
 * Items run under OpenMP dynamic scheduling, the costliest first; qb shrinks when there are too few items
 * to keep every thread busy.
 *
 * Float8 K/V (paged_extend_fp8): e4m3fn / e5m2 codes are widened exactly as the tiles are packed: to bf16
 * for a bf16 query on the AVX512-BF16 path (then exactly as bf16 K/V, P rounded to bf16; the K scales,
 * powers of two, multiply the bf16 query exactly), else to fp32 for the fp32 GEMMs; the V scale multiplies
 * the output.
 *
 * Returns 0 on success, 1 for inconsistent qo_indptr / seq_lens (see paged_extend below), 2 if a slot is
 * out of [0, num_slots) (its K/V read as zeros; the output is then unspecified), 3 when out of memory.
 */
#include "paged_extend.h"

/* S rows [r0, r0 + RB) = Q rows . K tile, times post (fp32 path: q already scaled, post = 1). The fp32 path
 * goes QKV key vectors at a time (RB x QKV accumulators), each group over all n columns. */
static inline __attribute__((always_inline)) void qk_block(const float* restrict q, int64_t qs, const vf* restrict kt,
                                                           int64_t n, float* restrict s, float post, int pairs) {
#if USE_DPBF16
    if (pairs) {
        vf acc[RB][NKV];
        for (int i = 0; i < RB; i++)
            for (int v = 0; v < NKV; v++) acc[i][v] = (vf){0};
        const uint32_t* qp = (const uint32_t*)q;
        for (int64_t c = 0; c < n; c++) {
            const __m512bh k0 = (__m512bh)kt[c * NKV], k1 = (__m512bh)kt[c * NKV + 1];
            const __m512bh k2 = (__m512bh)kt[c * NKV + 2], k3 = (__m512bh)kt[c * NKV + 3];
            for (int i = 0; i < RB; i++) {
                const __m512bh x = (__m512bh)_mm512_set1_epi32((int)qp[i * qs + c]);
                acc[i][0] = (vf)_mm512_dpbf16_ps((__m512)acc[i][0], x, k0);
                acc[i][1] = (vf)_mm512_dpbf16_ps((__m512)acc[i][1], x, k1);
                acc[i][2] = (vf)_mm512_dpbf16_ps((__m512)acc[i][2], x, k2);
                acc[i][3] = (vf)_mm512_dpbf16_ps((__m512)acc[i][3], x, k3);
            }
        }
        for (int i = 0; i < RB; i++)
            for (int v = 0; v < NKV; v++) {
                const vf x = acc[i][v] * post;
                memcpy(s + i * BK + v * VL, &x, sizeof x);
            }
        return;
    }
#endif
    (void)pairs;
    for (int g = 0; g < NKV; g += QKV) {
        vf acc[RB][QKV];
        for (int i = 0; i < RB; i++)
            for (int v = 0; v < QKV; v++) acc[i][v] = (vf){0};
        for (int64_t d = 0; d < n; d++) {
            vf k[QKV];
            for (int v = 0; v < QKV; v++) k[v] = kt[d * NKV + g + v];
            for (int i = 0; i < RB; i++) {
                const float x = q[i * qs + d];
                for (int v = 0; v < QKV; v++) acc[i][v] += x * k[v];
            }
        }
        for (int i = 0; i < RB; i++)
            for (int v = 0; v < QKV; v++) {
                const vf x = acc[i][v] * post;
                memcpy(s + i * BK + (g + v) * VL, &x, sizeof x);
            }
    }
}

/* O rows [r0, r0 + RB), columns [VL c0, VL (c0 + NC)) = alpha * O + P[:, :nk] V (NC <= PVC). */
static inline __attribute__((always_inline)) void pv_block(const float* restrict p, const float* restrict alpha,
                                                           const float* restrict vp, int64_t W, int64_t nk,
                                                           float* restrict o, int64_t c0, const int NC) {
    /* o and vp are scratch rows of W floats from VL-aligned offsets: whole aligned vectors (memcpy into
     * the accumulators went through the stack in 16-byte halves, a store-forwarding stall per vector) */
    vf acc[RB][PVC];
    for (int i = 0; i < RB; i++)
        for (int c = 0; c < NC; c++) acc[i][c] = *(const vf*)(o + i * W + (c0 + c) * VL) * alpha[i];
    for (int64_t j = 0; j < nk; j++) {
        vf v[PVC];
        for (int c = 0; c < NC; c++) v[c] = *(const vf*)(vp + j * W + (c0 + c) * VL);
        for (int i = 0; i < RB; i++) {
            const float x = p[i * BK + j];
            for (int c = 0; c < NC; c++) acc[i][c] += x * v[c];
        }
    }
    for (int i = 0; i < RB; i++)
        for (int c = 0; c < NC; c++) *(vf*)(o + i * W + (c0 + c) * VL) = acc[i][c];
}

#if USE_DPBF16
/* The same with bf16 probabilities (row i: BK / 2 words of pairs at p + i * BK) and V pairs (pack_v_pairs). */
static inline __attribute__((always_inline)) void pv_block_dp(const float* restrict p, const float* restrict alpha,
                                                              const float* restrict vp, int64_t W, int64_t nk,
                                                              float* restrict o, int64_t c0, const int NC) {
    const uint32_t* pw = (const uint32_t*)p;
    vf acc[RB][4];
    for (int i = 0; i < RB; i++)
        for (int c = 0; c < NC; c++) {
            memcpy(&acc[i][c], o + i * W + (c0 + c) * VL, sizeof(vf));
            acc[i][c] *= alpha[i];
        }
    for (int64_t j = 0; j < (nk + 1) / 2; j++) {
        __m512bh v[4];
        for (int c = 0; c < NC; c++) memcpy(&v[c], vp + j * W + (c0 + c) * VL, sizeof(vf));
        for (int i = 0; i < RB; i++) {
            const __m512bh x = (__m512bh)_mm512_set1_epi32((int)pw[i * BK + j]);
            for (int c = 0; c < NC; c++) acc[i][c] = (vf)_mm512_dpbf16_ps((__m512)acc[i][c], x, v[c]);
        }
    }
    for (int i = 0; i < RB; i++)
        for (int c = 0; c < NC; c++) memcpy(o + i * W + (c0 + c) * VL, &acc[i][c], sizeof(vf));
}
#define PV_BLOCK(NC)                                                                                       \
    do {                                                                                                   \
        if (pairs) pv_block_dp(p, alpha, vp, W, nk, o, c0, NC);                                            \
        else pv_block(p, alpha, vp, W, nk, o, c0, NC);                                                     \
    } while (0)
#else
#define PV_BLOCK(NC) pv_block(p, alpha, vp, W, nk, o, c0, NC)
#endif

static void pv_rows(const float* p, const float* alpha, const float* vp, int64_t W, int64_t nk, float* o,
                    int pairs) {
    const int64_t nvec = W / VL;
    int64_t c0 = 0;
    (void)pairs;
    for (; c0 + PVC <= nvec; c0 += PVC) PV_BLOCK(PVC);
    switch (nvec - c0) { /* fewer than PVC vectors left */
    case 1: PV_BLOCK(1); break;
#if PVC > 2
    case 2: PV_BLOCK(2); break;
    case 3: PV_BLOCK(3); break;
#endif
    default: break;
    }
}
#undef PV_BLOCK

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

/* Lane j of the result is the max of the lanes of p[j], j < VL (a VL x VL transpose folded into the maxima:
 * each round halves the lanes per row and doubles the rows per vector). */
static inline vf hmax_rows(const vf* restrict p) {
#if VL == 16
    static const vi lo[4] = {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                             {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
                             {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},
                             {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}};
    static const vi hi[4] = {{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
                             {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31},
                             {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31},
                             {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31}};
#else
    static const vi lo[3] = {{0, 1, 2, 3, 8, 9, 10, 11}, {0, 1, 4, 5, 8, 9, 12, 13}, {0, 2, 4, 6, 8, 10, 12, 14}};
    static const vi hi[3] = {{4, 5, 6, 7, 12, 13, 14, 15}, {2, 3, 6, 7, 10, 11, 14, 15}, {1, 3, 5, 7, 9, 11, 13, 15}};
#endif
    vf a[VL];
    for (int i = 0; i < VL; i++) a[i] = p[i];
    for (int round = 0, n = VL / 2; n >= 1; round++, n /= 2)
        for (int i = 0; i < n; i++)
            a[i] = vmaxf(__builtin_shuffle(a[2 * i], a[2 * i + 1], lo[round]),
                         __builtin_shuffle(a[2 * i], a[2 * i + 1], hi[round]));
    return a[0];
}

/* Mask, then online-softmax update of rows [0, R) (padding rows past R keep scores 0 and alpha 1): row r
 * is token r / G of the item, at position apos0 + r / G; key j of the tile is at position k0 + j. A row
 * sees the keys at positions <= its own (and > its own - window). s becomes 2^(s - m): float32, or with
 * pairs bf16 packed at the row's start (the running sum then adds the rounded values, the ones used).
 * Rows go VL at a time, so that their maxima and rescale factors are computed as vectors. */
static void softmax_rows(scratch_t ws, int64_t R, int64_t G, int64_t nk, int64_t k0, int64_t apos0,
                         int64_t window, int pairs) {
    vi lane;
    for (int i = 0; i < VL; i++) lane[i] = i;
    const vf ninf = (vf){0} - INFINITY;
    /* most tiles are wholly visible to every row of the item: no mask */
    const int full = nk == BK && k0 + BK - 1 <= apos0 && (window <= 0 || k0 > apos0 + R / G - 1 - window);
    for (int64_t r0 = 0; r0 < R; r0 += VL) {
        const int64_t nr = R - r0 < VL ? R - r0 : VL;
        vf mx[VL];
        for (int64_t i = 0; i < VL; i++) {
            mx[i] = ninf;
            if (i >= nr) continue;
            float* restrict sr = ws.s + (r0 + i) * BK;
            vf x[NKV];
            for (int v = 0; v < NKV; v++) memcpy(&x[v], sr + v * VL, sizeof(vf));
            if (!full) {
                const int64_t apos = apos0 + (r0 + i) / G;
                const int64_t hi = apos - k0 + 1 < nk ? apos - k0 + 1 : nk; /* keys [lo, hi) are visible */
                const int64_t lo = window > 0 && apos - window + 1 - k0 > 0 ? apos - window + 1 - k0 : 0;
                for (int v = 0; v < NKV; v++) {
                    const vi j = lane + v * VL;
                    const vi ok = (j >= (int32_t)lo) & (j < (int32_t)hi);
                    x[v] = (vf)(((vi)x[v] & ok) | ((vi)ninf & ~ok));
                    memcpy(sr + v * VL, &x[v], sizeof(vf));
                }
            }
            for (int v = 0; v < NKV; v++) mx[i] = vmaxf(mx[i], x[v]);
        }
        vf m_old, m_new;
        memcpy(&m_old, ws.m + r0, sizeof m_old);
        m_new = vmaxf(hmax_rows(mx), m_old);
        const vi none = m_new == -INFINITY; /* nothing visible yet: alpha 1 */
        const vf alpha = exp2_np((vf)((vi)(m_old - m_new) & ~none)); /* 0 at the first visible tile */
        memcpy(ws.m + r0, &m_new, sizeof m_new);
        memcpy(ws.alpha + r0, &alpha, sizeof alpha);
        for (int64_t i = 0; i < nr; i++) {
            float* restrict sr = ws.s + (r0 + i) * BK;
            const float m = m_new[i];
            if (m == -INFINITY) {
                memset(sr, 0, BK * sizeof(float));
                continue;
            }
            vf x[NKV], sum = {0};
            for (int v = 0; v < NKV; v++) memcpy(&x[v], sr + v * VL, sizeof(vf));
#if USE_DPBF16
            if (pairs) {
                for (int v = 0; v < NKV; v += 2) {
                    const vf p0 = exp2_np(x[v] - m), p1 = exp2_np(x[v + 1] - m);
                    const vu w = (vu)_mm512_cvtne2ps_pbh((__m512)p1, (__m512)p0); /* p0 in the low half */
                    memcpy((uint16_t*)sr + v * VL, &w, sizeof w);
                    sum += (vf)(w << 16) + (vf)(w & 0xffff0000u); /* the rounded values, even and odd */
                }
            } else
#endif
            {
                (void)pairs;
                for (int v = 0; v < NKV; v++) {
                    const vf p = exp2_np(x[v] - m);
                    memcpy(sr + v * VL, &p, sizeof p);
                    sum += p;
                }
            }
            ws.l[r0 + i] = ws.l[r0 + i] * alpha[i] + sum;
        }
    }
}

/* out rows of the item = O / l, rounded to bf16 when needed. */
static void store_rows(const job_t* job, const item_t* it, scratch_t ws, int64_t G, int64_t W) {
    const int64_t D = job->D, H = job->H, elem = job->bf16 ? 2 : 4;
    const int64_t t0 = job->qo_indptr[it->b] + it->q0;
    for (int64_t r = 0; r < it->nq * G; r++) {
        const float l = hadd(ws.l[r]), vs = job->v_scale ? job->v_scale[it->h] : 1.0f;
        const float inv_l = l > 0.0f ? vs / l : 0.0f;
        char* dst = job->out + ((t0 + r / G) * H + it->h * G + r % G) * D * elem;
        const float* o = ws.o + r * W;
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

/* Load the item's queries: row r = (token r / G, query head h * G + r % G); padding rows are zero. */
static void load_queries(const job_t* job, const item_t* it, scratch_t ws, int64_t G, int64_t Rp, int64_t qs,
                         int pairs) {
    const int64_t D = job->D, elem = job->bf16 ? 2 : 4;
    const int64_t t0 = job->qo_indptr[it->b] + it->q0;
    for (int64_t r = 0; r < Rp; r++) {
        float* dst = ws.q + r * qs;
        if (r >= it->nq * G) {
            memset(dst, 0, (size_t)qs * 4);
            continue;
        }
        const char* src = job->q + ((t0 + r / G) * job->q_stride + (it->h * G + r % G) * D) * elem;
        if (pairs) {
            memcpy(dst, src, (size_t)D * 2);
            if (D & 1) ((uint16_t*)dst)[D] = 0;
            if (job->k_scale) /* times powers of two: exact in bf16 */
                for (int64_t d = 0; d < D; d++) {
                    const float x = bf16_to_f32(((const uint16_t*)dst)[d]) * job->k_scale[it->h * D + d];
                    uint32_t u;
                    memcpy(&u, &x, sizeof u);
                    ((uint16_t*)dst)[d] = (uint16_t)(u >> 16);
                }
        } else {
            load_row_f32(dst, src, D, D, job->bf16 ? KV_BF16 : KV_F32);
            const float* ks = job->k_scale ? job->k_scale + it->h * D : NULL;
            for (int64_t d = 0; d < D; d++) dst[d] *= ks ? job->qscale * ks[d] : job->qscale;
        }
    }
}

static void run_item(job_t* job, const item_t* it) {
    const int64_t D = job->D, G = job->H / job->KVH, W = round_up(D, VL);
    const int64_t R = it->nq * G, Rp = round_up(R, RB);
    const int pairs = USE_DPBF16 && job->bf16 && job->kt != KV_F32;
    const int64_t qs = pairs ? (D + 1) / 2 : D; /* 32-bit elements per query row */
    const int64_t KW = pairs ? round_up((D + 1) / 2, VL) : W;
    const int64_t rows = round_up(job->qb * G, RB);
    const int64_t floats = round_up(rows * qs, VL) + 2 * BK * W + KW * BK + rows * (BK + W + VL) + 2 * round_up(rows, VL);
    float* base = thread_buffer(0, (size_t)floats * sizeof(float));
    if (!base) {
        __atomic_store_n(&job->err, 3, __ATOMIC_RELAXED);
        return;
    }
    scratch_t ws;
    ws.q = base, base += round_up(rows * qs, VL);
    ws.stage = base, base += BK * W;
    ws.vp = base, base += BK * W;
    ws.kt = (vf*)base, base += KW * BK;
    ws.s = base, base += rows * BK;
    ws.o = base, base += rows * W;
    ws.l = (vf*)base, base += rows * VL;
    ws.m = base, base += round_up(rows, VL);
    ws.alpha = base;
    load_queries(job, it, ws, G, Rp, qs, pairs);
    for (int64_t r = 0; r < Rp; r++) ws.m[r] = -INFINITY, ws.l[r] = (vf){0}, ws.alpha[r] = 1.0f;
    memset(ws.o, 0, (size_t)(Rp * W) * sizeof(float));

    const int64_t n_new = job->qo_indptr[it->b + 1] - job->qo_indptr[it->b];
    const int64_t apos0 = job->seq_lens[it->b] - n_new + it->q0; /* position of the item's first token */
    const int64_t kend = apos0 + it->nq; /* keys [kbeg, kend) */
    const int64_t kbeg = job->window > 0 && apos0 - job->window + 1 > 0 ? apos0 - job->window + 1 : 0;
    const int64_t* slots = job->slot_table + it->b * job->table_stride;
    const float post = pairs ? job->qscale : 1.0f;
    for (int64_t k0 = kbeg; k0 < kend; k0 += BK) {
        const int64_t nk = kend - k0 < BK ? kend - k0 : BK;
        const int64_t next_nk = kend - k0 - BK < BK ? kend - k0 - BK : BK; /* <= 0 at the last tile */
        pack_tile(job, slots + k0, nk, slots + k0 + BK, next_nk, it->h, ws, pairs);
        for (int64_t r0 = 0; r0 < Rp; r0 += RB) qk_block(ws.q + r0 * qs, qs, ws.kt, qs, ws.s + r0 * BK, post, pairs);
        softmax_rows(ws, R, G, nk, k0, apos0, job->window, pairs);
        for (int64_t r0 = 0; r0 < Rp; r0 += RB)
            pv_rows(ws.s + r0 * BK, ws.alpha + r0, ws.vp, W, nk, ws.o + r0 * W, pairs);
    }
    store_rows(job, it, ws, G, W);
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
