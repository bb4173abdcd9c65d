"""Entry point of verispec-mtp-nextn: registers the `mtp` speculator (no torch here).

`SPEC` is the one place the speculator's declarations live; `MtpSpeculator` reads them from it.
"""
from verispec.hookspecs import registers
from verispec.specs import SpeculatorSpec

SPEC = SpeculatorSpec(
    name="mtp",
    summary="chains a PER_TOKEN draft head (NextN / MTP); gate: top-1 prob over its top-10 logits",
    factory="verispec_mtp_nextn.speculator:create",
    requires_draft_head=True,
    # the head restarts its private KV after a gap (draft_head_resumes_after_gap), so a reused
    # prefix it never saw costs acceptance for a few steps, never correctness
    can_arm_after_prefix_reuse=True,
    needs_hidden_state=True,
    default_min_draft_prob=0.15,
    priority=20,
)

register_speculators = registers(SPEC)
