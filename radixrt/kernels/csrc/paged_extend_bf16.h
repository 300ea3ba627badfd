/* paged_extend.c's AVX512-BF16 path: a bf16 query over bf16 (or float8, widened exactly to bf16) K/V, with
 * vdpbf16ps dot products. Included by paged_extend.c only, where USE_DPBF16 is set (VL is then 16).
 *
 * Per tile of BK keys the K rows are gathered and transposed into bf16 pairs (kt) and the V rows interleaved
 * as key pairs (vp), once per item; then scores S[R, BK] = Q K^T (RB rows x 4 vectors of keys), the online
 * softmax 16 rows at a time (P rounded to bf16, as torch's bf16 flash attention does), and O = alpha O + P V
 * (RB rows x PVC vectors of channels). */
#ifndef RADIXRT_PAGED_EXTEND_BF16_H
#define RADIXRT_PAGED_EXTEND_BF16_H

typedef uint16_t vh32 __attribute__((vector_size(64))); /* 32 bf16 */

/* Per-thread scratch; every array starts 64-byte aligned. W = D rounded up to VL; K and Q hold bf16 pairs:
 * KW = D/2 rounded up to VL 32-bit columns. */
typedef struct {
    float* q;     /* [Rp, D/2] raw bf16 pairs of the queries */
    float* stage; /* [BK, KW] K rows staged (float8 widened, padded) when they cannot be transposed in place */
    vf* kt;       /* [KW, NKV] K tile transposed: kt[d * NKV + v] holds keys 16v..16v+15 of pair column d */
    float* vp;    /* [BK/2, W] the tile's V rows as key pairs (pack_v_pairs) */
    float* s;     /* [Rp, BK] scores, then bf16 probabilities at each row's start */
    float* o;     /* [Rp, W] running output */
    float *m, *alpha; /* [Rp] running max, this tile's rescale factor */
    vf* l;            /* [Rp] running sum, per lane */
} scratch_t;

/* 16 x 16 transpose of 32-bit lanes: r[i][j] -> r[j][i], by four rounds of two-input shuffles. */
static inline void transpose16(vf* r) {
    static const vi lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    static const vi hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    static const vi lo4 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
    static const vi hi4 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
    static const vi lo2 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
    static const vi hi2 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
    static const vi lo1 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
    static const vi hi1 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
    /* round b swaps the off-diagonal b x b blocks of every 2b x 2b block: rows i and i + b exchange */
#define TRANSPOSE_ROUND(B, LO, HI)                                                                       \
    for (int i = 0; i < 16; i++) {                                                                       \
        if (i & (B)) continue;                                                                           \
        const vf a = r[i], c = r[i + (B)];                                                               \
        r[i] = __builtin_shuffle(a, c, LO);                                                              \
        r[i + (B)] = __builtin_shuffle(a, c, HI);                                                        \
    }
    TRANSPOSE_ROUND(8, lo8, hi8)
    TRANSPOSE_ROUND(4, lo4, hi4)
    TRANSPOSE_ROUND(2, lo2, hi2)
    TRANSPOSE_ROUND(1, lo1, hi1)
#undef TRANSPOSE_ROUND
}

/* The 32 bf16 elements [d, d + 32) of the row at src (zero past D, all zero when src is NULL). */
static inline vh32 load_bf16x32(const char* src, int64_t d, int64_t D) {
    vh32 x = {0};
    if (!src) return x;
    if (d + 32 <= D) {
        memcpy(&x, src + 2 * d, sizeof x);
    } else {
        uint16_t tmp[32] = {0};
        for (int64_t e = d; e < D; e++) tmp[e - d] = ((const uint16_t*)src)[e];
        memcpy(&x, tmp, sizeof x);
    }
    return x;
}

/* dst[0, D) = the D float8 codes (kind kt) at src as bf16 bit patterns (exact: every e4m3 / e5m2 value is a
 * bf16 value). */
static inline void fp8_row_to_bf16(uint16_t* restrict dst, const char* restrict src, int64_t D, int kt) {
    for (int64_t d = 0; d < D; d += 32) {
        char tmp[32] = {0};
        const char* p = src + d;
        if (D - d < 32) p = memcpy(tmp, src + d, (size_t)(D - d));
        vf x[2];
        fp8x32_to_f32(p, kt, &x[0], &x[1]);
        uint16_t w[32];
        for (int i = 0; i < 2; i++) {
            const vu hi = round_bf16_high(x[i]) >> 16;
            for (int t = 0; t < VL; t++) w[i * VL + t] = (uint16_t)hi[t];
        }
        memcpy(dst + d, w, (size_t)(D - d < 32 ? D - d : 32) * 2);
    }
}

