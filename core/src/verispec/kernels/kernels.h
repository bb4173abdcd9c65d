/* What verispec's C files share (built into one library by `verispec.kernels.ckernels`). */
#ifndef VERISPEC_KERNELS_H
#define VERISPEC_KERNELS_H
#include <omp.h>
#include <stdint.h>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

static inline v16 splat(float x) { return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

/* exp(x) for x <= 0, ~1 ulp: x clamped to -80 (e^-80 ~ 1.8e-35, a weight of nothing; every
 * step stays a normal float), n = round(x / ln 2) by the 1.5 * 2^23 trick (ties to even),
 * r = x - n ln2 in two parts, cephes expf's polynomial, then * 2^n built from bits. */
static inline v16 vexp(v16 x) {
    const v16 lo = splat(-80.0f), magic = splat(12582912.0f);
    const v16i below = x < lo; /* lanes -1 where x < -80 */
    x = (v16)(((v16i)lo & below) | ((v16i)x & ~below));
    v16 n = (x * splat(1.44269504088896341f) + magic) - magic;
    v16 r = x - n * splat(0.693359375f);
    r = r - n * splat(-2.12194440e-4f);
    v16 p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    v16 y = p * (r * r);
    y = y + r;
    y = y + splat(1.0f);
    v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
    return y * (v16)bits;
}

/* Threads: OpenMP, so the kernels share torch's own thread team (torch's libgomp.so.1 is the one
 * loaded once per process) instead of a second set of threads competing with it for cores. */
typedef void (*task_fn)(void *arg, int64_t task, int64_t tasks);

/* Run fn(arg, task, tasks) for task = 0 .. tasks - 1 on up to `tasks` threads of the team (a task
 * the team does not grant a thread for runs on another). */
static inline void run_tasks(task_fn fn, void *arg, int64_t tasks) {
    if (tasks <= 1) {
        fn(arg, 0, 1);
        return;
    }
#pragma omp parallel num_threads(tasks)
    {
        const int64_t team = omp_get_num_threads();
        for (int64_t task = omp_get_thread_num(); task < tasks; task += team) fn(arg, task, tasks);
    }
}

/* One block-packed weight (qmatmul.c's layout; weights.block_linear.BlockLinear.kernel_args). */
typedef struct {
    const uint8_t *w;
    const void *s, *m;
    int64_t out, bits, group, zero, kind; /* kind: qmatmul.c's scale kind */
} verispec_qweight;

int verispec_qmatmul_parts(const float *x, int64_t n, int64_t k, const verispec_qweight *w, int64_t parts,
                           float *y, int64_t ldy, int64_t threads);
int verispec_attend(const float *q, const float *k, const float *v, float *out, const int64_t *desc,
                    int64_t num_seqs, int64_t H, int64_t Hkv, int64_t D, float scaling, int64_t threads);
void verispec_rms_norm(const float *x, const float *w, float *out, int64_t rows, int64_t dim, float eps);

#endif
