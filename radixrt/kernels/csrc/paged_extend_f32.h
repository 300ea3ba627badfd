/* paged_extend.c's float32 path (every call but the AVX512-BF16 one): scores computed transposed, so that
 * neither K nor V is packed. Included by paged_extend.c only, after paged_extend.h.
 *
 * An item's queries are transposed once, qt[d][r] (times the softmax scale in log2 units and the K scales).
 * Per tile of BK keys:
 *   scores   S^T[BK, Rp] = K Q^T: KB keys (scalars broadcast straight from the K rows) x TV vectors of
 *            query rows per register block; no transposed K tile, no horizontal sums;
 *   softmax  column-wise: the running max, sum and rescale factor of VL query rows are one vector each;
 *   values   O[Rp, D] = alpha * O + P V: RB rows x PVC vectors of channels, P^T scalars broadcast, V vectors
 *            loaded straight from the V rows.
 * K and V rows are read in place from a float32 pool (V when D is a multiple of VL, so that its vectors stay
 * inside the row); other kinds (bf16 without AVX512-BF16, float8) and partial V rows are widened into a
 * staged tile of BK rows first. Rows past the tile's end (and slots out of range) read a zero row.
 *
 * Why: the packed layout (paged_extend.h's pack_tile) transposes each K tile and copies each V tile once per
 * item that reads it; on AVX2 (float32, 256 tokens over a 3k prefix) that packing was 20% of the kernel, and
 * the softmax's per-row maxima needed a transpose of their own. */
#ifndef RADIXRT_PAGED_EXTEND_F32_H
#define RADIXRT_PAGED_EXTEND_F32_H

#define KB 6 /* keys per S^T register block (the last block of a tile: BK % KB) */
#if VL == 16
#define TV 4 /* query-row vectors per S^T register block: KB x TV accumulators (24 of 32 zmm) */
#else
#define TV 2 /* 12 of 16 ymm */
#endif
#define RP_ALIGN (VL == 16 ? 48 : 24) /* rows are padded to a multiple of VL and RB */

typedef float vfu __attribute__((vector_size(VL * 4), aligned(4))); /* an unaligned vector (pool rows) */

/* S^T rows [j0, j0 + NK) (keys) x query-row vectors [v0, v0 + NV) = K rows . qt (NK <= KB, NV <= TV). */
static inline __attribute__((always_inline)) void st_block(const float* const* restrict krow, const float* restrict qt,
                                                           int64_t Rp, int64_t D, float* restrict st, int64_t j0,
                                                           int64_t v0, const int NK, const int NV) {
    vf acc[KB][TV];
    for (int k = 0; k < NK; k++)
        for (int v = 0; v < NV; v++) acc[k][v] = (vf){0};
    for (int64_t d = 0; d < D; d++) {
        vf q[TV];
        for (int v = 0; v < NV; v++) q[v] = *(const vf*)(qt + d * Rp + (v0 + v) * VL);
        for (int k = 0; k < NK; k++) {
            const float x = krow[j0 + k][d];
            for (int v = 0; v < NV; v++) acc[k][v] += x * q[v];
        }
    }
    for (int k = 0; k < NK; k++)
        for (int v = 0; v < NV; v++) *(vf*)(st + (j0 + k) * Rp + (v0 + v) * VL) = acc[k][v];
}

/* Query-row vectors outer, keys inner: a block's slice of qt (D x TV vectors) and the tile's K rows stay in L1
 * while every key block reads them. */
static void st_tile(const float* const* krow, const float* qt, int64_t Rp, int64_t D, float* st) {
    const int64_t nv = Rp / VL, jfull = BK - BK % KB;
    int64_t v0 = 0;
    for (; v0 + TV <= nv; v0 += TV) {
        for (int64_t j0 = 0; j0 < jfull; j0 += KB) st_block(krow, qt, Rp, D, st, j0, v0, KB, TV);
        if (BK % KB) st_block(krow, qt, Rp, D, st, jfull, v0, BK % KB, TV);
    }
    for (; v0 < nv; v0++) {
        for (int64_t j0 = 0; j0 < jfull; j0 += KB) st_block(krow, qt, Rp, D, st, j0, v0, KB, 1);
        if (BK % KB) st_block(krow, qt, Rp, D, st, jfull, v0, BK % KB, 1);
    }
}

