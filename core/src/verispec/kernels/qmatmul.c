/* GGUF-block linears on the CPU: y = x · Wᵀ with W the file's own quantised values.
 * `verispec.weights.block_linear` packs the weights and states this arithmetic in PyTorch for the
 * tests. Four paths, chosen by what -march=native offers, all giving the same bits: AMX tile
 * products for runs of 16 rows (Sapphire Rapids and later), AVX-512 VNNI (vpdpbusd), AVX2
 * (maddubs; ~3x VNNI's time), and a plain loop the compiler vectorises as it can (other CPUs, or
 * -DVERISPEC_PORTABLE; ~20x). Threads: torch's OpenMP team.
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
 * then s (and m when the type has mins), by scale kind:
 *   1 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: the file's fp16 fields): fp16 [32 / G][16] per tile and block;
 *   2 (Q4_K, Q5_K, Q6_K: products s = d · sc of a super-block's fp16 d and a small integer sc):
 *     per tile and super-block of 8 blocks (256 columns), super_bytes(G) bytes: the 16 rows'
 *     fp16 d (or -dmin), then int8 sc (or m) [8][32 / G][16]. The kernel forms d · sc in fp32,
 *     which is exact (11 + 8 significant bits), so it multiplies by the file's s bit for bit
 *     while reading a byte a group instead of four: Q4_K 4.6 bits a weight instead of 6.
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
 *
 * Speed: each path is compiled once per block format and row count (16 with AMX,) 8, 4, 2, 1
 * (FORMAT_KERNEL), so the format's branches go and (VNNI) 8 rows' accumulators stay in registers
 * and share each unpacked weight block; a call's work is units of CHUNK rows by a run of tiles
 * (those rows' activations stay in L2), taken by threads as they free up. On Zen 5, one core:
 * VNNI at 512 rows ~90 -> ~195 GMAC/s; the AVX2 build at one row (a decode) 12-20 -> 20-41
 * GMAC/s. Sapphire Rapids, two cores, 512 rows of the Qwen2.5 1.5B's Q4_K: VNNI ~300 GMAC/s,
 * AMX ~480.
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
#if VNNI && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__) && !defined(VERISPEC_NO_AMX)
#include <sys/syscall.h>
#include <unistd.h>
#define AMX 1
#else
#define AMX 0
#endif

/* ---- activations */

/* Row r of x fp32 [n, k] (k % 32 == 0) -> a int8 [n, k], d fp32 [n, k / 32], S int32 [n, k / 16]. */
static void quantize_row(const float *x, int64_t r, int64_t k, int8_t *a, float *d, int32_t *S) {
    for (int64_t b = 0; b < k / 32; b++) {
        const float *xb = x + r * k + b * 32;
        int8_t *ab = a + r * k + b * 32;
#if VNNI /* the same operations 16 lanes at a time (cvtps rounds to nearest even, as rintf does) */
        const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        const float db = amax / 127.0f, id = db > 0.0f ? 1.0f / db : 0.0f;
        const __m512i a0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(id)));
        const __m512i a1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(id)));
        _mm_storeu_si128((__m128i *)ab, _mm512_cvtepi32_epi8(a0));
        _mm_storeu_si128((__m128i *)(ab + 16), _mm512_cvtepi32_epi8(a1));
        S[r * (k / 16) + 2 * b] = _mm512_reduce_add_epi32(a0);
        S[r * (k / 16) + 2 * b + 1] = _mm512_reduce_add_epi32(a1);
#else
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(xb[i]));
        const float db = amax / 127.0f, id = db > 0.0f ? 1.0f / db : 0.0f;
        for (int h = 0; h < 2; h++) {
            int32_t sum = 0;
            for (int i = 16 * h; i < 16 * h + 16; i++) {
                ab[i] = (int8_t)rintf(xb[i] * id);
                sum += ab[i];
            }
            S[r * (k / 16) + 2 * b + h] = sum;
        }
#endif
        d[r * (k / 32) + b] = db;
    }
}

typedef struct {
    const float *x;
    int64_t n, k;
    int8_t *a;
    float *d;
    int32_t *S;
} quantize_job;

static void quantize_task(void *arg, int64_t task, int64_t tasks) {
    const quantize_job *j = arg;
    for (int64_t r = j->n * task / tasks; r < j->n * (task + 1) / tasks; r++) quantize_row(j->x, r, j->k, j->a, j->d, j->S);
}

/* ---- the product */

typedef struct qjob qjob;
typedef void (*rows_fn)(const qjob *q, int64_t t, int64_t r0, int64_t R);

