"""Why a request speculated or not: one reason code and one line of text per request.

Every response's `verispec` field (and a stream's last chunk) carries it, and /metrics counts
finished requests by code. The codes are a fixed set (`REASON_CODES`):

- armed: the speculator drafted for this request (its counts are in the text).
- parked: the speculator was ready, but the cost governor parked it for every solo step
  (speculating cost more ms per token than plain decoding; both figures in the text).
- measuring: the governor was still timing plain decode before its first probe.
- budget: the cost model gave the request no draft slot: drafting, verifying and the drafter's
  upkeep cost more per expected token than plain decoding (the figures in the text), alone or
  in the batch beside other requests (verispec.cost_model).
- too_short: the request could not decode two tokens (max_tokens, a stop, or a full context).
- unarmed: the speculator cannot join a sequence that started from a reused prefix
  (`can_arm_after_prefix_reuse` False).
- declined: no speculator serves this trunk (the registry's reasons in the text).
- off: speculation is off, for the server (--spec-type none) or for this request.
- faulted: the speculator raised or returned junk and was switched off (named in the text).

The counts come from the request's `ExecutionStats.plain_steps` (why each step of its own that
did not draft was plain); requests without a speculator get the engine's reason.
"""
from __future__ import annotations

import attrs

REASON_CODES = ("armed", "parked", "measuring", "budget", "too_short", "unarmed", "declined", "off", "faulted")

#: `ExecutionStats.plain_steps` keys, and the codes they lead to when nothing drafted.
PLAIN_CAUSES = ("parked", "measuring", "budget", "too_short", "unarmed", "stop_token")


@attrs.frozen
class SpeculationReason:
    """One of REASON_CODES and a one-line explanation for a person."""

    code: str = attrs.field(validator=attrs.validators.in_(REASON_CODES))
    text: str

    def as_dict(self) -> dict[str, str]:
        return {"code": self.code, "text": self.text}


def request_reason(stats, fault: str | None, speculator: str, governor) -> SpeculationReason:
    """The reason for one request that ran with `speculator` (its name).

    stats: the request's ExecutionStats; fault: its execution's fault line, or None; governor:
    the GovernorStats at its end, or None. Precedence: a fault; then armed, when it drafted at
    least as many steps as the governor parked; then parked; then the most frequent other plain
    cause, ties broken in PLAIN_CAUSES order.
    """
    if fault is not None:
        return SpeculationReason("faulted", f"{fault}; switched off, decoded plainly")
    steps = stats.num_spec_steps + stats.num_no_draft_steps
    drafted = (f"speculator {speculator!r} drafted {stats.num_draft_tokens} tokens over {_count(steps, 'step')} "
               f"and {stats.num_accepted_tokens} {'was' if stats.num_accepted_tokens == 1 else 'were'} accepted "
               f"({100 * stats.acceptance_rate:.0f}%)")
    parked = stats.plain_steps.get("parked", 0)
    if steps and steps >= parked:
        others = ", ".join(f"{n} {cause}" for cause, n in stats.plain_steps.items() if n)
        return SpeculationReason("armed", drafted + (f"; plain steps: {others}" if others else ""))
    if parked:
        return SpeculationReason("parked", _plain_text("parked", speculator, stats, governor)
                                 + (f"; before the park, {drafted}" if steps else ""))
    if stats.plain_steps.get("detached"):
        return SpeculationReason("off", "the engine switched speculation off while this request ran (a plugin "
                                        "fault in another request, or a policy change); it finished plainly")
    counts = {cause: stats.plain_steps.get(cause, 0) for cause in PLAIN_CAUSES if cause not in ("parked", "stop_token")}
    cause = max(counts, key=lambda c: counts[c]) if any(counts.values()) else "too_short"
    return SpeculationReason(cause, _plain_text(cause, speculator, stats, governor))


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' * (n != 1)}"


def _plain_text(cause: str, speculator: str, stats, governor) -> str:
    if cause == "parked":
        left = f" for {governor.park_tokens_left} more tokens" if governor is not None and governor.park_tokens_left else ""
        why = governor.park_reason if governor is not None and governor.park_reason else "it lost a probe"
        return f"the cost governor parked speculator {speculator!r}{left} ({why})"
    if cause == "measuring":
        return (f"the cost governor was timing plain decode before its first probe of {speculator!r} "
                "(once per engine)")
    if cause == "budget":
        line = stats.budget_line or "drafting cost more per expected token than plain decoding"
        return f"the cost model gave {speculator!r} no draft slot: {line}"
    if cause == "unarmed":
        return (f"speculator {speculator!r} cannot arm on a sequence that starts from a reused prefix "
                "(can_arm_after_prefix_reuse is False); the next request without reuse drafts")
    return f"the request could not decode two tokens (max_tokens, a stop, or a full context): {stats.num_emitted_tokens} emitted"
