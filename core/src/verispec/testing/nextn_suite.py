"""Checks of a PER_TOKEN NextN / MTP draft head (`verispec.nn.nextn_head.NextNHead`) against a
reference of its block, shared by every family whose files carry one (glm4moe, glm-dsa,
glm5-next, Qwen 3.5).

- `NextNCase`: a head, the reference of its block and a run of tokens with the trunk's rows.
- `NextNTraining`: what the short training needs: a fresh block to train, its differentiable
  reference, and how its weights go back into a GGUF.
- `NextNHeadSuite`: the checks as a test class a family's tests subclass: draft steps equal the
  reference through commits, keeps and gaps; `mtp` speculation gives the plain stream; one
  speculator serves requests in turn; and a short training on the trunk's own greedy streams
  makes `mtp` accept most drafts with the plain stream.

The speculator checks skip when verispec-mtp-nextn (or verispec-ngram) is not installed.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

__all__ = ["NextNCase", "NextNHeadSuite", "NextNTraining"]

#: (tokens [T] or [B, T] int64, hidden [T, D] or [B, T, D] fp32, positions [T] int64)
#: -> (logits [T, V], h' [T, D]) (batched: [B, T, V], [B, T, D]): pair j is (hidden[j], tokens[j])
#: at positions[j], every pair causal over the earlier ones
Reference = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class NextNCase:
    """The fp32 trunk's draft head, the reference of its block, and a run: tokens int64 [n] (n ≥ 31)
    with the trunk's final-normed rows hidden fp32 [n, D]."""

    head: object
    reference: Reference
    tokens: torch.Tensor
    hidden: torch.Tensor


@dataclass(frozen=True)
class NextNTraining:
    """trunk: the fp32 trunk with the untrained head; block: a fresh copy of its block (the
    parameters with requires_grad train; the trunk's embedding and LM head stay frozen);
    reference: the block's differentiable forward (`Reference`); write(path): the trunk with
    the trained block as a GGUF at `path` (returned); load(path): a GGUF's fp32 trunk."""

    trunk: object
    block: torch.nn.Module
    reference: Reference
    write: Callable[[Path], str]
    load: Callable[[str], object]


def _mtp_speculator(head, max_draft_tokens: int, **kwargs):
    module = pytest.importorskip("verispec_mtp_nextn.speculator")
    return module.MtpSpeculator(head, max_draft_tokens=max_draft_tokens, **kwargs)