struct qjob {
    const uint8_t *w;
    const void *s, *m; /* by scale kind (kind); m NULL: no mins */
    const int8_t *a;
    const float *d;
    const void *G; /* per row and weight group: z · S int32 (no mins) or (float)S (mins) */
    float *y;
    int64_t n, k, out, bits, group, zero, kind, ldy;
    rows_fn rows; /* computes rows r0 .. r0 + R - 1 of tile t */
    int amx;      /* runs of 16 rows through the tile registers */
    int64_t run;  /* tiles a unit of work (qmatmul_task) */
    int64_t *next; /* the next unit to take */
};

/* Bytes of one tile's block of 32 columns. */
static inline int64_t tile_block_bytes(int64_t bits) { return bits == 8 ? 512 : 256 + 64 * (bits - 4); }

/* Bytes of one tile's super-block of kind-2 scales (or mins): 16 fp16 factors, int8 [8][32 / G][16]. */
static inline int64_t super_bytes(int64_t group) { return 32 + 8 * (32 / group) * 16; }

/* The 16 rows' fp16 factors of tile t's super-block holding block b (kind 2). */
static inline const uint16_t *super_factors(const qjob *q, const void *v, int64_t t, int64_t b) {
    return (const uint16_t *)((const char *)v + (t * (q->k / 256) + b / 8) * super_bytes(q->group));
}

/* Tile t, block b's group values [32 / G][16]: fp16 (kind 1) or int8 (kind 2). */
static inline const void *group_vals(const qjob *q, const void *v, int64_t t, int64_t b) {
    const int64_t gpb = 32 / q->group;
    if (q->kind == 2) return (const char *)super_factors(q, v, t, b) + 32 + (b % 8) * gpb * 16;
    return (const char *)v + (t * (q->k / 32) + b) * gpb * 16 * 2;
}

static inline float half_to_float(uint16_t bits) {
    _Float16 h;
    memcpy(&h, &bits, sizeof h);
    return (float)h;
}

/* Value i (16 h + row) of a block's groups `v` (group_vals), with the super-block's factors `f`
 * (kind 2): the fp16 value, or f[row] · v[i] (exact in fp32). */
static inline float group_val(const int64_t kind, const void *v, const uint16_t *f, int64_t i) {
    return kind == 2 ? half_to_float(f[i % 16]) * (float)((const int8_t *)v)[i] : half_to_float(((const uint16_t *)v)[i]);
}

/* u of row r, column c (0 .. 31) of one tile's block wb (the layout above), read one at a time. */
static inline int32_t tile_value(const uint8_t *wb, int64_t bits, int64_t r, int c) {
    const int j = c / 4, e = c % 4;
    if (bits == 8) return wb[64 * j + 4 * r + e];
    int32_t u = (wb[64 * (j & 3) + 4 * r + e] >> (4 * (j >> 2))) & 15;
    for (int64_t p = 0; p < bits - 4; p++) {
        uint64_t mask;
        memcpy(&mask, wb + 256 + 64 * p + 8 * j, 8);
        u |= (int32_t)((mask >> (4 * r + e)) & 1) << (4 + p);
    }
    return u;
}

/* Group g (row-major over rows and the weight's groups) of the activations: z · S (formats
 * without mins) or S as a float (formats with mins: z = 0). */
static inline int32_t zero_sum(const qjob *q, int64_t g) { return ((const int32_t *)q->G)[g]; }
static inline float float_sum(const qjob *q, int64_t g) { return ((const float *)q->G)[g]; }

#define ROWS 8     /* activation rows sharing each weight load */
#define CHUNK 64   /* rows whose activations stay in L2 while a task's tiles pass over them */
#define PARALLEL_QUANTIZE (1 << 15) /* activations from which quantising them is split between threads */

/* G for weight q: per row, the sum S of the activations of each of the weight's groups (16 or
 * 32 columns) from S int32 [n, k / 16], times z (no mins) or as a float (mins). */
static void group_sums(const qjob *q, const int32_t *S, int32_t *G) {
    const int64_t per16 = q->group / 16, groups = q->n * (q->k / q->group);
    for (int64_t g = 0; g < groups; g++) {
        const int32_t sum = per16 == 1 ? S[g] : S[2 * g] + S[2 * g + 1];
        if (q->m) {
            const float f = (float)sum;
            memcpy(&G[g], &f, 4);
        } else
            G[g] = (int32_t)q->zero * sum;
    }
}
#define PREFETCH 8 /* blocks ahead to prefetch: one thread streamed Q4_1 at 12 GB/s without, 16-20 with */

#if AVX2
/* Values i .. i + 7 of a block's groups (as group_val), i % 8 == 0. */
static inline __m256 load_group8(const int kind, const void *v, const uint16_t *f, int64_t i) {
    if (kind == 2)
        return _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(f + i % 16))),
                             _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)v + i)))));
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)v + i)));
}
#endif

