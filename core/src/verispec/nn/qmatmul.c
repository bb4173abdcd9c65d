/* GGUF-block linears on the CPU: y = x · Wᵀ with W the file's own quantised values.
 * `verispec.nn.block_linear` packs the weights and states this arithmetic in PyTorch for the
 * tests. Three paths, chosen by what -march=native offers, all giving the same bits: AVX-512
 * VNNI (vpdpbusd), AVX2 (maddubs; ~3x VNNI's time), and a plain loop the compiler vectorises as
 * it can (other CPUs, or -DVERISPEC_PORTABLE; ~20x). Threads: torch's OpenMP team.
 *
 * Weights (packed by block_linear.pack): every weight is u · s + m with u an unsigned integer
 * the file stores (Q8_0's q + 128, Q5_0's q + 16, Q6_K's q + 32, Q4_x's nibble, ...), s and m
 * per group of G = 16 or 32 input columns (m = 0 for a type without a min, which instead
 * carries its offset in the integer zero point z: w = (u - z) · s). Output rows come in tiles
 * of 16, a tile's 32 columns of one block in as many bits a weight as the file's type has:
 *   8 bits:    8 vectors j of 64 bytes; byte 4r + t of vector j = u[r][4j + t]
 *   4 bits:    4 vectors j; byte 4r + t = (u[r][4j + t] | u[r][16 + 4j + t] << 4) & 0xFF
 *   5, 6 bits: the 4-bit part (bits 0-3 of u), then for each higher bit p = 4 .. bits - 1 a
 *              plane of 8 64-bit words j: bit 4r + t of word j = bit p of u[r][4j + t]
 *              (Q5_x: 320 bytes a tile and block instead of 512, Q6_K: 384)
 * then s (and m when the type has mins) as [32 / G][16] per tile and block: fp16 for a type
 * whose scales are the file's fp16 fields (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: exact), else fp32.
 *
 * Activations: each row of x is quantised per block of 32 columns as llama.cpp's
 * quantize_row_q8_0 does (ggml-quants.c):
 *   d = amax_i |x_i| / 127,  id = d > 0 ? 1 / d : 0,  a_i = rint(x_i · id)   (int8, ties to even)
 * and the a_i of each 16 columns are summed (S_h, an integer).
 *
 * Output (each step one IEEE fp32 operation; -ffp-contract=off): for row r, output o, y = 0, then
 * for every block b in order, for each group h of the block in order:
 *   I  = sum_i u_i a_i - z · S_h                    (exact int32: any order, any vector width)
 *   y  = y + (float)I · (s_h · d_b)
 *   y  = y + (m_h · d_b) · (float)S_h               (types with mins only)
 * A row's bits therefore depend on nothing but the row and the weights: not on the other rows
 * of the call, the threads, or the instruction set.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && !defined(VERISPEC_PORTABLE)
#include <immintrin.h>
#define VNNI 1
#define AVX2 0
#elif defined(__AVX2__) && defined(__F16C__) && !defined(VERISPEC_PORTABLE)
#include <immintrin.h>
#define VNNI 0
#define AVX2 1
#else
#define VNNI 0
#define AVX2 0
#endif

/* ---- activations */

/* x fp32 [n, k] (k % 32 == 0) -> a int8 [n, k], d fp32 [n, k / 32], S int32 [n, k / 16]. */
static void quantize_rows(const float *x, int64_t n, int64_t k, int8_t *a, float *d, int32_t *S) {
    for (int64_t r = 0; r < n; r++)
        for (int64_t b = 0; b < k / 32; b++) {
            const float *xb = x + r * k + b * 32;
            float amax = 0.0f;
            for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(xb[i]));
            const float db = amax / 127.0f, id = db > 0.0f ? 1.0f / db : 0.0f;
            int8_t *ab = a + r * k + b * 32;
            for (int h = 0; h < 2; h++) {
                int32_t sum = 0;
                for (int i = 16 * h; i < 16 * h + 16; i++) {
                    ab[i] = (int8_t)rintf(xb[i] * id);
                    sum += ab[i];
                }
                S[r * (k / 16) + 2 * b + h] = sum;
            }
            d[r * (k / 32) + b] = db;
        }
}

