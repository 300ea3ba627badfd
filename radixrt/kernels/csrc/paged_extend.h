/* paged_extend.c's types, tile sizes and tile packing (gathering K/V rows through the slot table into
 * the layouts its register-blocked GEMMs read). Included by paged_extend.c only. */
#ifndef RADIXRT_PAGED_EXTEND_H
#define RADIXRT_PAGED_EXTEND_H

/* Vectors are VL floats (paged_simd.h): 16 with AVX-512, 8 on AVX2. The register blocks below are sized so
 * that their accumulators fill most of the target's vector registers (32 zmm / 16 ymm) without spilling. */
#include "paged_simd.h"

/* AVX-512 max / round / scale instructions in the softmax, unless PAGED_PORTABLE (then plain GNU C) */
#if defined(__AVX512F__) && !defined(PAGED_PORTABLE)
#include <immintrin.h>
#define USE_AVX512 1
#else
#define USE_AVX512 0
#endif

#define BK 64              /* keys per tile */
#define NKV (BK / VL)      /* score vectors per row of a tile */
#define RB 6               /* query rows per register block */
#if VL == 16
#define QKV 4 /* key vectors per Q K^T register block: RB x QKV accumulators (24 of 32 zmm) */
#define PVC 4 /* output vectors per P V register block (24 of 32 zmm) */
#else
#define QKV 2 /* 12 of 16 ymm, with 2 K vectors and a broadcast query */
#define PVC 2
#endif
/* Query rows per work item (tokens x G) when there is enough work, and new tokens per item at most. Each
 * item packs every K/V tile it reads once, so more rows spread that cost thinner, as long as the item's
 * queries, scores and outputs stay in L2 (384 rows: ~300 KB of fp32). On AVX2 (2 threads, float32, 256
 * tokens over a 3k prefix) 384 rows ran 1.2x faster than 192. */
#if VL == 16
#define ROWS_TARGET 192
#define QB_MAX 64
#else
#define ROWS_TARGET 384
#define QB_MAX 128
#endif
#define MIN_PARALLEL (1 << 18) /* below this many (row, key) pairs in all, run on the calling thread */

typedef uint16_t vh __attribute__((vector_size(VL * 2)));
#if USE_DPBF16
typedef uint16_t vh32 __attribute__((vector_size(64))); /* 32 bf16 */
#endif

/* One work item: new tokens [q0, q0 + nq) of request b, kv head h; cost ~ rows x keys. */
typedef struct {
    int64_t b, h, q0, nq, cost;
} item_t;

/* One call's arguments, shared by its threads. */
typedef struct {
    const char *q, *k_buf, *v_buf;
    const int64_t *slot_table, *qo_indptr, *seq_lens;
    int64_t q_stride, num_slots, table_stride, H, KVH, D, window;
    int64_t qb; /* new tokens per work item at most */
    float qscale; /* scale * log2(e) */
    int bf16;     /* the query and output are bf16 (else f32) */
    int kt;       /* the K/V element kind (paged_simd.h); KV_BF16 needs a bf16 query, KV_F32 an f32 one */
    const float *k_scale, *v_scale; /* float8 K/V: [KVH, D] and [KVH] dequantization scales, or NULL (1) */
    char* out;
    int err;
} job_t;

/* Per-thread scratch; every array starts 64-byte aligned. W = D rounded up to VL; with pairs (the
 * AVX512-BF16 path for bf16) K and Q hold bf16 pairs: KW = D/2 rounded up to VL 32-bit columns, else KW = W. */
typedef struct {
    float* q;     /* [Rp, D] queries times qscale, or with pairs [Rp, D/2] raw bf16 pairs */
    float* stage; /* [BK, KW] K rows staged (widened, padded) when they cannot be transposed in place */
    vf* kt;       /* [KW, NKV] K tile transposed: kt[d * NKV + v] holds keys VL v .. VL v + VL - 1 of column d */
    float* vp;    /* [BK, W] the tile's V rows in fp32, or with pairs [BK/2, W] key pairs (pack_v_pairs) */
    float* s;     /* [Rp, BK] scores, then probabilities (with pairs bf16, at each row's start) */
    float* o;     /* [Rp, W] running output */
    float *m, *alpha; /* [Rp] running max, this tile's rescale factor */
    vf* l;            /* [Rp] running sum, per lane */
} scratch_t;

/* VL x VL transpose of 32-bit lanes: r[i][j] -> r[j][i], by log2(VL) rounds of two-input shuffles; round b
 * swaps the off-diagonal b x b blocks of every 2b x 2b block (rows i and i + b exchange). */