/* V rows 2i and 2i + 1 of the tile interleaved as bf16 pairs: word d of pair row i (vp[i * W + d]) holds
 * v[2i][d] in its low half and v[2i + 1][d] in its high half (NULL rows are zeros). */
static void pack_v_pairs(const char* const* vrow, int64_t D, float* vp_out) {
    static const vh32 lo = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                            8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    static const vh32 hi = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                            24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
    const int64_t W = round_up(D, VL);
    uint32_t* vp = (uint32_t*)vp_out;
    for (int64_t i = 0; i < BK / 2; i++)
        for (int64_t d = 0; d < W; d += 32) {
            const vh32 a = load_bf16x32(vrow[2 * i], d, D), b = load_bf16x32(vrow[2 * i + 1], d, D);
            const vh32 x = __builtin_shuffle(a, b, lo), y = __builtin_shuffle(a, b, hi);
            memcpy(vp + i * W + d, &x, sizeof x);
            if (d + 16 < W) memcpy(vp + i * W + d + 16, &y, sizeof y);
        }
}

/* Gather the tile's nk K and V rows (kv head h) through slots: K transposed into kt as bf16 pairs, V into vp
 * (pack_v_pairs). Rows past nk are zero. Then prefetch the next tile's rows (next_slots[0, next_nk)) so that
 * memory works while this tile is computed. */
static void pack_tile(const job_t* job, const int64_t* slots, int64_t nk, const int64_t* next_slots,
                      int64_t next_nk, int64_t h, scratch_t ws) {
    const int64_t D = job->D, elem = kv_elem(job->kt), row_bytes = D * elem;
    const int64_t KW = round_up((D + 1) / 2, VL); /* 32-bit columns of a K row */
    const char* krow[BK];
    const char* vrow[BK];
    for (int64_t j = 0; j < BK; j++) {
        const int64_t slot = j < nk ? slots[j] : -1;
        krow[j] = vrow[j] = NULL;
        if ((uint64_t)slot < (uint64_t)job->num_slots) {
            const int64_t off = (slot * job->KVH + h) * row_bytes;
            krow[j] = job->k_buf + off;
            vrow[j] = job->v_buf + off;
        } else if (j < nk) {
            __atomic_store_n((int*)&job->err, 2, __ATOMIC_RELAXED);
        }
    }
    /* rows of whole vectors are transposed straight from the pool, others staged (widened, padded) first */
    const int fp8 = job->kt == KV_E4M3 || job->kt == KV_E5M2;
    const int direct = !fp8 && D % 32 == 0;
    if (!direct)
        for (int64_t j = 0; j < BK; j++) {
            float* dst = ws.stage + j * KW;
            memset(dst, 0, (size_t)KW * 4);
            if (krow[j] && fp8) fp8_row_to_bf16((uint16_t*)dst, krow[j], D, job->kt);
            else if (krow[j]) memcpy(dst, krow[j], (size_t)row_bytes);
        }
    for (int64_t jb = 0; jb < NKV; jb++)
        for (int64_t db = 0; db < KW; db += VL) {
            vf r[16];
            for (int i = 0; i < 16; i++) {
                const char* src = direct ? (krow[jb * VL + i] ? krow[jb * VL + i] + 4 * db : NULL)
                                         : (const char*)(ws.stage + (jb * VL + i) * KW + db);
                r[i] = (vf){0};
                if (src) memcpy(&r[i], src, sizeof(vf));
            }
            transpose16(r);
            for (int i = 0; i < 16; i++) ws.kt[(db + i) * NKV + jb] = r[i];
        }
    if (fp8) { /* V rows as bf16 in the stage (free again: K is transposed), then paired */
        uint16_t* staged = (uint16_t*)ws.stage;
        for (int64_t j = 0; j < BK; j++) {
            if (!vrow[j]) continue;
            fp8_row_to_bf16(staged + j * D, vrow[j], D, job->kt);
            vrow[j] = (const char*)(staged + j * D);
        }
    }
    pack_v_pairs(vrow, D, ws.vp);
    for (int64_t j = 0; j < next_nk; j++) {
        const int64_t slot = next_slots[j];
        if ((uint64_t)slot >= (uint64_t)job->num_slots) continue;
        const int64_t off = (slot * job->KVH + h) * row_bytes;
        for (int64_t b = 0; b < row_bytes; b += 64) {
            __builtin_prefetch(job->k_buf + off + b);
            __builtin_prefetch(job->v_buf + off + b);
        }
    }
}