/* ---- the product */

typedef struct {
    const uint8_t *w;
    const void *s, *m; /* fp16 or fp32 (half); m NULL: no mins */
    const int8_t *a;
    const float *d;
    const int32_t *S;
    float *y;
    int64_t n, k, out, bits, group, zero, half, ldy;
} qjob;

/* Bytes of one tile's block of 32 columns. */
static inline int64_t tile_block_bytes(int64_t bits) { return bits == 8 ? 512 : 256 + 64 * (bits - 4); }

/* Group scale (or min) i of tile t, block b: element ((t * nb + b) * gpb * 16 + i). */
static inline const void *group_vals(const qjob *q, const void *v, int64_t t, int64_t b) {
    const int64_t nb = q->k / 32, gpb = 32 / q->group;
    return (const char *)v + (t * nb + b) * gpb * 16 * (q->half ? 2 : 4);
}

static inline float half_to_float(uint16_t bits) {
    _Float16 h;
    memcpy(&h, &bits, sizeof h);
    return (float)h;
}

static inline float group_val(const qjob *q, const void *v, int64_t i) {
    return q->half ? half_to_float(((const uint16_t *)v)[i]) : ((const float *)v)[i];
}

#define ROWS 8     /* activation rows sharing each weight load */
#define PREFETCH 8 /* blocks ahead to prefetch: one thread streamed Q4_1 at 12 GB/s without, 16-20 with */

#if AVX2
static inline __m256 load_group8(const qjob *q, const void *v, int64_t i) {
    return q->half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)v + i)))
                   : _mm256_loadu_ps((const float *)v + i);
}
#endif

#if VNNI
static inline __m512 load_group(const qjob *q, const void *v, int64_t h) {
    return q->half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)v + 16 * h)))
                   : _mm512_loadu_ps((const float *)v + 16 * h);
}
#endif

/* Rows r0 .. r0 + R - 1 of tile t: y[r][16 t + lane]. */
static void tile_rows(const qjob *q, int64_t t, int64_t r0, int64_t R) {
    const int64_t nb = q->k / 32, gpb = 32 / q->group, bytes = tile_block_bytes(q->bits);
    const int64_t lanes = q->out - 16 * t < 16 ? q->out - 16 * t : 16;
#if VNNI
    __m512 acc[ROWS];
    for (int64_t r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = q->w + (t * nb + b) * bytes;
        for (int64_t p = 0; p < bytes; p += 64) _mm_prefetch((const char *)wb + PREFETCH * bytes + p, _MM_HINT_T0);
        __m512i wv[8];
        if (q->bits == 8)
            for (int j = 0; j < 8; j++) wv[j] = _mm512_loadu_si512(wb + 64 * j);
        else
            for (int j = 0; j < 4; j++) {
                const __m512i v = _mm512_loadu_si512(wb + 64 * j);
                wv[j] = _mm512_and_si512(v, low);
                wv[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
        for (int64_t p = 0; p < q->bits - 4 && q->bits < 8; p++) { /* higher bit planes: add 2^(4+p) */
            const __m512i bit = _mm512_set1_epi8((char)(16 << p));
            for (int j = 0; j < 8; j++) {
                uint64_t mask;
                memcpy(&mask, wb + 256 + 64 * p + 8 * j, 8);
                wv[j] = _mm512_mask_add_epi8(wv[j], (__mmask64)mask, wv[j], bit);
            }
        }
        const void *sb = group_vals(q, q->s, t, b), *mb = q->m ? group_vals(q, q->m, t, b) : NULL;
        __m512 sv[2], mv[2];
        for (int64_t h = 0; h < gpb; h++) {
            sv[h] = load_group(q, sb, h);
            if (mb) mv[h] = load_group(q, mb, h);
        }
        for (int64_t r = 0; r < R; r++) {
            const int8_t *ab = q->a + (r0 + r) * q->k + b * 32;
            const int32_t *Sb = q->S + (r0 + r) * (q->k / 16) + 2 * b;
            const __m512 db = _mm512_set1_ps(q->d[(r0 + r) * nb + b]);
            __m512i i0 = _mm512_setzero_si512(), i1 = _mm512_setzero_si512();
            int32_t a4[8];
            memcpy(a4, ab, 32);
            for (int j = 0; j < 4; j += 2) {
                i0 = _mm512_dpbusd_epi32(i0, wv[j], _mm512_set1_epi32(a4[j]));
                i1 = _mm512_dpbusd_epi32(i1, wv[j + 1], _mm512_set1_epi32(a4[j + 1]));
            }
            __m512i i2 = _mm512_setzero_si512(), i3 = _mm512_setzero_si512();
            for (int j = 4; j < 8; j += 2) {
                i2 = _mm512_dpbusd_epi32(i2, wv[j], _mm512_set1_epi32(a4[j]));
                i3 = _mm512_dpbusd_epi32(i3, wv[j + 1], _mm512_set1_epi32(a4[j + 1]));
            }
            __m512i I[2];
            int32_t Sg[2];
            if (gpb == 1) {
                I[0] = _mm512_add_epi32(_mm512_add_epi32(i0, i1), _mm512_add_epi32(i2, i3));
                Sg[0] = Sb[0] + Sb[1];
            } else {
                I[0] = _mm512_add_epi32(i0, i1);
                I[1] = _mm512_add_epi32(i2, i3);
                Sg[0] = Sb[0];
                Sg[1] = Sb[1];
            }
            for (int64_t h = 0; h < gpb; h++) {
                const __m512i Ih = _mm512_sub_epi32(I[h], _mm512_set1_epi32((int32_t)q->zero * Sg[h]));
                const __m512 sd = _mm512_mul_ps(sv[h], db);
                acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(Ih), sd));
                if (mb) {
                    const __m512 md = _mm512_mul_ps(mv[h], db);
                    acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(md, _mm512_set1_ps((float)Sg[h])));
                }
            }
        }
    }
    const __mmask16 mask = (__mmask16)((1u << lanes) - 1);
    for (int64_t r = 0; r < R; r++) _mm512_mask_storeu_ps(q->y + (r0 + r) * q->ldy + 16 * t, mask, acc[r]);