#if VNNI
/* The 16 x 32 values of one tile's block: wv[j] byte 4r + c = u[r][4j + c]. */
static inline __attribute__((always_inline)) void load_block(const uint8_t *wb, const int bits, __m512i wv[8]) {
    if (bits == 8) {
        for (int j = 0; j < 8; j++) wv[j] = _mm512_loadu_si512(wb + 64 * j);
        return;
    }
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < 4; j++) {
        const __m512i v = _mm512_loadu_si512(wb + 64 * j);
        wv[j] = _mm512_and_si512(v, low);
        wv[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    for (int p = 0; p < bits - 4; p++) { /* higher bit planes: add 2^(4+p) */
        const __m512i bit = _mm512_set1_epi8((char)(16 << p));
        for (int j = 0; j < 8; j++) {
            uint64_t mask;
            memcpy(&mask, wb + 256 + 64 * p + 8 * j, 8);
            wv[j] = _mm512_mask_add_epi8(wv[j], (__mmask64)mask, wv[j], bit);
        }
    }
}

/* Group h's 16 values of a block (as group_val). */
static inline __attribute__((always_inline)) __m512 load_group(const int kind, const void *v, const uint16_t *f, int h) {
    if (kind == 2)
        return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)f)),
                             _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)v + 16 * h)))));
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)v + 16 * h)));
}

/* Block b of tile t's group values, for each of its gpb groups: sv the scales, mv the mins
 * (zero for a type without mins), as load_group gives them. */
static inline __attribute__((always_inline)) void load_groups(const qjob *q, int64_t t, int64_t b, const int gpb,
                                                              const int mins, const int kind, __m512 sv[2],
                                                              __m512 mv[2]) {
    const void *sb = group_vals(q, q->s, t, b), *mb = mins ? group_vals(q, q->m, t, b) : NULL;
    const uint16_t *sf = kind == 2 ? super_factors(q, q->s, t, b) : NULL;
    const uint16_t *mf = kind == 2 && mins ? super_factors(q, q->m, t, b) : NULL;
    for (int h = 0; h < gpb; h++) {
        sv[h] = load_group(kind, sb, sf, h);
        mv[h] = mins ? load_group(kind, mb, mf, h) : _mm512_setzero_ps();
    }
}

/* One group's exact sums I of row `row` (16 outputs) into its accumulator, block b, group g
 * (qjob's numbering): y += I · (s · d_b), then for types with mins y += (m · d_b) · S. */
static inline __attribute__((always_inline)) __m512 scale_group(const qjob *q, __m512 acc, __m512i I, __m512 sv,
                                                                 __m512 mv, int64_t row, int64_t b, int64_t g,
                                                                 const int mins) {
    const __m512 db = _mm512_set1_ps(q->d[row * (q->k / 32) + b]);
    acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_cvtepi32_ps(I), _mm512_mul_ps(sv, db)));
    if (mins) acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_mul_ps(mv, db), _mm512_set1_ps(float_sum(q, g))));
    return acc;
}

/* Rows r0 .. r0 + R - 1 (R <= ROWS) of tile t for one block format. Always inlined with constant
 * arguments, so the R accumulators stay in registers and the format's branches go. Each row's
 * integer sums run as `chains` independent dpbusd chains: with 8 rows the rows already overlap. */
static inline __attribute__((always_inline)) void tile_rows_format(const qjob *q, int64_t t, int64_t r0, const int R,
                                                                   const int bits, const int gpb, const int mins,
                                                                   const int kind) {
    const int64_t nb = q->k / 32, bytes = tile_block_bytes(bits), groups = nb * gpb;
    const int chains = gpb == 2 ? 2 : R >= 8 ? 1 : R >= 4 ? 2 : 4;
    __m512 acc[ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = q->w + (t * nb + b) * bytes;
        for (int64_t p = 0; p < bytes; p += 64) _mm_prefetch((const char *)wb + PREFETCH * bytes + p, _MM_HINT_T0);
        __m512i wv[8];
        load_block(wb, bits, wv);
        __m512 sv[2], mv[2];
        load_groups(q, t, b, gpb, mins, kind, sv, mv);
        for (int r = 0; r < R; r++) {
            const int8_t *ab = q->a + (r0 + r) * q->k + 32 * b;
            __m512i I[4];
            for (int c = 0; c < chains; c++) I[c] = _mm512_setzero_si512();
            for (int j = 0; j < 8; j++) {
                int32_t a4;
                memcpy(&a4, ab + 4 * j, 4);
                const int c = gpb == 2 ? j / 4 : j % chains;
                I[c] = _mm512_dpbusd_epi32(I[c], wv[j], _mm512_set1_epi32(a4));
            }
            for (int c = 1; c < chains && gpb == 1; c++) I[0] = _mm512_add_epi32(I[0], I[c]);
            for (int h = 0; h < gpb; h++) {
                const int64_t g = (r0 + r) * groups + gpb * b + h;
                const __m512i Ih = mins ? I[h] : _mm512_sub_epi32(I[h], _mm512_set1_epi32(zero_sum(q, g)));
                acc[r] = scale_group(q, acc[r], Ih, sv[h], mv[h], r0 + r, b, g, mins);
            }
        }
    }
    const int64_t lanes = q->out - 16 * t < 16 ? q->out - 16 * t : 16;
    const __mmask16 mask = (__mmask16)((1u << lanes) - 1);
    for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(q->y + (r0 + r) * q->ldy + 16 * t, mask, acc[r]);
}

