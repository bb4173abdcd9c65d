"""GLM-5.3-Flash trunks (`glm5-next`): Kimi delta attention (KDA) layers and NoPE MLA layers with
the k-pool DSA indexer, mHC residual streams, clamped SwiGLU, dense leading layers then the
sigmoid-routed MoE of glm4moe.

Shape letters: n rows in a forward, D model width, HC streams, M = (2 + HC)·HC mixing
coefficients, H heads, hd KDA head dim, di = H·hd, K conv kernel, P k-pool size, ID indexer
head dim; MLA letters as `mla`.

Per layer (docs/reference/glm5-nemotron.md §6.5-§6.8; transformers Glm5NextTextDecoderLayer):
    post, comb, x = attn_hc(X)                   X fp32 [n, HC, D] (the embedding in every stream)
    X = post ⊗ mixer(input_layernorm(x)) + combᵀ X       mixer = KDA | NoPE MLA + k-pool indexer
    post, comb, x = ffn_hc(X)
    X = post ⊗ ffn(post_attention_layernorm(x)) + combᵀ X   ffn = clamped SwiGLU | MoE
then logits = lm_head(norm(mean over streams of X)).

KDA (`KdaAttention`) runs the gated delta rule one row at a time with a per-channel decay
g = lb · sigmoid(e^A_log · z) (Flash's gate lower bound lb) or -e^A_log · softplus(z), and hands
the state after every row to its `nn.state.RecurrentState` during a verify, so `keep(seq, a)`
selects the state after row a with no re-forward (as the Qwen 3.5 trunk's GatedDeltaNet). On
CUDA tensors the row loop is verispec.kernels.triton_delta_rule's kernel (its own fixed order of
the dk sums; the CPU loop's einsum sums in ATen's order).
The k-pool indexer (`KpoolIndexer`) caches per position [k ; gate] (2·ID floats) and pools
consecutive groups of P positions from 0 when it reads them; only pools whose last member is
visible to a row are candidates, so a pool completed by rejected draft rows is incomplete again
once `keep` moves the length back (rows past it are never read).

Batch invariance: every op on a row has shapes fixed by its position (per-row loops; elementwise
transcendentals through `nn.elementwise.rowwise`), so with int8 / int4 linears a verify row is
bitwise the one-row decode.
Sources: transformers models/glm5_next (5.24); llama.cpp src/models/glm5-next.cpp.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from verispec.gguf.io import MissingTensor, arch_value
from verispec.kernels import triton_delta_rule, triton_dispatch
from verispec.nn.elementwise import rowwise
from verispec.nn.mlp import GatedMLP
from verispec.nn.moe import TopkRouter, routed_experts
from verispec.nn.norm import RMSNorm
from verispec.nn.state import RecurrentState
from verispec.nn.trunk import Rows
from verispec.nn.trunk_module import TrunkModule

from verispec_glm5.mla import DsaIndexer, MlaAttention, MlaLayerCache
from verispec_glm5.modeling_glm4moe import SIGMOID_GATING, UnsupportedGlm4MoeVariant

__all__ = ["ARCHITECTURES", "Glm5NextConfig", "Glm5NextForCausalLM", "Glm5NextNextN", "HyperConnection",
           "KdaAttention", "KpoolIndexer", "NoRope", "nope_mla"]

#: the upstream llama.cpp spelling and the fork lineage's (unsloth GGUFs), §6.1.
ARCHITECTURES = ("glm5-next", "glm5next")
#: llama.cpp's and the reference's layer split without a head_count_kv array: MLA every 4th layer.
DEFAULT_FULL_ATTENTION_INTERVAL = 4


def _per_layer(value, num_layers: int) -> tuple[float, ...]:
    if isinstance(value, (list, tuple, np.ndarray)):
        return tuple(float(v) for v in list(value)[:num_layers])
    return (float(value),) * num_layers


@attrs.frozen
class Glm5NextConfig:
    """The whole math of one trunk (transformers Glm5NextTextConfig's field names); `from_gguf` reads it."""

    architecture: str
    vocab_size: int
    hidden_size: int  # D
    intermediate_size: int  # dense FFN width
    num_hidden_layers: int  # L (a NextN block not counted)
    num_attention_heads: int  # H (KDA and MLA)
    kda_layers: tuple[bool, ...]  # per trunk layer: KDA (True) or MLA
    linear_head_dim: int  # hd
    linear_conv_kernel_dim: int  # K
    linear_lower_bound: float | None  # None: Kimi-Linear's softplus gate
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    indexer_norm_eps: float
    max_position_embeddings: int
    first_k_dense_replace: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    n_group: int
    topk_group: int
    swiglu_limits: tuple[float, ...]  # per block (NextN included), dense and routed experts (0: no clamp)
    swiglu_limits_shared: tuple[float, ...]  # per block, the shared expert
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    index_kpool: int  # P
    hc_mult: int  # HC
    hc_sinkhorn_iters: int
    hc_eps: float
    tie_word_embeddings: bool
    num_nextn_predict_layers: int  # 1: the file holds the NextN block blk.{L}
    nextn_has_embed_tokens: bool = False  # blk.{L}.nextn.embed_tokens (else the trunk's embedding)
    nextn_has_shared_head: bool = False  # blk.{L}.nextn.shared_head_head (else the trunk's LM head)

    @property
    def num_experts(self) -> int:
        """E, the name `verispec.gguf.load` reads."""
        return self.n_routed_experts

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any], tensor_shapes: Mapping[str, tuple], *,
                  source: str = "the GGUF") -> "Glm5NextConfig":
        """Read the config from `glm5-next.*` / `glm5next.*` keys (§6.3), with the fork lineage's
        spellings (§6.1): `attention.indexer.block_size` for the k-pool size, `ssm.state_size`
        for the KDA head dim, `attention.recurrent_layers` (bool per layer) or
        `full_attention_interval` (default 4) for the KDA / MLA split where `head_count_kv` is no
        per-layer array. tensor_shapes: GGUF name -> torch-order shape. Raises MissingKey,
        MissingTensor (token_embd), UnsupportedGlm4MoeVariant (RoPE dims, softmax gating, an
        indexer "shared" layer, no k-pool, HC other than 4, several NextN blocks)."""
        arch = metadata.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise UnsupportedGlm4MoeVariant(source, f"general.architecture is {arch!r}",
                                            f"this module loads {', '.join(ARCHITECTURES)}")
        if "token_embd.weight" not in tensor_shapes:
            raise MissingTensor("token_embd.weight", arch, source)
        key = functools.partial(arch_value, metadata, source=source)

        def refuse(problem, fix):
            raise UnsupportedGlm4MoeVariant(source, problem, fix)

        if int(key("expert_gating_func", SIGMOID_GATING)) != SIGMOID_GATING:
            refuse(f"{arch}.expert_gating_func is not sigmoid (2)",
                   "only sigmoid expert gating is implemented")
        if int(key("rope.dimension_count", 0)):
            refuse(f"{arch}.rope.dimension_count = {key('rope.dimension_count')}",
                   "GLM-5.3-Flash's MLA is NoPE: reconvert with rope.dimension_count 0")
        num_nextn = int(key("nextn_predict_layers", 0))
        if num_nextn > 1:
            refuse(f"{num_nextn} NextN blocks", "only one NextN block is supported")
        blocks = int(key("block_count"))
        num_layers = blocks - num_nextn
        nextn = f"blk.{num_layers}.nextn."
        head_kv = key("attention.head_count_kv", None)
        recurrent = key("attention.recurrent_layers", None)
        if isinstance(head_kv, (list, tuple, np.ndarray)):
            kda = tuple(int(v) == 0 for v in list(head_kv)[:num_layers])
        elif recurrent is not None:
            kda = tuple(bool(v) for v in list(recurrent)[:num_layers])
        else:
            interval = int(key("full_attention_interval", DEFAULT_FULL_ATTENTION_INTERVAL))
            kda = tuple((i + 1) % interval != 0 for i in range(num_layers))
        if len(kda) != num_layers:
            refuse(f"{len(kda)} layer kinds for {num_layers} trunk layers", "give one entry per block")
        types = key("attention.indexer.types", None)
        if types is not None and not all(bool(t) for t in list(types)[:num_layers]):
            refuse("attention.indexer.types marks a shared indexer layer",
                   "only full indexers are implemented (GLM-5.3-Flash has no shared ones)")
        kpool = int(key("attention.indexer.kpool", None) or key("attention.indexer.block_size"))
        topk = int(key("attention.indexer.top_k"))
        if kpool < 2 or topk % kpool:
            refuse(f"indexer top_k {topk} with kpool {kpool}", "kpool must be > 1 and divide top_k")
        if not bool(key("attention.indexer.kpool_select_tail", True)):
            refuse("attention.indexer.kpool_select_tail false",
                   "only the tail-selecting k-pool is implemented")
        hc = int(key("hyper_connection.count"))
        if hc != 4:
            refuse(f"hyper_connection.count {hc}", "GLM-5.3-Flash files have 4 streams")
        kda_head = key("kda.head_dim", None) or key("ssm.state_size")
        lower = key("kda.gate_lower_bound", None)
        kv_lora = int(key("attention.kv_lora_rank"))
        clamp = key("swiglu_clamp_exp", 0.0)
        n_group = int(key("expert_group_count", 1) or 1)
        return cls(
            architecture=arch,
            vocab_size=int(tensor_shapes["token_embd.weight"][0]),
            hidden_size=int(key("embedding_length")),
            intermediate_size=int(_per_layer(key("feed_forward_length", 0), num_layers)[0]),
            num_hidden_layers=num_layers,
            num_attention_heads=int(key("attention.head_count")),
            kda_layers=kda,
            linear_head_dim=int(kda_head),
            linear_conv_kernel_dim=int(key("ssm.conv_kernel")),
            linear_lower_bound=None if lower is None else float(lower),
            q_lora_rank=int(key("attention.q_lora_rank")),
            kv_lora_rank=kv_lora,
            qk_nope_head_dim=int(key("attention.key_length_mla")),
            v_head_dim=int(key("attention.value_length_mla")),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            indexer_norm_eps=float(key("attention.layer_norm_epsilon", 1e-6)),
            max_position_embeddings=int(key("context_length")),
            first_k_dense_replace=int(key("leading_dense_block_count", 0)),
            n_routed_experts=int(key("expert_count")),
            num_experts_per_tok=int(key("expert_used_count")),
            moe_intermediate_size=int(_per_layer(key("expert_feed_forward_length"), num_layers)[-1]),
            n_shared_experts=int(key("expert_shared_count")),
            routed_scaling_factor=float(key("expert_weights_scale", 1.0) or 1.0),
            norm_topk_prob=bool(key("expert_weights_norm", False)),
            n_group=n_group,
            topk_group=int(key("expert_group_used_count", n_group) or n_group),
            swiglu_limits=_per_layer(clamp, blocks),
            swiglu_limits_shared=_per_layer(key("swiglu_clamp_shexp", clamp), blocks),
            index_n_heads=int(key("attention.indexer.head_count")),
            index_head_dim=int(key("attention.indexer.key_length")),
            index_topk=topk,
            index_kpool=kpool,
            hc_mult=hc,
            hc_sinkhorn_iters=int(key("hyper_connection.sinkhorn_iterations")),
            hc_eps=float(key("hyper_connection.epsilon")),
            tie_word_embeddings="output.weight" not in tensor_shapes,
            num_nextn_predict_layers=num_nextn,
            nextn_has_embed_tokens=bool(num_nextn) and nextn + "embed_tokens.weight" in tensor_shapes,
            nextn_has_shared_head=bool(num_nextn) and nextn + "shared_head_head.weight" in tensor_shapes,
        )


