"""Tensor-parallel shards of the shared layer kinds: the few lines where a rank's math differs
from the reference math (Megatron-LM's split; Shoeybi et al. 2019, §3).

A rank of W holds a slice of every layer and runs the reference forward on it:
- column-parallel linears (q|k|v, gate|up): the rank's output rows -- whole heads for q/k/v
  (and their KV caches), a run of FFN features for gate|up; no communication;
- row-parallel linears (o, down): the matching input columns; each rank's [n, D] is a partial
  sum, `Shards.all_reduce` adds them (biases go after the sum, once);
- vocabulary-parallel embedding / LM head: the rank's vocabulary rows [start, end); a token
  another rank owns embeds to zeros here and the sum over ranks is its row (one non-zero addend:
  exact), and the LM head's [r, V_rank] pieces are gathered into [r, V] (`gather_vocab`).

So a family adds TP per layer kind with sizes from `shard_config` (or `Shards.size` /
`Shards.heads`) and `reduce_partial` after each row-parallel linear; it never rewrites the layer.
`TrunkModule` (verispec.nn.trunk_module) does the vocabulary-parallel embedding rows and LM head (the
final softcap after the gather). Which rows and columns of a stored tensor a rank reads:
`verispec.gguf.shard`. The process model (who calls the trunk): `verispec.tensor_parallel`.

Exactness: the row-parallel sum is over W partial dot products, where one process sums all
columns in its kernel's order, so logits differ from world size 1 by rounding (bounded in the
tests); at a fixed W every op stays per row and the 2-rank sum is commutative, so a row's bits
still do not depend on the batch around it.
"""
from __future__ import annotations

from typing import Any

import attrs
import torch

from verispec.errors import VerispecError

__all__ = ["HeadsNotDivisible", "Shards", "embed_vocab_rows", "gather_vocab", "reduce_partial", "shard_config"]


class HeadsNotDivisible(VerispecError, ValueError):
    """A world size that does not divide a model's attention (or KV) head count."""

    def __init__(self, world_size: int, counts: dict[str, int]):
        self.world_size, self.counts = world_size, dict(counts)
        common = 0
        for n in counts.values():
            common = n if not common else _gcd(common, n)
        choices = [w for w in range(1, common + 1) if common % w == 0]
        named = ", ".join(f"{n} {what[:-1] if n == 1 and what.endswith('s') else what}" for what, n in counts.items())
        fix = ("this model cannot be split: leave --tp out" if choices == [1]
               else f"choose --tp among {', '.join(map(str, choices[1:]))} (or leave it out)")
        super().__init__(f"tensor parallelism over {world_size} ranks shards whole heads, but this model has "
                         f"{named}, which {world_size} does not divide; {fix}")


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


@attrs.frozen
class Shards:
    """This process's place in a tensor-parallel group: rank in [0, world_size).

    group: the torch.distributed process group of the math collectives (None: the default group;
    ignored when world_size is 1)."""

    rank: int
    world_size: int
    group: Any = attrs.field(default=None, eq=False, repr=False)

    def range(self, n: int) -> tuple[int, int]:
        """[start, end) of this rank's share of n units: equal shares, the first n % W ranks one more."""
        return self.range_of(self.rank, n)

    def range_of(self, rank: int, n: int) -> tuple[int, int]:
        base, extra = divmod(n, self.world_size)
        start = rank * base + min(rank, extra)
        return start, start + base + (rank < extra)

    def size(self, n: int) -> int:
        start, end = self.range(n)
        return end - start

    def heads(self, **counts: int) -> dict[str, int]:
        """Each head count divided by world_size (names as given, e.g. attention=9, kv=3).
        Raises HeadsNotDivisible naming every count when one is not a multiple."""
        if any(n % self.world_size for n in counts.values()):
            raise HeadsNotDivisible(self.world_size, {f"{k.replace('_', ' ')} heads": n for k, n in counts.items()})
        return {k: n // self.world_size for k, n in counts.items()}

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed elementwise over the ranks, in place (same shape and dtype on every rank)."""
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor, total: int) -> torch.Tensor:
        """[..., total]: every rank's [..., size(total)] piece, in rank order (uneven shares padded
        for the collective, then trimmed)."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        widest = self.range_of(0, total)[1]
        padded = torch.nn.functional.pad(x, (0, widest - x.shape[-1])).contiguous()
        pieces = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(pieces, padded, group=self.group)
        sizes = [end - start for start, end in (self.range_of(r, total) for r in range(self.world_size))]
        return torch.cat([p[..., :s] for p, s in zip(pieces, sizes)], dim=-1)


def embed_vocab_rows(embed, tokens: torch.Tensor, vocab_size: int, shards: Shards) -> torch.Tensor:
    """Embedding rows fp32 [n, D] of int64 tokens [n] from this rank's vocabulary rows.

    embed: a linear [V_rank, D] read by rows (`.rows(ids)`), holding rows shards.range(vocab_size).
    Other ranks' tokens give zero rows here; the all-reduce leaves each token's own row (exact)."""
    start, end = shards.range(vocab_size)
    mine = (tokens >= start) & (tokens < end)
    rows = embed.rows(torch.where(mine, tokens - start, 0))
    return shards.all_reduce(torch.where(mine[:, None], rows, 0.0))


def gather_vocab(logits: torch.Tensor, vocab_size: int, shards: Shards) -> torch.Tensor:
    """fp32 [r, V] from this rank's [r, V_rank] LM-head columns (one all-gather)."""
    return shards.all_gather_last(logits, vocab_size)


def reduce_partial(shards: Shards | None, partial: torch.Tensor) -> torch.Tensor:
    """A row-parallel linear's fp32 [n, D] partial sum, summed over the ranks (returned as is
    when shards is None: one process)."""
    return partial if shards is None else shards.all_reduce(partial)


def shard_config(config, shards: Shards):
    """The sizes of one rank's modules: an attrs config with num_attention_heads,
    num_key_value_heads, intermediate_size and vocab_size (the dense families' names) evolved to
    H/W and Hkv/W heads and this rank's run of FFN features and vocabulary rows (Shards.range).
    Raises HeadsNotDivisible naming both head counts."""
    heads = shards.heads(attention=config.num_attention_heads, KV=config.num_key_value_heads)
    return attrs.evolve(config, num_attention_heads=heads["attention"], num_key_value_heads=heads["KV"],
                        intermediate_size=shards.size(config.intermediate_size),
                        vocab_size=shards.size(config.vocab_size))