/* O rows [r0, r0 + RB), channel vectors [c0, c0 + NC) = alpha * O + P[rows, :nk] V (P read from P^T). */
static inline __attribute__((always_inline)) void pv_t_block(const float* restrict pt, int64_t Rp,
                                                             const float* restrict alpha,
                                                             const float* const* restrict vrow, int64_t nk,
                                                             float* restrict o, int64_t W, int64_t r0, int64_t c0,
                                                             const int NC) {
    vf acc[RB][PVC];
    for (int i = 0; i < RB; i++)
        for (int c = 0; c < NC; c++) acc[i][c] = *(const vf*)(o + (r0 + i) * W + (c0 + c) * VL) * alpha[r0 + i];
    for (int64_t j = 0; j < nk; j++) {
        vf v[PVC];
        for (int c = 0; c < NC; c++) v[c] = (vf)(*(const vfu*)(vrow[j] + (c0 + c) * VL));
        for (int i = 0; i < RB; i++) {
            const float x = pt[j * Rp + r0 + i];
            for (int c = 0; c < NC; c++) acc[i][c] += x * v[c];
        }
    }
    for (int i = 0; i < RB; i++)
        for (int c = 0; c < NC; c++) *(vf*)(o + (r0 + i) * W + (c0 + c) * VL) = acc[i][c];
}

static void pv_t_tile(const float* pt, int64_t Rp, const float* alpha, const float* const* vrow, int64_t nk,
                      float* o, int64_t W) {
    const int64_t nvec = W / VL;
    for (int64_t r0 = 0; r0 < Rp; r0 += RB) {
        int64_t c0 = 0;
        for (; c0 + PVC <= nvec; c0 += PVC) pv_t_block(pt, Rp, alpha, vrow, nk, o, W, r0, c0, PVC);
        switch (nvec - c0) { /* fewer than PVC vectors left */
        case 1: pv_t_block(pt, Rp, alpha, vrow, nk, o, W, r0, c0, 1); break;
#if PVC > 2
        case 2: pv_t_block(pt, Rp, alpha, vrow, nk, o, W, r0, c0, 2); break;
        case 3: pv_t_block(pt, Rp, alpha, vrow, nk, o, W, r0, c0, 3); break;
#endif
        default: break;
        }
    }
}

/* Mask, then online-softmax update of the tile's S^T columns, VL query rows at a time: row r is at position
 * apos[r] and sees the keys at positions <= its own (and > its own - window); key j is at position k0 + j,
 * and only j < nk exist. S^T becomes P^T = 2^(s - m); m, l, alpha per row. */
static void softmax_t(float* restrict st, int64_t Rp, int64_t nk, int64_t k0, const int32_t* restrict apos,
                      int64_t window, int full, float* restrict m, float* restrict l, float* restrict alpha) {
    const vf ninf = (vf){0} - INFINITY;
    for (int64_t r = 0; r < Rp; r += VL) {
        vi pos, lo;
        memcpy(&pos, apos + r, sizeof pos);
        lo = pos - (int32_t)window; /* keys at positions > lo are visible (window > 0) */
        vf mx = ninf;
        for (int64_t j = 0; j < BK; j++) {
            vf* s = (vf*)(st + j * Rp + r);
            if (!full) {
                const int32_t kp = (int32_t)(k0 + j);
                vi ok = pos >= kp;
                if (window > 0) ok &= lo < kp;
                if (j >= nk) ok = (vi){0};
                *s = (vf)(((vi)*s & ok) | ((vi)ninf & ~ok));
            }
            mx = vmaxf(mx, *s);
        }
        vf m_old, l_old;
        memcpy(&m_old, m + r, sizeof m_old);
        memcpy(&l_old, l + r, sizeof l_old);
        const vf m_new = vmaxf(mx, m_old);
        const vi none = m_new == -INFINITY;                     /* nothing visible yet: alpha 1, P 0 */
        const vf a = exp2_np((vf)((vi)(m_old - m_new) & ~none)); /* 0 at the first visible tile */
        const vf shift = (vf)((vi)m_new & ~none);               /* -inf - 0 gives P 0, not NaN */
        vf sum = {0};
        for (int64_t j = 0; j < BK; j++) {
            vf* s = (vf*)(st + j * Rp + r);
            const vf p = exp2_np(*s - shift);
            *s = p;
            sum += p;
        }
        const vf l_new = l_old * a + sum;
        memcpy(m + r, &m_new, sizeof m_new);
        memcpy(l + r, &l_new, sizeof l_new);
        memcpy(alpha + r, &a, sizeof a);
    }
}

/* Row pointers to the tile's nk K (or V) rows of kv head h: in the pool where `direct`, else widened into
 * stage ([BK, W]); rows past nk and out-of-range slots (an error, flagged) read `zero`. */
static void tile_rows(job_t* job, const char* buf, const int64_t* slots, int64_t nk, int64_t h, int direct,
                      float* stage, const float* zero, const float** rows) {
    const int64_t D = job->D, W = round_up(D, VL), row_bytes = D * kv_elem(job->kt);
    for (int64_t j = 0; j < BK; j++) {
        const int64_t slot = j < nk ? slots[j] : -1;
        rows[j] = zero;
        if ((uint64_t)slot < (uint64_t)job->num_slots) {
            const char* src = buf + (slot * job->KVH + h) * row_bytes;
            if (direct) {
                rows[j] = (const float*)src;
            } else {
                load_row_f32(stage + j * W, src, D, W, job->kt);
                rows[j] = stage + j * W;
            }
        } else if (j < nk) {
            __atomic_store_n(&job->err, 2, __ATOMIC_RELAXED);
        }
    }
}

