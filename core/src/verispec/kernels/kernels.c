/* verispec's C kernels (CPU, fp32): attention over paged KV and RMSNorm; `verispec.kernels.ckernels`
 * builds this file once per machine and states each kernel's arithmetic in PyTorch for the tests.
 *
 * Causal / sliding-window GQA over paged fp32 KV: every row of every sequence in one call.
 *
 * The arithmetic of one (row, head) is fixed by this file alone, whatever the row count, the
 * other sequences, the block size or the instruction set, which is what makes a row computed
 * inside a verify or beside other sequences bitwise the row computed alone:
 *   s_t   = (((0 + q_0 k_0t) + q_1 k_1t) + ... + q_{D-1} k_{D-1,t}) * scaling   (d in order)
 *   m     = max of s_t over the visible slots t
 *   e_t   = vexp(s_t - m)                                  (below: Cody-Waite + cephes expf)
 *   den   = ((0 + e_t0) + e_t1) + ...                      (visible slots in slot order)
 *   o_d   = ((0 + e_t0 v_t0d) + e_t1 v_t1d) + ...          (same order)
 *   out_d = o_d / den
 * Each step is one IEEE fp32 operation: build with -ffp-contract=off (no fused multiply-add)
 * and without -ffast-math. Vectorised loops run across independent elements (slots for s,
 * dims for o), never across a reduction, so vector width does not change any result.
 * `verispec.kernels.ckernels` states the same arithmetic in PyTorch for the tests.
 *
 * Slot t of a sequence lives in block t / B at offset t % B. Per block:
 *   K transposed, fp32 [Hkv, D, B];  V fp32 [Hkv, B, D].
 * A slot is visible to the query at position p when its position sp (slot_pos[t], or t itself
 * when the sequence has no slot_pos table) satisfies 0 <= sp <= p and, with a window W > 0,
 * p - sp < W (the sliding rule of docs/reference/gemma4.md §3.1).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

/* One sequence's descriptor: DESC_FIELDS int64 values. */
enum { Q_ROW, N_ROWS, START_POS, NUM_SLOTS, BLOCK, K_TABLE, V_TABLE, SLOT_POS, WINDOW, DESC_FIELDS };

static inline int visible(int64_t sp, int64_t p, int64_t window) {
    return sp >= 0 && sp <= p && (window <= 0 || p - sp < window);
}

static inline v16 load16(const float *x) { v16 r; memcpy(&r, x, sizeof r); return r; }
static inline void store16(float *x, v16 r) { memcpy(x, &r, sizeof r); }

/* s[l] = (((0 + q_0 k[0][l]) + q_1 k[1][l]) + ...) * scaling for l < len; k: [D, stride]. The
 * tail of scores_heads (under 64 slots), one head. */
static void scores(const float *q, const float *k, int64_t stride, int64_t len, int64_t D, float scaling,
                   float *s) {
    int64_t l = 0;
    for (; l + 16 <= len; l += 16) {
        v16 a = splat(0.0f);
        for (int64_t d = 0; d < D; d++) a = a + splat(q[d]) * load16(k + d * stride + l);
        store16(s + l, a * splat(scaling));
    }
    for (; l < len; l++) {
        float a = 0.0f;
        for (int64_t d = 0; d < D; d++) a = a + q[d] * k[d * stride + l];
        s[l] = a * scaling;
    }
}

/* o[d] = o[d] + e_t v[t][d] and den = den + e_t over the slots t < len in order, skipping
 * e_t = 0 (a masked slot: adding it would change nothing). One head whose D is not a multiple
 * of 64 (pv_heads takes the others). */
static void pv(const float *e, const float *v, int64_t len, int64_t D, float *o, float *den) {
    for (int64_t t = 0; t < len; t++) {
        if (e[t] == 0.0f) continue;
        *den = *den + e[t];
        for (int64_t d = 0; d < D; d++) o[d] = o[d] + e[t] * v[t * D + d];
    }
}

/* The machine's own vectors (vn, VN_LANES floats) and how many of them each head keeps in flight
 * across a pass of scores_heads (slots) or pv_heads (columns): 4 of 16 lanes where there are 32
 * registers of 512 bits (AVX-512), 2 of 8 elsewhere (AVX2's 16 registers of 256 bits: v16 arrays of
 * 4 heads x 64 lanes spilled through memory on every step, and GCC keeps only native-width vector
 * arrays in registers). Lanes are independent elements, so the width changes no result. */
