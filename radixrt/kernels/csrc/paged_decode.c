/* Paged decode attention for CPU: one query token per request over its KV slots, read in place.
 *
 * GNU C (vector extensions) + OpenMP, no torch headers; built by radixrt/kernels/cpu_decode.py with
 * `gcc -O3 -march=native -fopenmp -shared -fPIC`, together with paged_extend.c (helpers shared through
 * paged_simd.h). It needs no libm. The only target-specific code is the AVX512-BF16 dot product for bf16
 * scores (USE_DPBF16, paged_simd.h), with a portable fallback (forced by -DPAGED_PORTABLE).
 *
 * Layout (all row-major):
 *   q           [B, H, D]          row b at q + b * q_stride (q_stride >= H * D); heads contiguous
 *   k_buf/v_buf [num_slots, KVH, D] contiguous: slot s, kv head h at (s * KVH + h) * D
 *   slot_table  [B, table_stride]  int64; the first seq_lens[b] entries of row b are request b's slots
 *   seq_lens    [B]                int64, 0 <= seq_lens[b] <= table_width
 *   out         [B, H, D]          contiguous
 * GQA: query head h reads kv head h / (H / KVH).
 *
 * out = softmax(scale * q.k) @ v over the request's positions (the last `window` ones when window > 0),
 * computed in float32; bf16 inputs are widened exactly and the bf16 output is rounded to nearest-even.
 * A request with seq_len 0 gets a zero output row.
 *
 * Algorithm: a single pass with online softmax over blocks of BT positions, all H query heads of a
 * request together, so each slot's K and V records (KVH * D contiguous elements) are read once, in
 * address order: with sequential slots the pool is read as two streams that the hardware prefetchers
 * follow; scattered slots are software-prefetched ahead. Per block:
 *   scores  per position and kv head, G 16-lane partial dot products; for 16 positions a transposing
 *           tree reduction turns 16 partial vectors into 16 scores (no per-dot horizontal sums);
 *   softmax running max / sum per head, 2^x by a vectorized polynomial (scores are kept in log2 units);
 *   values  acc[g] += p[g, j] * v[j], the accumulators of one 32-wide column pair in registers.
 * bf16 rows are widened with one integer op per 16 elements by splitting each 32-bit lane into its even
 * (low) and odd (high) element; queries and accumulators use that lane order.
 * The work (the sum of the effective lengths, in positions) is divided evenly across the OpenMP threads
 * as one flat range, so a long context at batch 1 is spread over all threads (split-K): a request cut
 * between threads leaves partial (max, sum, acc) records, merged at the end.
 *
 * Float8 K/V (paged_decode_fp8): rows of 1-byte e4m3fn / e5m2 codes, widened in registers (fp8_to_f32);
 * the per-channel K scales multiply the query once per call and the per-head V scales the output, so a
 * float8 pool is read at half the bytes of bf16 with a few integer ops per 16 elements more.
 *
 * Returns 0 on success, 1 if some seq_len is out of [0, table_width], 2 if a slot is out of
 * [0, num_slots) (such rows are skipped, never read; the output is then unspecified), 3 when out of memory.
 */
#include "paged_simd.h"

#define BT 64                  /* positions per online-softmax block (a multiple of VL) */
#define GQ 4                   /* query heads whose accumulators are kept in registers at once */
#define MIN_PARALLEL_ROWS 384  /* below this many K rows in all, the call runs on the calling thread */

/* A row of D elements is handled as NP = ceil(D / PW) pairs of float vectors (2 * NP vectors, PW = 2 VL
 * elements a pair: 32 with AVX-512, 16 on AVX2), the last pair zero padded; kt is the K/V element kind
 * (KV_F32, KV_BF16, KV_E4M3, KV_E5M2 of paged_simd.h). For bf16 a pair is one vector load: the low halves
 * of its 32-bit lanes (shifted up) are the even elements and the high halves (masked) the odd ones, one
 * integer op per VL elements; the queries and accumulators use the same lane order. For f32 a pair is
 * simply PW consecutive floats, and for float8 PW consecutive codes widened by fp8x32_to_f32, in the f32
 * lane order. */
#define PW (2 * VL)
static inline int64_t lane_dim(int64_t v, int64_t t, int kt) {
    return PW * (v >> 1) + (kt == KV_BF16 ? 2 * t + (v & 1) : VL * (v & 1) + t);
}

