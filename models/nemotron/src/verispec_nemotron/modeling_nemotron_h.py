"""NVIDIA Nemotron-H trunks: Mamba-2, attention and relu² MLP / MoE blocks, one mixer per block.

Shape letters: n rows in a forward, V vocabulary, D model width, L layers; Mamba-2: Hm heads,
P head dim, di = Hm·P inner width, G groups, N state size, K conv width, C = di + 2·G·N conv
channels; attention: H / Hkv query / KV heads, Dh head dim; MoE: E experts, k used per row.

Every block is pre-norm with a residual (transformers NemotronHBlock):
    h = h + mixer(rmsnorm(h))          mixer = Mamba-2 | attention | MLP | MoE
then logits = lm_head(rmsnorm(h)). No positional encoding anywhere (no RoPE).

Mamba-2, per row t of a sequence (docs/reference/glm5-nemotron.md §7.4; transformers
NemotronHMamba2Mixer, mamba2_selective_state_update; llama.cpp ggml_ssm_conv / ggml_ssm_scan):
    z, xBC, dt = in_proj(x)                                    [di], [C], [Hm]
    xBC = silu(conv1d over the last K inputs (conv state) + bias)
    x, B, C = xBC                                              [Hm, P], [G, N], [G, N]
    dt = softplus(dt + dt_bias);  dA = exp(dt · A),  A = -exp(A_log) (stored as is in the GGUF)
    S_h = dA_h · S_h + (dt_h · x_h) ⊗ B_g(h)                   S: [Hm, P, N] fp32
    y_h = S_h · C_g(h) + D_h · x_h
    out = out_proj(group_rmsnorm(y · silu(z)))                 gate before the norm
Head h reads group g(h) = h // (Hm / G). The recurrence runs row by row for prefill and decode
alike (no chunked SSD scan): a row's state is the same bits however many rows share the
forward, and a verify records the conv tail and S after every row, so `keep` selects them
(nn.state.RecurrentState) with no re-forward.

Batch invariance: with int8/int4 linears every op a row sees has the same shape whether the
row is alone or inside an n-row forward. The Mamba-2 step, the router and the routing weights
run per row (elementwise kernels take vectorised or scalar paths by a tensor's length, so a
transcendental over [n, Hm] could round differently from one over [Hm]); attention is
nn.attention's per-row bmm; each expert is an int8 linear over the rows routed to it, and a
row's expert outputs are summed in ascending expert order.

Sources: transformers models/nemotron_h/modeling_nemotron_h.py (5.24); llama.cpp
src/models/nemotron-h.cpp, nemotron-h-moe.cpp, mamba-base.cpp.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping

import attrs
import torch
import torch.nn.functional as F
from torch import nn
from verispec.errors import UnsupportedVariant
from verispec.gguf.io import MissingTensor, arch_value
from verispec.nn.attention import attend_rows
from verispec.nn.norm import RMSNorm
from verispec.nn.kv_cache import PagedKVCache
from verispec.nn.moe import TopkRouter, routed_experts
from verispec.nn.state import RecurrentState
from verispec.nn.trunk import Rows
from verispec.nn.trunk_module import TrunkModule

__all__ = ["ARCHITECTURES", "LAYER_TYPES", "NemotronHConfig", "NemotronHForCausalLM",
           "UnsupportedNemotronVariant"]

ARCHITECTURES = ("nemotron_h", "nemotron_h_moe")
#: one mixer per block; HF's layers_block_type names these linear_attention, full_attention, mlp, moe.
LAYER_TYPES = ("mamba", "attention", "mlp", "moe")


class UnsupportedNemotronVariant(UnsupportedVariant):
    """The GGUF is a Nemotron-H file whose math or layout this package does not implement."""


@attrs.frozen
class NemotronHConfig:
    """The whole math of one trunk; sizes from GGUF metadata and its tensor table."""

    architecture: str  # "nemotron_h" | "nemotron_h_moe"
    vocab_size: int  # V: rows of token_embd
    hidden_size: int  # D
    #: one of LAYER_TYPES per block (the file's per-layer head_count_kv / feed_forward_length).
    layer_types: tuple[str, ...] = attrs.field(
        converter=tuple, validator=attrs.validators.deep_iterable(attrs.validators.in_(LAYER_TYPES)))
    #: MLP width per block (0 for blocks without one); MoE blocks use moe_intermediate_size.
    intermediate_sizes: tuple[int, ...]
    num_attention_heads: int  # H
    num_key_value_heads: int  # Hkv (every attention block has the same)
    head_dim: int  # Dh
    mamba_num_heads: int  # Hm (llama.cpp ssm.time_step_rank)
    mamba_head_dim: int  # P = ssm.inner_size / Hm
    n_groups: int  # G
    ssm_state_size: int  # N
    conv_kernel: int  # K
    layer_norm_epsilon: float
    max_position_embeddings: int  # the file's context_length (2^20 for real files: no RoPE limit)
    #: the conv1d has a bias (real models do; llama.cpp treats it as optional).
    use_conv_bias: bool = True
    tie_word_embeddings: bool = False
    n_routed_experts: int = 0  # E
    num_experts_per_tok: int = 0  # k
    moe_intermediate_size: int = 0
    moe_shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @property
    def intermediate_size(self) -> int:
        """d_inner of the Mamba-2 mixers (di = Hm·P)."""
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        """C: channels of the short convolution (x, B, C)."""
        return self.intermediate_size + 2 * self.n_groups * self.ssm_state_size

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE block (0: dense), the name `verispec.gguf.load.load_trunk` reads."""
        return self.n_routed_experts

    @classmethod
    def from_gguf(cls, metadata: Mapping, tensor_shapes: Mapping[str, tuple[int, ...]], *,
                  source: str = "the GGUF") -> NemotronHConfig:
        """Read `{arch}.*` keys (docs/reference/glm5-nemotron.md §7.2) and which optional tensors exist.

        The block pattern comes from the per-layer arrays: head_count_kv[i] = feed_forward_length[i]
        = 0 is a Mamba-2 block, head_count_kv[i] > 0 attention, feed_forward_length[i] > 0 an
        MLP, or a MoE when the block has a router (`blk.{i}.ffn_gate_inp.weight`).
        Raises MissingKey, MissingTensor, UnsupportedNemotronVariant.
        """
        arch = metadata.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise UnsupportedNemotronVariant(source, f"general.architecture is {arch!r}",
                                             f"this package loads {', '.join(ARCHITECTURES)}")
        key = functools.partial(arch_value, metadata, source=source)
        _refuse_variants(key, arch, source)
        layer_types, widths, kv_heads = _block_pattern(key, tensor_shapes, arch, source)
        heads = int(key("attention.head_count"))
        head_dim = int(key("attention.key_length", int(key("embedding_length")) // heads))
        if int(key("attention.value_length", head_dim)) != head_dim:
            raise UnsupportedNemotronVariant(source, "attention key and value head sizes differ",
                                             "only equal K/V head sizes are supported")
        mamba_heads, inner = int(key("ssm.time_step_rank")), int(key("ssm.inner_size"))
        groups = int(key("ssm.group_count"))
        if inner % mamba_heads or mamba_heads % groups:
            raise UnsupportedNemotronVariant(
                source, f"ssm.inner_size {inner}, ssm.time_step_rank (Mamba heads) {mamba_heads}, "
                f"ssm.group_count {groups}", "the inner size must split into heads and the heads into groups")
        if "token_embd.weight" not in tensor_shapes:
            raise MissingTensor("token_embd.weight", arch, source)
        eps = key("attention.layer_norm_rms_epsilon", None)
        return cls(
            architecture=arch,
            vocab_size=int(tensor_shapes["token_embd.weight"][0]),
            hidden_size=int(key("embedding_length")),
            layer_types=layer_types,
            intermediate_sizes=tuple(0 if t == "moe" else ff for t, ff in zip(layer_types, widths)),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads or heads,
            head_dim=head_dim,
            mamba_num_heads=mamba_heads,
            mamba_head_dim=inner // mamba_heads,
            n_groups=groups,
            ssm_state_size=int(key("ssm.state_size")),
            conv_kernel=int(key("ssm.conv_kernel")),
            # real files carry only layer_norm_epsilon; llama.cpp uses it as the RMS eps
            layer_norm_epsilon=float(key("attention.layer_norm_epsilon") if eps is None else eps),
            max_position_embeddings=int(key("context_length")),
            use_conv_bias=any(f"blk.{i}.ssm_conv1d.bias" in tensor_shapes for i in range(len(layer_types))),
            tie_word_embeddings="output.weight" not in tensor_shapes,
            **(_moe_fields(key, layer_types, widths, arch, source) if "moe" in layer_types else {}),
        )


def _refuse_variants(key, arch: str, source: str) -> None:
    """Nemotron 3 Super's MTP head and latent MoE are not implemented."""
    if int(key("nextn_predict_layers", 0)):
        raise UnsupportedNemotronVariant(
            source, f"{arch}.nextn_predict_layers={key('nextn_predict_layers')} (an MTP head: Nemotron 3 "
            "Super)",
            "only trunk-only files are supported")
    if key("moe_latent_size", None):
        raise UnsupportedNemotronVariant(
            source, f"{arch}.moe_latent_size={key('moe_latent_size')} (latent MoE)",
            "only MoE experts at the full hidden width are supported")


def _block_pattern(key, tensor_shapes, arch: str, source: str) -> tuple[tuple[str, ...], list[int], int]:
    """(layer type per block, feed_forward_length per block, the attention blocks' KV heads or 0)."""
    num_layers = int(key("block_count"))
    kv_heads = _per_layer(key("attention.head_count_kv", 0), num_layers, "attention.head_count_kv", arch,
                          source)
    widths = _per_layer(key("feed_forward_length", 0), num_layers, "feed_forward_length", arch, source)
    layer_types = tuple(_layer_type(i, kv, ff, tensor_shapes, source)
                        for i, (kv, ff) in enumerate(zip(kv_heads, widths)))
    attention_kv = {kv for kv in kv_heads if kv}
    if len(attention_kv) > 1:
        raise UnsupportedNemotronVariant(
            source, f"attention blocks with KV head counts {sorted(attention_kv)}",
            "every attention block must have the same head_count_kv")
    return layer_types, widths, attention_kv.pop() if attention_kv else 0


def _per_layer(value, num_layers: int, name: str, arch: str, source: str) -> list[int]:
    """A scalar or a per-layer array of length block_count (llama.cpp's rule) -> [L] ints."""
    if _is_array(value):
        if len(value) != num_layers:
            raise UnsupportedNemotronVariant(
                source, f"{arch}.{name} has {len(value)} entries for {num_layers} blocks",
                "a per-layer array needs one entry per block")
        return [int(v) for v in value]
    return [int(value)] * num_layers


def _is_array(value) -> bool:
    """GGUF arrays arrive as lists or numpy arrays, scalars as Python or numpy scalars."""
    return not isinstance(value, str) and hasattr(value, "__len__")


def _layer_type(i: int, kv: int, ff: int, tensor_shapes, source: str) -> str:
    if kv and ff:
        raise UnsupportedNemotronVariant(
            source, f"block {i} has both head_count_kv {kv} and feed_forward_length {ff}",
            "a Nemotron-H block holds one mixer (llama.cpp's pattern rule)")
    if kv:
        return "attention"
    if not ff:
        return "mamba"
    return "moe" if f"blk.{i}.ffn_gate_inp.weight" in tensor_shapes else "mlp"


def _moe_fields(key, layer_types, widths, arch: str, source: str) -> dict:
    """MoE keys (§7.2); sigmoid gating is fixed for Nemotron-H, groups must be 1."""
    if int(key("expert_group_count", 1)) != 1:
        raise UnsupportedNemotronVariant(source, f"{arch}.expert_group_count={key('expert_group_count')}",
                                         "only ungrouped expert routing (1 group) is supported")
    used = key("expert_used_count")
    used = {int(v) for v in used} if _is_array(used) else {int(used)}
    # expert_feed_forward_length (scalar or per layer), else the MoE blocks' feed_forward_length
    width = key("expert_feed_forward_length", None)
    if width is None:
        width = [w for t, w in zip(layer_types, widths) if t == "moe"]
    width = {int(v) for v in width} - {0} if _is_array(width) else {int(width)}
    if len(used) != 1 or len(width) != 1:
        raise UnsupportedNemotronVariant(
            source, f"per-layer expert counts {sorted(used)} / widths {sorted(width)}",
            "every MoE block must use the same expert count and width")
    return {
        "n_routed_experts": int(key("expert_count")),
        "num_experts_per_tok": int(used.pop()),
        "moe_intermediate_size": int(width.pop()),
        "moe_shared_expert_intermediate_size": int(key("expert_shared_feed_forward_length")),
        "norm_topk_prob": bool(key("expert_weights_norm", False)),
        "routed_scaling_factor": float(key("expert_weights_scale", 1.0) or 1.0),
    }


# -- mixers ----------------------------------------------------------------------------------


class NemotronHMamba2Mixer(nn.Module):
    """Mamba-2 over each sequence's RecurrentState {"conv": [K-1, C], "ssm": [Hm, P, N]}.

    Parameters keep the GGUF shapes: conv_weight [C, K], A and D [Hm, 1], norm_weight [G, di/G].
    x: fp32 [n, D] -> fp32 [n, D].
    """

    def __init__(self, config: NemotronHConfig, *, device=None):
        super().__init__()
        c = config
        self.num_heads, self.head_dim, self.n_groups = c.mamba_num_heads, c.mamba_head_dim, c.n_groups
        self.state_size, self.conv_kernel, self.eps = c.ssm_state_size, c.conv_kernel, c.layer_norm_epsilon
        self.inner, self.conv_dim = c.intermediate_size, c.conv_dim
        self.in_proj = nn.Linear(c.hidden_size, self.inner + self.conv_dim + self.num_heads, bias=False,
                                 device=device)
        self.conv_weight = _param(device, self.conv_dim, self.conv_kernel)
        self.conv_bias = (nn.Parameter(torch.zeros(self.conv_dim), requires_grad=False) if c.use_conv_bias
                          else None)
        self.dt_bias = _param(device, self.num_heads)
        self.A = _param(device, self.num_heads, 1)  # -exp(A_log), as llama.cpp's converter stores it
        self.D = _param(device, self.num_heads, 1)
        self.norm_weight = _param(device, self.n_groups, self.inner // self.n_groups)
        self.out_proj = nn.Linear(self.inner, c.hidden_size, bias=False, device=device)

    def new_state(self) -> RecurrentState:
        return RecurrentState({"conv": (self.conv_kernel - 1, self.conv_dim),
                               "ssm": (self.num_heads, self.head_dim, self.state_size)})

    def forward(self, x: torch.Tensor, rows: Rows, layer_idx: int) -> torch.Tensor:
        projected = self.in_proj(x)  # [n, di + C + Hm]
        y = torch.empty(x.shape[0], self.inner)
        for s in rows.sequences:
            y[s.rows] = self.scan(projected[s.rows], s.state.layers[layer_idx],
                                  record_every_row=s.state.verify_rows is not None)
        return self.out_proj(y)

    def scan(self, projected: torch.Tensor, state: RecurrentState, *, record_every_row: bool) -> torch.Tensor:
        """Rows of one sequence: projected fp32 [m, di + C + Hm] -> gated, normed y fp32 [m, di].

        Runs the recurrence row by row from `state` and hands it the state after each row
        (every row in a verify, else only the last)."""
        z, xbc, dt_raw = projected.split([self.inner, self.conv_dim, self.num_heads], dim=-1)
        window = torch.cat([state.values["conv"], xbc])  # [K-1 + m, C]: the conv tail, then these rows
        ssm = state.values["ssm"].clone()  # [Hm, P, N], updated in place (the held state never changes)
        m, k = projected.shape[0], self.conv_kernel
        outputs, ssms = [], []
        for t in range(m):
            outputs.append(self._step(window[t:t + k], dt_raw[t], z[t], ssm))
            if record_every_row:  # a prefill holds only the state it ends with
                ssms.append(ssm.clone())
        if record_every_row:
            convs = torch.stack([window[t + 1:t + k] for t in range(m)])  # [m, K-1, C]
            state.update({"conv": convs, "ssm": torch.stack(ssms)})
        else:
            state.update({"conv": window[m:m + k - 1].clone()[None], "ssm": ssm[None]})
        return torch.stack(outputs)

    def _step(self, window: torch.Tensor, dt_raw: torch.Tensor, z: torch.Tensor,
              ssm: torch.Tensor) -> torch.Tensor:
        """One row: window fp32 [K, C] (conv inputs up to this row), dt_raw [Hm], z [di]; advances
        the state ssm [Hm, P, N] in place (one pass over it, not three) and returns y [di]."""
        hm, p, g, n = self.num_heads, self.head_dim, self.n_groups, self.state_size
        conv = window[0] * self.conv_weight[:, 0]
        for j in range(1, self.conv_kernel):
            conv = conv + window[j] * self.conv_weight[:, j]
        if self.conv_bias is not None:
            conv = conv + self.conv_bias
        xbc = F.silu(conv)  # [C]
        x = xbc[:self.inner].view(hm, p)  # [Hm, P]
        b = xbc[self.inner:self.inner + g * n].view(g, 1, n).expand(g, hm // g, n).reshape(hm, n)  # [Hm, N]
        c = xbc[self.inner + g * n:].view(g, 1, n).expand(g, hm // g, n).reshape(hm, n, 1)  # [Hm, N, 1]
        dt = F.softplus(dt_raw + self.dt_bias)  # [Hm]; no dt clamp (time_step_limit (0, inf))
        decay = torch.exp(dt[:, None] * self.A)  # [Hm, 1]
        ssm.mul_(decay[:, :, None]).addcmul_((x * dt[:, None])[:, :, None], b[:, None, :])  # [Hm, P, N]
        y = torch.bmm(ssm, c).view(hm, p) + self.D * x  # [Hm, P]
        y = (y.reshape(-1) * F.silu(z)).view(g, -1)  # [G, di/G]: gate before the norm
        y = F.rms_norm(y, (y.shape[-1],), None, self.eps) * self.norm_weight
        return y.reshape(-1)


def _param(device, *shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device=device), requires_grad=False)


class NemotronHAttention(nn.Module):
    """GQA self-attention, no RoPE, no biases, over each sequence's PagedKVCache of this layer."""

    def __init__(self, config: NemotronHConfig, *, device=None):
        super().__init__()
        c = config
        d, h, hkv, dh = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, hkv, dh
        self.q_proj = nn.Linear(d, h * dh, bias=False, device=device)
        self.k_proj = nn.Linear(d, hkv * dh, bias=False, device=device)
        self.v_proj = nn.Linear(d, hkv * dh, bias=False, device=device)
        self.o_proj = nn.Linear(h * dh, d, bias=False, device=device)

    def forward(self, x: torch.Tensor, rows: Rows, layer_idx: int) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)  # [n, H, Dh]
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)  # [n, Hkv, Dh]
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)  # [n, Hkv, Dh]
        out = attend_rows(q, k, v, rows, layer_idx, scaling=self.head_dim ** -0.5)  # [n, H, Dh]
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class NemotronHMLP(nn.Module):
    """down(relu(up(x))²); x fp32 [n, D] -> fp32 [n, D] (also one expert of a MoE)."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, device=None):
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False, device=device)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, device=device)

    def forward(self, x: torch.Tensor, rows: Rows | None = None, layer_idx: int | None = None
                ) -> torch.Tensor:
        return self.down_proj(torch.square(F.relu(self.up_proj(x))))


class NemotronHMoE(nn.Module):
    """Routed relu² experts plus one always-on shared relu² expert. x fp32 [n, D] -> fp32 [n, D]."""

    def __init__(self, config: NemotronHConfig, *, device=None):
        super().__init__()
        c = config
        self.gate = TopkRouter(c.hidden_size, c.n_routed_experts, c.num_experts_per_tok,
                               norm_topk_prob=c.norm_topk_prob, routed_scaling_factor=c.routed_scaling_factor,
                               device=device)  # sigmoid scores, selection bias (verispec.nn.moe)
        self.experts = nn.ModuleList(NemotronHMLP(c.hidden_size, c.moe_intermediate_size, device=device)
                                     for _ in range(c.n_routed_experts))
        self.shared_experts = NemotronHMLP(c.hidden_size, c.moe_shared_expert_intermediate_size,
                                           device=device)

    def forward(self, x: torch.Tensor, rows: Rows | None = None, layer_idx: int | None = None
                ) -> torch.Tensor:
        ids, weights = self.gate(x)  # [n, k], [n, k]
        return routed_experts(x, ids, weights, self.experts) + self.shared_experts(x)


class NemotronHBlock(nn.Module):
    def __init__(self, config: NemotronHConfig, layer_type: str, intermediate_size: int, *, device=None):
        super().__init__()
        self.block_type = layer_type
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
        if layer_type == "mamba":
            self.mixer = NemotronHMamba2Mixer(config, device=device)
        elif layer_type == "attention":
            self.mixer = NemotronHAttention(config, device=device)
        elif layer_type == "mlp":
            self.mixer = NemotronHMLP(config.hidden_size, intermediate_size, device=device)
        else:
            self.mixer = NemotronHMoE(config, device=device)

    def forward(self, hidden_states: torch.Tensor, rows: Rows, layer_idx: int) -> torch.Tensor:
        """hidden_states: fp32 [n, D] -> fp32 [n, D]."""
        return hidden_states + self.mixer(self.norm(hidden_states), rows, layer_idx)


class NemotronHModel(nn.Module):
    """embed_tokens (HF: embeddings; also the tied LM head), layers, norm_f."""

    def __init__(self, config: NemotronHConfig, *, device=None):
        super().__init__()
        c = config
        # a linear [V, D] read by rows, so a tied LM head is this same module (weights.quant)
        self.embed_tokens = nn.Linear(c.hidden_size, c.vocab_size, bias=False, device=device)
        self.layers = nn.ModuleList(NemotronHBlock(c, t, w, device=device)
                                    for t, w in zip(c.layer_types, c.intermediate_sizes))
        self.norm_f = RMSNorm(c.hidden_size, c.layer_norm_epsilon)


class NemotronHForCausalLM(TrunkModule):
    """The Nemotron-H trunk: a `Trunk` (the seam is verispec.nn.trunk.SequenceTrunk).

    dtype: weight dtype ("int8" | "bfloat16" | "float32" | "int4", see verispec.weights.quant); the
      router, norms, conv and SSM parameters stay fp32.
    max_rows_per_forward: longer inputs run in chunks this long.
    context_length: max positions (default: the GGUF's context_length).
    Per-sequence state: a RecurrentState per Mamba-2 block, a PagedKVCache per attention
    block, nothing for MLP/MoE blocks. Built on the meta device; `load_state_dict(state,
    assign=True)` fills the weights.
    """

    def __init__(self, config: NemotronHConfig, *, dtype: str = "int8",
                 max_rows_per_forward: int | None = None, context_length: int | None = None, device="meta"):
        super().__init__()
        self._init_sizes(config, dtype, max_rows_per_forward, context_length)
        self.model = NemotronHModel(config, device=device)
        self._finish_linears(device)

    def _new_layer_states(self) -> list:
        c = self.config
        states = []
        for layer in self.model.layers:
            if layer.block_type == "mamba":
                states.append(layer.mixer.new_state())
            elif layer.block_type == "attention":
                states.append(PagedKVCache(c.num_key_value_heads, c.head_dim,
                                            max_positions=self.max_context_length))
            else:
                states.append(None)
        return states

    def _embed(self, tokens):
        return self.model.embed_tokens.rows(tokens)  # [n, D] fp32

    def _forward_rows(self, rows: Rows):
        """Final-normed rows fp32 [n, D] and the residual rows entering each layer (L = after the last)."""
        x = self._embed(rows.tokens)
        taps = {}
        for i, layer in enumerate(self.model.layers):
            taps[i] = x
            x = layer(x, rows, i)
        taps[self.num_layers] = x
        return self.model.norm_f(x), taps