#if defined(__AVX512F__)
typedef float vn __attribute__((vector_size(64)));
#define VN_LANES 16
#define PASS_VECTORS 4
#else
typedef float vn __attribute__((vector_size(32)));
#define VN_LANES 8
#define PASS_VECTORS 2
#endif
#define PASS_LANES (VN_LANES * PASS_VECTORS)
static inline vn loadn(const float *x) { vn r; memcpy(&r, x, sizeof r); return r; }
static inline void storen(float *x, vn r) { memcpy(x, &r, sizeof r); }
static inline vn splatn(float x) { return (vn){0} + x; }

/* The same two loops for G <= 4 query heads of one row at once (the heads of one KV head share
 * each K and V load; per head the arithmetic is scores' and pv's, in the same order). */
static inline __attribute__((always_inline)) void scores_heads(const float *q, int64_t G, const float *k,
                                                               int64_t stride, int64_t len, int64_t D,
                                                               float scaling, float *s, int64_t ld) {
    int64_t l = 0;
    for (; l + PASS_LANES <= len; l += PASS_LANES) {
        vn a[4][PASS_VECTORS];
        for (int64_t h = 0; h < G; h++)
            for (int i = 0; i < PASS_VECTORS; i++) a[h][i] = splatn(0.0f);
        for (int64_t d = 0; d < D; d++) {
            const float *kd = k + d * stride + l;
            vn kv[PASS_VECTORS];
            for (int i = 0; i < PASS_VECTORS; i++) kv[i] = loadn(kd + VN_LANES * i);
            for (int64_t h = 0; h < G; h++) {
                const vn qd = splatn(q[h * D + d]);
                for (int i = 0; i < PASS_VECTORS; i++) a[h][i] = a[h][i] + qd * kv[i];
            }
        }
        for (int64_t h = 0; h < G; h++)
            for (int i = 0; i < PASS_VECTORS; i++) storen(s + h * ld + l + VN_LANES * i, a[h][i] * splatn(scaling));
    }
    if (l < len)
        for (int64_t h = 0; h < G; h++) scores(q + h * D, k + l, stride, len - l, D, scaling, s + h * ld + l);
}

/* o[h][d] += e[h][t] v[t][d], den[h] += e[h][t] for G <= 4 heads whose masked slots (e = 0)
 * coincide (one row's heads), D % 64 == 0: D in runs of PASS_LANES columns, den with the first. */
static inline __attribute__((always_inline)) void pv_heads(const float *e, int64_t ld, int64_t G, const float *v,
                                                           int64_t len, int64_t D, float *o, float *den) {
    for (int64_t c = 0; c < D; c += PASS_LANES) {
        vn a[4][PASS_VECTORS];
        float dn[4];
        for (int64_t h = 0; h < G; h++) {
            dn[h] = den[h];
            for (int i = 0; i < PASS_VECTORS; i++) a[h][i] = loadn(o + h * D + c + VN_LANES * i);
        }
        for (int64_t t = 0; t < len; t++) {
            if (e[t] == 0.0f) continue; /* masked for every head of the row */
            const float *vt = v + t * D + c;
            vn vv[PASS_VECTORS];
            for (int i = 0; i < PASS_VECTORS; i++) vv[i] = loadn(vt + VN_LANES * i);
            for (int64_t h = 0; h < G; h++) {
                const float eh = e[h * ld + t];
                const vn et = splatn(eh);
                if (c == 0) dn[h] = dn[h] + eh;
                for (int i = 0; i < PASS_VECTORS; i++) a[h][i] = a[h][i] + et * vv[i];
            }
        }
        for (int64_t h = 0; h < G; h++) {
            den[h] = dn[h];
            for (int i = 0; i < PASS_VECTORS; i++) storen(o + h * D + c + VN_LANES * i, a[h][i]);
        }
    }
}

#define HEADS_KERNELS(G)                                                                                   \
    static void scores_##G(const float *q, const float *k, int64_t stride, int64_t len, int64_t D,         \
                           float scaling, float *s, int64_t ld) {                                          \
        scores_heads(q, G, k, stride, len, D, scaling, s, ld);                                              \
    }                                                                                                      \
    static void pv_##G##_heads(const float *e, int64_t ld, const float *v, int64_t len, int64_t D, float *o, \
                               float *den) {                                                               \
        pv_heads(e, ld, G, v, len, D, o, den);                                                              \
    }