static inline __attribute__((always_inline)) void load_pair(const char* row, int64_t c, int64_t D, int kt,
                                                            vf* even, vf* odd) {
    const int64_t cnt = D - PW * c < PW ? D - PW * c : PW;
    if (kt == KV_E4M3 || kt == KV_E5M2) {
        if (cnt == PW) {
            fp8x32_to_f32(row + PW * c, kt, even, odd);
        } else {
            char tmp[PW] = {0};
            memcpy(tmp, row + PW * c, (size_t)cnt);
            fp8x32_to_f32(tmp, kt, even, odd);
        }
    } else if (kt == KV_BF16) {
        vu x;
        if (cnt == PW) {
            memcpy(&x, row + 2 * PW * c, sizeof x);
        } else {
            uint16_t tmp[PW] = {0};
            memcpy(tmp, row + 2 * PW * c, (size_t)cnt * 2);
            memcpy(&x, tmp, sizeof x);
        }
        *even = (vf)(x << 16);
        *odd = (vf)(x & 0xffff0000u);
    } else {
        if (cnt == PW) {
            memcpy(even, row + 4 * PW * c, sizeof *even);
            memcpy(odd, row + 4 * PW * c + 4 * VL, sizeof *odd);
        } else {
            float tmp[PW] = {0};
            memcpy(tmp, row + 4 * PW * c, (size_t)cnt * 4);
            memcpy(even, tmp, sizeof *even);
            memcpy(odd, tmp + VL, sizeof *odd);
        }
    }
}

/* The 32 bf16 elements [32c, 32c + 32) of a row as raw bits, zero padded. */
static inline __attribute__((always_inline)) void load_raw_pair(const char* row, int64_t c, int64_t D, vu* x) {
    const int64_t cnt = D - PW * c < PW ? D - PW * c : PW;
    if (cnt == PW) {
        memcpy(x, row + 2 * PW * c, sizeof *x);
    } else {
        uint16_t tmp[PW] = {0};
        memcpy(tmp, row + 2 * PW * c, (size_t)cnt * 2);
        memcpy(x, tmp, sizeof *x);
    }
}

/* Lane j of the result is the sum of the lanes of p[j] (a VL x VL transpose folded into the adds). */
#if VL == 16
static inline vf hsum_lanes(const vf* restrict p) {
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
        a[i] = __builtin_shuffle(p[2 * i], p[2 * i + 1], lo8) + __builtin_shuffle(p[2 * i], p[2 * i + 1], hi8);
    for (int i = 0; i < 4; i++)
        b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo4) + __builtin_shuffle(a[2 * i], a[2 * i + 1], hi4);
    for (int i = 0; i < 2; i++)
        c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], lo2) + __builtin_shuffle(b[2 * i], b[2 * i + 1], hi2);
    return __builtin_shuffle(c[0], c[1], lo1) + __builtin_shuffle(c[0], c[1], hi1);
}
#else
static inline vf hsum_lanes(const vf* restrict p) {
    const vi lo4 = {0, 1, 2, 3, 8, 9, 10, 11}, hi4 = {4, 5, 6, 7, 12, 13, 14, 15};
    const vi lo2 = {0, 1, 4, 5, 8, 9, 12, 13}, hi2 = {2, 3, 6, 7, 10, 11, 14, 15};
    const vi lo1 = {0, 2, 4, 6, 8, 10, 12, 14}, hi1 = {1, 3, 5, 7, 9, 11, 13, 15};
    vf a[4], b[2];
    for (int i = 0; i < 4; i++)
        a[i] = __builtin_shuffle(p[2 * i], p[2 * i + 1], lo4) + __builtin_shuffle(p[2 * i], p[2 * i + 1], hi4);
    for (int i = 0; i < 2; i++)
        b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo2) + __builtin_shuffle(a[2 * i], a[2 * i + 1], hi2);
    return __builtin_shuffle(b[0], b[1], lo1) + __builtin_shuffle(b[0], b[1], hi1);
}
#endif

static inline void prefetch_row(const char* p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o);
    __builtin_prefetch(p + bytes - 1);
}

/* Scores of VL positions for all H = KVH * G query heads: s[hq * BT + jj] = qv[hq] . k_h[off[jj]] for
 * jj < cnt (0 for the rest), where off are element offsets of slot records (-1: a bad slot, scored 0).
 * Each position's K record (KVH * D contiguous elements) is read in address order, then its V record is
 * touched in address order too (pv_rows reads it again, from cache), so the pool is read as two
 * sequential streams when slots are sequential, which the hardware prefetchers follow at full
 * bandwidth. For scattered slots, position jj also prefetches the K and V records pf[jj] ahead. */
