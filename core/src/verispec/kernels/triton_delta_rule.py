"""The gated delta rule's per-row recurrence in Triton, emitting the state after every row.

Two trunks run it on CUDA tensors (verispec.kernels.triton_dispatch) for decodes and verifies
alike: the Qwen 3.5 GatedDeltaNet (`Qwen35GatedDeltaNet.recurrence`, one decay per head) and
GLM-5.3-Flash's Kimi delta attention (`KdaAttention.recurrence`, one decay per key channel). A
verify row is bitwise the same row decoded alone and `keep` stays a selection of the emitted
states. `reference_delta_rule` states its arithmetic in PyTorch and is what the kernel is held
to bitwise. The CPU layers' einsum loops are the same function but not these bits: their dk sums
are ATen's (bmm) order, which no kernel can state, so the Triton path fixes its own order (below)
and is within fp32 rounding of the CPU path (models/qwen35/tests/test_triton_delta_rule.py and
models/glm5/tests/test_triton_kda.py measure the error).

Shapes (one sequence's m rows): q, k fp32 [m, nv, dk] (q scaled, both L2-normed and, for Qwen,
tiled to nv heads), v fp32 [m, nv, dv], beta fp32 [m, nv], decay = exp(g) fp32 [m, nv, dk] (key
channel i of head h decays by decay[t, h, i]; a per-head decay [m, nv] is broadcast over dk,
which multiplies every element by the same fp32 value: the same bits as one scalar multiply),
state fp32 [nv, dk, dv]. One program per v-head h walks the rows in order; per row t, each step
one IEEE fp32 operation (the launch passes enable_fp_fusion=False: no fused multiply-add on the
GPU):
    S_ij   = S_ij · decay_t,i                                              (key channel i)
    mem_j  = ((0 + S_0j k_0) + S_1j k_1) + ... + S_{dk-1,j} k_{dk-1}        (i in order)
    delta  = beta_t · (v_t - mem)
    S      = S + k_i · delta_j                                             (rank-1 write)
    out_j  = ((0 + S_0j q_0) + S_1j q_1) + ... + S_{dk-1,j} q_{dk-1}        (i in order)
then stores out_t [dv] and S [dk, dv]. Nothing depends on another sequence or on m beyond
the rows before t.
"""
from __future__ import annotations

import functools

import torch

__all__ = ["delta_rule", "reference_delta_rule"]


def _per_channel(decay: torch.Tensor, dk: int) -> torch.Tensor:
    """decay [m, nv] (per head) or [m, nv, dk] (per key channel) -> [m, nv, dk]."""
    return decay[..., None].expand(*decay.shape, dk) if decay.dim() == 2 else decay


def reference_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                         decay: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's arithmetic in PyTorch, one fp32 operation per step in its order (slow: for
    tests). Shapes: the module docstring (decay [m, nv] or [m, nv, dk]). Returns (outputs fp32
    [m, nv, dv], the state after every row fp32 [m, nv, dk, dv])."""
    m, nv, dk = q.shape
    decay = _per_channel(decay, dk)
    outputs, states = [], []
    for t in range(m):
        state = state * decay[t][:, :, None]
        memory = torch.zeros(nv, v.shape[-1])
        for i in range(dk):
            memory = memory + state[:, i, :] * k[t][:, i, None]
        delta = beta[t][:, None] * (v[t] - memory)
        state = state + k[t][:, :, None] * delta[:, None, :]
        out = torch.zeros(nv, v.shape[-1])
        for i in range(dk):
            out = out + state[:, i, :] * q[t][:, i, None]
        outputs.append(out)
        states.append(state)
    return torch.stack(outputs), torch.stack(states)


@functools.cache
def _kernel():
    """The jitted kernel, built on first use (TRITON_INTERPRET is read then). `tl` is made a
    module global: the interpreter patches the language module through the kernel's globals."""
    global tl
    import triton
    import triton.language as tl

    @triton.jit
    def delta_rule_kernel(q_ptr, k_ptr, v_ptr, beta_ptr, decay_ptr, state_ptr, out_ptr, states_ptr, m, nv,
                          DK: tl.constexpr, DV: tl.constexpr, DKP: tl.constexpr, DVP: tl.constexpr):
        h = tl.program_id(0)
        ii = tl.arange(0, DKP)
        jj = tl.arange(0, DVP)
        i_ok, j_ok = ii < DK, jj < DV
        mat_ok = i_ok[:, None] & j_ok[None, :]
        mat = ii[:, None] * DV + jj[None, :]
        S = tl.load(state_ptr + h * DK * DV + mat, mask=mat_ok, other=0.0)
        for t in range(0, m):
            row = t * nv + h
            kt = tl.load(k_ptr + row * DK + ii, mask=i_ok, other=0.0)
            qt = tl.load(q_ptr + row * DK + ii, mask=i_ok, other=0.0)
            vt = tl.load(v_ptr + row * DV + jj, mask=j_ok, other=0.0)
            S = S * tl.load(decay_ptr + row * DK + ii, mask=i_ok, other=1.0)[:, None]  # key channel i
            memory = tl.zeros([DVP], dtype=tl.float32)
            for i in range(0, DK):  # row i of S and k_i exactly: one term, the rest +0
                memory = memory + tl.sum(tl.where(ii[:, None] == i, S, 0.0), axis=0) * tl.sum(tl.where(ii == i, kt, 0.0))
            delta = tl.load(beta_ptr + row) * (vt - memory)
            S = S + kt[:, None] * delta[None, :]
            out = tl.zeros([DVP], dtype=tl.float32)
            for i in range(0, DK):
                out = out + tl.sum(tl.where(ii[:, None] == i, S, 0.0), axis=0) * tl.sum(tl.where(ii == i, qt, 0.0))
            tl.store(out_ptr + row * DV + jj, out, mask=j_ok)
            tl.store(states_ptr + row * DK * DV + mat, S, mask=mat_ok)

    return delta_rule_kernel


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, decay: torch.Tensor,
               state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference_delta_rule`'s bits on q's device (CUDA, or CPU under TRITON_INTERPRET=1).
    decay: [m, nv] (per head, broadcast over dk) or [m, nv, dk] (per key channel). Returns
    (outputs fp32 [m, nv, dv], states after every row fp32 [m, nv, dk, dv]). Raises ValueError
    for shapes that do not fit together."""
    import triton

    m, nv, dk = q.shape
    dv = v.shape[-1]
    if k.shape != q.shape or v.shape[:2] != (m, nv) or beta.shape != (m, nv) \
            or decay.shape not in ((m, nv), (m, nv, dk)) or state.shape != (nv, dk, dv):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, beta {tuple(beta.shape)}, "
                         f"decay {tuple(decay.shape)}, state {tuple(state.shape)} do not fit [m, nv, dk], "
                         "[m, nv, dv], [m, nv], [m, nv] or [m, nv, dk], [nv, dk, dv]")
    outputs = torch.empty(m, nv, dv, dtype=torch.float32, device=q.device)
    states = torch.empty(m, nv, dk, dv, dtype=torch.float32, device=q.device)
    if m == 0:
        return outputs, states
    args = [t.float().contiguous() for t in (q, k, v, beta, _per_channel(decay, dk), state)]
    _kernel()[(nv,)](*args, outputs, states, m, nv, DK=dk, DV=dv, DKP=triton.next_power_of_2(dk),
                     DVP=triton.next_power_of_2(dv), enable_fp_fusion=False)
    return outputs, states