HEADS_KERNELS(1)
HEADS_KERNELS(2)
HEADS_KERNELS(3)
HEADS_KERNELS(4)

typedef void (*scores_fn)(const float *, const float *, int64_t, int64_t, int64_t, float, float *, int64_t);
typedef void (*pv_fn)(const float *, int64_t, const float *, int64_t, int64_t, float *, float *);
static const scores_fn SCORES[5] = {NULL, scores_1, scores_2, scores_3, scores_4};
static const pv_fn PV[5] = {NULL, pv_1_heads, pv_2_heads, pv_3_heads, pv_4_heads};

/* Rows of one sequence attended together (a verify's or a prefill chunk's): they share each
 * K/V block read. */
enum { ROWS_PER_UNIT = 8 };

/* The g query heads of one KV head for n <= ROWS_PER_UNIT consecutive rows of one sequence:
 * q, out fp32 rows of `stride` floats, the group's heads at offsets j * D; row r reads slots
 * [0, T[r]) and has per-slot bias (0 / -inf) and keep (1 / 0: visible / masked) at r * T16,
 * padded to round_up(T[r], 16) with -inf / 0; s: scratch [n, g, T16]; o: [n, g, D]; den:
 * [n, g]. Blocks are the outer loops, so each K and V block is read from memory once for all
 * n·g queries; each query's arithmetic is the header's, whatever n. */
static void attend_unit(const float *q, float *out, int64_t stride, int64_t n, int64_t g, const int64_t *desc,
                        const float *bias, const float *keep, const int64_t *T, int64_t T16, int64_t head_kv,
                        int64_t D, float scaling, float *s, float *o, float *den) {
    const int64_t B = desc[BLOCK];
    const float *const *kt = (const float *const *)(intptr_t)desc[K_TABLE];
    const float *const *vt = (const float *const *)(intptr_t)desc[V_TABLE];
    int64_t T_max = 0;
    for (int64_t r = 0; r < n; r++) T_max = T[r] > T_max ? T[r] : T_max;
    for (int64_t b0 = 0; b0 < T_max; b0 += B)
        for (int64_t r = 0; r < n; r++) {
            if (b0 >= T[r]) continue;
            const int64_t len = T[r] - b0 < B ? T[r] - b0 : B;
            for (int64_t j = 0; j < g; j += 4) /* up to 4 heads share each K load */
                SCORES[g - j < 4 ? g - j : 4](q + r * stride + j * D, kt[b0 / B] + head_kv * D * B, B, len, D,
                                              scaling, s + (r * g + j) * T16 + b0, T16);
        }
    for (int64_t r = 0; r < n; r++) {
        const int64_t T16r = (T[r] + 15) & ~(int64_t)15;
        const float *br = bias + r * T16, *kr = keep + r * T16;
        for (int64_t j = 0; j < g; j++) {
            float *sj = s + (r * g + j) * T16;
            for (int64_t t = T[r]; t < T16r; t++) sj[t] = 0.0f; /* finite padding; bias masks it */
            v16 mv = splat(-INFINITY);
            for (int64_t t = 0; t < T16r; t += 16) { /* max is exact in any order */
                const v16 x = load16(sj + t) + load16(br + t); /* s + 0 = s; s + -inf = -inf */
                const v16i greater = x > mv;
                mv = (v16)(((v16i)x & greater) | ((v16i)mv & ~greater));
            }
            float m = -INFINITY;
            for (int l = 0; l < 16; l++) m = mv[l] > m ? mv[l] : m;
            for (int64_t t = 0; t < T16r; t += 16) {
                v16 x = load16(sj + t) - splat(m); /* <= 0 where visible; masked slots may exceed 0 */
                const v16i above = x > splat(0.0f);
                x = (v16)((v16i)x & ~above); /* min(x, 0): a masked exp stays finite, so * 0 is 0 */
                store16(sj + t, vexp(x) * load16(kr + t));
            }
            den[r * g + j] = 0.0f;
            for (int64_t d = 0; d < D; d++) o[(r * g + j) * D + d] = 0.0f;
        }
    }
    for (int64_t b0 = 0; b0 < T_max; b0 += B)
        for (int64_t r = 0; r < n; r++) {
            if (b0 >= T[r]) continue;
            const int64_t len = T[r] - b0 < B ? T[r] - b0 : B;
            const float *vb = vt[b0 / B] + head_kv * B * D;
            if (D % 64)
                for (int64_t j = 0; j < g; j++)
                    pv(s + (r * g + j) * T16 + b0, vb, len, D, o + (r * g + j) * D, den + r * g + j);
            else
                for (int64_t j = 0; j < g; j += 4) /* up to 4 heads share each V load */
                    PV[g - j < 4 ? g - j : 4](s + (r * g + j) * T16 + b0, T16, vb, len, D, o + (r * g + j) * D,
                                              den + r * g + j);
        }
    for (int64_t r = 0; r < n; r++)
        for (int64_t j = 0; j < g; j++)
            for (int64_t d = 0; d < D; d++)
                out[r * stride + j * D + d] = o[(r * g + j) * D + d] / den[r * g + j];
}