static inline __attribute__((always_inline)) void qk_rows(
    const char* restrict kb, const char* restrict vb, const int64_t* restrict off, int64_t cnt,
    const int64_t* restrict pf, int64_t pf_cnt, int64_t KVH, const vf* restrict qv, vf* restrict part,
    float* restrict s, float post_scale, const int64_t D, const int64_t G, const int kt) {
    const int64_t NP = (D + PW - 1) / PW, NV = 2 * NP, elem = kv_elem(kt), record_bytes = KVH * D * elem;
    for (int64_t jj = 0; jj < VL; jj++) {
        if (jj < pf_cnt && pf[jj] >= 0) {
            prefetch_row(kb + pf[jj] * elem, record_bytes);
            prefetch_row(vb + pf[jj] * elem, record_bytes);
        }
        const int valid = jj < cnt && off[jj] >= 0;
        for (int64_t h = 0; h < KVH; h++) {
            const char* row = kb + ((valid ? off[jj] : 0) + h * D) * elem;
            for (int64_t g0 = 0; g0 < G; g0 += GQ) {
                const int64_t ng = G - g0 < GQ ? G - g0 : GQ;
                const vf* restrict qh = qv + (h * G + g0) * NV;
                vf a[GQ];
                for (int64_t gg = 0; gg < ng; gg++) a[gg] = (vf){0};
#if USE_DPBF16
                if (kt == KV_BF16) {
                    /* qh[gg * NV + c], c < NP, holds the raw bf16 pairs of the query (see load_queries) */
                    if (valid)
                        for (int64_t c = 0; c < NP; c++) {
                            vu x;
                            load_raw_pair(row, c, D, &x);
                            for (int64_t gg = 0; gg < ng; gg++)
                                a[gg] = (vf)_mm512_dpbf16_ps((__m512)a[gg], (__m512bh)qh[gg * NV + c], (__m512bh)x);
                        }
                    for (int64_t gg = 0; gg < ng; gg++) part[(h * G + g0 + gg) * VL + jj] = a[gg];
                    continue;
                }
#endif
                if (valid)
                    for (int64_t c = 0; c < NP; c++) {
                        vf e, o;
                        load_pair(row, c, D, kt, &e, &o);
                        for (int64_t gg = 0; gg < ng; gg++) {
                            a[gg] += qh[gg * NV + 2 * c] * e;
                            a[gg] += qh[gg * NV + 2 * c + 1] * o;
                        }
                    }
                for (int64_t gg = 0; gg < ng; gg++) part[(h * G + g0 + gg) * VL + jj] = a[gg];
            }
        }
        if (valid) {
            const char* vrec = vb + off[jj] * elem;
            for (int64_t o = 0; o < record_bytes; o += 64) (void)*(const volatile char*)(vrec + o);
        }
    }
    for (int64_t hq = 0; hq < KVH * G; hq++) {
        const vf r = hsum_lanes(part + hq * VL) * post_scale;
        memcpy(s + hq * BT, &r, sizeof r);
    }
}

/* acc[gg] = alpha[gg] * acc[gg] + sum_{j < nb} s[gg * BT + j] * v[off[j]] for ng (<= GQ) query heads,
 * one pair of column vectors at a time so the accumulators stay in registers. vb points at this kv
 * head's row of slot 0. Row j of the first pair also prefetches the K and V records pf[j] (of the next
 * block, so that memory stays busy while this block is computed), when j < pf_cnt. */
static inline __attribute__((always_inline)) void pv_rows(
    const char* restrict vb, const int64_t* restrict off, int64_t nb, const float* restrict s,
    const float* restrict alpha, vf* restrict acc, const char* pf_kb, const char* pf_vb,
    const int64_t* restrict pf, int64_t pf_cnt, int64_t pf_bytes, const int64_t D, const int64_t ng,
    const int kt) {
    const int64_t NP = (D + PW - 1) / PW, NV = 2 * NP, elem = kv_elem(kt);
    for (int64_t c = 0; c < NP; c++) {
        vf ae[GQ], ao[GQ];
        for (int64_t gg = 0; gg < ng; gg++) {
            ae[gg] = acc[gg * NV + 2 * c] * alpha[gg];
            ao[gg] = acc[gg * NV + 2 * c + 1] * alpha[gg];
        }
        for (int64_t j = 0; j < nb; j++) {
            if (c == 0 && j < pf_cnt && pf[j] >= 0) {
                prefetch_row(pf_kb + pf[j] * elem, pf_bytes);
                prefetch_row(pf_vb + pf[j] * elem, pf_bytes);
            }
            if (off[j] < 0) continue;
            vf e, o;
            load_pair(vb + off[j] * elem, c, D, kt, &e, &o);
            for (int64_t gg = 0; gg < ng; gg++) {
                const float p = s[gg * BT + j];
                ae[gg] += p * e;
                ao[gg] += p * o;
            }
        }
        for (int64_t gg = 0; gg < ng; gg++) {
            acc[gg * NV + 2 * c] = ae[gg];
            acc[gg * NV + 2 * c + 1] = ao[gg];
        }
    }
}

/* Instantiate CALL(D, N, KT) for D in {64, 128, any} x N (NS_CASES, else any) x the four K/V kinds:
 * compile-time shapes let gcc unroll the chunk and head loops into registers. */
#define SPECIALIZE_KT(CALL, N, NS_CASES, KT)                                                               \
    if (D == 64) { NS_CASES(CALL, N, 64, KT) }                                                             \
    else if (D == 128) { NS_CASES(CALL, N, 128, KT) }                                                      \
    else { NS_CASES(CALL, N, D, KT) }
#define SPECIALIZE(CALL, N, NS_CASES)                                                                      \
    switch (kt) {                                                                                          \
    case KV_BF16: SPECIALIZE_KT(CALL, N, NS_CASES, KV_BF16) break;                                         \
    case KV_E4M3: SPECIALIZE_KT(CALL, N, NS_CASES, KV_E4M3) break;                                         \
    case KV_E5M2: SPECIALIZE_KT(CALL, N, NS_CASES, KV_E5M2) break;                                         \
    default: SPECIALIZE_KT(CALL, N, NS_CASES, KV_F32) break;                                               \
    }