# -- FFN ------------------------------------------------------------------------------------------


class ClampedGatedMLP(GatedMLP):
    """SwiGLU with min(gate, limit) and clamp(up, -limit, limit) (§6.8); limit 0: plain SwiGLU.
    x fp32 [n, D] -> fp32 [n, D]."""

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float, *, device=None):
        super().__init__(hidden_size, intermediate_size, "silu", device=device)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.limit:
            return super().forward(x)
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return self.down_proj(rowwise(F.silu, gate) * up)


class Glm5NextMoE(nn.Module):
    """Sigmoid-routed clamped-SwiGLU experts plus the shared expert (§4, §6.8). x fp32 [n, D] -> [n, D]."""

    def __init__(self, c: Glm5NextConfig, layer: int, *, device=None):
        super().__init__()
        d, fe = c.hidden_size, c.moe_intermediate_size
        self.gate = TopkRouter(d, c.n_routed_experts, c.num_experts_per_tok, norm_topk_prob=c.norm_topk_prob,
                               routed_scaling_factor=c.routed_scaling_factor, n_group=c.n_group,
                               topk_group=c.topk_group, device=device)
        self.experts = nn.ModuleList(ClampedGatedMLP(d, fe, c.swiglu_limits[layer], device=device)
                                     for _ in range(c.n_routed_experts))
        self.shared_experts = ClampedGatedMLP(d, fe * c.n_shared_experts, c.swiglu_limits_shared[layer],
                                              device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)
        return routed_experts(x, ids, weights, self.experts) + self.shared_experts(x)


