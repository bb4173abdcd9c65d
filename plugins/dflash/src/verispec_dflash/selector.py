"""How a block's rows become drafts and confidences (reference note §7.3-§7.5).

DFlash1: d_e = argmax ℓ_e (ties: lowest id), conf_e = softmax(ℓ_e)[d_e].

DFlash2, the candidate selector's greedy walk (not Viterbi; what the references do):

    cand_e = top-K ids of ℓ_e, by descending ℓ then ascending id     u_e = ℓ_e[cand_e]
    γ_e = P · z_e                                                     [R]
    S_e[p][c] = u_e[c] + Σ_j A[pred_e[p]][j] · γ_e[j] · B[cand_e[c]][j]
    pred_1 = anchor; π_e = argmax_c S_e[π_{e-1}][c] (ties: lowest c); d_e = cand_e[π_e]
    conf_e = softmax(S_e[π_{e-1}])[π_e]   (within the K candidates: llama.cpp's p_min)

Only the row of the chosen predecessor is ever needed, so each step scores K pairs, not K×K.
Drafts are always greedy: verispec verifies by drawing the trunk's row, so the mode is the best
guess at any temperature. Both return per-row confidences (not yet cumulative).
"""
from __future__ import annotations

import torch


def argmax_drafts(logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """logits fp32 [m, V] (transformed) -> (m draft ids, m row confidences)."""
    ids = logits.argmax(dim=-1)
    conf = torch.exp(logits.gather(-1, ids[:, None])[:, 0] - torch.logsumexp(logits, dim=-1))  # softmax at the argmax
    return ids.tolist(), conf.tolist()


def top_candidates(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(u fp32 [m, K], cand int64 [m, K]): the K largest logits of each row, by descending value then ascending id."""
    values, ids = torch.topk(logits, k, dim=-1)
    order = torch.argsort(ids, dim=-1)  # ascending id, then a stable sort by descending value
    values, ids = values.gather(-1, order), ids.gather(-1, order)
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices
    return values.gather(-1, order), ids.gather(-1, order)


def walk_drafts(logits: torch.Tensor, hidden: torch.Tensor, anchor: int, *, top_k: int, projection: torch.Tensor,
                predecessor: torch.Tensor, successor: torch.Tensor) -> tuple[list[int], list[float]]:
    """The greedy walk. logits fp32 [m, V] (transformed), hidden z fp32 [m, H] (post output_norm),
    projection P fp32 [R, H], predecessor A / successor B fp32 [V, R]. Returns (m ids, m confidences)."""
    unary, cand = top_candidates(logits, top_k)  # [m, K]
    gamma = hidden @ projection.T  # [m, R]
    ids, confs, pred = [], [], anchor
    for e in range(logits.shape[0]):
        scores = unary[e] + successor[cand[e]] @ (predecessor[pred] * gamma[e])  # [K]
        pick = int(scores.argmax())
        pred = int(cand[e, pick])
        ids.append(pred)
        confs.append(float(torch.softmax(scores, dim=-1)[pick]))
    return ids, confs