/* head-group sizes of pv_rows: 1..GQ */
#define NG_CASES(CALL, N, DD, BF)                                                                          \
    switch (N) {                                                                                           \
    case 1: CALL(DD, 1, BF); break;                                                                        \
    case 2: CALL(DD, 2, BF); break;                                                                        \
    case 3: CALL(DD, 3, BF); break;                                                                        \
    default: CALL(DD, 4, BF); break;                                                                       \
    }
/* GQA group sizes of qk_rows: the common ones, else generic */
#define G_CASES(CALL, N, DD, BF)                                                                           \
    switch (N) {                                                                                           \
    case 1: CALL(DD, 1, BF); break;                                                                        \
    case 2: CALL(DD, 2, BF); break;                                                                        \
    case 3: CALL(DD, 3, BF); break;                                                                        \
    case 4: CALL(DD, 4, BF); break;                                                                        \
    case 7: CALL(DD, 7, BF); break;                                                                        \
    case 8: CALL(DD, 8, BF); break;                                                                        \
    default: CALL(DD, N, BF); break;                                                                       \
    }

static void qk_any(const char* kb, const char* vb, const int64_t* off, int64_t cnt, const int64_t* pf,
                   int64_t pf_cnt, int64_t KVH, const vf* qv, vf* part, float* s, float post_scale, int64_t D,
                   int64_t G, int kt) {
#define QK_CALL(DD, GG, BF) qk_rows(kb, vb, off, cnt, pf, pf_cnt, KVH, qv, part, s, post_scale, DD, GG, BF)
    SPECIALIZE(QK_CALL, G, G_CASES)
#undef QK_CALL
}

static void pv_any(const char* vb, const int64_t* off, int64_t nb, const float* s, const float* alpha, vf* acc,
                   const char* pf_kb, const char* pf_vb, const int64_t* pf, int64_t pf_cnt, int64_t pf_bytes,
                   int64_t D, int64_t ng, int kt) {
#define PV_CALL(DD, NG, BF) pv_rows(vb, off, nb, s, alpha, acc, pf_kb, pf_vb, pf, pf_cnt, pf_bytes, DD, NG, BF)
    SPECIALIZE(PV_CALL, ng, NG_CASES)
#undef PV_CALL
}

/* Running softmax state of one request (all its query heads) or of a piece of its positions. */
typedef struct {
    float* m; /* [H] running max of the log2-scaled scores */
    float* l; /* [H] running sum of 2^(score - m) */
    vf* acc;  /* [H, NV] running sum of 2^(score - m) * v, in the lane order of load_pair */
} state_t;

/* Per-thread scratch of accumulate(). */
typedef struct {
    const vf* qv;  /* [H, NV] the queries times scale * log2(e), in the lane order of load_pair */
    vf* part;      /* [H, VL] partial dot products of VL positions */
    float* s;      /* [H, BT] scores, then probabilities, of a block */
    float* alpha;  /* [H] rescale factor of the accumulators for the current block */
    int64_t* off;  /* [2, BT] element offsets of the slot records of this block and the next (-1: bad) */
    float post_scale; /* applied to the dot products: 1, or scale * log2(e) when qv is unscaled */
} scratch_t;

static void fill_offsets(int64_t* restrict off, const int64_t* restrict slots, int64_t cnt, int64_t num_slots,
                         int64_t record, int* err) {
    for (int64_t j = 0; j < cnt; j++) {
        const int64_t slot = slots[j];
        if ((uint64_t)slot < (uint64_t)num_slots) {
            off[j] = slot * record;
        } else {
            off[j] = -1;
            __atomic_store_n(err, 2, __ATOMIC_RELAXED);
        }
    }
}

/* Accumulate positions slots[0..n) of one request into st, for all its H = KVH * G query heads. Per block
 * the kv heads are visited one after the other, so a block's K (then V) slot records, KVH * D contiguous
 * elements each, are read as a whole while they are in cache: the pool is streamed, not strided. */
