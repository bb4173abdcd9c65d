"""`verispec bench --diagnostic`: the speculative path's logits, teacher-forced, against plain decoding's.

It tells a state bug from kernel arithmetic. Per scenario, greedy:

1. Plain: prefill the prompt, then decode one row per forward; row j (logits fp32 [V]) draws
   stream token t_j.
2. Speculative, teacher-forced, in a second sequence: the drafts are the plain stream's next
   tokens (an exact-copy drafter), so every verify row lands on a position the plain run
   decoded. A step forwards the window [t_{j-1}, t_j .. t_{j+K-1}] as one verify segment
   (`logits="all", verify=True`, as `SpeculativeExecution` does), then `trunk.keep` keeps
   1, 2, .., K+1 of its rows in turn (a rejection after 0, 1, .. K drafts), then decodes the
   pending token as one row; the stream stays the plain one whatever the rows say.

Row classes, each compared with the plain row of its position:

- ``verify row i``: row i of a (K+1)-row window (i = 0 .. K): kernel arithmetic at K+1 rows.
- ``kept-prefix row``: the one-row decode right after a `keep` that dropped rows: it reads
  only the state the verify wrote and `keep` kept, so a rollback bug shows here first.
- ``one-row decode``: the one-row decode after a window kept whole.

Per row: error = max over the vocabulary of |spec logit - plain logit|; a *flip* is a row whose
argmax differs from the plain row's, with the plain row's margin (top1 - top2 logit). A row
with error e can only flip when its margin is at most 2e, so every flip must lie inside twice
its row's error. A trunk declaring `spec_batch_invariant` must show 0 everywhere: any nonzero
error there is a state bug, not arithmetic.
"""
from __future__ import annotations

import attrs
import torch

from verispec.seams import Segment, declared

VERIFY, KEPT, DECODE = "verify row {}", "kept-prefix row", "one-row decode"


@attrs.define
class RowClass:
    """Rows of one class: how many, the largest error, and the flips among them."""

    name: str
    num_rows: int = 0
    max_abs_error: float = 0.0
    num_flips: int = 0


@attrs.frozen
class Flip:
    """One row whose argmax differs from the plain row's. Logits and errors in logit units."""

    scenario: str
    row: str  # its row class
    position: int  # the position whose token the row draws
    plain_token: int
    spec_token: int
    margin: float  # top1 - top2 of the plain row
    row_error: float  # max |spec - plain| of this row

    @property
    def within_bound(self) -> bool:
        return self.margin <= 2 * self.row_error


@attrs.define
class Diagnostic:
    """What `run_diagnostic` measured over every scenario."""

    batch_invariant: bool
    max_draft_tokens: int
    classes: dict[str, RowClass] = attrs.field(factory=dict)
    flips: list[Flip] = attrs.field(factory=list)
    num_tokens: int = 0

    def add(self, scenario: str, name: str, spec_row: torch.Tensor, plain_row: torch.Tensor, position: int) -> None:
        """Compare one row (logits fp32 [V] each) and fold it into its class."""
        row_class = self.classes.setdefault(name, RowClass(name))
        error = (spec_row - plain_row).abs().max().item()
        row_class.num_rows += 1
        row_class.max_abs_error = max(row_class.max_abs_error, error)
        plain_token, spec_token = int(plain_row.argmax()), int(spec_row.argmax())
        if spec_token != plain_token:
            top2 = plain_row.topk(2).values
            row_class.num_flips += 1
            self.flips.append(Flip(scenario, name, position, plain_token, spec_token,
                                   (top2[0] - top2[1]).item(), error))

    @property
    def ok(self) -> bool:
        """Every flip within twice its row's error, and 0 everywhere on a batch-invariant trunk."""
        zero = not self.batch_invariant or all(c.max_abs_error == 0 for c in self.classes.values())
        return zero and all(f.within_bound for f in self.flips)

    def as_dict(self) -> dict:
        return {"batch_invariant": self.batch_invariant, "max_draft_tokens": self.max_draft_tokens,
                "num_tokens": self.num_tokens, "ok": self.ok,
                "rows": [attrs.asdict(c) for c in self.classes.values()],
                "flips": [{**attrs.asdict(f), "within_bound": f.within_bound} for f in self.flips]}


def plain_rows(trunk, prompt: list[int], num_tokens: int) -> torch.Tensor:
    """Greedy plain decoding: logits fp32 [num_tokens, V]; row j draws stream token j (its argmax)."""
    seq = trunk.new_sequence()
    try:
        rows = [trunk.forward([Segment(seq, prompt, logits="last")])[0].logits[-1]]
        while len(rows) < num_tokens:
            token = int(rows[-1].argmax())
            rows.append(trunk.forward([Segment(seq, [token], logits="last")])[0].logits[-1])
    finally:
        trunk.release(seq)
    return torch.stack(rows)


