"""Multi-head latent attention (MLA) over a paged latent cache, and the DSA lightning indexer that
restricts it to top-k keys: the attention of GLM-5.x (`glm-dsa`), written so a NoPE variant can
reuse it (`rope_dim` 0 drops the roped part).

Shape letters: n rows of one sequence, T keys (positions 0 .. p of a row at position p), D model
width, H heads, qL / kvL query / KV LoRA ranks, nope / r the per-head non-roped / roped q·k dims,
vh value head dim, W = kvL + r one latent cache row, IH / ID indexer heads / head dim.

MLA (docs/reference/glm5-nemotron.md §5.4; transformers GlmMoeDsaAttention over AXK1Attention):
    cq = q_a_layernorm(q_a_proj(a));  q = q_b_proj(cq) -> [H, nope + r] = [q_nope ; q_pe]
    [c ; k_pe] = kv_a_proj_with_mqa(a);  c = kv_a_layernorm(c)          k_pe shared by every head
    q_pe, k_pe = rope_pairs(q_pe), rope_pairs(k_pe)                      adjacent pairs (GPT-J)
    cache per position: [c ; k_pe] (W floats)
  unabsorbed: k_h = [c k_b[h] ; k_pe], v_h = v_b[h] c, softmax(q_h·k_h · scale) v_h
  absorbed:   q̃_h = k_b[h] q_nope_h ([kvL]); s = ([q̃_h ; q_pe_h] · [c ; k_pe]) · scale;
              o_h = v_b[h] Σ_j softmax(s)_j c_j                          (MQA over the latent rows)
    out = o_proj(concat_h o_h);  scale = (nope + r)^-0.5
`attn_k_b` is stored [H, kvL, nope] and `attn_v_b` [H, vh, kvL] (llama.cpp's split of kv_b_proj).

`rope_pairs` rotates pairs (x[2j], x[2j+1]) by position · theta^(-2j/r) and writes the result
de-interleaved ([rotated evens ; rotated odds]), bitwise transformers'
apply_rotary_pos_emb_interleave; q and k get the same permutation, so dot products are those of
the interleaved layout llama.cpp keeps (LLAMA_ROPE_TYPE_NORM).

DSA indexer (§5.5; transformers GlmMoeDsaIndexer):
    qI = wq_b(cq) -> [IH, ID];  kI = LayerNorm(wk(a)) [ID] (eps 1e-6);  both [roped r ; rest],
    rope FIRST here; one key per position, kept in the indexer key cache.
    score(t, j) = Σ_h (weights_proj(a)_h · IH^-0.5) · ReLU(qI_h · kI_j · ID^-0.5),  j <= t
    S(t) = top-k(score(t, ·), k = min(index_topk, t + 1)): the keys row t's attention may read.
A "shared" layer has no indexer and uses the previous full layer's S(t).

Which form runs depends only on the number of rows of the sequence in the forward:
n < UNABSORBED_MIN_ROWS (every decode and verify) runs the absorbed form one row at a time (each
row's products have shapes fixed by its position alone, so with batch-invariant projections a
verify row is bitwise the one-row decode), longer prefill chunks the unabsorbed form over the
whole chunk (a row's bits then depend on the chunk; within fp32 rounding of the absorbed form).
"""
from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F
from verispec.nn.kv_cache import MAX_VERIFY_ROWS, storage_nbytes
from verispec.nn.norm import RMSNorm
from verispec.nn.rope import default_inv_freq

__all__ = ["UNABSORBED_MIN_ROWS", "DsaIndexer", "HeadRows", "MlaAttention", "MlaHeadCache", "MlaLayerCache",
           "PagedRows", "PairRope", "rope_pairs"]