static void accumulate(const void* k_buf, const void* v_buf, const int64_t* slots, int64_t n, int64_t num_slots,
                       int64_t KVH, int64_t D, int64_t G, int kt, state_t st, scratch_t ws, int* err) {
    const int64_t H = KVH * G, NV = 2 * ((D + PW - 1) / PW), elem = kv_elem(kt);
    const int64_t record = KVH * D, record_bytes = record * elem, head_bytes = D * elem;
    const char* kb = (const char*)k_buf;
    const char* vb = (const char*)v_buf;
    int64_t* cur = ws.off;
    int64_t* next = ws.off + BT;
    int64_t nb = n < BT ? n : BT;
    fill_offsets(cur, slots, nb, num_slots, record, err);
    for (int64_t j = 0; j < nb && j < VL; j++)
        if (cur[j] >= 0) {
            prefetch_row(kb + cur[j] * elem, record_bytes);
            prefetch_row(vb + cur[j] * elem, record_bytes);
        }
    for (int64_t j0 = 0; j0 < n; j0 += BT) {
        nb = n - j0 < BT ? n - j0 : BT;
        const int64_t rest = n - j0 - BT, nb_next = rest <= 0 ? 0 : (rest < BT ? rest : BT);
        fill_offsets(next, slots + j0 + BT, nb_next, num_slots, record, err);
        /* scores, VL positions at a time, prefetching the records VL positions ahead */
        for (int64_t jg = 0; jg < nb; jg += VL) {
            const int64_t cnt = nb - jg < VL ? nb - jg : VL, ahead = jg + VL;
            const int64_t* pf = ahead < nb ? cur + ahead : next;
            int64_t pf_cnt = ahead < nb ? nb - ahead : (nb == BT ? nb_next : 0);
            pf_cnt = pf_cnt < VL ? pf_cnt : VL;
            qk_any(kb, vb, cur + jg, cnt, pf, pf_cnt, KVH, ws.qv, ws.part, ws.s + jg, ws.post_scale, D, G, kt);
        }
        /* online softmax update over the VL-rounded block; s becomes 2^(s - m) */
        const int64_t nvec = round_up(nb, VL) / VL;
        for (int64_t g = 0; g < H; g++) {
            float* restrict sg = ws.s + g * BT;
            for (int64_t j = nb; j < nvec * VL; j++) sg[j] = -INFINITY;
            vf x[BT / VL];
            for (int64_t i = 0; i < nvec; i++) memcpy(&x[i], sg + i * VL, sizeof(vf));
            vf mx = x[0];
            for (int64_t i = 1; i < nvec; i++) mx = vmax(mx, x[i]);
            const float bmax = hmax(mx), m_old = st.m[g];
            const float m_new = bmax > m_old ? bmax : m_old;
            vf sum = {0};
            for (int64_t i = 0; i < nvec; i++) {
                const vf p = exp2v(x[i] - m_new);
                memcpy(sg + i * VL, &p, sizeof p);
                sum += p;
            }
            const float alpha = exp2_nonpos(m_old - m_new); /* 1 if the max is unchanged, 0 at first */
            ws.alpha[g] = alpha;
            st.l[g] = st.l[g] * alpha + hadd(sum);
            st.m[g] = m_new;
        }
        for (int64_t h = 0; h < KVH; h++)
            for (int64_t g0 = 0; g0 < G; g0 += GQ) {
                const int64_t ng = G - g0 < GQ ? G - g0 : GQ, hq = h * G + g0;
                const int64_t pf_cnt = h == 0 && g0 == 0 ? nb_next : 0;
                pv_any(vb + h * head_bytes, cur, nb, ws.s + hq * BT, ws.alpha + hq, st.acc + hq * NV, kb, vb, next,
                       pf_cnt, record_bytes, D, ng, kt);
            }
        int64_t* t = cur;
        cur = next;
        next = t;
    }
}

/* A shared prefix attended elsewhere (paged_decode_prefixed): its normalized output and log-sum-exp per
 * request and query head, laid out [KVH, B, G, D] and [KVH, B, G] (what SDPA returns for the queries of
 * all requests grouped by kv head), merged into each request's state before the division. */
typedef struct {
    const void* out; /* q's dtype */
    const float* lse; /* natural log of sum(exp(scale * q.k)) over the prefix */
    int64_t B;
} prefix_t;

/* Prefix output of query head g of request b as the lane-order vectors of pair c (zero padded). */
static void prefix_pair(const prefix_t* pre, int64_t b, int64_t g, int64_t G, int64_t c, int64_t D, int qbf16,
                        int kt, vf* e, vf* o) {
    const int64_t base = (((g / G) * pre->B + b) * G + g % G) * D;
    for (int t = 0; t < VL; t++) {
        const int64_t de = lane_dim(2 * c, t, kt), dn = lane_dim(2 * c + 1, t, kt);
        (*e)[t] = de >= D ? 0.0f
                  : qbf16 ? bf16_to_f32(((const uint16_t*)pre->out)[base + de])
                          : ((const float*)pre->out)[base + de];
        (*o)[t] = dn >= D ? 0.0f
                  : qbf16 ? bf16_to_f32(((const uint16_t*)pre->out)[base + dn])
                          : ((const float*)pre->out)[base + dn];
    }
}

/* out rows of request b = acc / l (times the kv head's V scale, when v_scale), undoing the lane order of
 * load_pair; G query heads per kv head. With pre, the prefix's (lse, out) is merged in first. */
