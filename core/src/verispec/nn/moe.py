"""Mixture-of-experts routing shared by the DeepSeek-style families (GLM-4.5 glm4moe, Nemotron-H MoE):
a sigmoid top-k router with a selection bias and expert groups, and the weighted sum of the chosen
experts. The experts themselves are the family's modules (SwiGLU for GLM, relu² for Nemotron).

Shape letters: n rows, D width, E experts, k experts per row, G expert groups.

Per row x [D] (docs/reference/glm5-nemotron.md §4; transformers Glm4MoeTopkRouter, NemotronHTopkRouter):
    s     = sigmoid(W x)                         fp32 [E]   W: router weight [E, D], kept fp32
    s_sel = s + e_score_correction_bias          [E]        used only to choose (GGUF exp_probs_b)
    G > 1: score each group by the sum of its two largest s_sel, keep the topk_group best groups,
           set s_sel of the other groups' experts to -inf
    ids   = topk(s_sel, k);  w = s[ids]          unbiased scores weight the experts
    norm_topk_prob: w = w / (sum(w) + 1e-20);    then w = w · routed_scaling_factor
    moe(x) = Σ_j w_j · expert_{ids_j}(x)          summed in ascending expert order

Batch invariance: the router runs one row at a time (`torch.mv`, sigmoid over [E]), so a row's
experts and weights are the same bits alone or inside an n-row verify; an fp32 GEMM over [n, D]
changes its blocking with n, and near-tied s_sel would then pick different experts (§4.4). Each
expert runs over the rows routed to it and a row adds its experts' outputs in ascending expert
order, so with batch-invariant linears (int8 / int4 / gguf) the whole block is per row.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["TopkRouter", "routed_experts"]


class TopkRouter(nn.Module):
    """Sigmoid scores, experts chosen by score + `e_score_correction_bias` (within the best
    `topk_group` of `n_group` groups), weighted by the unbiased scores, normalised when
    `norm_topk_prob`, scaled by `routed_scaling_factor`. HF's parameter names (`weight` [E, D],
    `e_score_correction_bias` [E]), both fp32 in every weight dtype (the router is not a linear
    the weight dtype swaps). Raises ValueError for groups that do not divide E or a top-k that
    the kept groups cannot fill."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, norm_topk_prob: bool,
                 routed_scaling_factor: float = 1.0, n_group: int = 1, topk_group: int = 1, device=None):
        super().__init__()
        if n_group < 1 or num_experts % n_group or not 1 <= topk_group <= n_group:
            raise ValueError(f"{num_experts} experts in {n_group} groups keeping {topk_group}: the groups "
                             "must divide the experts and 1 <= topk_group <= n_group")
        if n_group > 1 and num_experts // n_group < 2:
            raise ValueError(f"{n_group} groups of {num_experts // n_group} expert: a group is scored by its "
                             "top two experts, so it needs at least two")
        if not 1 <= top_k <= topk_group * (num_experts // n_group):
            raise ValueError(f"top_k {top_k} outside 1..{topk_group * (num_experts // n_group)} (the experts "
                             "of the kept groups)")
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor
        self.n_group, self.topk_group = n_group, topk_group
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, device=device), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, device=device),
                                                    requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x fp32 [n, D] -> (expert ids int64 [n, k], weights fp32 [n, k]); one row at a time."""
        ids, weights = [], []
        for row in x.float():
            scores = torch.sigmoid(torch.mv(self.weight, row))  # [E]
            chosen = self._choose(scores + self.e_score_correction_bias)  # [k]
            w = scores[chosen]
            if self.norm_topk_prob:
                w = w / (w.sum() + 1e-20)  # transformers' epsilon (llama.cpp clamps at 6.1e-5 instead)
            ids.append(chosen)
            weights.append(w * self.routed_scaling_factor)
        return torch.stack(ids), torch.stack(weights)

    def _choose(self, selection: torch.Tensor) -> torch.Tensor:
        """selection scores fp32 [E] -> the k chosen expert ids int64 [k]."""
        if self.n_group > 1:
            grouped = selection.view(self.n_group, -1)  # [G, E/G]
            best = grouped.topk(2, dim=-1).values.sum(dim=-1).topk(self.topk_group).indices  # [topk_group]
            keep = torch.zeros(self.n_group, dtype=torch.bool)
            keep[best] = True
            selection = grouped.masked_fill(~keep[:, None], float("-inf")).reshape(-1)
        return torch.topk(selection, self.top_k).indices


def routed_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                   experts: Sequence[nn.Module]) -> torch.Tensor:
    """Σ_j weights[:, j] · experts[ids[:, j]](x) per row: x fp32 [n, D], ids int64 [n, k], weights
    fp32 [n, k] -> fp32 [n, D]. Each expert runs once over the rows routed to it; a row adds its
    experts' outputs in ascending expert order (the order transformers' eager loop adds them)."""
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():  # ascending
        token, slot = torch.where(ids == e)
        out.index_add_(0, token, experts[e](x[token]) * weights[token, slot, None])
    return out
