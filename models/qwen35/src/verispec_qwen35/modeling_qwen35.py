"""Qwen 3.5 / 3.6 hybrid trunks: GatedDeltaNet and gated full-attention layers, dense SwiGLU or
MoE with a sigmoid-gated shared expert, and the MTP block the draft head runs.

Shape letters: n rows in a forward, V vocabulary, D model width, H / Hkv query / KV heads
(full attention), Dh head dim, nk / nv GDN key / value heads, dk / dv their head dims,
C = 2·nk·dk + nv·dv conv channels, W conv kernel width, E experts, L main layers.

Per layer (pre-norm residual, as transformers Qwen3_5DecoderLayer):
    h = h + mixer(input_layernorm(h))          mixer = GatedDeltaNet | gated attention
    h = h + ffn(post_attention_layernorm(h))    ffn = SwiGLU | MoE + shared expert
then logits = lm_head(norm(h)). Layer i is full attention iff (i + 1) % interval == 0.

What the GGUF holds (docs/reference/qwen35.md §4), so the math here is plain:
- every `*norm.weight` except the GDN gated norm already holds 1 + w: RMSNorm multiplies by it;
- `ssm_a` holds -exp(A_log): the log decay is g = ssm_a · softplus(a + dt_bias);
- value heads are re-tiled: GGUF v-head p pairs with k-head p % nk, so q/k are expanded to
  nv heads by tiling (`repeat`), not repeat_interleave as in transformers' grouped order.

The GDN layer runs the delta rule one row at a time (exact; the reference a fused kernel must
match) and hands the state after every row to its `nn.state.RecurrentState` during a verify,
so `keep(seq, a)` selects the state after row a with no re-forward. On CUDA tensors the row
loop is verispec.kernels.triton_delta_rule's kernel (its own fixed order of the dk sums). Every
op is per row with the same shapes whatever n, so with batch-invariant linears (int8) a row is
the same bits alone or inside an n-row verify.
Sources: transformers models/qwen3_5/modeling_qwen3_5.py, qwen3_5_moe (5.24);
llama.cpp src/models/qwen35.cpp, qwen35moe.cpp, delta-net-base.cpp.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn
from verispec.errors import DamagedFile, UnsupportedVariant
from verispec.gguf.io import MissingTensor, arch_value
from verispec.kernels import ckernels, triton_delta_rule, triton_dispatch
from verispec.nn.attention import attend_rows
from verispec.nn.elementwise import rowwise
from verispec.nn.mlp import GatedMLP
from verispec.nn.norm import RMSNorm
from verispec.nn.rope import RotaryEmbedding
from verispec.nn.kv_cache import PagedKVCache
from verispec.nn.state import RecurrentState
from verispec.nn.trunk import Rows
from verispec.nn.trunk_module import TrunkModule

__all__ = ["ARCHITECTURES", "Qwen35Config", "Qwen35ForCausalLM", "UnsupportedQwen35Variant", "check_file_kind"]

ARCHITECTURES = ("qwen35", "qwen35moe")
LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"


class UnsupportedQwen35Variant(UnsupportedVariant):
    """The GGUF is a qwen35-family file whose layout or math this package does not implement."""


@attrs.frozen
class Qwen35Config:
    """The whole math of one trunk (HF field names); read from GGUF metadata by `from_gguf`."""

    architecture: str  # "qwen35" | "qwen35moe"
    vocab_size: int
    hidden_size: int  # D
    num_hidden_layers: int  # L, the main stack (MTP layers not counted)
    num_attention_heads: int  # H
    num_key_value_heads: int  # Hkv
    head_dim: int  # Dh
    rotary_dim: int  # dims of each head that rotate (partial RoPE, NEOX pairing)
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    layer_types: tuple[str, ...]  # per main layer: LINEAR_ATTENTION | FULL_ATTENTION
    linear_conv_kernel_dim: int  # W
    linear_key_head_dim: int  # dk
    linear_value_head_dim: int  # dv
    linear_num_key_heads: int  # nk
    linear_num_value_heads: int  # nv
    intermediate_size: int = 0  # dense FFN width (qwen35)
    num_experts: int = 0  # E; 0 = dense FFN
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    #: the shared-expert gate's stored shape: (D,) or (1, D) (writers differ; both are accepted).
    shared_expert_gate_shape: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    #: MTP blocks in the file (0: no draft head); only 1 is supported.
    num_mtp_layers: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any], tensor_shapes: Mapping[str, tuple[int, ...]], *,
                  source: str = "the GGUF", standalone_mtp: bool = False) -> Qwen35Config:
        """Read the `{arch}.*` keys of a qwen35 / qwen35moe GGUF (docs/reference/qwen35.md §2) and which
        tensors exist. The main stack is block_count - nextn_predict_layers; layer types come from
        `attention.recurrent_layers` when the file has it, else the `full_attention_interval` rule.

        tensor_shapes: GGUF tensor name -> torch-order shape (V from token_embd, tying, the
        shared-expert gate's stored shape).
        standalone_mtp: the file is the converter's separate MTP GGUF (§3.7, variant 3: the main
        file's metadata, only `blk.{n_main}.*` plus embedding/norm/head tensors), not a main file.
        Raises MissingKey, MissingTensor (token_embd), UnsupportedQwen35Variant, errors.DamagedFile."""
        arch = metadata.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise UnsupportedQwen35Variant(source, f"general.architecture is {arch!r}",
                                           f"this package loads {', '.join(ARCHITECTURES)}")
        if "token_embd.weight" not in tensor_shapes:
            raise MissingTensor("token_embd.weight", arch, source)
        check_file_kind(tensor_shapes, source=source, standalone_mtp=standalone_mtp)
        key = functools.partial(arch_value, metadata, source=source)

        num_mtp = int(key("nextn_predict_layers", 0))
        if num_mtp > 1:
            raise UnsupportedQwen35Variant(source, f"{num_mtp} MTP layers", "only one MTP block is supported")
        if standalone_mtp and num_mtp != 1:
            raise UnsupportedQwen35Variant(source, "a standalone file without nextn_predict_layers = 1",
                                           "this is not an MTP GGUF; pass the converter's --mtp output")
        num_layers = int(key("block_count")) - num_mtp
        layer_types = _layer_types(key, num_layers, source)
        hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
        head_dim = int(key("attention.key_length", hidden // heads))
        if int(key("attention.value_length", head_dim)) != head_dim:
            raise UnsupportedQwen35Variant(source, "attention key and value head sizes differ",
                                           "only equal K/V head sizes are supported")
        nv, inner, nk = int(key("ssm.time_step_rank")), int(key("ssm.inner_size")), int(key("ssm.group_count"))
        if min(nv, inner, nk) < 1:
            raise DamagedFile(source, f"GDN heads: {nv} value heads, {nk} key heads, inner size {inner}: "
                              "positive counts are needed")
        if nv % nk or inner % nv:
            raise UnsupportedQwen35Variant(source, f"GDN heads: {nv} value heads, {nk} key heads, inner size "
                                           f"{inner}",
                                           "value heads must be a multiple of key heads and divide inner_size")
        num_experts = int(key("expert_count", 0)) if arch == "qwen35moe" else 0
        if arch == "qwen35moe" and not num_experts:
            raise UnsupportedQwen35Variant(source, "qwen35moe without expert_count",
                                           "the file's metadata is incomplete")
        shexp = f"blk.{num_layers if standalone_mtp else num_layers - 1}.ffn_gate_inp_shexp.weight"
        return cls(
            architecture=arch,
            vocab_size=int(tensor_shapes["token_embd.weight"][0]),
            hidden_size=hidden,
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(key("attention.head_count_kv", heads)),
            head_dim=head_dim,
            rotary_dim=int(key("rope.dimension_count", head_dim // 4)),
            rope_theta=float(key("rope.freq_base", 10_000_000.0)),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            max_position_embeddings=int(key("context_length")),
            layer_types=layer_types,
            linear_conv_kernel_dim=int(key("ssm.conv_kernel")),
            linear_key_head_dim=int(key("ssm.state_size")),
            linear_value_head_dim=inner // nv,
            linear_num_key_heads=nk,
            linear_num_value_heads=nv,
            intermediate_size=0 if num_experts else int(key("feed_forward_length")),
            num_experts=num_experts,
            num_experts_per_tok=int(key("expert_used_count")) if num_experts else 0,
            moe_intermediate_size=int(key("expert_feed_forward_length")) if num_experts else 0,
            shared_expert_intermediate_size=int(key("expert_shared_feed_forward_length")) if num_experts else 0,
            shared_expert_gate_shape=tuple(tensor_shapes[shexp]) if num_experts and shexp in tensor_shapes else (),
            tie_word_embeddings="output.weight" not in tensor_shapes,
            num_mtp_layers=num_mtp,
        )


def check_file_kind(tensor_names: Iterable[str], *, source: str = "the GGUF", standalone_mtp: bool = False) -> None:
    """Refuse a qwen35-family file of another kind than asked for, by its tensor names: a
    standalone MTP file (no main stack) as a trunk, a main file as a standalone MTP file, the
    qwen3next layout (ssm_ba / ssm_in projections). Raises UnsupportedQwen35Variant."""
    names = set(tensor_names)
    has_main_stack = "blk.0.attn_norm.weight" in names
    if not has_main_stack and not standalone_mtp:
        raise UnsupportedQwen35Variant(source, "no main-stack tensors (blk.0.attn_norm.weight): "
                                       "a standalone MTP file",
                                       "load the main GGUF as --model and pass this file as --draft-model")
    if has_main_stack and standalone_mtp:
        raise UnsupportedQwen35Variant(source, "a main GGUF (it has blk.0.attn_norm.weight), not a standalone "
                                       "MTP file", "pass the MTP-only file as --draft-model, or load this one "
                                       "as --model: an MTP block inside it is found by itself")
    if any(name.endswith((".ssm_ba.weight", ".ssm_in.weight")) for name in names):
        raise UnsupportedQwen35Variant(source, "qwen3next GDN projections (ssm_ba / ssm_in)",
                                       "this file has the qwen3next layout (grouped value heads), "
                                       "not qwen35's")


def _layer_types(key: Callable[..., Any], num_layers: int, source: str) -> tuple[str, ...]:
    """Per main layer LINEAR_ATTENTION | FULL_ATTENTION: `attention.recurrent_layers` (a flag per
    layer, MTP layers after them) when present, else full iff (i + 1) % full_attention_interval == 0.
    Raises errors.DamagedFile for too few flags or an interval below 1."""
    recurrent = key("attention.recurrent_layers", None)
    if recurrent is not None:
        flags = list(recurrent)[:num_layers]
        if len(flags) != num_layers:
            raise DamagedFile(source, f"attention.recurrent_layers has {len(flags)} entries for {num_layers} layers")
        return tuple(LINEAR_ATTENTION if r else FULL_ATTENTION for r in flags)
    interval = int(key("full_attention_interval", 4))
    if interval < 1:
        raise DamagedFile(source, f"full_attention_interval is {interval}: an interval of 1 or more layers is needed")
    return tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers))


# -- GatedDeltaNet -------------------------------------------------------------------------


class Qwen35GatedDeltaNet(nn.Module):
    """Linear-attention mixer: short causal conv over Q‖K‖V, then the gated delta rule.

    State per sequence (a RecurrentState): "conv" fp32 [C, W-1], the pre-conv channels of the
    last W-1 rows, oldest first; "ssm" fp32 [nv, dk, dv]. x: fp32 [n, D] -> fp32 [n, D].
    """

    def __init__(self, c: Qwen35Config, *, device=None):
        super().__init__()
        self.nk, self.nv = c.linear_num_key_heads, c.linear_num_value_heads
        self.dk, self.dv = c.linear_key_head_dim, c.linear_value_head_dim
        self.key_dim, self.value_dim = self.nk * self.dk, self.nv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = c.linear_conv_kernel_dim
        d = c.hidden_size
        self.in_proj_qkv = nn.Linear(d, self.conv_dim, bias=False, device=device)
        self.in_proj_z = nn.Linear(d, self.value_dim, bias=False, device=device)
        self.in_proj_b = nn.Linear(d, self.nv, bias=False, device=device)
        self.in_proj_a = nn.Linear(d, self.nv, bias=False, device=device)
        self.out_proj = nn.Linear(self.value_dim, d, bias=False, device=device)
        self.conv1d_weight = nn.Parameter(torch.empty(self.conv_dim, self.kernel, device=device),
                                          requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.nv, device=device), requires_grad=False)
        self.ssm_a = nn.Parameter(torch.empty(self.nv, device=device), requires_grad=False)  # -exp(A_log)
        self.norm = RMSNorm(self.dv, c.rms_norm_eps)  # plain weight (no 1 + w), docs/reference/qwen35.md §4.1
        #: run a non-verify chunk of at least this many rows through `chunked_delta_rule` (None: never).
        self.chunked_min_rows: int | None = None

    #: set by `TrunkModule.to_device`: the conv and the q/k l2norm as fixed-order elementwise
    #: statements (a GPU's reductions may pick their order by shape), the rows in Triton
    device_kernels = False

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"conv": (self.conv_dim, self.kernel - 1), "ssm": (self.nv, self.dk, self.dv)}

    def forward(self, x: torch.Tensor, rows: Rows, layer_idx: int) -> torch.Tensor:
        n = x.shape[0]
        mix = self.in_proj_qkv(x)  # [n, C], pre-conv
        z = self.in_proj_z(x).view(n, self.nv, self.dv)
        beta = rowwise(torch.sigmoid, self.in_proj_b(x))  # [n, nv]
        g = self.ssm_a * rowwise(F.softplus, self.in_proj_a(x) + self.dt_bias)  # [n, nv] log decay <= 0
        core = torch.empty(n, self.nv, self.dv, device=x.device)
        for s in rows.sequences:  # each sequence runs its own recurrence (never across sequences)
            state = s.state.layers[layer_idx]
            core[s.rows] = self.recurrence(mix[s.rows], beta[s.rows], g[s.rows], state,
                                           record_rows=s.state.verify_rows is not None)
        o = self.norm(core) * rowwise(F.silu, z)  # gated RMSNorm per v-head over dv
        return self.out_proj(o.reshape(n, self.value_dim))

    def recurrence(self, mix: torch.Tensor, beta: torch.Tensor, g: torch.Tensor, state: RecurrentState,
                   *, record_rows: bool) -> torch.Tensor:
        """One sequence's rows in order: mix fp32 [m, C], beta, g fp32 [m, nv] -> output [m, nv, dv].
        Hands the state after every row (record_rows: a verify) or after the last to `state.update`."""
        m, r = mix.shape[0], self.nv // self.nk
        # short causal conv: row t reads the window X[:, t : t+W] of X = [conv tail | this chunk's rows]
        x = torch.cat([state.values["conv"], mix.t()], dim=1)  # [C, W-1+m]
        windows = x.unfold(1, self.kernel, 1)  # [C, m, W]; column W-1 is the row itself
        if self.device_kernels:  # the taps summed in order, elementwise: no reduction whose order a GPU picks
            conv = windows[..., 0] * self.conv1d_weight[:, None, 0]
            for j in range(1, self.kernel):
                conv = conv + windows[..., j] * self.conv1d_weight[:, None, j]
        else:
            conv = (windows * self.conv1d_weight[:, None, :]).sum(dim=-1)
        u = rowwise(F.silu, conv.t().contiguous())  # [m, C]
        q, k, v = u.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        l2norm = _lane_l2norm if self.device_kernels else _l2norm
        q = l2norm(q.reshape(m, self.nk, self.dk)) * self.dk ** -0.5
        k = l2norm(k.reshape(m, self.nk, self.dk))
        q, k = q.repeat(1, r, 1), k.repeat(1, r, 1)  # [m, nv, dk]: v-head p reads k-head p % nk (tiled)
        v = v.reshape(m, self.nv, self.dv)
        if not record_rows and self.chunked_min_rows and m >= self.chunked_min_rows:
            out, ssm = chunked_delta_rule(q, k, v, beta, g, state.values["ssm"])
            state.update({"conv": x[:, m:].contiguous()[None], "ssm": ssm[None]})
            return out
        decay = g.exp()  # [m, nv]
        if triton_dispatch.use_triton(mix):  # CUDA: the rows in Triton, the state after each emitted
            out, ssms = triton_delta_rule.delta_rule(q, k, v, beta, decay, state.values["ssm"])
            convs = windows[:, :, 1:].permute(1, 0, 2).contiguous()  # [m, C, W-1]: the tail after each row
            state.update({"conv": convs, "ssm": ssms} if record_rows else {"conv": convs[-1:], "ssm": ssms[-1:]})
            return out
        ssm, ssms, outputs = state.values["ssm"], [], []
        for t in range(m):  # the delta rule, state [nv, dk, dv]
            ssm = ssm * decay[t][:, None, None]
            memory = torch.einsum("hkv,hk->hv", ssm, k[t])  # read with the decayed state
            delta = beta[t][:, None] * (v[t] - memory)  # [nv, dv]
            ssm = ssm + k[t][:, :, None] * delta[:, None, :]  # rank-1 write
            outputs.append(torch.einsum("hkv,hk->hv", ssm, q[t]))  # read with the updated state
            if record_rows:
                ssms.append(ssm)
        if record_rows:
            convs = windows[:, :, 1:].permute(1, 0, 2).contiguous()  # [m, C, W-1]: the tail after each row
            state.update({"conv": convs, "ssm": torch.stack(ssms)})
        else:
            state.update({"conv": x[:, m:].contiguous()[None], "ssm": ssm[None]})
        return torch.stack(outputs)


#: rows per chunk of the parallel form (HF, FLA and llama.cpp all use 64).
DELTA_CHUNK = 64


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                       g: torch.Tensor, state: torch.Tensor,
                       chunk: int = DELTA_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule re-associated in chunks (prefill): the same function as the row loop
    in `recurrence`, equal to it within fp32 rounding (tests/test_chunked.py: <= 2e-5, measured
    6e-7 on unit-scale inputs), not bitwise.

    q, k: fp32 [m, nv, dk] (q scaled, both L2-normed, tiled); v: [m, nv, dv]; beta, g: [m, nv];
    state: [nv, dk, dv]. Returns (outputs [m, nv, dv], the state after the last row).
    Per chunk, with Γ the in-chunk cumulative log decay and L_ij = β_i e^(Γ_i−Γ_j) k_i·k_j (j < i):
    U = (I + L)⁻¹ (β⊙V − β⊙e^Γ⊙K · S₀), o_i = e^Γ_i q_i S₀ + Σ_{j≤i} e^(Γ_i−Γ_j) (q_i·k_j) u_j,
    S = e^Γ_C S₀ + Σ_j e^(Γ_C−Γ_j) k_j u_jᵀ (docs/reference/qwen35.md §5.4). The upper triangle is
    masked before exponentiating (Γ_i − Γ_j > 0 there); padded rows have β = g = 0 (inert).
    """
    m = q.shape[0]
    pad = -m % chunk
    q, k, v, beta, g = (F.pad(t.transpose(0, 1), (0, 0, 0, pad) if t.dim() == 3 else (0, pad))
                        for t in (q, k, v, beta, g))  # heads first: [nv, m', d] / [nv, m']
    outputs = []
    causal = torch.ones(chunk, chunk, dtype=torch.bool).tril()  # j <= i
    for start in range(0, m + pad, chunk):
        rows = slice(start, start + chunk)
        qc, kc, vc, bc = q[:, rows], k[:, rows], v[:, rows], beta[:, rows]
        gamma = g[:, rows].cumsum(dim=-1)  # [nv, C]
        diff = (gamma[:, :, None] - gamma[:, None, :]).masked_fill(~causal, float("-inf"))
        decay = diff.exp()  # [nv, C, C]: e^(Γ_i − Γ_j) for j <= i, else 0
        kb = kc * bc[..., None]  # β⊙K
        lower = (kb @ kc.transpose(1, 2)) * decay.tril(-1)  # strictly lower L
        eye = torch.eye(chunk).expand_as(lower)
        rhs = vc * bc[..., None] - (kb * gamma.exp()[..., None]) @ state  # [nv, C, dv]
        u = torch.linalg.solve_triangular(eye + lower, rhs, upper=False, unitriangular=True)
        outputs.append((qc * gamma.exp()[..., None]) @ state + ((qc @ kc.transpose(1, 2)) * decay) @ u)
        last = gamma[:, -1:]  # [nv, 1]
        state = state * last.exp()[..., None] + (kc * (last - gamma).exp()[..., None]).transpose(1, 2) @ u
    return torch.cat(outputs, dim=1)[:, :m].transpose(0, 1), state


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x · rsqrt(Σx² + eps) over the last dim (transformers / FLA l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _lane_l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`_l2norm` with Σx² in `ckernels.lane_sum_of_squares`' fixed order (a placed trunk's: each
    row's bits its own on any device, whatever the rows around it). x fp32 [..., d]."""
    sums = ckernels.lane_sum_of_squares(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], 1)
    return x * torch.rsqrt(sums + eps)


# -- gated full attention --------------------------------------------------------------------


class Qwen35Attention(nn.Module):
    """q_proj gives q and an output gate, interleaved per head [q_h | gate_h]; q/k RMSNorm over
    Dh before partial NEOX RoPE; the output is multiplied by sigmoid(gate). x: fp32 [n, D]."""

    def __init__(self, c: Qwen35Config, *, device=None):
        super().__init__()
        d, h, hkv, dh = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, hkv, dh
        self.scaling = dh ** -0.5
        self.q_proj = nn.Linear(d, h * dh * 2, bias=False, device=device)
        self.k_proj = nn.Linear(d, hkv * dh, bias=False, device=device)
        self.v_proj = nn.Linear(d, hkv * dh, bias=False, device=device)
        self.o_proj = nn.Linear(h * dh, d, bias=False, device=device)
        self.q_norm = RMSNorm(dh, c.rms_norm_eps)
        self.k_norm = RMSNorm(dh, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor,
                attend) -> torch.Tensor:
        """attend(q [n, H, Dh], k, v [n, Hkv, Dh]) -> [n, H, Dh]: writes k/v to the right cache first."""
        n = x.shape[0]
        qg = self.q_proj(x).view(n, self.num_heads, 2 * self.head_dim)  # [q_h | gate_h] per head
        q, gate = qg.chunk(2, dim=-1)  # [n, H, Dh] each
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        q, k = rope(self.q_norm(q), cos, sin), rope(self.k_norm(k), cos, sin)
        out = attend(q, k, v) * rowwise(torch.sigmoid, gate)  # [n, H, Dh]
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


# -- FFN -------------------------------------------------------------------------------------


class Qwen35SparseMoe(nn.Module):
    """Softmax router over E experts (fp32), top-k renormalised, SwiGLU experts, plus a shared
    expert scaled by sigmoid(x · shared_expert_gate). x: fp32 [n, D] -> fp32 [n, D]."""

    def __init__(self, c: Qwen35Config, *, device=None):
        super().__init__()
        d, ff = c.hidden_size, c.moe_intermediate_size
        self.top_k, self.moe_intermediate_size = c.num_experts_per_tok, ff
        self.gate = nn.Linear(d, c.num_experts, bias=False, device=device)  # router
        # gate|up fused per expert (llama.cpp ffn_gate_up_exps, or ffn_gate_exps ‖ ffn_up_exps)
        self.gate_up_proj = nn.ModuleList(nn.Linear(d, 2 * ff, bias=False, device=device)
                                          for _ in range(c.num_experts))
        self.down_proj = nn.ModuleList(nn.Linear(ff, d, bias=False, device=device)
                                       for _ in range(c.num_experts))
        self.shared_expert = GatedMLP(d, c.shared_expert_intermediate_size, "silu", device=device)
        self.shared_expert_gate = nn.Parameter(torch.empty(c.shared_expert_gate_shape or (d,), device=device),
                                               requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [n, E]
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [n, k]
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():
            rows, slot = torch.where(experts == e)
            gate, up = self.gate_up_proj[e](x[rows]).split(self.moe_intermediate_size, dim=-1)
            out.index_add_(0, rows, self.down_proj[e](rowwise(F.silu, gate) * up) * weights[rows, slot, None])
        shared_logit = (x * self.shared_expert_gate.reshape(-1)).sum(-1, keepdim=True)  # [n, 1], per row
        shared_gate = rowwise(torch.sigmoid, shared_logit)
        return out + shared_gate * self.shared_expert(x)


class Qwen35DecoderLayer(nn.Module):
    def __init__(self, c: Qwen35Config, layer_type: str, *, device=None):
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if layer_type == LINEAR_ATTENTION:
            self.linear_attn = Qwen35GatedDeltaNet(c, device=device)
        else:
            self.self_attn = Qwen35Attention(c, device=device)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = (Qwen35SparseMoe(c, device=device) if c.is_moe
                    else GatedMLP(c.hidden_size, c.intermediate_size, "silu", device=device))

    def forward(self, hidden_states: torch.Tensor, mixer) -> torch.Tensor:
        """hidden_states fp32 [n, D]; mixer(normed [n, D]) -> [n, D] runs this layer's token mixer."""
        hidden_states = hidden_states + mixer(self.input_layernorm(hidden_states))
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class Qwen35Mtp(nn.Module):
    """The MTP (NextN) block: HF's `mtp.*` names (fc, pre_fc_norm_embedding, pre_fc_norm_hidden,
    norm) and one full-attention decoder layer. The math of a draft step lives in `draft_head`."""

    def __init__(self, c: Qwen35Config, *, device=None):
        super().__init__()
        d = c.hidden_size
        self.pre_fc_norm_embedding = RMSNorm(d, c.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(d, c.rms_norm_eps)
        self.fc = nn.Linear(2 * d, d, bias=False, device=device)  # [embedding ‖ hidden] -> D
        self.layer = Qwen35DecoderLayer(c, FULL_ATTENTION, device=device)
        self.norm = RMSNorm(d, c.rms_norm_eps)  # shared_head_norm (or output_norm)


class Qwen35Model(nn.Module):
    def __init__(self, c: Qwen35Config, *, device=None):
        super().__init__()
        self.embed_tokens = nn.Linear(c.hidden_size, c.vocab_size, bias=False, device=device)  # read by rows
        self.layers = nn.ModuleList(Qwen35DecoderLayer(c, t, device=device) for t in c.layer_types)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding.default(c.rotary_dim, c.rope_theta, style="neox")


class Qwen35ForCausalLM(TrunkModule):
    """The Qwen 3.5 / 3.6 trunk: a `Trunk` over GDN recurrent state and attention KV.

    dtype: weight dtype of the linears ("int8" | "bfloat16" | "float32" | "int4", weights.quant);
    norms, conv kernel, decay parameters and all state stay fp32.
    chunked_prefill_min_rows: non-verify chunks of at least this many rows run the chunked delta
    rule (equal within fp32 rounding, not bitwise: the trunk then declares no batch invariance);
    None (default): every row through the exact row loop.
    Built on the meta device; the loader fills it. `draft_head` is the MTP head when the file
    has an MTP block, else None (the engine reads it with getattr).
    Truncation to a non-zero prefix is refused (CannotTruncate): GDN state is a fixed-size summary.
    """

    # The K ceiling, from the verify cost measured on the tiny benchmark fixture (README
    # "Verify cost"): the per-row recurrence makes a k-row verify cost grow ~linearly in its
    # GDN share, so wide windows only pay at high acceptance; MTP acceptance falls with depth.
    spec_preferred_max_draft_tokens = 4
    #: `TrunkModule.to_device`: on CUDA the block linears run kernels.triton_qmatmul, the attention
    #: layers kernels.triton_attend over nn.kv_pool's pools, the GDN rows kernels.triton_delta_rule
    #: with their states on the device; the MTP head stays on the CPU and is switched off there
    devices = ("cpu", "cuda")

    def __init__(self, config: Qwen35Config, *, dtype: str = "int8", max_rows_per_forward: int | None = None,
                 context_length: int | None = None, chunked_prefill_min_rows: int | None = None,
                 device="meta"):
        super().__init__()
        self._init_sizes(config, dtype, max_rows_per_forward, context_length)
        self.model = Qwen35Model(config, device=device)
        self.chunked_prefill_min_rows = chunked_prefill_min_rows
        for layer in self.model.layers:
            if layer.layer_type == LINEAR_ATTENTION:
                layer.linear_attn.chunked_min_rows = chunked_prefill_min_rows
        self.mtp = Qwen35Mtp(config, device=device) if config.num_mtp_layers else None
        self._finish_linears(device)
        self.draft_head = None  # set by the loader when the file has MTP weights

    @property
    def spec_batch_invariant(self) -> bool:
        """The linears' verdict (TrunkModule), unless prefill chunks take the chunked delta rule,
        whose rows differ from the row loop's in the last bits."""
        return not self.chunked_prefill_min_rows and super().spec_batch_invariant

    def _new_layer_states(self) -> list:
        c, states = self.config, []
        pooled = self._pooled_caches()  # on a device: the attention layers' KV in their pools
        for i, layer in enumerate(self.model.layers):
            if layer.layer_type == LINEAR_ATTENTION:
                states.append(RecurrentState(layer.linear_attn.state_shapes(), device=self.trunk_device))
            elif pooled is not None:
                states.append(pooled[i])
            else:
                states.append(PagedKVCache(c.num_key_value_heads, c.head_dim,
                                            max_positions=self.max_context_length))
        return states

    def _place_state(self, device: torch.device) -> None:
        """`TrunkModule._place_state`, with pools for the full-attention layers only (a GDN layer's
        state is a `RecurrentState` on the device)."""
        super()._place_state(device)
        self._kv_pools = [pool if layer.layer_type == FULL_ATTENTION else None
                          for pool, layer in zip(self._kv_pools, self.model.layers)]

    def _embed(self, tokens):
        return self.model.embed_tokens.rows(tokens)  # [n, D] fp32

    def _forward_rows(self, rows: Rows):
        """Final-normed rows fp32 [n, D] and the residual rows entering each layer (L = after the last)."""
        m = self.model
        cos, sin = m.rotary_emb.cos_sin(rows.positions)  # [n, r/2]
        x = self._embed(rows.tokens)
        taps = {}
        for i, layer in enumerate(m.layers):
            taps[i] = x
            x = layer(x, self._mixer(layer, i, rows, cos, sin))
        taps[self.num_layers] = x
        return m.norm(x), taps

    def _mixer(self, layer: Qwen35DecoderLayer, i: int, rows: Rows, cos: torch.Tensor, sin: torch.Tensor):
        """Layer i's token mixer for this chunk: normed rows fp32 [n, D] -> [n, D]."""
        if layer.layer_type == LINEAR_ATTENTION:
            return lambda y: layer.linear_attn(y, rows, i)
        attn = layer.self_attn

        def attend(q, k, v):  # writes this chunk's K/V into each sequence's cache of layer i
            return attend_rows(q, k, v, rows, i, scaling=attn.scaling)

        return lambda y: attn(y, self.model.rotary_emb, cos, sin, attend)
