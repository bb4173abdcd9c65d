/* Whole decoder layers in one call: a one-row decode spends more time in per-op dispatch (a
 * dozen PyTorch ops and module calls a layer) than in the layer's arithmetic, so a family whose
 * linears are all block-packed (weights.block_linear) runs each layer here. Every step is the same
 * fp32 operation, in the same order, as the family's PyTorch forward with the C kernels
 * (RMSNorms, block linears, RoPE's x·cos + swap(x)·sin, attention, residual adds, and the
 * SwiGLU / GeGLU below, which that forward calls too), so the fused and the op-by-op layer
 * give the same bits (each family's test_fused_layer.py).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

/* act(g) · u over rows of gu fp32 [n, 2F] (gate | up) -> out fp32 [n, F], 16 independent lanes
 * at a time (a row's tail padded with zeros, which it never reads back). */
static void glu(const float *gu, float *out, int64_t n, int64_t F, v16 (*act)(v16)) {
    for (int64_t r = 0; r < n; r++) {
        const float *g = gu + r * 2 * F, *u = g + F;
        float *o = out + r * F;
        int64_t i = 0;
        for (; i + 16 <= F; i += 16) {
            v16 gv, uv;
            memcpy(&gv, g + i, sizeof gv);
            memcpy(&uv, u + i, sizeof uv);
            const v16 res = act(gv) * uv;
            memcpy(o + i, &res, sizeof res);
        }
        if (i < F) {
            const int64_t w = F - i;
            float gl[16] = {0}, ul[16] = {0}, ol[16];
            memcpy(gl, g + i, sizeof(float) * w);
            memcpy(ul, u + i, sizeof(float) * w);
            v16 gv, uv;
            memcpy(&gv, gl, sizeof gv);
            memcpy(&uv, ul, sizeof uv);
            const v16 res = act(gv) * uv;
            memcpy(ol, &res, sizeof ol);
            memcpy(o + i, ol, sizeof(float) * w);
        }
    }
}

/* silu(g) = g · sigmoid(g) through vexp of a non-positive argument (transformers LlamaMLP's
 * act_fn): e = vexp(-|g|), sig = g >= 0 ? 1 / (1 + e) : e / (1 + e), silu = g · sig. */
static v16 silu(v16 g) {
    const v16i neg = g < splat(0.0f);
    const v16 e = vexp((v16)((v16i)g | (v16i)splat(-0.0f))); /* -|g| */
    const v16 num = (v16)(((v16i)e & neg) | ((v16i)splat(1.0f) & ~neg));
    return g * (num / (splat(1.0f) + e));
}

/* gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) (transformers GELUTanh /
 * gelu_pytorch_tanh), tanh through vexp of a non-positive argument:
 *   y = 0.7978845608 · (x + 0.044715 · ((x · x) · x)),  e = vexp(-2 |y|),
 *   t = (1 - e) / (1 + e) with y's sign,  gelu = (0.5 · x) · (1 + t) */
static v16 gelu_tanh(v16 x) {
    const v16 y = splat(0.7978845608f) * (x + splat(0.044715f) * ((x * x) * x));
    const v16i sign = (v16i)y & (v16i)splat(-0.0f);
    const v16 e = vexp((v16)((v16i)y | (v16i)splat(-0.0f)) * splat(2.0f)); /* vexp(-2|y|) */
    const v16 t = (v16)((v16i)((splat(1.0f) - e) / (splat(1.0f) + e)) | sign);
    return (splat(0.5f) * x) * (splat(1.0f) + t);
}

typedef struct {
    const float *gu;
    float *out;
    int64_t n, F;
    v16 (*act)(v16);
} glu_job;

static void glu_task(void *arg, int64_t task, int64_t tasks) {
    const glu_job *j = arg;
    const int64_t r0 = j->n * task / tasks, r1 = j->n * (task + 1) / tasks;
    glu(j->gu + r0 * 2 * j->F, j->out + r0 * j->F, r1 - r0, j->F, j->act);
}

/* SwiGLU / GeGLU: out fp32 [n, F] = act(gate) · up for gu fp32 [n, 2F] (gate | up); the
 * arithmetic above, `ckernels.reference_glu` in PyTorch. */
void verispec_silu_mul(const float *gu, float *out, int64_t n, int64_t F) { glu(gu, out, n, F, silu); }
void verispec_gelu_tanh_mul(const float *gu, float *out, int64_t n, int64_t F) { glu(gu, out, n, F, gelu_tanh); }

typedef struct {
    int64_t parts;
    verispec_qweight part[4];
} linear;

/* A pre-norm decoder layer (transformers LlamaDecoderLayer, Gemma3DecoderLayer): sizes, the
 * activation (0: SwiGLU, 1: GeGLU tanh), norm weights, biases and optional parts (NULL: none),
 * and the four linears (q|k|v as one linear of up to 4 parts), built once per layer by the
 * family's Python (nn.layers.DecoderLayerKernel):
 *   x = input_norm(h); q|k|v = qkv(x) + qkv_bias; q, k per head: q_norm, k_norm; RoPE on q, k
 *   a = o(attention(q, k, v)) + o_bias;  h' = h + post_attn_norm(a)
 *   m = down(act(gate_up(pre_ff_norm(h'))));  out = h' + post_ff_norm(m) */
typedef struct {
    int64_t D, H, Hkv, Dh, F, rotary_dim, neox, act;
    float eps, scaling;
    const float *input_norm, *post_attn_norm, *pre_ff_norm, *post_ff_norm, *q_norm, *k_norm, *qkv_bias, *o_bias;
    linear qkv, o, gate_up, down;
} decoder_layer;

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