#if AMX
/* AMX (Sapphire Rapids and later): 16 rows of a tile at a time, each block's 16 x 16 integer sums
 * I from one tile product (int8 activations A [16 rows, 32 columns] times the block's unpacked
 * weights B, which load_block already lays out as AMX's B [8, 16 outputs x 4 columns]: TDPBSUD
 * of u, or for a type without mins TDPBSSD of u - z, which is I - z S at once);
 * a format with groups of 16 (Q6_K) takes two products of 16 columns. The sums are exact, so the
 * fp32 steps that follow are the VNNI path's in the same order: the same bits. A block is
 * unpacked a step before its product, which runs two steps before its scaling (tiles of sums in
 * turns of three), so none waits on another (a tile load waiting for the unpacking's stores to
 * reach the cache cost the 1.5B's Q4_K a tenth of its speed). Linux lends
 * a process the tile registers on request (arch_prctl); where it refuses, or VERISPEC_AMX=0,
 * the VNNI path runs. */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 1 when this process may use the tile registers (asked once), else 0. */
static int amx_usable(void) {
    static int state = -1;
    if (state < 0) {
        const char *env = getenv("VERISPEC_AMX");
        state = (env && env[0] == '0') ? 0 : syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return state;
}

/* Tiles, for groups of G columns: sums of blocks in turns of three, 0, 1 and 4 (group 0), with
 * 5, 6 and 7 (group 1: G = 16); 2 activations [16 rows, G bytes], 3 weights [G / 4, 64 bytes]. */
static void amx_configure(const int gpb) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } __attribute__((packed, aligned(64))) config = {.palette = 1};
    const int g = 32 / gpb;
    for (int i = 0; i < 8; i++) config.rows[i] = 16, config.colsb[i] = 64;
    config.colsb[2] = (uint16_t)g;
    config.rows[3] = (uint8_t)(g / 4);
    _tile_loadconfig(&config);
}

/* One block's unpacked weights (wbuf, 512 bytes: u, or u - z as int8 for a type without mins) times
 * 16 rows of its activations (ab, row stride k) into the sums tiles T (group 0) and U (group 1);
 * tile numbers are literals (the intrinsics' syntax). */
#define AMX_PRODUCT(T, U, wbuf, ab, k, gpb, mins)                           \
    do {                                                                   \
        _tile_loadd(3, (wbuf), 64);                                        \
        _tile_loadd(2, (ab), (k));                                         \
        _tile_zero(T);                                                     \
        if (mins)                                                          \
            _tile_dpbsud(T, 2, 3);                                         \
        else                                                               \
            _tile_dpbssd(T, 2, 3);                                         \
        if ((gpb) == 2) {                                                  \
            _tile_loadd(3, (const uint8_t *)(wbuf) + 256, 64);             \
            _tile_loadd(2, (const int8_t *)(ab) + 16, (k));                \
            _tile_zero(U);                                                 \
            if (mins)                                                      \
                _tile_dpbsud(U, 2, 3);                                     \
            else                                                           \
                _tile_dpbssd(U, 2, 3);                                     \
        }                                                                  \
    } while (0)

/* Sums tiles T and U to memory: int32 [group][16 rows][16 outputs]. */
#define AMX_STORE(T, U, sums, gpb)                                          \
    do {                                                                   \
        _tile_stored(T, (sums), 64);                                       \
        if ((gpb) == 2) _tile_stored(U, (int32_t *)(sums) + 256, 64);      \
    } while (0)