typedef struct {
    const float *q;
    float *out;
    const int64_t *desc;
    int64_t num_seqs, H, Hkv, D, max_slots, max_rows;
    float scaling;
    int status;
} job;

/* Units of up to ROWS_PER_UNIT rows of one sequence, flattened over sequences; job `task` of
 * `tasks` takes every tasks-th unit from its own index. A sequence of n rows is cut into units of
 * min(ROWS_PER_UNIT, ceil(n / tasks)) rows, so a verify's few rows are shared between the threads
 * (9 rows on 2 threads: 5 + 4, not 8 + 1); a row's arithmetic is the same in any unit. */
static void run_job(void *arg, int64_t task, int64_t tasks) {
    job *jb = (job *)arg + task;
    const int64_t T16 = (jb->max_slots + 15) & ~(int64_t)15, group = jb->H / jb->Hkv;
    const int64_t R = jb->max_rows < ROWS_PER_UNIT ? jb->max_rows : ROWS_PER_UNIT; /* scratch for a decode: 1 */
    float *s = malloc(sizeof(float) * (R * group * T16 + 2 * R * T16 + R * group * jb->D + R * group));
    if (!s) {
        jb->status = -1;
        return;
    }
    float *bias = s + R * group * T16, *keep = bias + R * T16, *o = keep + R * T16, *den = o + R * group * jb->D;
    int64_t T[ROWS_PER_UNIT], index = 0;
    for (int64_t i = 0; i < jb->num_seqs; i++) {
        const int64_t *dsc = jb->desc + i * DESC_FIELDS;
        const int64_t *slot_pos = (const int64_t *)(intptr_t)dsc[SLOT_POS];
        const int64_t share = (dsc[N_ROWS] + tasks - 1) / tasks, unit = share < R ? share : R;
        for (int64_t r0 = 0; r0 < dsc[N_ROWS]; r0 += unit, index++) {
            if (index % tasks != task) continue;
            const int64_t n = dsc[N_ROWS] - r0 < unit ? dsc[N_ROWS] - r0 : unit;
            for (int64_t r = 0; r < n; r++) {
                const int64_t p = dsc[START_POS] + r0 + r;
                T[r] = dsc[NUM_SLOTS];
                /* slot = position: slots past p are never visible, so a row reads up to p's run of 16
                 * (the masked slots between add exact zeros, and keep the loops vectorised) */
                if (!slot_pos && T[r] > ((p + 16) & ~(int64_t)15)) T[r] = (p + 16) & ~(int64_t)15;
                const int64_t T16r = (T[r] + 15) & ~(int64_t)15;
                for (int64_t t = 0; t < T16r; t++) {
                    const int vis = t < T[r] && visible(slot_pos ? slot_pos[t] : t, p, dsc[WINDOW]);
                    bias[r * T16 + t] = vis ? 0.0f : -INFINITY;
                    keep[r * T16 + t] = vis ? 1.0f : 0.0f;
                }
            }
            const int64_t row = dsc[Q_ROW] + r0;
            for (int64_t h = 0; h < jb->Hkv; h++) {
                const int64_t first = (row * jb->H + h * group) * jb->D;
                attend_unit(jb->q + first, jb->out + first, jb->H * jb->D, n, group, dsc, bias, keep, T, T16, h,
                            jb->D, jb->scaling, s, o, den);
            }
        }
    }
    free(s);
    jb->status = 0;
}

/* Copy k, v fp32 [rows, Hkv, D] into each sequence's blocks at its rows' slots: slot = position,
 * or position mod B for a ring (a sequence with slot_pos; its one block holds all B slots). */