/* S rows [r0, r0 + RB) = Q rows . K tile (bf16 pairs), times post (the softmax scale in log2 units). */
static inline __attribute__((always_inline)) void qk_block(const float* restrict q, int64_t qs, const vf* restrict kt,
                                                           int64_t n, float* restrict s, float post) {
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
}

/* O rows [r0, r0 + RB), columns [16 c0, 16 (c0 + NC)) = alpha * O + P[:, :nk] V, with bf16 probabilities
 * (row i: BK / 2 words of pairs at p + i * BK) and V pairs (pack_v_pairs). o is VL-aligned scratch. */
static inline __attribute__((always_inline)) void pv_block_dp(const float* restrict p, const float* restrict alpha,
                                                              const float* restrict vp, int64_t W, int64_t nk,
                                                              float* restrict o, int64_t c0, const int NC) {
    const uint32_t* pw = (const uint32_t*)p;
    vf acc[RB][PVC];
    for (int i = 0; i < RB; i++)
        for (int c = 0; c < NC; c++) acc[i][c] = *(const vf*)(o + i * W + (c0 + c) * VL) * alpha[i];
    for (int64_t j = 0; j < (nk + 1) / 2; j++) {
        __m512bh v[PVC];
        for (int c = 0; c < NC; c++) memcpy(&v[c], vp + j * W + (c0 + c) * VL, sizeof(vf));
        for (int i = 0; i < RB; i++) {
            const __m512bh x = (__m512bh)_mm512_set1_epi32((int)pw[i * BK + j]);
            for (int c = 0; c < NC; c++) acc[i][c] = (vf)_mm512_dpbf16_ps((__m512)acc[i][c], x, v[c]);
        }
    }
    for (int i = 0; i < RB; i++)
        for (int c = 0; c < NC; c++) *(vf*)(o + i * W + (c0 + c) * VL) = acc[i][c];
}

static void pv_rows(const float* p, const float* alpha, const float* vp, int64_t W, int64_t nk, float* o) {
    const int64_t nvec = W / VL;
    int64_t c0 = 0;
    for (; c0 + PVC <= nvec; c0 += PVC) pv_block_dp(p, alpha, vp, W, nk, o, c0, PVC);
    switch (nvec - c0) {
    case 1: pv_block_dp(p, alpha, vp, W, nk, o, c0, 1); break;
    case 2: pv_block_dp(p, alpha, vp, W, nk, o, c0, 2); break;
    case 3: pv_block_dp(p, alpha, vp, W, nk, o, c0, 3); break;
    default: break;
    }
}

/* Lane j of the result is the max of the lanes of p[j] (a 16 x 16 transpose folded into the maxima). */
static inline vf hmax16(const vf* restrict p) {
    const vi lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const vi hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const vi lo4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const vi hi4 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const vi lo2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const vi hi2 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const vi lo1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const vi hi1 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    vf a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = vmaxf(__builtin_shuffle(p[2 * i], p[2 * i + 1], lo8), __builtin_shuffle(p[2 * i], p[2 * i + 1], hi8));
    for (int i = 0; i < 4; i++)
        b[i] = vmaxf(__builtin_shuffle(a[2 * i], a[2 * i + 1], lo4), __builtin_shuffle(a[2 * i], a[2 * i + 1], hi4));
    for (int i = 0; i < 2; i++)
        c[i] = vmaxf(__builtin_shuffle(b[2 * i], b[2 * i + 1], lo2), __builtin_shuffle(b[2 * i], b[2 * i + 1], hi2));
    return vmaxf(__builtin_shuffle(c[0], c[1], lo1), __builtin_shuffle(c[0], c[1], hi1));
}

/* Mask, then online-softmax update of rows [0, R) (padding rows past R keep scores 0 and alpha 1): row r
 * is token r / G of the item, at position apos0 + r / G; key j of the tile is at position k0 + j. A row
 * sees the keys at positions <= its own (and > its own - window). s becomes 2^(s - m) in bf16, packed at
 * the row's start (the running sum then adds the rounded values, the ones used).
 * Rows go 16 at a time, so that their maxima and rescale factors are computed as vectors. */