class NextNHeadSuite:
    """The checks as tests: subclass it as `Test...` in a family's tests, beside three fixtures:
    `nextn_case` (a `NextNCase`), `nextn_trunk` (dtype -> a trunk with its head: "float32",
    "int8") and `nextn_training` (a `NextNTraining`); set the class attributes where the family's
    tiny model differs."""

    #: rows kept after each step of the draft-step check (its run reaches 10 + their sum)
    kept = (3, 1, 5, 2, 4)
    #: a position the draft-step run and the training streams pass (an indexer's top-k: past it,
    #: the head's own indexer selects a strict subset)
    selects_past = 0
    #: the gap check commits hidden rows 14..gap_end - 1 after the gap and steps at gap_end
    gap_end = 20
    #: tokens of the speculative stream check
    stream_tokens = 48
    #: the short training: streams, prompt tokens, greedy tokens per stream, Adam steps, the
    #: final loss it must reach
    num_streams, prompt_len, num_generated, num_steps, max_loss = 16, 8, 56, 300, 0.1
    atol = 1e-4

    def test_draft_steps_match_the_reference(self, nextn_case):
        """Commits in chunks as the loop makes them, a first step per chunk (catch-up folded in)
        and one chained step on the head's own row, provisional rows dropped by keep: every logits
        row equals the reference over the pairs (h[j], t[j+1]) at position j+1 (+ the chained pair)."""
        from verispec.seams import DraftHead, DraftHeadKind

        head, reference, tokens, hidden = (nextn_case.head, nextn_case.reference, nextn_case.tokens,
                                           nextn_case.hidden)
        assert isinstance(head, DraftHead) and head.draft_head_kind is DraftHeadKind.PER_TOKEN
        assert head.draft_head_resumes_after_gap
        with torch.no_grad():
            ref_logits, ref_hidden = reference(tokens[1:], hidden[:-1], torch.arange(1, len(tokens)))
        state = head.new_state()
        head.draft_catch_up(state, tokens[:10].tolist(), hidden[:10], 0)
        pos = 10
        for kept in self.kept:
            logits, h_out = head.draft_step(state, int(tokens[pos]), hidden[pos - 1], pos)
            torch.testing.assert_close(logits, ref_logits[pos - 1], atol=self.atol, rtol=0)
            torch.testing.assert_close(h_out, ref_hidden[pos - 1], atol=self.atol, rtol=0)
            draft = int(logits.argmax())
            chained, _ = head.draft_step(state, draft, h_out, pos + 1)
            with torch.no_grad():
                expected, _ = reference(torch.cat([tokens[1:pos + 1], torch.tensor([draft])]),
                                        torch.cat([hidden[:pos], ref_hidden[pos - 1:pos]]), torch.arange(1, pos + 2))
            torch.testing.assert_close(chained, expected[-1], atol=self.atol, rtol=0)
            head.keep(state, kept)
            head.draft_catch_up(state, tokens[pos:pos + kept].tolist(), hidden[pos:pos + kept], pos)
            pos += kept
        assert pos > self.selects_past

    def test_head_restarts_after_a_gap(self, nextn_case):
        """Tokens committed without hidden rows (prefix reuse): the head's rows restart at the next
        pair it can form, and steps equal the reference run over only those pairs."""
        head, reference, tokens, hidden = (nextn_case.head, nextn_case.reference, nextn_case.tokens,
                                           nextn_case.hidden)
        end = self.gap_end
        state = head.new_state()
        head.draft_catch_up(state, tokens[:8].tolist(), hidden[:8], 0)
        head.draft_step(state, int(tokens[8]), hidden[7], 8)
        head.keep(state, 1)
        head.draft_catch_up(state, tokens[8:14].tolist(), None, 8)  # a gap: no hidden rows
        head.draft_catch_up(state, tokens[14:end].tolist(), hidden[14:end], 14)
        logits, _ = head.draft_step(state, int(tokens[end]), hidden[end - 1], end)
        with torch.no_grad():  # pairs (h[j], t[j+1]) for j = 14..end - 1 at positions 15..end
            expected, _ = reference(tokens[15:end + 1], hidden[14:end], torch.arange(15, end + 1))
        torch.testing.assert_close(logits, expected[-1], atol=self.atol, rtol=0)

    @pytest.mark.parametrize("dtype", ["float32", "int8"])
    def test_mtp_speculation_gives_the_plain_stream(self, nextn_trunk, dtype):
        from verispec.testing import run_greedy

        trunk = nextn_trunk(dtype)
        speculator = _mtp_speculator(trunk.draft_head, 4, min_draft_prob=0.0)
        prompt = [1, 5, 9, 2, 7, 3, 11, 4, 8, 6, 10, 12]
        plain = run_greedy(trunk, prompt, self.stream_tokens)[0]
        got, ex = run_greedy(trunk, prompt, self.stream_tokens, speculator, max_draft_tokens=4)
        assert got == plain
        assert ex.stats.num_draft_tokens > 0 and ex.stats.num_spec_steps > 0

    @pytest.mark.parametrize("kind", ["mtp", "ngram"])
    def test_one_speculator_serves_requests_in_turn(self, nextn_trunk, kind):
        """Two requests of one scheduler sharing one speculator (the head's rows are per sequence),
        run alone in turn, each give their plain stream and the draft/accept counts they get alone."""
        from verispec.testing import run_greedy, run_greedy_requests

        trunk = nextn_trunk("int8")
        if kind == "mtp":
            new = lambda: _mtp_speculator(trunk.draft_head, 3, min_draft_prob=0.0)  # noqa: E731
        else:
            ngram = pytest.importorskip("verispec_ngram.speculator")
            new = lambda: ngram.NGramSpeculator(max_draft_tokens=3)  # noqa: E731
        prompts = [[1, 5, 9, 2, 7, 3, 11, 4] * 2, [8, 6, 10, 12, 40, 77, 101, 3, 8, 6]]
        plains = [run_greedy(trunk, p, 32)[0] for p in prompts]
        solos = [run_greedy(trunk, p, 32, new(), max_draft_tokens=3)[1].stats for p in prompts]
        runs = run_greedy_requests(trunk, prompts, 32, new(), max_running=1, max_draft_tokens=3)
        assert [tokens for tokens, _ in runs] == plains
        assert [ex.stats for _, ex in runs] == solos

    def test_trained_head_accepts_most_drafts_with_the_plain_stream(self, nextn_training, tmp_path):
        """A short training of the head on the tiny trunk's own greedy outputs makes `mtp`
        speculation accept most drafts while the stream stays the plain greedy stream, through
        the scheduler (one and two draft tokens) and through the engine.

        The head is trained as the reference block (autograd), written back to GGUF through the
        test map and loaded by the real loader, so the trained weights also cross the whole
        HF -> GGUF -> head path. Teacher forcing: pair (h[j], t[j+1]) at position j+1 predicts
        t[j+2], loss only on targets the trunk generated. Acceptance is measured on the training
        prompts' own continuations (a random tiny trunk's streams are chaotic; held-out acceptance
        stays low, ~2-7 % measured on Qwen 3.5): the point is a trained head driving the loop to
        high acceptance with exact output, not generalisation."""
        pytest.importorskip("verispec_mtp_nextn.speculator")
        training = nextn_training
        prompts, tokens, hidden = self._greedy_streams(training.trunk)
        assert tokens.shape[1] > self.selects_past
        untrained = self._acceptance(training.trunk, prompts[:3], max_draft_tokens=1)[0]

        training.block.train()
        assert self._train(training, tokens, hidden) < self.max_loss
        training.block.eval()
        trained_path = training.write(tmp_path / "trained.gguf")
        trained = training.load(trained_path)
        acceptance, exact = self._acceptance(trained, prompts[:3], max_draft_tokens=1)
        assert exact
        assert acceptance >= 0.5 > untrained, (acceptance, untrained)
        assert self._acceptance(trained, prompts[:3], max_draft_tokens=2)[1]  # chained drafts: still exact
        self._engine_accepts_most(trained_path, prompts[0])

    def _greedy_streams(self, trunk):
        """(prompts, tokens int64 [S, P + G], the trunk's final-normed rows fp32 [S, P + G, D])."""
        from verispec.testing import forward_one, run_greedy

        g = torch.Generator().manual_seed(7)
        prompts, tokens, hidden = [], [], []
        for _ in range(self.num_streams):
            prompt = torch.randint(0, trunk.vocab_size, (self.prompt_len,), generator=g).tolist()
            stream = prompt + run_greedy(trunk, prompt, self.num_generated)[0]
            seq = trunk.new_sequence()
            hidden.append(forward_one(trunk, seq, stream, logits="none", hidden=True).hidden)
            trunk.release(seq)
            prompts.append(prompt)
            tokens.append(torch.tensor(stream))
        return prompts, torch.stack(tokens), torch.stack(hidden)

    def _train(self, training: NextNTraining, tokens, hidden) -> float:
        """Adam over the block's trainable weights; returns the last step's loss."""
        torch.manual_seed(0)
        t = tokens.shape[1]
        inputs, rows, targets = tokens[:, 1:t - 1], hidden[:, :t - 2], tokens[:, 2:]
        weight = torch.zeros(t - 2)
        weight[self.prompt_len - 2:] = 1.0  # targets the trunk generated (the prompt is random)
        optimizer = torch.optim.Adam([p for p in training.block.parameters() if p.requires_grad], lr=3e-3)
        for _ in range(self.num_steps):
            logits, _ = training.reference(inputs, rows, torch.arange(1, t - 1))
            losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.reshape(-1),
                                                       reduction="none").view(len(tokens), -1)
            loss = (losses * weight).sum() / (weight.sum() * len(tokens))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        return loss.item()

    def _acceptance(self, trunk, prompts: Sequence[Sequence[int]], *, max_draft_tokens: int):
        """(accepted / drafted over the prompts, every stream equal to plain greedy)."""
        from verispec.testing import run_greedy

        n = self.num_generated - 8
        accepted = drafted = 0
        exact = True
        for prompt in prompts:
            plain = run_greedy(trunk, prompt, n)[0]
            speculator = _mtp_speculator(trunk.draft_head, max_draft_tokens)
            got, ex = run_greedy(trunk, prompt, n, speculator, max_draft_tokens=max_draft_tokens)
            exact &= got == plain
            accepted, drafted = accepted + ex.stats.num_accepted_tokens, drafted + ex.stats.num_draft_tokens
        return accepted / max(drafted, 1), exact

    def _engine_accepts_most(self, path: str, prompt: Sequence[int]) -> None:
        """The engine (`--spec-type mtp --spec-draft 1`, drafting forced) on the trained file: the
        plain greedy tokens, most drafts accepted."""
        import verispec

        n = self.num_generated - 8
        plain = [e.token for e in verispec.load(path, dtype="float32", enabled=False).generate(
            prompt, max_tokens=n, ignore_eos=True)]
        engine = verispec.load(path, dtype="float32", spec_type="mtp", max_draft_tokens=1, adaptive=False)
        generation = engine.generate(prompt, max_tokens=n, ignore_eos=True)
        assert [e.token for e in generation] == plain
        stats = generation.result.spec
        assert stats.num_accepted_tokens > 0.5 * stats.num_draft_tokens > 0, stats