#elif AVX2
    /* The tile as two halves of 8 rows (bytes 0-31 and 32-63 of each 64-byte vector). u8 · s8
     * products summed in pairs by maddubs saturate above 32767: u <= 63 (4 to 6 bits) cannot
     * reach it (63 · 127 · 2), and 8-bit u is split into its two nibbles. */
    __m256 acc[ROWS][2];
    for (int64_t r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), sixteen = _mm256_set1_epi16(16);
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3,
                                            3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = q->w + (t * nb + b) * bytes;
        __m256i wv[8][2], hv[8][2]; /* [j][half]; hv: 8-bit u's high nibbles */
        for (int j = 0; j < 8; j++)
            for (int half = 0; half < 2; half++) {
                if (q->bits == 8) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(wb + 64 * j + 32 * half));
                    wv[j][half] = _mm256_and_si256(v, low);
                    hv[j][half] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                    continue;
                }
                const __m256i v = _mm256_loadu_si256((const __m256i *)(wb + 64 * (j & 3) + 32 * half));
                wv[j][half] = _mm256_and_si256(j < 4 ? v : _mm256_srli_epi16(v, 4), low);
                for (int64_t p = 0; p < q->bits - 4; p++) { /* bit plane p: 32 mask bits -> 32 bytes */
                    uint32_t m32;
                    memcpy(&m32, wb + 256 + 64 * p + 8 * j + 4 * half, 4);
                    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)m32), spread);
                    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
                    wv[j][half] = _mm256_add_epi8(wv[j][half], _mm256_and_si256(set, _mm256_set1_epi8((char)(16 << p))));
                }
            }
        const void *sb = group_vals(q, q->s, t, b), *mb = q->m ? group_vals(q, q->m, t, b) : NULL;
        __m256 sv[2][2], mv[2][2];
        for (int64_t h = 0; h < gpb; h++)
            for (int half = 0; half < 2; half++) {
                sv[h][half] = load_group8(q, sb, 16 * h + 8 * half);
                if (mb) mv[h][half] = load_group8(q, mb, 16 * h + 8 * half);
            }
        for (int64_t r = 0; r < R; r++) {
            const int8_t *ab = q->a + (r0 + r) * q->k + b * 32;
            const int32_t *Sb = q->S + (r0 + r) * (q->k / 16) + 2 * b;
            const __m256 db = _mm256_set1_ps(q->d[(r0 + r) * nb + b]);
            int32_t a4[8];
            memcpy(a4, ab, 32);
            for (int half = 0; half < 2; half++) {
                __m256i I[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
                for (int j = 0; j < 8; j++) {
                    const __m256i av = _mm256_set1_epi32(a4[j]);
                    __m256i sum = _mm256_madd_epi16(_mm256_maddubs_epi16(wv[j][half], av), ones);
                    if (q->bits == 8)
                        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(hv[j][half], av), sixteen));
                    I[j / 4] = _mm256_add_epi32(I[j / 4], sum);
                }
                int32_t Sg[2] = {Sb[0], Sb[1]};
                if (gpb == 1) {
                    I[0] = _mm256_add_epi32(I[0], I[1]);
                    Sg[0] = Sb[0] + Sb[1];
                }
                for (int64_t h = 0; h < gpb; h++) {
                    const __m256i Ih = _mm256_sub_epi32(I[h], _mm256_set1_epi32((int32_t)q->zero * Sg[h]));
                    const __m256 sd = _mm256_mul_ps(sv[h][half], db);
                    acc[r][half] = _mm256_add_ps(acc[r][half], _mm256_mul_ps(_mm256_cvtepi32_ps(Ih), sd));
                    if (mb) {
                        const __m256 md = _mm256_mul_ps(mv[h][half], db);
                        acc[r][half] = _mm256_add_ps(acc[r][half], _mm256_mul_ps(md, _mm256_set1_ps((float)Sg[h])));
                    }
                }
            }
        }
    }
    for (int64_t r = 0; r < R; r++) {
        float row[16];
        _mm256_storeu_ps(row, acc[r][0]);
        _mm256_storeu_ps(row + 8, acc[r][1]);
        memcpy(q->y + (r0 + r) * q->ldy + 16 * t, row, sizeof(float) * lanes);
    }