static void softmax_rows(scratch_t ws, int64_t R, int64_t G, int64_t nk, int64_t k0, int64_t apos0,
                         int64_t window) {
    const vi lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
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
        m_new = vmaxf(hmax16(mx), m_old);
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
            for (int v = 0; v < NKV; v += 2) {
                const vf p0 = exp2_np(x[v] - m), p1 = exp2_np(x[v + 1] - m);
                const vu w = (vu)_mm512_cvtne2ps_pbh((__m512)p1, (__m512)p0); /* p0 in the low half */
                memcpy((uint16_t*)sr + v * VL, &w, sizeof w);
                sum += (vf)(w << 16) + (vf)(w & 0xffff0000u); /* the rounded values, even and odd */
            }
            ws.l[r0 + i] = ws.l[r0 + i] * alpha[i] + sum;
        }
    }
}

/* Load the item's queries as bf16 pairs: row r = (token r / G, query head h * G + r % G); padding rows are
 * zero; float8 K scales (powers of two) multiply them exactly. */
static void load_queries(const job_t* job, const item_t* it, scratch_t ws, int64_t G, int64_t Rp, int64_t qs) {
    const int64_t D = job->D;
    const int64_t t0 = job->qo_indptr[it->b] + it->q0;
    for (int64_t r = 0; r < Rp; r++) {
        float* dst = ws.q + r * qs;
        if (r >= it->nq * G) {
            memset(dst, 0, (size_t)qs * 4);
            continue;
        }
        const char* src = job->q + ((t0 + r / G) * job->q_stride + (it->h * G + r % G) * D) * 2;
        memcpy(dst, src, (size_t)D * 2);
        if (D & 1) ((uint16_t*)dst)[D] = 0;
        if (job->k_scale)
            for (int64_t d = 0; d < D; d++) {
                const float x = bf16_to_f32(((const uint16_t*)dst)[d]) * job->k_scale[it->h * D + d];
                uint32_t u;
                memcpy(&u, &x, sizeof u);
                ((uint16_t*)dst)[d] = (uint16_t)(u >> 16);
            }
    }
}

/* One item on the AVX512-BF16 path (a bf16 query over bf16 or float8 K/V), its output stored. */
static void run_item_bf16(job_t* job, const item_t* it) {
    const int64_t D = job->D, G = job->H / job->KVH, W = round_up(D, VL);
    const int64_t R = it->nq * G, Rp = round_up(R, RB);
    const int64_t qs = (D + 1) / 2; /* 32-bit elements per query row */
    const int64_t KW = round_up((D + 1) / 2, VL);
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
    load_queries(job, it, ws, G, Rp, qs);
    for (int64_t r = 0; r < Rp; r++) ws.m[r] = -INFINITY, ws.l[r] = (vf){0}, ws.alpha[r] = 1.0f;
    memset(ws.o, 0, (size_t)(Rp * W) * sizeof(float));

    const int64_t n_new = job->qo_indptr[it->b + 1] - job->qo_indptr[it->b];
    const int64_t apos0 = job->seq_lens[it->b] - n_new + it->q0; /* position of the item's first token */
    const int64_t kend = apos0 + it->nq; /* keys [kbeg, kend) */
    const int64_t kbeg = job->window > 0 && apos0 - job->window + 1 > 0 ? apos0 - job->window + 1 : 0;
    const int64_t* slots = job->slot_table + it->b * job->table_stride;
    for (int64_t k0 = kbeg; k0 < kend; k0 += BK) {
        const int64_t nk = kend - k0 < BK ? kend - k0 : BK;
        const int64_t next_nk = kend - k0 - BK < BK ? kend - k0 - BK : BK; /* <= 0 at the last tile */
        pack_tile(job, slots + k0, nk, slots + k0 + BK, next_nk, it->h, ws);
        for (int64_t r0 = 0; r0 < Rp; r0 += RB) qk_block(ws.q + r0 * qs, qs, ws.kt, qs, ws.s + r0 * BK, job->qscale);
        softmax_rows(ws, R, G, nk, k0, apos0, job->window);
        for (int64_t r0 = 0; r0 < Rp; r0 += RB) pv_rows(ws.s + r0 * BK, ws.alpha + r0, ws.vp, W, nk, ws.o + r0 * W);
    }
    for (int64_t r = 0; r < R; r++) ws.m[r] = hadd(ws.l[r]); /* the row sums (m is no longer needed) */
    store_rows(job, it, ws.o, ws.m, G, W);
}

#endif /* RADIXRT_PAGED_EXTEND_BF16_H */
