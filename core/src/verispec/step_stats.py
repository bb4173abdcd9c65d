"""What one execution counts: ExecutionStats (vLLM's spec-decode metric names), a StepRecord per
step when asked for, and the one definition of the acceptance rate."""
from __future__ import annotations

import collections

import attrs


@attrs.define
class ExecutionStats:
    """Counters over the life of one execution (vLLM's spec-decode metric names)."""

    num_spec_steps: int = 0  # steps that verified a draft
    num_no_draft_steps: int = 0  # armed steps whose proposal was empty
    num_plain_steps: int = 0  # parked / unarmed / budget steps
    #: why plain steps were plain: cause -> steps (verispec.reasons.PLAIN_CAUSES; "detached" after
    #: the engine switched its speculator off, "faulted" after it faulted).
    plain_steps: collections.Counter = attrs.field(factory=collections.Counter)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    #: seconds in Speculator.propose (with its DraftContext); a timing, left out of == (two runs
    #: that did the same steps are equal).
    draft_s: float = attrs.field(default=0.0, eq=False)
    #: one StepRecord per step, in order, when the caller asked for them (`steps=[]`); else None.
    steps: list[StepRecord] | None = attrs.field(default=None, eq=False)
    #: accepted drafts by draft position (index 0: the first draft), vLLM's num_accepted_tokens_per_pos.
    num_accepted_tokens_per_pos: list[int] = attrs.field(factory=list)
    #: the cost model's line for the last step it made plain ("budget"), else None.
    budget_line: str | None = attrs.field(default=None, eq=False)

    @property
    def num_drafts(self) -> int:
        """Steps that verified a draft (vLLM's num_drafts)."""
        return self.num_spec_steps

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verified draft, the bonus or correction token included (vLLM's
        definition): 1 + accepted / drafts; 0.0 before any draft."""
        return 1 + self.num_accepted_tokens / self.num_spec_steps if self.num_spec_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return acceptance_rate(self.num_accepted_tokens, self.num_draft_tokens)


@attrs.frozen
class StepRecord:
    """One step of an execution (ExecutionStats.steps): what it drafted, accepted and emitted."""

    #: "spec" (verified a draft), "no_draft" (asked to draft, drafted nothing), or why a plain
    #: step was plain: a `plain_steps` cause ("parked", "measuring", "budget", "too_short", ...).
    kind: str
    num_drafted: int
    num_accepted: int
    num_emitted: int


def acceptance_rate(num_accepted: int, num_drafted: int) -> float:
    """Accepted draft tokens / drafted tokens (0.0 before any draft): the one definition, used by
    ExecutionStats and the server's gauge."""
    return num_accepted / num_drafted if num_drafted else 0.0
