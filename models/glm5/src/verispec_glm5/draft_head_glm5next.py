"""The GLM-5.3-Flash NextN (MTP) block as a PER_TOKEN `DraftHead` bound to its glm5-next trunk.

One draft step (docs/reference/glm5-nemotron.md §3.5, §6.9; transformers modeling_layers.MtpLayer
over a plain-residual layer of Glm5NextTextAttention and Glm5NextTextMoE), for the trunk's
final-normed row h [D] (after the mHC mean and output_norm) and the token t that follows it, at
NextN position p: x = eh_proj([enorm(embed(t)) ‖ hnorm(h)]); x = x + nope_mla(input_layernorm(x));
x = x + moe(post_attention_layernorm(x)); h' = post_norm(x); logits = lm_head(h'). The math of a
step is glm-dsa's head with r = 0 (`GlmDsaNextNHead.forward_rows`); the head's cache rows are
latent [kvL] and k-pool indexer rows [k ; gate] over its own run of positions, pooled from the
run's first position. Its indexer selects among the head's own pools each step (transformers 5.24
has no `index_share_for_mtp_iteration` path; llama.cpp b11434 has no glm5-next draft graph).
"""
from __future__ import annotations

from verispec.nn.nextn_head import NextNState

from verispec_glm5.draft_head_glm_dsa import GlmDsaNextNHead
from verispec_glm5.mla import MlaHeadCache

__all__ = ["Glm5NextNextNHead"]


class Glm5NextNextNHead(GlmDsaNextNHead):
    """The NextN draft head of a glm5-next trunk over its `mtp` block (`Glm5NextNextN`).

    `draft_head_resumes_after_gap` is True, for glm-dsa's reason: the head's only state is its own
    latent and indexer rows over one contiguous run of positions (no recurrent state: the block is
    MLA, not KDA), which it drops and restarts after a gap.
    """

    def new_state(self) -> NextNState:
        c = self.config
        return NextNState(MlaHeadCache(c.kv_lora_rank, 2 * c.index_head_dim))
