/* Whole decoder layers in one call: a one-row decode spends more time in per-op dispatch (a
 * dozen PyTorch ops and module calls a layer) than in the layer's arithmetic, so a family whose
 * linears are all block-packed (nn.block_linear) runs each layer here. Every step is the same
 * fp32 operation, in the same order, as the family's PyTorch forward with the C kernels
 * (RMSNorm, block linears, RoPE's x·cos + swap(x)·sin, attention, residual adds, and the SwiGLU
 * of `verispec_silu_mul`, which that forward calls too), so the fused and the op-by-op layer
 * give the same bits (tests/test_fused_layers.py).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

/* out fp32 [n, F] = silu(g) · u for gu fp32 [n, 2F] (gate | up, transformers LlamaMLP's
 * act_fn(gate_proj(x)) * up_proj(x)), through vexp of a non-positive argument:
 *   e = vexp(-|g|),  sig = g >= 0 ? 1 / (1 + e) : e / (1 + e),  out = (g · sig) · u
 * (`ckernels.reference_silu_mul` states it in PyTorch). Lanes are independent elements. */
void verispec_silu_mul(const float *gu, float *out, int64_t n, int64_t F) {
    for (int64_t r = 0; r < n; r++) {
        const float *g = gu + r * 2 * F, *u = g + F;
        float *o = out + r * F;
        for (int64_t i = 0; i < F; i += 16) {
            const int64_t w = F - i < 16 ? F - i : 16;
            float gl[16] = {0}, ul[16] = {0}, ol[16];
            memcpy(gl, g + i, sizeof(float) * w);
            memcpy(ul, u + i, sizeof(float) * w);
            v16 gv, uv;
            memcpy(&gv, gl, sizeof gv);
            memcpy(&uv, ul, sizeof uv);
            const v16i neg = gv < splat(0.0f);
            const v16 e = vexp((v16)((v16i)gv | (v16i)splat(-0.0f))); /* -|g| */
            const v16 den = splat(1.0f) + e;
            const v16 num = (v16)(((v16i)e & neg) | ((v16i)splat(1.0f) & ~neg));
            const v16 res = (gv * (num / den)) * uv;
            memcpy(ol, &res, sizeof ol);
            memcpy(o + i, ol, sizeof(float) * w);
        }
    }
}

typedef struct {
    int64_t parts;
    verispec_qweight part[4];
} linear;

/* A llama / qwen2 decoder layer (transformers LlamaDecoderLayer): sizes, norm weights, biases
 * (NULL: none) and the four linears, built once per layer by the family's Python. */
typedef struct {
    int64_t D, H, Hkv, Dh, F, rotary_dim, neox;
    float eps, scaling;
    const float *input_norm, *post_norm, *qkv_bias, *o_bias;
    linear qkv, o, gate_up, down;
} llama_layer;

/* RoPE in place on x [heads, Dh] of one row: y_d = x_d · cos_d + x_swap(d) · sin_d over the first
 * r dims (neox: swap(d) = d ± r/2; normal: d ^ 1), with the row's cos/sin tables [r]
 * (nn.rope.RotaryEmbedding.cos_sin: the signs are in sin). */
static void rope(float *x, int64_t heads, int64_t Dh, int64_t r, int64_t neox, const float *cos, const float *sin) {
    float tmp[1024];
    for (int64_t h = 0; h < heads; h++) {
        float *xh = x + h * Dh;
        memcpy(tmp, xh, sizeof(float) * r);
        for (int64_t d = 0; d < r; d++) {
            const int64_t sw = neox ? (d < r / 2 ? d + r / 2 : d - r / 2) : (d ^ 1);
            xh[d] = tmp[d] * cos[d] + tmp[sw] * sin[d];
        }
    }
}

static void add_rows(float *y, const float *bias, int64_t n, int64_t w) {
    if (bias)
        for (int64_t r = 0; r < n; r++)
            for (int64_t i = 0; i < w; i++) y[r * w + i] = y[r * w + i] + bias[i];
}

/* out fp32 [n, D] = the layer applied to h fp32 [n, D]; cos, sin fp32 [n, rotary_dim]; desc,
 * num_seqs, attend_threads: verispec_attend's (the caches prepared for the write); threads: the
 * linears'. Returns 0, or -1 when scratch memory ran out. */
int verispec_llama_layer(const llama_layer *L, const float *h, float *out, int64_t n, const float *cos,
                         const float *sin, const int64_t *desc, int64_t num_seqs, int64_t attend_threads,
                         int64_t threads) {
    const int64_t D = L->D, H = L->H, Hkv = L->Hkv, Dh = L->Dh, F = L->F, W = (H + 2 * Hkv) * Dh;
    if (L->rotary_dim > 1024) return -1;
    float *buf = malloc(sizeof(float) * (size_t)(n * (D + W + H * Dh + 2 * Hkv * Dh + H * Dh + 3 * F)));
    if (!buf) return -1;
    float *x = buf, *qkv = x + n * D, *q = qkv + n * W, *k = q + n * H * Dh, *v = k + n * Hkv * Dh;
    float *att = v + n * Hkv * Dh, *gu = att + n * H * Dh, *act = gu + n * 2 * F;
    int status = 0;
    verispec_rms_norm(h, L->input_norm, x, n, D, L->eps);
    status |= verispec_qmatmul_parts(x, n, D, L->qkv.part, L->qkv.parts, qkv, W, threads);
    add_rows(qkv, L->qkv_bias, n, W);
    for (int64_t r = 0; r < n; r++) {
        float *row = qkv + r * W;
        rope(row, H + Hkv, Dh, L->rotary_dim, L->neox, cos + r * L->rotary_dim, sin + r * L->rotary_dim);
        memcpy(q + r * H * Dh, row, sizeof(float) * H * Dh);
        memcpy(k + r * Hkv * Dh, row + H * Dh, sizeof(float) * Hkv * Dh);
        memcpy(v + r * Hkv * Dh, row + (H + Hkv) * Dh, sizeof(float) * Hkv * Dh);
    }
    status |= verispec_attend(q, k, v, att, desc, num_seqs, H, Hkv, Dh, L->scaling, attend_threads);
    status |= verispec_qmatmul_parts(att, n, H * Dh, L->o.part, L->o.parts, out, D, threads);
    add_rows(out, L->o_bias, n, D);
    for (int64_t i = 0; i < n * D; i++) out[i] = h[i] + out[i];
    verispec_rms_norm(out, L->post_norm, x, n, D, L->eps);
    status |= verispec_qmatmul_parts(x, n, D, L->gate_up.part, L->gate_up.parts, gu, 2 * F, threads);
    verispec_silu_mul(gu, act, n, F);
    status |= verispec_qmatmul_parts(act, n, F, L->down.part, L->down.parts, x, D, threads);
    for (int64_t i = 0; i < n * D; i++) out[i] = out[i] + x[i];
    free(buf);
    return status ? -1 : 0;
}