/* Rows r0 .. r0 + 15 of tile t for one block format (tiles configured by amx_configure). */
static inline __attribute__((always_inline)) void tile_rows16_format(const qjob *q, int64_t t, int64_t r0, const int bits,
                                                                     const int gpb, const int mins, const int kind) {
    const int64_t nb = q->k / 32, bytes = tile_block_bytes(bits), groups = nb * gpb;
    uint8_t wbuf[3][512] __attribute__((aligned(64)));
    int32_t sums[2][2 * 16 * 16] __attribute__((aligned(64))); /* [turn][group h][row][output] */
    __m512 acc[16];
    for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
    const int8_t *a0 = q->a + r0 * q->k;
    /* Four stages a step: block b + 1 unpacked to memory (a tile load cannot take a store's data
     * before it reaches the cache: a step later it has), block b's product, block b - 1's sums to
     * memory, block b - 2 scaled. */
    for (int64_t b = -1; b < nb + 2; b++) {
        if (b + 1 < nb) {
            const uint8_t *wb = q->w + (t * nb + b + 1) * bytes;
            for (int64_t p = 0; p < bytes; p += 64) _mm_prefetch((const char *)wb + PREFETCH * bytes + p, _MM_HINT_T0);
            __m512i wv[8];
            load_block(wb, bits, wv);
            if (!mins) /* u - z fits int8 for every such type: the product then subtracts z · S itself */
                for (int j = 0; j < 8; j++) wv[j] = _mm512_sub_epi8(wv[j], _mm512_set1_epi8((char)q->zero));
            for (int j = 0; j < 8; j++) _mm512_store_si512(wbuf[(b + 1) % 3] + 64 * j, wv[j]);
        }
        if (b < 0) continue;
        if (b < nb) {
            const uint8_t *buf = wbuf[b % 3];
            switch (b % 3) {
            case 0: AMX_PRODUCT(0, 5, buf, a0 + 32 * b, q->k, gpb, mins); break;
            case 1: AMX_PRODUCT(1, 6, buf, a0 + 32 * b, q->k, gpb, mins); break;
            default: AMX_PRODUCT(4, 7, buf, a0 + 32 * b, q->k, gpb, mins);
            }
        }
        if (b >= 1 && b <= nb) {
            int32_t *to = sums[(b - 1) & 1];
            switch ((b - 1) % 3) {
            case 0: AMX_STORE(0, 5, to, gpb); break;
            case 1: AMX_STORE(1, 6, to, gpb); break;
            default: AMX_STORE(4, 7, to, gpb);
            }
        }
        if (b < 2) continue;
        const int64_t c = b - 2;
        const int32_t *from = sums[c & 1];
        __m512 sv[2], mv[2];
        load_groups(q, t, c, gpb, mins, kind, sv, mv);
        for (int r = 0; r < 16; r++)
            for (int h = 0; h < gpb; h++) /* u a - z S, exact */
                acc[r] = scale_group(q, acc[r], _mm512_load_si512(from + 256 * h + 16 * r), sv[h], mv[h], r0 + r, c,
                                     (r0 + r) * groups + gpb * c + h, mins);
    }
    const int64_t lanes = q->out - 16 * t < 16 ? q->out - 16 * t : 16;
    const __mmask16 mask = (__mmask16)((1u << lanes) - 1);
    for (int r = 0; r < 16; r++) _mm512_mask_storeu_ps(q->y + (r0 + r) * q->ldy + 16 * t, mask, acc[r]);
}
#endif
#else
/* Rows r0 .. r0 + R - 1 (R <= ROWS) of tile t: y[r][16 t + lane]; inlined with constant
 * arguments as the VNNI path's. */