static void finalize(void* out, int64_t b, int64_t H, int64_t D, state_t st, int qbf16, int kt, int64_t G,
                     const float* v_scale, const prefix_t* pre) {
    const int64_t NP = (D + PW - 1) / PW, NV = 2 * NP;
    for (int64_t g = 0; g < H; g++) {
        float a = 1.0f, cp = 0.0f, l = st.l[g];
        if (pre) {
            const float mp = pre->lse[((g / G) * pre->B + b) * G + g % G] * LOG2E;
            const float m = st.m[g] > mp ? st.m[g] : mp;
            a = exp2_nonpos(st.m[g] - m);
            cp = exp2_nonpos(mp - m);
            l = l * a + cp;
        }
        float inv_l = l > 0.0f ? 1.0f / l : 0.0f;
        if (v_scale) inv_l *= v_scale[g / G];
        char* o = (char*)out + (b * H + g) * D * (qbf16 ? 2 : 4);
        for (int64_t c = 0; c < NP; c++) {
            vf e = st.acc[g * NV + 2 * c] * a, od = st.acc[g * NV + 2 * c + 1] * a;
            if (pre) {
                vf pe, po;
                prefix_pair(pre, b, g, G, c, D, qbf16, kt, &pe, &po);
                e += pe * cp;
                od += po * cp;
            }
            e *= inv_l;
            od *= inv_l;
            const int64_t cnt = D - PW * c < PW ? D - PW * c : PW;
            if (qbf16 && kt == KV_BF16) {
                const vu word = (round_bf16_high(e) >> 16) | round_bf16_high(od);
                memcpy(o + 2 * PW * c, &word, (size_t)cnt * 2);
            } else if (qbf16) {
                const vu lo = round_bf16_high(e) >> 16, hi = round_bf16_high(od) >> 16;
                uint16_t tmp[PW];
                for (int t = 0; t < VL; t++) tmp[t] = (uint16_t)lo[t], tmp[VL + t] = (uint16_t)hi[t];
                memcpy(o + 2 * PW * c, tmp, (size_t)cnt * 2);
            } else {
                float tmp[PW];
                memcpy(tmp, &e, sizeof e);
                memcpy(tmp + VL, &od, sizeof od);
                memcpy(o + 4 * PW * c, tmp, (size_t)cnt * 4);
            }
        }
    }
}

/* qv[g] = q[g] * qscale (times the K scales of g's kv head, channel by channel, when k_scale) in the lane
 * order of load_pair, for the G query heads at qb (Gk per kv head); with USE_DPBF16 and bf16 K/V (then q
 * is bf16 and there are no K scales), qv[g, c] (c < NP) instead holds the raw bf16 pairs of q[g] and the
 * scale is applied to the dot products. Returns the scale still to apply. */
static float load_queries(vf* restrict qv, const void* qb, int64_t D, int64_t G, float qscale, int qbf16, int kt,
                          int64_t Gk, const float* k_scale) {
    const int64_t NP = (D + PW - 1) / PW, NV = 2 * NP;
    (void)Gk;
#if USE_DPBF16
    if (kt == KV_BF16) {
        for (int64_t g = 0; g < G; g++)
            for (int64_t c = 0; c < NP; c++) {
                vu x;
                load_raw_pair((const char*)qb + g * D * 2, c, D, &x);
                qv[g * NV + c] = (vf)x;
            }
        return qscale;
    }
#endif
    for (int64_t g = 0; g < G; g++)
        for (int64_t v = 0; v < NV; v++) {
            vf x = {0};
            for (int t = 0; t < VL; t++) {
                const int64_t d = lane_dim(v, t, kt);
                if (d >= D) continue;
                x[t] = qbf16 ? bf16_to_f32(((const uint16_t*)qb)[g * D + d]) : ((const float*)qb)[g * D + d];
                if (k_scale) x[t] *= k_scale[(g / Gk) * D + d];
            }
            qv[g * NV + v] = x * qscale;
        }
    return 1.0f;
}

static void state_reset(state_t st, int64_t G, int64_t NV) {
    for (int64_t g = 0; g < G; g++) {
        st.m[g] = -INFINITY;
        st.l[g] = 0.0f;
    }
    memset(st.acc, 0, (size_t)(G * NV) * sizeof(vf));
}

/* dst = the state over the union of the (disjoint) position sets of dst and src. */
static void state_merge(state_t dst, state_t src, int64_t G, int64_t NV) {
    for (int64_t g = 0; g < G; g++) {
        const float m = dst.m[g] > src.m[g] ? dst.m[g] : src.m[g];
        if (m == -INFINITY) continue;
        const float a = exp2_nonpos(dst.m[g] - m), c = exp2_nonpos(src.m[g] - m);
        dst.l[g] = dst.l[g] * a + src.l[g] * c;
        dst.m[g] = m;
        for (int64_t i = 0; i < NV; i++) dst.acc[g * NV + i] = dst.acc[g * NV + i] * a + src.acc[g * NV + i] * c;
    }
}

/* A partial state left by a thread whose range cut a segment. */
typedef struct {
    int64_t seg; /* the request, or -1 when unused */
    state_t st;
} partial_t;

/* Carve a state out of a 64-byte aligned float buffer; returns the (aligned) first float after it. */
static float* state_at(state_t* st, float* base, int64_t G, int64_t NV) {
    st->acc = (vf*)base;
    st->m = base + G * NV * VL;
    st->l = st->m + G;
    return base + G * NV * VL + round_up(2 * G, VL);
}

/* One call's arguments and bookkeeping, shared by its threads. */
typedef struct {
    const void *q, *k_buf, *v_buf;
    const int64_t *slot_table, *seq_lens, *cum;
    int64_t q_stride, num_slots, table_stride, B, H, KVH, D, W;
    float qscale;
    int qbf16, kt;                  /* the query / output is bf16 (else f32); the K/V element kind */
    const float *k_scale, *v_scale; /* [KVH, D] and [KVH] dequantization scales, or NULL (1) */
    void* out;
    const prefix_t* pre; /* or NULL */
    partial_t* partials; /* [2 * threads] */
    int err;
} job_t;