#else
    /* Written so the compiler vectorises across the 16 rows of the tile (AVX2: 8 int32 lanes). */
    float acc[ROWS][16] = {{0}};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = q->w + (t * nb + b) * bytes;
        int32_t u[32][16]; /* [column][row] */
        for (int j = 0; j < 8; j++)
            for (int e = 0; e < 4; e++)
                for (int l = 0; l < 16; l++)
                    u[4 * j + e][l] = q->bits == 8 ? wb[64 * j + 4 * l + e]
                                                   : (wb[64 * (j & 3) + 4 * l + e] >> (4 * (j >> 2))) & 15;
        for (int64_t p = 0; p < q->bits - 4 && q->bits < 8; p++)
            for (int j = 0; j < 8; j++) {
                uint64_t mask;
                memcpy(&mask, wb + 256 + 64 * p + 8 * j, 8);
                for (int e = 0; e < 4; e++)
                    for (int l = 0; l < 16; l++) u[4 * j + e][l] |= (int32_t)((mask >> (4 * l + e)) & 1) << (4 + p);
            }
        const void *sb = group_vals(q, q->s, t, b), *mb = q->m ? group_vals(q, q->m, t, b) : NULL;
        float sv[2][16], mv[2][16];
        for (int64_t h = 0; h < gpb; h++)
            for (int l = 0; l < 16; l++) {
                sv[h][l] = group_val(q, sb, 16 * h + l);
                mv[h][l] = mb ? group_val(q, mb, 16 * h + l) : 0.0f;
            }
        for (int64_t r = 0; r < R; r++) {
            const int8_t *ab = q->a + (r0 + r) * q->k + b * 32;
            const int32_t *Sb = q->S + (r0 + r) * (q->k / 16) + 2 * b;
            const float db = q->d[(r0 + r) * nb + b];
            int32_t I[2][16] = {{0}};
            for (int c = 0; c < 32; c++) {
                const int32_t av = ab[c];
                int32_t *Ih = I[c / 16];
                for (int l = 0; l < 16; l++) Ih[l] += u[c][l] * av;
            }
            if (gpb == 1)
                for (int l = 0; l < 16; l++) I[0][l] += I[1][l];
            for (int64_t h = 0; h < gpb; h++) {
                const int32_t Sg = gpb == 1 ? Sb[0] + Sb[1] : Sb[h];
                for (int l = 0; l < 16; l++) {
                    acc[r][l] = acc[r][l] + (float)(I[h][l] - (int32_t)q->zero * Sg) * (sv[h][l] * db);
                    if (mb) acc[r][l] = acc[r][l] + (mv[h][l] * db) * (float)Sg;
                }
            }
        }
    }
    for (int64_t r = 0; r < R; r++) memcpy(q->y + (r0 + r) * q->ldy + 16 * t, acc[r], sizeof(float) * lanes);
