/* The machine's read roofline: the bandwidth at which `threads` threads stream a buffer that
 * no cache holds, with the widest vector loads the compiler's target has (-march=native:
 * 512-bit on AVX-512, 256-bit on AVX2, 64-bit words elsewhere).
 *
 * Each thread reads its own contiguous slice of the buffer once per pass, with eight
 * independent accumulators (so the adds never limit the loads); a pass is timed from a
 * barrier all threads leave together to the barrier the last one reaches. The best of `passes`
 * passes is the roofline: a decode step cannot read its weights faster than this.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

static volatile uint64_t sink;

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Bits of one load: 512, 256 or 64. */
int read_roofline_load_bits(void) {
#if defined(__AVX512F__)
    return 512;
#elif defined(__AVX2__)
    return 256;
#else
    return 64;
#endif
}

static uint64_t read_slice(const char *begin, size_t bytes) {
#if defined(__AVX512F__)
    __m512i a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm512_setzero_si512();
    for (size_t off = 0; off + 512 <= bytes; off += 512)
        for (int i = 0; i < 8; i++)
            a[i] = _mm512_add_epi64(a[i], _mm512_load_si512((const void *)(begin + off + 64 * i)));
    for (int i = 1; i < 8; i++) a[0] = _mm512_add_epi64(a[0], a[i]);
    return (uint64_t)_mm512_reduce_add_epi64(a[0]);
#elif defined(__AVX2__)
    __m256i a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_si256();
    for (size_t off = 0; off + 256 <= bytes; off += 256)
        for (int i = 0; i < 8; i++)
            a[i] = _mm256_add_epi64(a[i], _mm256_load_si256((const __m256i *)(begin + off + 32 * i)));
    for (int i = 1; i < 8; i++) a[0] = _mm256_add_epi64(a[0], a[i]);
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, a[0]);
    return lanes[0] + lanes[1] + lanes[2] + lanes[3];
#else
    uint64_t a[8] = {0};
    for (size_t off = 0; off + 64 <= bytes; off += 64)
        for (int i = 0; i < 8; i++) a[i] += *(const uint64_t *)(begin + off + 8 * i);
    return a[0] + a[1] + a[2] + a[3] + a[4] + a[5] + a[6] + a[7];
#endif
}

/* Reads `bytes` (rounded down to 4096 per thread: aligned_alloc takes whole pages) with `threads` OpenMP threads, each its own
 * slice (first touched by that thread), `passes` times; writes each pass's GB/s (1e9 bytes per
 * second) to gbps_out[p]. Returns 0; -1 when the buffer cannot be had, -2 when OpenMP gave
 * fewer threads than asked. */
int read_roofline(size_t bytes, int threads, int passes, double *gbps_out) {
    if (threads < 1 || passes < 1) return -1;
    size_t per = (bytes / (size_t)threads) & ~(size_t)4095;
    char *buffer = aligned_alloc(4096, per * (size_t)threads);
    if (!buffer) return -1;
    int status = 0;
    double t0 = 0.0;
    uint64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        int t = omp_get_thread_num();
        if (omp_get_num_threads() != threads) {
#pragma omp atomic write
            status = -2;
        } else {
            char *begin = buffer + per * (size_t)t;
            memset(begin, 1, per);
            for (int p = 0; p < passes; p++) {
#pragma omp barrier
                if (t == 0) t0 = now_s();
                total += read_slice(begin, per);
#pragma omp barrier
                if (t == 0) gbps_out[p] = (double)(per * (size_t)threads) / (now_s() - t0) / 1e9;
            }
        }
    }
    sink += total;
    free(buffer);
    return status;
}
