"""/metrics: the engine's counters in Prometheus' text exposition format."""
from __future__ import annotations

from verispec.engine import InferenceEngine
from verispec.step_stats import acceptance_rate
from verispec.reasons import REASON_CODES


def prometheus_text(engine: InferenceEngine) -> str:
    """The engine's counters in Prometheus' text exposition format (version 0.0.4)."""
    scheduler = engine.scheduler
    m = scheduler.metrics
    acceptance = acceptance_rate(m.num_accepted_tokens, m.num_draft_tokens)
    rows = [
        ("requests_running", "gauge", "Requests in the running batch.", scheduler.num_running),
        ("requests_waiting", "gauge", "Requests queued for admission.", scheduler.num_waiting),
        ("requests_finished_total", "counter", "Requests finished (any reason).", m.num_finished_requests),
        ("generated_tokens_total", "counter", "Tokens emitted to clients.", m.num_generated_tokens),
        ("draft_tokens_total", "counter", "Draft tokens verified (finished requests).", m.num_draft_tokens),
        ("accepted_tokens_total", "counter", "Draft tokens accepted (finished requests).", m.num_accepted_tokens),
        ("acceptance_rate", "gauge", "accepted_tokens_total / draft_tokens_total.", acceptance),
        ("prefix_cache_hits_total", "counter", "Requests that adopted a cached prefix.", m.num_prefix_cache_hits),
        ("prefix_cache_reused_tokens_total", "counter", "Prompt tokens not prefilled thanks to the prefix cache.",
         m.num_reused_prefix_tokens),
        ("kv_budget_bytes", "gauge", "KV/state memory budget of running and idle sequences (0: none).",
         scheduler.kv_budget.budget_bytes or 0),
        ("kv_reserved_bytes", "gauge", "KV/state memory reserved by running requests.", scheduler.kv_budget.reserved_bytes),
        ("kv_idle_bytes", "gauge", "KV/state memory held by idle prefix-cache sequences.", scheduler.kv_budget.idle_bytes),
        ("kv_budget_evictions_total", "counter", "Idle sequences released to make room in the KV budget.",
         m.num_kv_budget_evictions),
    ]
    lines = []
    for name, kind, help_text, value in rows:
        lines += [f"# HELP verispec_{name} {help_text}", f"# TYPE verispec_{name} {kind}", f"verispec_{name} {value}"]
    lines += ["# HELP verispec_requests_by_reason_total Requests finished, by why they speculated or not "
              "(verispec.reasons).", "# TYPE verispec_requests_by_reason_total counter"]
    lines += [f'verispec_requests_by_reason_total{{reason="{code}"}} {m.num_requests_by_reason[code]}'
              for code in REASON_CODES]
    lines += ["# HELP verispec_accepted_tokens_per_pos_total Draft tokens accepted at each draft position "
              "(0: the first draft; finished requests).", "# TYPE verispec_accepted_tokens_per_pos_total counter"]
    lines += [f'verispec_accepted_tokens_per_pos_total{{position="{j}"}} {n}'
              for j, n in enumerate(m.num_accepted_tokens_per_pos)]
    return "\n".join(lines) + "\n"