/* Thread tid of T: positions [W * tid / T, W * (tid + 1) / T) of the flat work range. Requests wholly
 * inside are finished here; the first and last, if cut, leave partial records for the merge. */
static void run_range(job_t* job, int tid, int T) {
    const int64_t B = job->B, H = job->H, KVH = job->KVH, D = job->D, G = H / KVH, NV = 2 * ((D + PW - 1) / PW);
    const int64_t* cum = job->cum;
    partial_t* rec = job->partials + 2 * tid;
    rec[0].seg = rec[1].seg = -1;
    /* scratch, in floats, each part a multiple of VL so that all stay 64-byte aligned: qv, part, s,
     * alpha, off, then the thread's own state and two partial records */
    const int64_t state_floats = H * NV * VL + round_up(2 * H, VL);
    const int64_t floats = H * NV * VL + H * VL * VL + H * BT + round_up(H, VL) + 2 * BT * 2 + 3 * state_floats;
    float* base = thread_buffer(0, (size_t)floats * sizeof(float));
    if (!base) {
        __atomic_store_n(&job->err, 3, __ATOMIC_RELAXED);
        return;
    }
    scratch_t ws;
    vf* qv = (vf*)base;
    ws.qv = qv;
    base += H * NV * VL;
    ws.part = (vf*)base;
    base += H * VL * VL;
    ws.s = base;
    base += H * BT;
    ws.alpha = base;
    base += round_up(H, VL);
    ws.off = (int64_t*)base;
    base += 2 * BT * 2;
    state_t own;
    base = state_at(&own, base, H, NV);
    base = state_at(&rec[0].st, base, H, NV);
    state_at(&rec[1].st, base, H, NV);
    const size_t elem = job->qbf16 ? 2 : 4;
    int nrec = 0;
    const int64_t lo = job->W * tid / T, hi = job->W * (tid + 1) / T;
    int64_t b = 0, top = B; /* binary search: the first request whose work extends past lo */
    while (b < top) {
        const int64_t mid = (b + top) / 2;
        if (cum[mid + 1] <= lo) b = mid + 1;
        else top = mid;
    }
    for (int64_t pos = lo; pos < hi && b < B; b++) {
        if (pos >= cum[b + 1]) continue; /* an empty request */
        const int64_t p_hi = hi < cum[b + 1] ? hi : cum[b + 1];
        const int full = pos == cum[b] && p_hi == cum[b + 1];
        state_t st = full ? own : rec[nrec].st;
        state_reset(st, H, NV);
        const char* qb = (const char*)job->q + (size_t)(b * job->q_stride) * elem;
        ws.post_scale = load_queries(qv, qb, D, H, job->qscale, job->qbf16, job->kt, G, job->k_scale);
        const int64_t start = job->seq_lens[b] - (cum[b + 1] - cum[b]); /* the window's first position */
        const int64_t* slots = job->slot_table + b * job->table_stride + start + (pos - cum[b]);
        accumulate(job->k_buf, job->v_buf, slots, p_hi - pos, job->num_slots, KVH, D, G, job->kt, st, ws,
                   &job->err);
        if (full) {
            finalize(job->out, b, H, D, st, job->qbf16, job->kt, G, job->v_scale, job->pre);
        } else {
            rec[nrec].seg = b;
            nrec++;
        }
        pos = p_hi;
    }
}

static int paged_decode(const void* q, int64_t q_stride, const void* k_buf, const void* v_buf,
                        int64_t num_slots, const int64_t* slot_table, int64_t table_stride,
                        int64_t table_width, const int64_t* seq_lens, int64_t B, int64_t H, int64_t KVH,
                        int64_t D, float scale, int64_t window, void* out, int nthreads, int qbf16, int kt,
                        const float* k_scale, const float* v_scale, const prefix_t* pre) {
    if (B <= 0 || H <= 0 || D <= 0 || KVH <= 0) return 0;
    const int64_t NV = 2 * ((D + PW - 1) / PW), G = H / KVH;
    const size_t elem = qbf16 ? sizeof(uint16_t) : sizeof(float);
    int nt = nthreads < 1 ? 1 : nthreads;
    /* the caller's bookkeeping: cum[b], the first flat work position of request b, then 2 partial
     * records per thread */
    const size_t cum_bytes = (size_t)round_up((B + 1) * (int64_t)sizeof(int64_t), 64);
    char* book = thread_buffer(1, cum_bytes + (size_t)nt * 2 * sizeof(partial_t));
    if (!book) return 3;
    int64_t* cum = (int64_t*)book;
    cum[0] = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t L = seq_lens[b];
        if (L < 0 || L > table_width) return 1;
        const int64_t eff = window > 0 && L > window ? window : L; /* its window starts at L - eff */
        if (eff == 0 && pre) return 1; /* the caller leaves every request a position past the prefix */
        if (eff == 0) memset((char*)out + (size_t)(b * H * D) * elem, 0, (size_t)(H * D) * elem);
        cum[b + 1] = cum[b] + eff;
    }
    job_t job = {q, k_buf, v_buf, slot_table, seq_lens, cum, q_stride, num_slots, table_stride, B, H, KVH, D,
                 cum[B], scale * LOG2E, qbf16, kt, k_scale, v_scale, out, pre, (partial_t*)(book + cum_bytes), 0};
    if (job.W * KVH < MIN_PARALLEL_ROWS) nt = 1;
    int used_threads = 1;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const int T = omp_get_num_threads();
        if (omp_get_thread_num() == 0) used_threads = T;
        run_range(&job, omp_get_thread_num(), T);
    }
    if (job.err == 3) return 3;

    /* merge the partial records: those of one request are consecutive in thread order */
    state_t cur = {0, 0, 0};
    int64_t cur_seg = -1;
    for (int i = 0; i < 2 * used_threads; i++) {
        const partial_t* p = &job.partials[i];
        if (p->seg < 0) continue;
        if (p->seg != cur_seg) {
            if (cur_seg >= 0) finalize(out, cur_seg, H, D, cur, qbf16, kt, G, v_scale, pre);
            cur = p->st;
            cur_seg = p->seg;
        } else {
            state_merge(cur, p->st, H, NV);
        }
    }
    if (cur_seg >= 0) finalize(out, cur_seg, H, D, cur, qbf16, kt, G, v_scale, pre);
    return job.err;
}