static inline void transpose_vl(vf* r) {
#if VL == 16
    static const vi lo[4] = {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                             {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
                             {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
                             {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}};
    static const vi hi[4] = {{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
                             {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31},
                             {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31},
                             {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}};
#else
    static const vi lo[3] = {{0, 1, 2, 3, 8, 9, 10, 11}, {0, 1, 8, 9, 4, 5, 12, 13}, {0, 8, 2, 10, 4, 12, 6, 14}};
    static const vi hi[3] = {{4, 5, 6, 7, 12, 13, 14, 15}, {2, 3, 10, 11, 6, 7, 14, 15}, {1, 9, 3, 11, 5, 13, 7, 15}};
#endif
    for (int round = 0, b = VL / 2; b >= 1; round++, b /= 2)
        for (int i = 0; i < VL; i++) {
            if (i & b) continue;
            const vf a = r[i], c = r[i + b];
            r[i] = __builtin_shuffle(a, c, lo[round]);
            r[i + b] = __builtin_shuffle(a, c, hi[round]);
        }
}

/* dst[0, W) = the D elements (of kind kt) at src widened to fp32 (or copied), zero padded; src NULL: all
 * zero. */
static inline void load_row_f32(float* restrict dst, const char* restrict src, int64_t D, int64_t W, int kt) {
    int64_t d = 0;
    if (src && (kt == KV_E4M3 || kt == KV_E5M2)) {
        for (; d < D; d += 2 * VL) { /* fp8x32_to_f32 widens 2 VL codes */
            char tmp[2 * VL] = {0};
            const char* p = src + d;
            if (D - d < 2 * VL) p = memcpy(tmp, src + d, (size_t)(D - d));
            vf y[2];
            fp8x32_to_f32(p, kt, &y[0], &y[1]);
            memcpy(dst + d, y, (size_t)(W - d < 2 * VL ? W - d : 2 * VL) * sizeof(float));
        }
    } else if (src && kt == KV_F32) {
        for (; d + VL <= D; d += VL) memcpy(dst + d, src + 4 * d, sizeof(vf));
        for (; d < D; d++) memcpy(dst + d, src + 4 * d, 4);
    } else if (src) {
        for (; d + VL <= D; d += VL) {
            vh x;
            memcpy(&x, src + 2 * d, sizeof x);
            const vu w = __builtin_convertvector(x, vu) << 16;
            memcpy(dst + d, &w, sizeof w);
        }
        for (; d < D; d++) dst[d] = bf16_to_f32(((const uint16_t*)src)[d]);
    }
    for (; d < W; d++) dst[d] = 0.0f;
}

#if USE_DPBF16 /* the bf16 pair layouts of the AVX512-BF16 path (VL 16) */
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

#endif

/* Gather the tile's nk K and V rows (kv head h) through slots: K transposed into kt (fp32, or bf16 pairs
 * when pairs is set), V into vp (fp32, or pack_v_pairs). Rows past nk are zero. Then prefetch the next
 * tile's rows (next_slots[0, next_nk)) so that memory works while this tile is computed. */
static void pack_tile(const job_t* job, const int64_t* slots, int64_t nk, const int64_t* next_slots,
                      int64_t next_nk, int64_t h, scratch_t ws, int pairs) {
    const int64_t D = job->D, W = round_up(D, VL), elem = kv_elem(job->kt), row_bytes = D * elem;
    const int64_t KW = pairs ? round_up((D + 1) / 2, VL) : W; /* 32-bit columns of a K row */
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
    const int direct = pairs ? !fp8 && D % 32 == 0 : job->kt == KV_F32 && D % VL == 0;
    if (!direct)
        for (int64_t j = 0; j < BK; j++) {
            float* dst = ws.stage + j * KW;
            if (!pairs) {
                load_row_f32(dst, krow[j], D, KW, job->kt);
                continue;
            }
#if USE_DPBF16
            memset(dst, 0, (size_t)KW * 4);
            if (krow[j] && fp8) fp8_row_to_bf16((uint16_t*)dst, krow[j], D, job->kt);
            else if (krow[j]) memcpy(dst, krow[j], (size_t)row_bytes);
#endif
        }
    for (int64_t jb = 0; jb < NKV; jb++)
        for (int64_t db = 0; db < KW; db += VL) {
            vf r[VL];
            for (int i = 0; i < VL; i++) {
                const char* src = direct ? (krow[jb * VL + i] ? krow[jb * VL + i] + 4 * db : NULL)
                                         : (const char*)(ws.stage + (jb * VL + i) * KW + db);
                r[i] = (vf){0};
                if (src) memcpy(&r[i], src, sizeof(vf));
            }
            transpose_vl(r);
            for (int i = 0; i < VL; i++) ws.kt[(db + i) * NKV + jb] = r[i];
        }
#if USE_DPBF16
    if (pairs && fp8) { /* V rows as bf16 in the stage (free again: K is transposed), then paired */
        uint16_t* staged = (uint16_t*)ws.stage;
        for (int64_t j = 0; j < BK; j++) {
            if (!vrow[j]) continue;
            fp8_row_to_bf16(staged + j * D, vrow[j], D, job->kt);
            vrow[j] = (const char*)(staged + j * D);
        }
    }
    if (pairs) {
        pack_v_pairs(vrow, D, ws.vp);
    } else
#endif
        for (int64_t j = 0; j < BK; j++) load_row_f32(ws.vp + j * W, vrow[j], D, W, job->kt);
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

#endif /* RADIXRT_PAGED_EXTEND_H */