static inline __attribute__((always_inline)) void tile_rows_format(const qjob *q, int64_t t, int64_t r0, const int R,
                                                                   const int bits, const int gpb, const int mins,
                                                                   const int kind) {
    const int64_t nb = q->k / 32, bytes = tile_block_bytes(bits);
    const int64_t lanes = q->out - 16 * t < 16 ? q->out - 16 * t : 16;
#if AVX2
    /* The tile as two halves of 8 rows (bytes 0-31 and 32-63 of each 64-byte vector). u8 · s8
     * products summed in pairs by maddubs saturate above 32767: u <= 63 (4 to 6 bits) cannot
     * reach it (63 · 127 · 2), and 8-bit u is split into its two nibbles. */
    __m256 acc[ROWS][2];
    for (int64_t r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), sixteen = _mm256_set1_epi16(16);
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3,
                                            3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const int J16 = bits == 5 ? 4 : bits == 6 ? 2 : 8; /* vectors j summed in int16 (below) */
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = q->w + (t * nb + b) * bytes;
        __m256i wv[8][2], hv[8][2]; /* [j][half]; hv: 8-bit u's high nibbles */
        for (int j = 0; j < 8; j++)
            for (int half = 0; half < 2; half++) {
                if (bits == 8) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(wb + 64 * j + 32 * half));
                    wv[j][half] = _mm256_and_si256(v, low);
                    hv[j][half] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                    continue;
                }
                const __m256i v = _mm256_loadu_si256((const __m256i *)(wb + 64 * (j & 3) + 32 * half));
                wv[j][half] = _mm256_and_si256(j < 4 ? v : _mm256_srli_epi16(v, 4), low);
                for (int64_t p = 0; p < bits - 4; p++) { /* bit plane p: 32 mask bits -> 32 bytes */
                    uint32_t m32;
                    memcpy(&m32, wb + 256 + 64 * p + 8 * j + 4 * half, 4);
                    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)m32), spread);
                    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
                    wv[j][half] = _mm256_add_epi8(wv[j][half], _mm256_and_si256(set, _mm256_set1_epi8((char)(16 << p))));
                }
            }
        const void *sb = group_vals(q, q->s, t, b), *mb = mins ? group_vals(q, q->m, t, b) : NULL;
        const uint16_t *sf = kind == 2 ? super_factors(q, q->s, t, b) : NULL;
        const uint16_t *mf = kind == 2 && mins ? super_factors(q, q->m, t, b) : NULL;
        __m256 sv[2][2], mv[2][2];
        for (int64_t h = 0; h < gpb; h++)
            for (int half = 0; half < 2; half++) {
                sv[h][half] = load_group8(kind, sb, sf, 16 * h + 8 * half);
                if (mb) mv[h][half] = load_group8(kind, mb, mf, 16 * h + 8 * half);
            }
        for (int64_t r = 0; r < R; r++) {
            const int8_t *ab = q->a + (r0 + r) * q->k + b * 32;
            const int64_t g0 = (r0 + r) * (q->k / q->group) + gpb * b;
            const __m256 db = _mm256_set1_ps(q->d[(r0 + r) * nb + b]);
            int32_t a4[8];
            memcpy(a4, ab, 32);
            __m256i av[8];
            for (int j = 0; j < 8; j++) av[j] = _mm256_set1_epi32(a4[j]);
            for (int half = 0; half < 2; half++) {
                __m256i I[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
                /* maddubs' int16 pair sums of J vectors j added in int16 before widening: with
                 * |a| <= 127, 2J products of u <= 2^bits - 1 stay within 32767 (4 bits or 8-bit
                 * nibbles: J = 8, 30480; 5 bits: J = 4, 31496; 6 bits: J = 2, 32004), so the int32
                 * sums are the same integers. J divides 4: a group (16 columns) is never split. */
                for (int j0 = 0; j0 < 8; j0 += J16) {
                    __m256i lo = _mm256_maddubs_epi16(wv[j0][half], av[j0]), hi = _mm256_setzero_si256();
                    if (bits == 8) hi = _mm256_maddubs_epi16(hv[j0][half], av[j0]);
                    for (int j = j0 + 1; j < j0 + J16; j++) {
                        lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(wv[j][half], av[j]));
                        if (bits == 8) hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(hv[j][half], av[j]));
                    }
                    __m256i sum = _mm256_madd_epi16(lo, ones);
                    if (bits == 8) sum = _mm256_add_epi32(sum, _mm256_madd_epi16(hi, sixteen));
                    I[j0 / 4] = _mm256_add_epi32(I[j0 / 4], sum);
                }
                if (gpb == 1 && J16 < 8) I[0] = _mm256_add_epi32(I[0], I[1]);
                for (int64_t h = 0; h < gpb; h++) {
                    const __m256i Ih = mb ? I[h] : _mm256_sub_epi32(I[h], _mm256_set1_epi32(zero_sum(q, g0 + h)));
                    const __m256 sd = _mm256_mul_ps(sv[h][half], db);
                    acc[r][half] = _mm256_add_ps(acc[r][half], _mm256_mul_ps(_mm256_cvtepi32_ps(Ih), sd));
                    if (mb) {
                        const __m256 md = _mm256_mul_ps(mv[h][half], db);
                        acc[r][half] = _mm256_add_ps(acc[r][half], _mm256_mul_ps(md, _mm256_set1_ps(float_sum(q, g0 + h))));
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
        for (int c = 0; c < 32; c++)
            for (int l = 0; l < 16; l++) u[c][l] = tile_value(wb, bits, l, c);
        const void *sb = group_vals(q, q->s, t, b), *mb = mins ? group_vals(q, q->m, t, b) : NULL;
        const uint16_t *sf = kind == 2 ? super_factors(q, q->s, t, b) : NULL;
        const uint16_t *mf = kind == 2 && mins ? super_factors(q, q->m, t, b) : NULL;
        float sv[2][16], mv[2][16];
        for (int64_t h = 0; h < gpb; h++)
            for (int l = 0; l < 16; l++) {
                sv[h][l] = group_val(kind, sb, sf, 16 * h + l);
                mv[h][l] = mb ? group_val(kind, mb, mf, 16 * h + l) : 0.0f;
            }
        for (int64_t r = 0; r < R; r++) {
            const int8_t *ab = q->a + (r0 + r) * q->k + b * 32;
            const int64_t g0 = (r0 + r) * (q->k / q->group) + gpb * b;
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
                const int32_t zS = mb ? 0 : zero_sum(q, g0 + h);
                for (int l = 0; l < 16; l++) {
                    acc[r][l] = acc[r][l] + (float)(I[h][l] - zS) * (sv[h][l] * db);
                    if (mb) acc[r][l] = acc[r][l] + (mv[h][l] * db) * float_sum(q, g0 + h);
                }
            }
        }
    }
    for (int64_t r = 0; r < R; r++) memcpy(q->y + (r0 + r) * q->ldy + 16 * t, acc[r], sizeof(float) * lanes);
#endif
}