# -- mHC ------------------------------------------------------------------------------------------


class HyperConnection(nn.Module):
    """The mixing coefficients of one sublayer's mHC (§6.7; transformers Glm5NextTextHyperConnection):
    `fn` fp32 [M, HC·D], `base` [M], `scale` [3]. All fp32, one row at a time."""

    def __init__(self, c: Glm5NextConfig, *, device=None):
        super().__init__()
        hc, m = c.hc_mult, (2 + c.hc_mult) * c.hc_mult
        self.hc, self.iters, self.hc_eps, self.norm_eps = hc, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps
        self.fn = nn.Parameter(torch.empty(m, hc * c.hidden_size, device=device), requires_grad=False)
        self.base = nn.Parameter(torch.empty(m, device=device), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(3, device=device), requires_grad=False)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams fp32 [n, HC, D] -> (post [n, HC], comb [n, HC, HC] (comb[j, k]: stream j into
        output stream k), collapsed sublayer input [n, D])."""
        n, hc = streams.shape[0], self.hc
        flat = streams.reshape(n, -1)
        flat = F.rms_norm(flat, (flat.shape[-1],), None, self.norm_eps)
        mix = torch.stack([torch.mv(self.fn, flat[i]) for i in range(n)])  # [n, M], per row
        pre_b, post_b, comb_b = self.base.split([hc, hc, hc * hc])
        pre = rowwise(torch.sigmoid, mix[:, :hc] * self.scale[0] + pre_b) + self.hc_eps
        post = 2 * rowwise(torch.sigmoid, mix[:, hc:2 * hc] * self.scale[1] + post_b)
        comb = torch.softmax((mix[:, 2 * hc:] * self.scale[2] + comb_b).view(n, hc, hc), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):  # Sinkhorn: rows, then columns
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        return post, comb, (pre[..., None] * streams).sum(dim=1)


def hc_merge(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor,
             comb: torch.Tensor) -> torch.Tensor:
    """X'[k] = post[k] · out + Σ_j comb[j, k] · X[j]: streams fp32 [n, HC, D], out [n, D] -> [n, HC, D]."""
    return post[..., None] * out[:, None, :] + torch.bmm(comb.transpose(1, 2), streams)