static void add_bias(float *y, const float *bias, int64_t n, int64_t w) {
    if (bias)
        for (int64_t r = 0; r < n; r++)
            for (int64_t i = 0; i < w; i++) y[r * w + i] = y[r * w + i] + bias[i];
}

/* out = h + (norm ? norm(y) : y), y [n, D] (normed in place). */
static void residual(const float *h, float *y, const float *norm, float *out, int64_t n, int64_t D, float eps) {
    if (norm) verispec_rms_norm(y, norm, y, n, D, eps);
    for (int64_t i = 0; i < n * D; i++) out[i] = h[i] + y[i];
}

/* Floats of scratch one layer needs for n rows. */
static int64_t scratch_floats(const decoder_layer *L, int64_t n) {
    const int64_t W = (L->H + 2 * L->Hkv) * L->Dh;
    return n * (2 * L->D + W + 2 * L->H * L->Dh + 2 * L->Hkv * L->Dh + 3 * L->F);
}

/* out fp32 [n, D] = the layer applied to h fp32 [n, D] (out may not be h); cos, sin fp32
 * [n, rotary_dim]; desc, num_seqs, attend_threads: verispec_attend's (the caches prepared for the
 * write); threads: the linears'; buf: scratch_floats(L, n) floats. Returns 0, or -1 when a kernel's
 * scratch memory ran out. */
static int layer_forward(const decoder_layer *L, const float *h, float *out, int64_t n, const float *cos,
                         const float *sin, const int64_t *desc, int64_t num_seqs, int64_t attend_threads,
                         int64_t threads, float *buf) {
    const int64_t D = L->D, H = L->H, Hkv = L->Hkv, Dh = L->Dh, F = L->F, W = (H + 2 * Hkv) * Dh;
    float *x = buf, *y = x + n * D, *qkv = y + n * D, *q = qkv + n * W, *k = q + n * H * Dh, *v = k + n * Hkv * Dh;
    float *att = v + n * Hkv * Dh, *gu = att + n * H * Dh, *act = gu + n * 2 * F;
    int status = 0;
    verispec_rms_norm(h, L->input_norm, x, n, D, L->eps);
    status |= verispec_qmatmul_parts(x, n, D, L->qkv.part, L->qkv.parts, qkv, W, threads);
    add_bias(qkv, L->qkv_bias, n, W);
    for (int64_t r = 0; r < n; r++) {
        float *row = qkv + r * W;
        if (L->q_norm) verispec_rms_norm(row, L->q_norm, row, H, Dh, L->eps);
        if (L->k_norm) verispec_rms_norm(row + H * Dh, L->k_norm, row + H * Dh, Hkv, Dh, L->eps);
        rope(row, H + Hkv, Dh, L->rotary_dim, L->neox, cos + r * L->rotary_dim, sin + r * L->rotary_dim);
        memcpy(q + r * H * Dh, row, sizeof(float) * H * Dh);
        memcpy(k + r * Hkv * Dh, row + H * Dh, sizeof(float) * Hkv * Dh);
        memcpy(v + r * Hkv * Dh, row + (H + Hkv) * Dh, sizeof(float) * Hkv * Dh);
    }
    status |= verispec_attend(q, k, v, att, desc, num_seqs, H, Hkv, Dh, L->scaling, attend_threads);
    status |= verispec_qmatmul_parts(att, n, H * Dh, L->o.part, L->o.parts, y, D, threads);
    add_bias(y, L->o_bias, n, D);
    residual(h, y, L->post_attn_norm, out, n, D, L->eps);
    verispec_rms_norm(out, L->pre_ff_norm, x, n, D, L->eps);
    status |= verispec_qmatmul_parts(x, n, D, L->gate_up.part, L->gate_up.parts, gu, 2 * F, threads);
    glu_job glu_rows = {gu, act, n, F, L->act ? gelu_tanh : silu}; /* rows split between threads: the same bits */
    run_tasks(glu_task, &glu_rows, n * F < (1 << 16) ? 1 : threads < n ? threads : n);
    status |= verispec_qmatmul_parts(act, n, F, L->down.part, L->down.parts, y, D, threads);
    residual(out, y, L->post_ff_norm, out, n, D, L->eps);
    return status ? -1 : 0;
}

/* A stack of layers in one call: h fp32 [n, D] through layers[0 .. num_layers) in order, out fp32
 * [num_layers, n, D] the residual after each. Per layer l: cos[l], sin[l] fp32 [n, rotary_dim],
 * desc + l * num_seqs * 9 its sequences' verispec_attend descriptors (the caches of that layer
 * prepared for the write), attend_threads[l] the attention's threads; threads: the linears'.
 * Returns 0, or -1 when scratch memory ran out or RoPE spans over 1024 dims. */
int verispec_decoder_layers(const decoder_layer *const *layers, int64_t num_layers, const float *h, float *out,
                            int64_t n, const float *const *cos, const float *const *sin, const int64_t *desc,
                            int64_t num_seqs, const int64_t *attend_threads, int64_t threads) {
    int64_t floats = 0;
    for (int64_t l = 0; l < num_layers; l++) {
        if (layers[l]->rotary_dim > 1024) return -1;
        const int64_t f = scratch_floats(layers[l], n);
        floats = f > floats ? f : floats;
    }
    float *buf = malloc(sizeof(float) * (size_t)floats);
    if (!buf) return -1;
    int status = 0;
    for (int64_t l = 0; l < num_layers && !status; l++) {
        const int64_t D = layers[l]->D;
        status = layer_forward(layers[l], l ? out + (l - 1) * n * D : h, out + l * n * D, n, cos[l], sin[l],
                               desc + l * num_seqs * 9, num_seqs, attend_threads[l], threads, buf);
    }
    free(buf);
    return status;
}