static void write_kv(const float *k, const float *v, const int64_t *desc, int64_t num_seqs, int64_t Hkv,
                     int64_t D) {
    for (int64_t i = 0; i < num_seqs; i++) {
        const int64_t *dsc = desc + i * DESC_FIELDS;
        const int64_t B = dsc[BLOCK];
        float *const *kt = (float *const *)(intptr_t)dsc[K_TABLE];
        float *const *vt = (float *const *)(intptr_t)dsc[V_TABLE];
        for (int64_t r = 0; r < dsc[N_ROWS]; r++) {
            const int64_t row = dsc[Q_ROW] + r, p = dsc[START_POS] + r;
            const int64_t slot = dsc[SLOT_POS] ? p % B : p, off = slot % B;
            float *kb = kt[slot / B], *vb = vt[slot / B];
            for (int64_t h = 0; h < Hkv; h++) {
                const float *kr = k + (row * Hkv + h) * D, *vr = v + (row * Hkv + h) * D;
                for (int64_t d = 0; d < D; d++) kb[(h * D + d) * B + off] = kr[d];
                memcpy(vb + (h * B + off) * D, vr, sizeof(float) * D);
            }
        }
    }
}

/* q, out: fp32 [rows, H, D] (each sequence's rows contiguous); k, v: fp32 [rows, Hkv, D] to
 * write first (write_kv), or NULL (a KV-shared layer reads what its source wrote); desc: int64
 * [num_seqs, DESC_FIELDS]. threads > 1 splits the units of rows between threads (each row is
 * computed the same way wherever it runs). Returns 0, or -1 when scratch memory ran out. */
int verispec_attend(const float *q, const float *k, const float *v, float *out, const int64_t *desc,
                    int64_t num_seqs, int64_t H, int64_t Hkv, int64_t D, float scaling, int64_t threads) {
    if (k) write_kv(k, v, desc, num_seqs, Hkv, D);
    int64_t max_slots = 0, max_rows = 1;
    for (int64_t i = 0; i < num_seqs; i++) {
        if (desc[i * DESC_FIELDS + NUM_SLOTS] > max_slots) max_slots = desc[i * DESC_FIELDS + NUM_SLOTS];
        if (desc[i * DESC_FIELDS + N_ROWS] > max_rows) max_rows = desc[i * DESC_FIELDS + N_ROWS];
    }
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    job jobs[64];
    for (int64_t j = 0; j < threads; j++)
        jobs[j] = (job){q, out, desc, num_seqs, H, Hkv, D, max_slots, max_rows, scaling, -1};
    run_tasks(run_job, jobs, threads);
    int status = 0;
    for (int64_t j = 0; j < threads; j++) status |= jobs[j].status;
    return status;
}

/* RMSNorm of each row: x, out fp32 [rows, dim]; w fp32 [dim] or NULL (no weight).
 *   ss    = 16 lane sums, lane l adding x_i * x_i for i = l, l + 16, ... in order, then
 *           lanes folded in halves: l + 8, then l + 4, l + 2, l + 1
 *   r     = 1 / sqrt(ss / dim + eps)
 *   out_i = (x_i * r) * w_i
 * The same per-row arithmetic as y = x / sqrt(mean(x^2) + eps) * w (transformers
 * Gemma3RMSNorm / LlamaRMSNorm), with the reduction order fixed here. */
void verispec_rms_norm(const float *x, const float *w, float *out, int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *yr = out + r * dim;
        v16 acc = splat(0.0f);
        int64_t i = 0;
        for (; i + 16 <= dim; i += 16) {
            const v16 xi = load16(xr + i);
            acc = acc + xi * xi;
        }
        if (i < dim) { /* the tail's missing lanes add 0 */
            float tail[16] = {0};
            memcpy(tail, xr + i, sizeof(float) * (dim - i));
            const v16 xi = load16(tail);
            acc = acc + xi * xi;
        }
        float lanes[16];
        store16(lanes, acc);
        for (int half = 8; half >= 1; half /= 2)
            for (int l = 0; l < half; l++) lanes[l] = lanes[l] + lanes[l + half];
        const float inv = 1.0f / sqrtf(lanes[0] / (float)dim + eps);
        if (w)
            for (int64_t j = 0; j < dim; j++) yr[j] = (xr[j] * inv) * w[j];
        else
            for (int64_t j = 0; j < dim; j++) yr[j] = xr[j] * inv;
    }
}