# -- KDA ------------------------------------------------------------------------------------------


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(Σx² + eps) over the last dim (transformers / FLA l2norm, eps inside the sqrt)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class KdaAttention(nn.Module):
    """Kimi delta attention, GLM-5.3-Flash flavour (§6.5): q, k, v projections, a depthwise causal
    conv + SiLU over q‖k‖v, L2-normed q / k, a per-channel forget gate, β = sigmoid(b_proj),
    the gated delta rule per head, a per-head RMSNorm gated by sigmoid(g_b(g_a(a))).

    State per sequence (a RecurrentState): "conv" fp32 [3·di, K-1], the pre-conv q‖k‖v of the
    last K-1 rows, oldest first; "ssm" fp32 [H, hd, hd] (key channel × value channel).
    a: fp32 [n, D] -> fp32 [n, D]. `ssm_a` holds -exp(A_log) as the GGUF stores it.
    """

    def __init__(self, c: Glm5NextConfig, *, device=None):
        super().__init__()
        d, self.heads, self.hd = c.hidden_size, c.num_attention_heads, c.linear_head_dim
        self.di, self.kernel = self.heads * self.hd, c.linear_conv_kernel_dim
        self.lower_bound = c.linear_lower_bound
        self.qkv_proj = nn.Linear(d, 3 * self.di, bias=False, device=device)
        self.conv1d_weight = nn.Parameter(torch.empty(3 * self.di, 1, self.kernel, device=device),
                                          requires_grad=False)
        self.f_a_proj = nn.Linear(d, self.hd, bias=False, device=device)
        self.f_b_proj = nn.Linear(self.hd, self.di, bias=False, device=device)
        self.dt_bias = nn.Parameter(torch.empty(self.di, device=device), requires_grad=False)
        self.ssm_a = nn.Parameter(torch.empty(self.heads, device=device), requires_grad=False)
        self.b_proj = nn.Linear(d, self.heads, bias=False, device=device)
        self.g_a_proj = nn.Linear(d, self.hd, bias=False, device=device)
        self.g_b_proj = nn.Linear(self.hd, self.di, bias=False, device=device)
        self.o_norm = RMSNorm(self.hd, c.rms_norm_eps)
        self.o_proj = nn.Linear(self.di, d, bias=False, device=device)

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"conv": (3 * self.di, self.kernel - 1), "ssm": (self.heads, self.hd, self.hd)}

    def forward(self, a: torch.Tensor, rows: Rows, layer_idx: int) -> torch.Tensor:
        n, shape = a.shape[0], (a.shape[0], self.heads, self.hd)
        mix = self.qkv_proj(a)  # [n, 3·di] pre-conv
        z = (self.f_b_proj(self.f_a_proj(a)) + self.dt_bias).view(shape)
        rate = (-self.ssm_a)[None, :, None]  # e^A_log [1, H, 1]
        if self.lower_bound is not None:
            g = self.lower_bound * rowwise(torch.sigmoid, rate * z)
        else:
            g = -rate * rowwise(F.softplus, z)
        beta = rowwise(torch.sigmoid, self.b_proj(a))  # [n, H]
        core = torch.empty(shape)
        for s in rows.sequences:  # each sequence runs its own recurrence
            core[s.rows] = self.recurrence(mix[s.rows], beta[s.rows], g[s.rows], s.state.layers[layer_idx],
                                           record_rows=s.state.verify_rows is not None)
        gate = rowwise(torch.sigmoid, self.g_b_proj(self.g_a_proj(a)).view(shape))
        return self.o_proj((self.o_norm(core) * gate).reshape(n, self.di))

    def recurrence(self, mix: torch.Tensor, beta: torch.Tensor, g: torch.Tensor, state: RecurrentState,
                   *, record_rows: bool) -> torch.Tensor:
        """One sequence's rows in order: mix fp32 [m, 3·di], beta [m, H], g [m, H, hd] (log decay)
        -> output [m, H, hd]. Hands the state after every row (record_rows: a verify) or after the
        last to `state.update`."""
        m = mix.shape[0]
        x = torch.cat([state.values["conv"], mix.t()], dim=1)  # [3·di, K-1+m]
        windows = x.unfold(1, self.kernel, 1)  # [3·di, m, K]; column K-1 is the row itself
        u = rowwise(F.silu, (windows * self.conv1d_weight).sum(dim=-1).t().contiguous())  # [m, 3·di]
        q, k, v = (t.reshape(m, self.heads, self.hd) for t in u.split(self.di, dim=-1))
        q, k = _l2norm(q) * self.hd ** -0.5, _l2norm(k)
        decay = rowwise(torch.exp, g)  # [m, H, hd]
        if triton_dispatch.use_triton(mix):  # CUDA: the rows in Triton, the state after each emitted
            out, ssms = triton_delta_rule.delta_rule(q, k, v, beta, decay, state.values["ssm"])
            convs = windows[:, :, 1:].permute(1, 0, 2).contiguous()  # [m, 3·di, K-1]: each row's tail
            state.update({"conv": convs, "ssm": ssms} if record_rows
                         else {"conv": convs[-1:], "ssm": ssms[-1:]})
            return out
        ssm, ssms, outputs = state.values["ssm"], [], []
        for t in range(m):
            ssm = ssm * decay[t][:, :, None]  # key channel i decays by e^g[i]
            memory = torch.einsum("hkv,hk->hv", ssm, k[t])
            delta = beta[t][:, None] * (v[t] - memory)
            ssm = ssm + k[t][:, :, None] * delta[:, None, :]
            outputs.append(torch.einsum("hkv,hk->hv", ssm, q[t]))
            if record_rows:
                ssms.append(ssm)
        if record_rows:
            convs = windows[:, :, 1:].permute(1, 0, 2).contiguous()  # [m, 3·di, K-1]
            state.update({"conv": convs, "ssm": torch.stack(ssms)})
        else:
            state.update({"conv": x[:, m:].contiguous()[None], "ssm": ssm[None]})
        return torch.stack(outputs)


