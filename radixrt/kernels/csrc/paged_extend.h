/* paged_extend.c's types, tile sizes and row widening, shared by its float32 path (paged_extend_f32.h) and its
 * AVX512-BF16 path (paged_extend_bf16.h). Included by paged_extend.c only. */
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
#define PVC 4 /* output vectors per P V register block: RB x PVC accumulators (24 of 32 zmm) */
#else
#define PVC 2 /* 12 of 16 ymm, with 2 V vectors and a broadcast probability */
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

#endif /* RADIXRT_PAGED_EXTEND_H */
