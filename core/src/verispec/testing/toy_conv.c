/* The toy trunk's depthwise causal short convolution: the toy plugin's own kernel, built by
 * verispec.kernels.build.CLibrary (a worked example of a distribution shipping C).
 *
 * out[i][d] = sum over w = 0..width-1 of padded[i + w][d] * weight[w][d], summed in the order
 * w = 0, 1, ..., each product and sum rounded to fp32 (built with -ffp-contract=off: no FMA).
 * `verispec.testing.toy.reference_short_conv` states the same operations in PyTorch.
 * padded: fp32 [rows + width - 1][dim] (the state's tail, then the rows); weight: fp32
 * [width][dim]; out: fp32 [rows][dim]. Each row reads only its own window: batch-invariant. */
#include <stdint.h>

void verispec_toy_short_conv(const float *padded, const float *weight, float *out, int64_t rows,
                             int64_t width, int64_t dim) {
    for (int64_t i = 0; i < rows; i++) {
        for (int64_t d = 0; d < dim; d++) {
            float acc = padded[i * dim + d] * weight[d];
            for (int64_t w = 1; w < width; w++) {
                acc = acc + padded[(i + w) * dim + d] * weight[w * dim + d];
            }
            out[i * dim + d] = acc;
        }
    }
}