#endif

/* The block formats (weights.gguf_blocks.BLOCK_FORMATS): name, bits, groups a block (32 / G), mins,
 * scale kind. */
#define BLOCK_FORMATS(X) \
    X(q4_0, 4, 1, 0, 1)  \
    X(q4_1, 4, 1, 1, 1)  \
    X(q4_k, 4, 1, 1, 2)  \
    X(q5_0, 5, 1, 0, 1)  \
    X(q5_1, 5, 1, 1, 1)  \
    X(q5_k, 5, 1, 1, 2)  \
    X(q6_k, 6, 2, 0, 2)  \
    X(q8_0, 8, 1, 0, 1)

/* Rows r0 .. r0 + R - 1 of tile t in runs of 16 (AMX), 8, 4, 2 and 1, each a compiled instance. */
#if AMX
#define AMX_ROWS(bits, gpb, mins, kind) \
    if (q->amx)                         \
        for (; R >= 16; r0 += 16, R -= 16) tile_rows16_format(q, t, r0, bits, gpb, mins, kind);
#else
#define AMX_ROWS(bits, gpb, mins, kind)
#endif
#define FORMAT_KERNEL(name, bits, gpb, mins, kind)                                              \
    static void rows_##name(const qjob *q, int64_t t, int64_t r0, int64_t R) {                   \
        AMX_ROWS(bits, gpb, mins, kind)                                                          \
        for (; R >= ROWS; r0 += ROWS, R -= ROWS) tile_rows_format(q, t, r0, ROWS, bits, gpb, mins, kind); \
        if (R & 4) tile_rows_format(q, t, r0, 4, bits, gpb, mins, kind), r0 += 4;                \
        if (R & 2) tile_rows_format(q, t, r0, 2, bits, gpb, mins, kind), r0 += 2;                \
        if (R & 1) tile_rows_format(q, t, r0, 1, bits, gpb, mins, kind);                         \
    }
BLOCK_FORMATS(FORMAT_KERNEL)

/* The compiled instance for a weight's format, or NULL for one not in BLOCK_FORMATS. */
static rows_fn format_kernel(const qjob *q) {
#define MATCH(name, BITS, GPB, MINS, KIND) \
    if (q->bits == BITS && q->group == 32 / GPB && (q->m != NULL) == MINS && q->kind == KIND) return rows_##name;
    BLOCK_FORMATS(MATCH)
#undef MATCH
    return NULL;
}

/* The work of a call in units of CHUNK rows by a run of q->run tiles, chunk by chunk; a task
 * takes the next unit until none is left, so a thread slowed by something else on its core
 * holds up no one (the bits do not depend on who computes a unit). */
static void qmatmul_task(void *arg, int64_t task, int64_t tasks) {
    (void)task, (void)tasks;
    const qjob *q = arg;
    const int64_t tiles = (q->out + 15) / 16, runs = (tiles + q->run - 1) / q->run;
    const int64_t units = runs * ((q->n + CHUNK - 1) / CHUNK);
#if AMX
    if (q->amx) amx_configure(32 / (int)q->group);
#endif
    for (int64_t u; (u = __atomic_fetch_add(q->next, 1, __ATOMIC_RELAXED)) < units;) {
        const int64_t r0 = u / runs * CHUNK, first = u % runs * q->run;
        const int64_t last = first + q->run < tiles ? first + q->run : tiles;
        for (int64_t t = first; t < last; t++) q->rows(q, t, r0, q->n - r0 < CHUNK ? q->n - r0 : CHUNK);
    }
#if AMX
    if (q->amx) _tile_release();
#endif
}

/* y fp32 [n, sum of the parts' out] (row stride ldy) = x fp32 [n, k] times `parts` packed
 * weights side by side (a stacked linear run partwise: each part's columns follow the previous
 * part's), x quantised once. Layout above (k % 32 == 0; k % 256 == 0 for kind 2): w uint8
 * [ceil(out / 16), k / 32, tile_block_bytes(bits)] (bits: 4, 5, 6 or 8), s by scale kind (kind 1:
 * fp16 [ceil(out / 16), k / 32, 32 / group, 16]; kind 2: [ceil(out / 16), k / 256,
 * super_bytes(group)] bytes), m like s or NULL, zero the integer zero point z. threads: tasks the output
 * tiles are split between (the bits do not depend on it).
 * Returns 0, -1 when the activations' scratch could not be allocated, -2 for a format this
 * file has no kernel for. */