# -- NoPE MLA with the k-pool indexer -----------------------------------------------------------


class KpoolIndexer(DsaIndexer):
    """The DSA indexer over k-pools (§6.6; transformers Glm5NextTextIndexer): its cache row per
    position is [k ; gate] (2·ID); pool p (positions pP .. pP+P-1, complete only) has the key
    Σ_m softmax_m(gate + ape[m]) · k per channel; row t scores the pools whose last member is
    <= t, keeps the top top_k / P (all of them while they are no more), expanded to their
    positions, plus the raw positions of its incomplete tail pool."""

    def __init__(self, hidden_size: int, q_lora_rank: int, num_heads: int, head_dim: int, top_k: int,
                 kpool: int, norm_eps: float, *, device=None):
        super().__init__(hidden_size, q_lora_rank, num_heads, head_dim, 0, top_k, device=device)
        self.kpool = kpool
        self.k_norm.eps = norm_eps
        self.compress_gate = nn.Linear(hidden_size, head_dim, bias=False, device=device)
        self.compress_ape = nn.Parameter(torch.empty(kpool, head_dim, device=device), requires_grad=False)

    def project(self, a, cq, cos, sin):
        """a fp32 [n, D], cq [n, qL] -> (queries [n, IH, ID], cache rows [k ; gate] [n, 2·ID],
        head weights [n, IH] with IH^-0.5 folded in)."""
        n = a.shape[0]
        q = self.wq_b(cq).view(n, self.num_heads, self.head_dim)
        k = self.k_norm(self.wk(a).float())
        weights = self.weights_proj(a).float() * self.num_heads ** -0.5
        return q, torch.cat([k, self.compress_gate(a)], dim=-1), weights

    def pool_keys(self, rows: torch.Tensor) -> torch.Tensor:
        """rows fp32 [p·P, 2·ID] -> pooled keys [p, ID]; each pool's bits depend on its rows alone."""
        p, d = rows.shape[0] // self.kpool, self.head_dim
        grouped = rows.view(p, self.kpool, 2 * d)
        logits = grouped[..., d:] + self.compress_ape  # [p, P, ID]
        e = rowwise(torch.exp, logits - logits.amax(dim=1, keepdim=True))
        return (e / e.sum(dim=1, keepdim=True) * grouped[..., :d]).sum(dim=1)

    def select(self, q, weights, keys, start_pos, rowwise):
        """Keys row i (at start_pos + i) may read: bool [n, T]; keys fp32 [T, 2·ID] (the cache rows,
        these rows' included). Always one row at a time."""
        n, total, size = q.shape[0], keys.shape[0], self.kpool
        pooled = self.pool_keys(keys[:total // size * size])
        keep, scale = self.top_k // size, self.head_dim ** -0.5
        allowed = torch.zeros(n, total, dtype=torch.bool)
        for i in range(n):
            visible = start_pos + i + 1
            pools = visible // size
            allowed[i, pools * size:visible] = True  # the incomplete tail, unscored
            if pools <= keep:
                allowed[i, :pools * size] = True
                continue
            scores = F.relu(torch.matmul(q[i], pooled[:pools].t()) * scale)  # [IH, pools]
            chosen = torch.matmul(weights[i], scores).topk(keep).indices
            allowed[i, (chosen[:, None] * size + torch.arange(size)).flatten()] = True
        return allowed


# -- layers and trunk ---------------------------------------------------------------------------


class NoRope(nn.Module):
    """The NoPE stand-in for a rotary table: empty cos / sin (r = 0) at any positions."""

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 [n] -> cos, sin fp32 [n, 0]."""
        empty = torch.zeros(positions.shape[0], 0)
        return empty, empty


def nope_mla(c: Glm5NextConfig, *, device=None) -> MlaAttention:
    """NoPE MLA with its k-pool indexer (§6.6); the latents normalised with the config's epsilon,
    as transformers' Glm5NextTextAttention does."""
    indexer = KpoolIndexer(c.hidden_size, c.q_lora_rank, c.index_n_heads, c.index_head_dim,
                           c.index_topk, c.index_kpool, c.indexer_norm_eps, device=device)
    attn = MlaAttention(hidden_size=c.hidden_size, num_heads=c.num_attention_heads, q_lora_rank=c.q_lora_rank,
                        kv_lora_rank=c.kv_lora_rank, nope_dim=c.qk_nope_head_dim, rope_dim=0,
                        v_head_dim=c.v_head_dim, indexer=indexer, device=device)
    attn.q_a_layernorm.eps = attn.kv_a_layernorm.eps = c.rms_norm_eps
    return attn


class Glm5NextMtpBlock(nn.Module):
    """The NextN block's decoder layer (§6.9): NoPE MLA + k-pool indexer and the MoE with plain
    residuals (no mHC). Called as `GlmDsaDecoderLayer` (h fp32 [n, D], cos, sin, caches,
    sequences, selection) -> (fp32 [n, D], selection)."""

    def __init__(self, c: Glm5NextConfig, *, device=None):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = nope_mla(c, device=device)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = Glm5NextMoE(c, c.num_hidden_layers, device=device)

    def forward(self, h, cos, sin, caches, sequences, selection):
        attn, selection = self.self_attn(self.input_layernorm(h), cos, sin, caches, sequences, selection)
        h = h + attn
        return h + self.mlp(self.post_attention_layernorm(h)), selection


class Glm5NextNextN(nn.Module):
    """The NextN (MTP) block `blk.{L}` in transformers' MtpLayer names: enorm, hnorm, eh_proj
    ([embedding ‖ hidden] 2D -> D), mtp_block (`Glm5NextMtpBlock`), post_norm (GGUF
    shared_head_norm); its own embed_tokens / shared_head only where the file has them."""

    def __init__(self, c: Glm5NextConfig, *, device=None):
        super().__init__()
        d = c.hidden_size
        self.enorm = RMSNorm(d, c.rms_norm_eps)
        self.hnorm = RMSNorm(d, c.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False, device=device)
        self.mtp_block = Glm5NextMtpBlock(c, device=device)
        self.post_norm = RMSNorm(d, c.rms_norm_eps)
        self.embed_tokens = (nn.Linear(d, c.vocab_size, bias=False, device=device)
                             if c.nextn_has_embed_tokens else None)  # read by rows
        self.shared_head = (nn.Linear(d, c.vocab_size, bias=False, device=device)
                            if c.nextn_has_shared_head else None)


class Glm5NextDecoderLayer(nn.Module):
    def __init__(self, c: Glm5NextConfig, i: int, *, device=None):
        super().__init__()
        self.is_kda = c.kda_layers[i]
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if self.is_kda:
            self.self_attn = KdaAttention(c, device=device)
        else:
            self.self_attn = nope_mla(c, device=device)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = (Glm5NextMoE(c, i, device=device) if i >= c.first_k_dense_replace
                    else ClampedGatedMLP(c.hidden_size, c.intermediate_size, c.swiglu_limits[i],
                                         device=device))
        self.attn_hc = HyperConnection(c, device=device)
        self.ffn_hc = HyperConnection(c, device=device)

    def forward(self, streams: torch.Tensor, rows: Rows, i: int) -> torch.Tensor:
        """streams fp32 [n, HC, D] -> [n, HC, D]; layer i's caches in each sequence's state."""
        post, comb, x = self.attn_hc(streams)
        x = self.input_layernorm(x)
        if self.is_kda:
            out = self.self_attn(x, rows, i)
        else:
            empty = x.new_zeros(x.shape[0], 0)  # NoPE: no rotation
            caches = [s.state.layers[i] for s in rows.sequences]
            out, _ = self.self_attn(x, empty, empty, caches, rows.sequences, None)
        streams = hc_merge(streams, out, post, comb)
        post, comb, x = self.ffn_hc(streams)
        return hc_merge(streams, self.mlp(self.post_attention_layernorm(x)), post, comb)


class Glm5NextModel(nn.Module):
    def __init__(self, c: Glm5NextConfig, *, device=None):
        super().__init__()
        self.embed_tokens = nn.Linear(c.hidden_size, c.vocab_size, bias=False, device=device)  # read by rows
        self.layers = nn.ModuleList(Glm5NextDecoderLayer(c, i, device=device)
                                    for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary_emb = NoRope()


class Glm5NextForCausalLM(TrunkModule):
    """The glm5-next trunk: a `Trunk` over a RecurrentState per KDA layer and an `mla.MlaLayerCache`
    per MLA layer (latent rows and [k ; gate] indexer rows).

    dtype: weight dtype of the linears ("int8" | "bfloat16" | "float32" | "int4"); conv kernel,
    decay parameters, k_b / v_b, the router, mHC, norms and all state stay fp32. Built on the
    meta device; the loader fills it. `mtp` is the NextN block when the file has one (never run
    as a trunk layer), and `draft_head` its PER_TOKEN head (set by the loader). Truncation to a
    non-zero prefix is refused (CannotTruncate): the KDA state is a fixed-size summary; fork at
    the full length only.
    """

    # as the Qwen 3.5 trunk: the per-row recurrence makes a k-row verify cost grow ~linearly
    spec_preferred_max_draft_tokens = 4

    def __init__(self, config: Glm5NextConfig, *, dtype: str = "int8",
                 max_rows_per_forward: int | None = None, context_length: int | None = None, device="meta"):
        super().__init__()
        self._init_sizes(config, dtype, max_rows_per_forward, context_length)
        self.model = Glm5NextModel(config, device=device)
        self.mtp = Glm5NextNextN(config, device=device) if config.num_nextn_predict_layers else None
        self._finish_linears(device)
        self.draft_head = None  # set by the loader when the file has a NextN block

    def _new_layer_states(self) -> list:
        c = self.config
        return [RecurrentState(layer.self_attn.state_shapes()) if layer.is_kda
                else MlaLayerCache(c.kv_lora_rank, 2 * c.index_head_dim,
                                   max_positions=self.max_context_length)
                for layer in self.model.layers]

    def _embed(self, tokens):
        return self.model.embed_tokens.rows(tokens)

    def _forward_rows(self, rows: Rows):
        """Final-normed rows fp32 [n, D] and, per layer, the mean of the streams entering it
        (L = after the last)."""
        x = self._embed(rows.tokens)
        streams = x[:, None, :].expand(-1, self.config.hc_mult, -1).contiguous()
        taps = {}
        for i, layer in enumerate(self.model.layers):
            taps[i] = streams.mean(dim=1)
            streams = layer(streams, rows, i)
        h = streams.mean(dim=1)
        taps[self.num_layers] = h
        return self.model.norm(h), taps