def teacher_forced(trunk, prompt: list[int], plain: torch.Tensor, max_draft_tokens: int, report: Diagnostic,
                   scenario: str, hidden: bool = False, tap_layers=None) -> None:
    """The speculative path over the plain stream (module docstring), each row added to `report`.

    plain: `plain_rows` [N, V]. hidden, tap_layers: ask for hidden rows as the engine's
    speculator would (the trunk may take another path for them)."""
    tokens = plain.argmax(dim=-1).tolist()  # the plain stream t_0 .. t_{N-1}
    base = len(prompt)  # position of t_0
    seq = trunk.new_sequence()

    def forward(rows: list[int], **kw):
        return trunk.forward([Segment(seq, rows, hidden=hidden, tap_layers=tap_layers, **kw)])[0]

    try:
        forward(prompt, logits="none")
        j, step = 1, 0  # pending token t_{j-1}; the next row drawn is t_j
        while j < len(tokens):
            k = min(max_draft_tokens, len(tokens) - 1 - j)  # drafts t_j .. t_{j+k-1}
            num_kept = 1
            if k >= 1:
                out = forward(tokens[j - 1:j + k], logits="all", verify=True)  # [k+1, V]
                for i in range(k + 1):
                    report.add(scenario, VERIFY.format(i), out.logits[i], plain[j + i], base + j + i)
                num_kept = 1 + step % (k + 1)  # keep 1 .. k+1 rows in turn: a rejection after 0 .. k drafts
                trunk.keep(seq, num_kept)
                j += num_kept
            if j < len(tokens):
                row = forward([tokens[j - 1]], logits="last").logits[-1]
                report.add(scenario, KEPT if num_kept < k + 1 else DECODE, row, plain[j], base + j)
                j += 1
            step += 1
    finally:
        trunk.release(seq)


def run_diagnostic(engine, prompts: dict[str, list[int]], *, num_tokens: int,
                   max_draft_tokens: int) -> Diagnostic:
    """Teacher-forced rows for each scenario's prompt (name -> token ids) on `engine.trunk`.

    num_tokens: plain tokens per scenario (>= 2); max_draft_tokens: K, drafts per window.
    The engine's prefix cache is emptied first (the two sequences are the trunk's own)."""
    trunk = engine.trunk
    speculator = engine.speculator
    hidden = speculator is not None and speculator.spec.needs_hidden_state
    tap_layers = speculator.tap_layers if hidden else None
    engine.reset_cache()
    report = Diagnostic(bool(declared(trunk, "spec_batch_invariant")), max_draft_tokens)
    for name, prompt in prompts.items():
        n = min(num_tokens, trunk.max_context_length - len(prompt))
        plain = plain_rows(trunk, prompt, n)
        teacher_forced(trunk, prompt, plain, max_draft_tokens, report, name, hidden, tap_layers)
        report.num_tokens += n
    return report


def _num(x: float) -> str:
    return "0" if x == 0 else f"{x:.3g}"


def format_diagnostic(report: Diagnostic) -> str:
    """The human table: a row per row class, every flip, then the verdict line."""
    order = sorted(report.classes.values(), key=lambda c: _order(c.name))
    lines = ["row | rows | max |spec - plain| | flips",
             *(f"{c.name} | {c.num_rows} | {_num(c.max_abs_error)} | {c.num_flips}" for c in order)]
    for f in report.flips:
        lines.append(f"flip {f.scenario} @{f.position} ({f.row}): plain {f.plain_token} -> spec {f.spec_token}, "
                     f"margin {_num(f.margin)} {'<=' if f.within_bound else '>'} 2 x error {_num(f.row_error)}")
    worst = max((c.max_abs_error for c in report.classes.values()), default=0.0)
    if report.batch_invariant:
        verdict = ("batch-invariant: every error is 0" if worst == 0 else
                   f"batch-invariant, yet rows differ by up to {_num(worst)}: a state bug, not arithmetic")
    else:
        verdict = f"not batch-invariant: rows differ by up to {_num(worst)}"
    bounded = all(f.within_bound for f in report.flips)
    verdict += f"; {len(report.flips)} flip(s)" + ("" if not report.flips else
                                                     ", every one within twice its row's error" if bounded else
                                                     ", some outside twice their row's error: not arithmetic")
    return "\n".join(lines + [verdict])


def _order(name: str) -> tuple[int, int]:
    """Verify rows by index, then kept-prefix rows, then one-row decodes."""
    if name.startswith("verify row"):
        return 0, int(name.rsplit(" ", 1)[1])
    return (1 if name == KEPT else 2), 0


#: plain tokens per scenario when --max-tokens is not given.
DEFAULT_NUM_TOKENS = 64


def prompt_ids(engine, scenario: dict) -> list[int]:
    """The scenario's first turn as token ids (through the chat template when the model has one)."""
    text = (scenario.get("turns") or [scenario["prompt"]])[0]
    chat = engine.tokenizer.chat_template is not None
    return engine.encode([{"role": "user", "content": text}] if chat else text)


def run(engine, scenarios: list[dict], *, max_tokens: int | None = None, as_json: bool = False) -> int:
    """`verispec bench --diagnostic`: print the table (or JSON) for `scenarios` (bench.load_scenarios).
    Returns 0, or 3 when a row contradicts arithmetic (a nonzero error on a batch-invariant
    trunk, or a flip outside twice its row's error)."""
    import json

    prompts = {s["name"]: prompt_ids(engine, s) for s in scenarios}
    report = run_diagnostic(engine, prompts, num_tokens=max(2, max_tokens or DEFAULT_NUM_TOKENS),
                            max_draft_tokens=engine.max_draft_tokens)
    print(json.dumps(report.as_dict(), indent=1) if as_json else format_diagnostic(report))
    return 0 if report.ok else 3