int verispec_qmatmul_parts(const float *x, int64_t n, int64_t k, const verispec_qweight *w, int64_t parts,
                           float *y, int64_t ldy, int64_t threads) {
    int8_t *a = malloc((size_t)(n * k + 4 * n * (k / 32) + 8 * n * (k / 16)));
    if (!a) return -1;
    float *d = (float *)(a + n * k);
    int32_t *S = (int32_t *)(d + n * (k / 32)), *G = S + n * (k / 16);
    quantize_job quantize = {x, n, k, a, d, S};
    run_tasks(quantize_task, &quantize, n * k < PARALLEL_QUANTIZE ? 1 : (threads < n ? threads : n));
    for (int64_t p = 0; p < parts; p++) {
        const verispec_qweight *wp = &w[p];
        qjob q = {wp->w, wp->s, wp->m, a, d, G, y, n, k, wp->out, wp->bits, wp->group, wp->zero, wp->kind, ldy, NULL, 0, 1, NULL};
#if AMX
        q.amx = n >= 16 && amx_usable();
#endif
        q.rows = format_kernel(&q);
        if (!q.rows) {
            free(a);
            return -2;
        }
        group_sums(&q, S, G);
        const int64_t tiles = (wp->out + 15) / 16;
        int64_t tasks = threads < tiles ? threads : tiles;
        /* below ~64k weight bytes a call is cheaper on one thread than handing out tasks */
        if (tasks > 1 && tiles * (k / 32) * tile_block_bytes(wp->bits) * (n < ROWS ? n : ROWS) < (1 << 16)) tasks = 1;
        int64_t next = 0;
        q.run = (tiles + 4 * tasks - 1) / (4 * tasks); /* four units a task and chunk */
        q.next = &next;
        run_tasks(qmatmul_task, &q, tasks);
        y += wp->out;
    }
    free(a);
    return 0;
}

/* One weight: verispec_qmatmul_parts with one part and ldy = out (the ctypes entry point). */
int verispec_qmatmul(const float *x, int64_t n, int64_t k, const uint8_t *w, const void *s, const void *m,
                     int64_t out, int64_t bits, int64_t group, int64_t zero, int64_t kind, float *y,
                     int64_t threads) {
    const verispec_qweight weight = {w, s, m, out, bits, group, zero, kind};
    return verispec_qmatmul_parts(x, n, k, &weight, 1, y, out, threads);
}

/* out fp32 [n, k] = rows ids[0 .. n - 1] of a packed weight (layout above) dequantised as
 * gguf-py does, bitwise: (u - z) · s, or u · s + m for a format with mins (each an fp32 step):
 * a tied embedding's lookup. Returns 0, or -1 (nothing written) when an id is outside [0, rows). */
int verispec_block_rows(const uint8_t *w, const void *s, const void *m, int64_t rows, int64_t k, int64_t bits,
                        int64_t group, int64_t zero, int64_t kind, const int64_t *ids, int64_t n, float *out) {
    const qjob q = {.w = w, .s = s, .m = m, .k = k, .bits = bits, .group = group, .kind = kind};
    const int64_t nb = k / 32, bytes = tile_block_bytes(bits);
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= rows) return -1;
    for (int64_t i = 0; i < n; i++) {
        const int64_t t = ids[i] / 16, r = ids[i] % 16;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *wb = w + (t * nb + b) * bytes;
            const void *sb = group_vals(&q, s, t, b), *mb = m ? group_vals(&q, m, t, b) : NULL;
            const uint16_t *sf = kind == 2 ? super_factors(&q, s, t, b) : NULL;
            const uint16_t *mf = kind == 2 && m ? super_factors(&q, m, t, b) : NULL;
            for (int c = 0; c < 32; c++) {
                const int32_t u = tile_value(wb, bits, r, c);
                const int64_t g = 16 * (c / group) + r;
                float *o = out + i * k + 32 * b + c;
                *o = mb ? (float)u * group_val(kind, sb, sf, g) + group_val(kind, mb, mf, g)
                        : ((float)u - (float)zero) * group_val(kind, sb, sf, g);
            }
        }
    }
    return 0;
}

/* Which path this build runs: 3 AMX (runs of 16 rows; fewer rows take VNNI), 2 AVX-512 VNNI, 1 AVX2,
 * 0 the portable loop. */
int verispec_qmatmul_path(void) {
#if AMX
    if (amx_usable()) return 3;
#endif
    return VNNI ? 2 : AVX2 ? 1 : 0;
}