/* One item on the float32 path, its output stored. */
static void run_item_f32(job_t* job, const item_t* it) {
    const int64_t D = job->D, G = job->H / job->KVH, W = round_up(D, VL), R = it->nq * G;
    const int64_t Rp = round_up(R, RP_ALIGN);
    const int64_t floats = D * Rp + BK * Rp + Rp * W + 2 * BK * W + W + 3 * Rp;
    float* base = thread_buffer(0, (size_t)floats * sizeof(float) + (size_t)Rp * sizeof(int32_t));
    if (!base) {
        __atomic_store_n(&job->err, 3, __ATOMIC_RELAXED);
        return;
    }
    /* every array starts VL-aligned: D * Rp, BK * Rp, Rp * W, BK * W and W are multiples of VL */
    float *qt = base, *st = qt + D * Rp, *o = st + BK * Rp, *kstage = o + Rp * W, *vstage = kstage + BK * W;
    float *zero = vstage + BK * W, *m = zero + W, *l = m + Rp, *alpha = l + Rp;
    int32_t* apos = (int32_t*)(alpha + Rp);
    memset(zero, 0, (size_t)W * sizeof(float));
    const int64_t n_new = job->qo_indptr[it->b + 1] - job->qo_indptr[it->b];
    const int64_t apos0 = job->seq_lens[it->b] - n_new + it->q0; /* position of the item's first token */
    const int64_t t0 = job->qo_indptr[it->b] + it->q0;
    const float* ks = job->k_scale ? job->k_scale + it->h * D : NULL;
    float row[W];
    for (int64_t r = 0; r < Rp; r++) { /* padding rows: zero queries, any position (never stored) */
        apos[r] = (int32_t)(apos0 + (r < R ? r / G : it->nq - 1));
        m[r] = -INFINITY, l[r] = 0.0f;
        if (r < R) {
            const char* src = job->q + ((t0 + r / G) * job->q_stride + (it->h * G + r % G) * D) * (job->bf16 ? 2 : 4);
            load_row_f32(row, src, D, W, job->bf16 ? KV_BF16 : KV_F32);
        }
        for (int64_t d = 0; d < D; d++) qt[d * Rp + r] = r < R ? row[d] * (ks ? job->qscale * ks[d] : job->qscale) : 0.0f;
    }
    memset(o, 0, (size_t)(Rp * W) * sizeof(float));
    const int k_direct = job->kt == KV_F32, v_direct = job->kt == KV_F32 && D % VL == 0;
    const int64_t kend = apos0 + it->nq; /* keys [kbeg, kend) */
    const int64_t kbeg = job->window > 0 && apos0 - job->window + 1 > 0 ? apos0 - job->window + 1 : 0;
    const int64_t* slots = job->slot_table + it->b * job->table_stride;
    const int64_t row_bytes = D * kv_elem(job->kt);
    const float* krow[BK];
    const float* vrow[BK];
    for (int64_t k0 = kbeg; k0 < kend; k0 += BK) {
        const int64_t nk = kend - k0 < BK ? kend - k0 : BK;
        tile_rows(job, job->k_buf, slots + k0, nk, it->h, k_direct, kstage, zero, krow);
        tile_rows(job, job->v_buf, slots + k0, nk, it->h, v_direct, vstage, zero, vrow);
        for (int64_t j = 0; j < kend - k0 - BK && j < BK; j++) { /* the next tile's rows, while this one runs */
            const int64_t slot = slots[k0 + BK + j];
            if ((uint64_t)slot >= (uint64_t)job->num_slots) continue;
            const int64_t off = (slot * job->KVH + it->h) * row_bytes;
            for (int64_t b = 0; b < row_bytes; b += 64) {
                __builtin_prefetch(job->k_buf + off + b);
                __builtin_prefetch(job->v_buf + off + b);
            }
        }
        st_tile(krow, qt, Rp, D, st);
        /* most tiles are wholly visible to every row of the item: no mask */
        const int full = nk == BK && k0 + BK - 1 <= apos0 &&
                         (job->window <= 0 || k0 > apos0 + it->nq - 1 - job->window);
        softmax_t(st, Rp, nk, k0, apos, job->window, full, m, l, alpha);
        pv_t_tile(st, Rp, alpha, vrow, nk, o, W);
    }
    store_rows(job, it, o, l, G, W);
}

#endif /* RADIXRT_PAGED_EXTEND_F32_H */