#endif
}

/* Task `task` of `tasks` takes an equal run of whole tiles (every row of each). */
static void qmatmul_task(void *arg, int64_t task, int64_t tasks) {
    const qjob *q = arg;
    const int64_t tiles = (q->out + 15) / 16;
    const int64_t first = tiles * task / tasks, last = tiles * (task + 1) / tasks;
    for (int64_t t = first; t < last; t++)
        for (int64_t r0 = 0; r0 < q->n; r0 += ROWS) tile_rows(q, t, r0, q->n - r0 < ROWS ? q->n - r0 : ROWS);
}

/* y fp32 [n, sum of the parts' out] (row stride ldy) = x fp32 [n, k] times `parts` packed
 * weights side by side (a stacked linear run partwise: each part's columns follow the previous
 * part's), x quantised once. Layout above (k % 32 == 0): w uint8 [ceil(out / 16), k / 32,
 * tile_block_bytes(bits)] (bits: 4, 5, 6 or 8), s [ceil(out / 16), k / 32, 32 / group, 16] fp16
 * (half) or fp32, m like s or NULL, zero the integer zero point z. threads: tasks the output
 * tiles are split between (the bits do not depend on it).
 * Returns 0, or -1 when the activations' scratch could not be allocated. */
int verispec_qmatmul_parts(const float *x, int64_t n, int64_t k, const verispec_qweight *w, int64_t parts,
                           float *y, int64_t ldy, int64_t threads) {
    int8_t *a = malloc((size_t)(n * k + 4 * n * (k / 32) + 4 * n * (k / 16)));
    if (!a) return -1;
    float *d = (float *)(a + n * k);
    int32_t *S = (int32_t *)(d + n * (k / 32));
    quantize_rows(x, n, k, a, d, S);
    for (int64_t p = 0; p < parts; p++) {
        const verispec_qweight *wp = &w[p];
        qjob q = {wp->w, wp->s, wp->m, a, d, S, y, n, k, wp->out, wp->bits, wp->group, wp->zero, wp->half, ldy};
        const int64_t tiles = (wp->out + 15) / 16;
        int64_t tasks = threads < tiles ? threads : tiles;
        /* below ~64k weight bytes a call is cheaper on one thread than handing out tasks */
        if (tasks > 1 && tiles * (k / 32) * tile_block_bytes(wp->bits) * (n < ROWS ? n : ROWS) < (1 << 16)) tasks = 1;
        run_tasks(qmatmul_task, &q, tasks);
        y += wp->out;
    }
    free(a);
    return 0;
}

/* One weight: verispec_qmatmul_parts with one part and ldy = out (the ctypes entry point). */
int verispec_qmatmul(const float *x, int64_t n, int64_t k, const uint8_t *w, const void *s, const void *m,
                     int64_t out, int64_t bits, int64_t group, int64_t zero, int64_t half, float *y,
                     int64_t threads) {
    const verispec_qweight weight = {w, s, m, out, bits, group, zero, half};
    return verispec_qmatmul_parts(x, n, k, &weight, 1, y, out, threads);
}

/* Which path this build runs: 2 AVX-512 VNNI, 1 AVX2, 0 the portable loop. */
int verispec_qmatmul_path(void) { return VNNI ? 2 : AVX2 ? 1 : 0; }