int paged_decode_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* k_buf, const uint16_t* v_buf,
                      int64_t num_slots, const int64_t* slot_table, int64_t table_stride,
                      int64_t table_width, const int64_t* seq_lens, int64_t batch, int64_t num_heads,
                      int64_t num_kv_heads, int64_t head_dim, float scale, int64_t window, uint16_t* out,
                      int nthreads) {
    return paged_decode(q, q_stride, k_buf, v_buf, num_slots, slot_table, table_stride, table_width,
                        seq_lens, batch, num_heads, num_kv_heads, head_dim, scale, window, out, nthreads, 1,
                        KV_BF16, NULL, NULL, NULL);
}

int paged_decode_f32(const float* q, int64_t q_stride, const float* k_buf, const float* v_buf,
                     int64_t num_slots, const int64_t* slot_table, int64_t table_stride, int64_t table_width,
                     const int64_t* seq_lens, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                     int64_t head_dim, float scale, int64_t window, float* out, int nthreads) {
    return paged_decode(q, q_stride, k_buf, v_buf, num_slots, slot_table, table_stride, table_width,
                        seq_lens, batch, num_heads, num_kv_heads, head_dim, scale, window, out, nthreads, 0,
                        KV_F32, NULL, NULL, NULL);
}

/* Float8 K/V (kv_kind KV_E4M3 or KV_E5M2) with a bf16 (q_bf16 1) or f32 query and output; k_scale [KVH, D]
 * and v_scale [KVH] float32 (NULL: 1) dequantize the stored codes: k = code * k_scale[h, d]. The K scales
 * are folded into the query and the V scale into the output, so the inner loops only widen codes. */
int paged_decode_fp8(const void* q, int64_t q_stride, const uint8_t* k_buf, const uint8_t* v_buf,
                     int64_t num_slots, const int64_t* slot_table, int64_t table_stride, int64_t table_width,
                     const int64_t* seq_lens, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                     int64_t head_dim, float scale, int64_t window, void* out, int nthreads, int q_bf16,
                     int kv_kind, const float* k_scale, const float* v_scale) {
    if (kv_kind != KV_E4M3 && kv_kind != KV_E5M2) return 1;
    return paged_decode(q, q_stride, k_buf, v_buf, num_slots, slot_table, table_stride, table_width,
                        seq_lens, batch, num_heads, num_kv_heads, head_dim, scale, window, out, nthreads,
                        q_bf16 != 0, kv_kind, k_scale, v_scale, NULL);
}

/* Cascade decode: each request's positions after a prefix that all share, merged with that prefix's
 * attention computed elsewhere (one batched SDPA call for every request's queries): prefix_out [KVH, B, G, D]
 * in q's dtype and prefix_lse [KVH, B, G] float32 (prefix_t). bf16 (q_bf16 1) or f32 q, K/V and output; the
 * slot table and seq_lens describe the suffixes only, each at least one position (status 1 otherwise). */
int paged_decode_prefixed(const void* q, int64_t q_stride, const void* k_buf, const void* v_buf, int64_t num_slots,
                          const int64_t* slot_table, int64_t table_stride, int64_t table_width,
                          const int64_t* seq_lens, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                          int64_t head_dim, float scale, int64_t window, void* out, int nthreads, int q_bf16,
                          const void* prefix_out, const float* prefix_lse) {
    const prefix_t pre = {prefix_out, prefix_lse, batch};
    return paged_decode(q, q_stride, k_buf, v_buf, num_slots, slot_table, table_stride, table_width,
                        seq_lens, batch, num_heads, num_kv_heads, head_dim, scale, window, out, nthreads,
                        q_bf16 != 0, q_bf16 ? KV_BF16 : KV_F32, NULL, NULL, &pre);
}