#: a sequence's rows in one forward from which the unabsorbed form runs: above any verify.
UNABSORBED_MIN_ROWS = MAX_VERIFY_ROWS + 1
#: transformers DeepseekV32Indexer's k_norm epsilon (llama.cpp's graph differs negligibly, §12.7).
INDEXER_NORM_EPS = 1e-6
#: epsilon of q_a_layernorm / kv_a_layernorm: transformers' GlmMoeDsaRMSNorm default (DeepSeek's
#: reference too), not the config's rms_norm_eps; llama.cpp's graph uses the file's epsilon there.
LATENT_NORM_EPS = 1e-6


def rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x fp32 [n, ..., r] (position of row i in cos/sin row i), cos, sin fp32 [n, r/2] -> fp32
    [n, ..., r]: pairs (2j, 2j+1) rotated, output [evens' ; odds'] (module docstring)."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos, sin = cos.view(shape), sin.view(shape)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)


class PairRope(nn.Module):
    """cos / sin of `rope_pairs` at given positions: theta^(-2j/r) · position, j < r/2 (transformers
    compute_default_rope_parameters; fp32)."""

    def __init__(self, rotary_dim: int, theta: float):
        super().__init__()
        self.register_buffer("inv_freq", default_inv_freq(rotary_dim, theta), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 [n] -> cos, sin fp32 [n, r/2]."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        return angles.cos(), angles.sin()


class PagedRows:
    """One row of `width` fp32 values per position, in blocks of `block` positions allocated as the
    sequence grows (a block table, as `nn.kv_cache.PagedKVCache`): forks share blocks and copy
    one before writing into it; keep and truncate move the committed length (rows past it are
    never read: a query at position p reads rows 0..p). Block: fp32 [block, width]."""

    def __init__(self, width: int, *, max_positions: int, block: int = 64):
        self.width, self.block = width, block
        self.max_capacity = -(-max_positions // block) * block
        self.blocks: list[torch.Tensor] = []
        self.shared: list[bool] = []

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.block

    def max_nbytes(self, num_positions: int) -> int:
        """Bytes once this cache has room for `num_positions` positions (whole blocks)."""
        count = -(-min(num_positions, self.max_capacity) // self.block)
        return count * self.block * self.width * 4

    def nbytes(self) -> int:
        return storage_nbytes(self.blocks)

    def ensure_capacity(self, num_positions: int) -> None:
        while self.capacity < min(num_positions, self.max_capacity):
            self.blocks.append(torch.zeros(self.block, self.width))
            self.shared.append(False)

    def write(self, start_pos: int, rows: torch.Tensor) -> None:
        """rows fp32 [n, width] for positions start_pos .. start_pos + n - 1."""
        row, n = 0, rows.shape[0]
        while row < n:
            index, offset = divmod(start_pos + row, self.block)
            if self.shared[index]:
                self.blocks[index], self.shared[index] = self.blocks[index].clone(), False
            m = min(self.block - offset, n - row)
            self.blocks[index][offset:offset + m] = rows[row:row + m]
            row += m

    def read(self, num_positions: int) -> torch.Tensor:
        """fp32 [T, width] of positions 0 .. T - 1 (a view of one block, else a copy)."""
        count = -(-num_positions // self.block)
        whole = self.blocks[0] if count == 1 else torch.cat(self.blocks[:count])
        return whole[:num_positions]

    def truncate(self, length: int) -> None:
        count = -(-length // self.block)
        del self.blocks[count:], self.shared[count:]

    def fork(self, length: int) -> "PagedRows":
        new = copy.copy(self)
        count = min(len(self.blocks), -(-length // self.block))
        new.blocks = self.blocks[:count]
        self.shared[:count] = [True] * count
        new.shared = [True] * count
        return new


class MlaLayerCache:
    """An MLA layer's state for one sequence: the latent rows [c ; k_pe] (W floats per position) and,
    on a layer with its own indexer, the indexer keys (ID floats per position). Slot = position;
    rows past the committed length are never read, so keep is free and exact."""

    def __init__(self, latent_width: int, index_width: int | None, *, max_positions: int):
        self.latent = PagedRows(latent_width, max_positions=max_positions)
        self.index_keys = None if index_width is None else PagedRows(index_width, max_positions=max_positions)

    def _parts(self) -> list[PagedRows]:
        return [self.latent] if self.index_keys is None else [self.latent, self.index_keys]

    def max_nbytes(self, num_positions: int) -> int:
        return sum(p.max_nbytes(num_positions) for p in self._parts())

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self._parts())

    def ensure_capacity(self, num_positions: int) -> None:
        for p in self._parts():
            p.ensure_capacity(num_positions)

    def begin(self, seq_len: int, verify: bool) -> None:
        pass  # a verify's rows land where decodes would put them

    def check_truncate(self, length: int) -> None:
        pass

    check_keep = check_truncate

    def keep(self, length: int) -> None:
        pass  # rows past `length` are never read and are overwritten by the next forward

    def truncate(self, length: int) -> None:
        for p in self._parts():
            p.truncate(length)

    def fork(self, length: int) -> "MlaLayerCache":
        new = copy.copy(self)
        new.latent = self.latent.fork(length)
        new.index_keys = None if self.index_keys is None else self.index_keys.fork(length)
        return new


class HeadRows:
    """A draft head's rows: one contiguous run of positions [base, end), grown on demand. Writing
    into an empty run starts it anywhere (a head restarting after a gap); otherwise a write
    starts at or before `end` and ends the run after it. Row: fp32 [width]."""

    def __init__(self, width: int):
        self.rows = torch.zeros(0, width)
        self.base = self.end = 0

    def write(self, start_pos: int, rows: torch.Tensor) -> None:
        """rows fp32 [m, width] for positions start_pos ..; raises ValueError past the run's end."""
        if self.end == self.base:
            self.base = self.end = start_pos
        if not self.base <= start_pos <= self.end:
            raise ValueError(f"head rows at {start_pos}: the run holds [{self.base}, {self.end}); "
                             "drop_from the first position to rewrite before writing")
        end = start_pos + rows.shape[0]
        if end - self.base > self.rows.shape[0]:
            grow = max(end - self.base, 2 * self.rows.shape[0], 64) - self.rows.shape[0]
            self.rows = torch.cat([self.rows, self.rows.new_zeros(grow, self.rows.shape[1])])
        self.rows[start_pos - self.base:end - self.base] = rows
        self.end = end

    def read(self, num_positions: int) -> torch.Tensor:
        """fp32 [num_positions - base, width]: positions base .. num_positions - 1."""
        return self.rows[:num_positions - self.base]

    def drop_from(self, pos: int) -> None:
        """Forget every row at position >= pos."""
        self.end = max(self.base, min(self.end, pos))


class MlaHeadCache:
    """A NextN head's MLA state for one sequence: latent rows and indexer keys over one run of
    positions from `base` (the `nn.nextn_head` bookkeeping restarts it after a gap)."""

    def __init__(self, latent_width: int, index_width: int | None):
        self.latent = HeadRows(latent_width)
        self.index_keys = None if index_width is None else HeadRows(index_width)

    @property
    def base(self) -> int:
        return self.latent.base

    def drop_from(self, pos: int) -> None:
        self.latent.drop_from(pos)
        if self.index_keys is not None:
            self.index_keys.drop_from(pos)


class DsaIndexer(nn.Module):
    """The lightning indexer of one full layer (transformers' parameter names). `select` gives the
    keys each row may attend to."""

    def __init__(self, hidden_size: int, q_lora_rank: int, num_heads: int, head_dim: int, rope_dim: int,
                 top_k: int, *, device=None):
        super().__init__()
        self.num_heads, self.head_dim, self.rope_dim, self.top_k = num_heads, head_dim, rope_dim, top_k
        self.wq_b = nn.Linear(q_lora_rank, num_heads * head_dim, bias=False, device=device)
        self.wk = nn.Linear(hidden_size, head_dim, bias=False, device=device)
        self.k_norm = nn.LayerNorm(head_dim, eps=INDEXER_NORM_EPS)
        self.weights_proj = nn.Linear(hidden_size, num_heads, bias=False, device=device)

    def project(self, a: torch.Tensor, cq: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """a fp32 [n, D], cq fp32 [n, qL] -> (queries fp32 [n, IH, ID], keys fp32 [n, ID], head
        weights fp32 [n, IH] with IH^-0.5 folded in)."""
        n, r = a.shape[0], self.rope_dim
        q = self.wq_b(cq).view(n, self.num_heads, self.head_dim)
        k = self.k_norm(self.wk(a).float())
        q = torch.cat([rope_pairs(q[..., :r], cos, sin), q[..., r:]], dim=-1)
        k = torch.cat([rope_pairs(k[:, :r], cos, sin), k[:, r:]], dim=-1)
        return q, k, self.weights_proj(a).float() * self.num_heads ** -0.5

    def select(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, start_pos: int,
               rowwise: bool) -> torch.Tensor:
        """Keys row i (at start_pos + i) may read: bool [n, T], T = start_pos + n. q fp32 [n, IH, ID],
        weights fp32 [n, IH], keys fp32 [T, ID] (this sequence's indexer cache, these rows' keys
        included). rowwise: one row at a time (each row's products shaped by its position alone)."""
        n, total = q.shape[0], keys.shape[0]
        scale = self.head_dim ** -0.5
        allowed = torch.zeros(n, total, dtype=torch.bool)
        if rowwise:
            for i in range(n):
                visible = start_pos + i + 1
                if visible <= self.top_k:
                    allowed[i, :visible] = True
                    continue
                scores = F.relu(torch.matmul(q[i], keys[:visible].t()) * scale)  # [IH, visible]
                index = torch.matmul(weights[i], scores)  # [visible]
                allowed[i, index.topk(self.top_k).indices] = True
            return allowed
        scores = F.relu(torch.matmul(q, keys.t()[None]) * scale)  # [n, IH, T]
        index = torch.matmul(weights[:, None, :], scores)[:, 0]  # [n, T]
        future = torch.arange(total)[None, :] > torch.arange(start_pos, start_pos + n)[:, None]
        index = index.masked_fill(future, float("-inf"))
        chosen = index.topk(min(self.top_k, total), dim=-1).indices  # may include future keys: masked below
        allowed.scatter_(1, chosen, True)
        return allowed & ~future


class MlaAttention(nn.Module):
    """MLA with an optional DSA indexer (module docstring; transformers' parameter names, `k_b` /
    `v_b` the per-head up-projections). a: fp32 [n, D] -> fp32 [n, D]."""

    def __init__(self, *, hidden_size: int, num_heads: int, q_lora_rank: int, kv_lora_rank: int,
                 nope_dim: int, rope_dim: int, v_head_dim: int, indexer: DsaIndexer | None, device=None):
        super().__init__()
        self.num_heads, self.kv_lora_rank, self.v_head_dim = num_heads, kv_lora_rank, v_head_dim
        self.nope_dim, self.rope_dim = nope_dim, rope_dim
        self.scaling = (nope_dim + rope_dim) ** -0.5
        self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=False, device=device)
        self.q_a_layernorm = RMSNorm(q_lora_rank, LATENT_NORM_EPS)
        self.q_b_proj = nn.Linear(q_lora_rank, num_heads * (nope_dim + rope_dim), bias=False, device=device)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + rope_dim, bias=False, device=device)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, LATENT_NORM_EPS)
        self.k_b = nn.Parameter(torch.empty(num_heads, kv_lora_rank, nope_dim, device=device),
                                requires_grad=False)
        self.v_b = nn.Parameter(torch.empty(num_heads, v_head_dim, kv_lora_rank, device=device),
                                requires_grad=False)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=False, device=device)
        self.indexer = indexer

    def forward(self, a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches, sequences,
                shared_selection: list | None) -> tuple[torch.Tensor, list]:
        """a fp32 [n, D] (all sequences' rows of the forward), cos/sin fp32 [n, r/2]; caches: each
        sequence's MlaLayerCache; sequences: `nn.trunk.RowsOfSequence` (row ranges, start
        positions); shared_selection: on a layer without an indexer, each sequence's allowed-key
        mask from the previous full layer. Writes these rows into the caches first. A cache whose
        rows start at a position `base` > 0 (a draft head's) reads keys base .. only. Returns
        (fp32 [n, D], each sequence's allowed-key mask bool [n_s, T_s - base])."""
        n, heads, nope, r = a.shape[0], self.num_heads, self.nope_dim, self.rope_dim
        cq = self.q_a_layernorm(self.q_a_proj(a))
        q = self.q_b_proj(cq).view(n, heads, nope + r)
        q_nope, q_pe = q[..., :nope], rope_pairs(q[..., nope:], cos, sin)
        ckv = self.kv_a_proj_with_mqa(a)
        latent = torch.cat([self.kv_a_layernorm(ckv[:, :self.kv_lora_rank]),
                            rope_pairs(ckv[:, self.kv_lora_rank:], cos, sin)], dim=-1)  # [n, W]
        if self.indexer is not None:
            iq, ik, iw = self.indexer.project(a, cq, cos, sin)
        out, selections = torch.empty(n, heads, self.v_head_dim), []
        for j, (s, cache) in enumerate(zip(sequences, caches)):
            rows, m = s.rows, s.end - s.begin
            cache.latent.write(s.start_pos, latent[rows])
            total = s.start_pos + m
            rowwise = m < UNABSORBED_MIN_ROWS
            start = s.start_pos - getattr(cache, "base", 0)  # the rows' first position among the keys read
            if self.indexer is not None:
                cache.index_keys.write(s.start_pos, ik[rows])
                index_keys = cache.index_keys.read(total)
                allowed = self.indexer.select(iq[rows], iw[rows], index_keys, start, rowwise)
            else:
                allowed = shared_selection[j]
            selections.append(allowed)
            keys = cache.latent.read(total)  # [T, W]
            attend = self._absorbed if rowwise else self._unabsorbed
            out[rows] = attend(q_nope[rows], q_pe[rows], keys, allowed, start)
        return self.o_proj(out.reshape(n, heads * self.v_head_dim)), selections

    def _absorbed(self, q_nope, q_pe, keys, allowed, start_pos):
        """One row at a time: q_nope [m, H, nope], q_pe [m, H, r], keys [T, W], allowed bool [m, T]
        -> [m, H, vh]."""
        out = torch.empty(q_nope.shape[0], self.num_heads, self.v_head_dim)
        for i in range(q_nope.shape[0]):
            visible = start_pos + i + 1
            q_lat = torch.bmm(self.k_b, q_nope[i, :, :, None])[..., 0]  # [H, kvL]
            scores = torch.matmul(torch.cat([q_lat, q_pe[i]], dim=-1), keys[:visible].t()) * self.scaling
            scores = scores.masked_fill(~allowed[i, :visible], float("-inf"))  # [H, visible]
            probs = torch.softmax(scores, dim=-1)
            o_lat = torch.matmul(probs, keys[:visible, :self.kv_lora_rank])  # [H, kvL]
            out[i] = torch.bmm(self.v_b, o_lat[:, :, None])[..., 0]
        return out

    def _unabsorbed(self, q_nope, q_pe, keys, allowed, start_pos):
        """The chunk at once, keys and values decompressed per head; shapes as `_absorbed`."""
        c, k_pe = keys[:, :self.kv_lora_rank], keys[:, self.kv_lora_rank:]
        k_nope = torch.einsum("tc,hcd->htd", c, self.k_b)  # [H, T, nope]
        values = torch.einsum("tc,hec->hte", c, self.v_b)  # [H, T, vh]
        k = torch.cat([k_nope, k_pe[None].expand(self.num_heads, -1, -1)], dim=-1)  # [H, T, nope + r]
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)  # [H, m, nope + r]
        scores = torch.matmul(q, k.transpose(1, 2)) * self.scaling  # [H, m, T]
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1), values).transpose(0, 1)  # [m, H, vh]
