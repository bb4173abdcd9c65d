"""Greedy and seeded sampling keyed by (seed, position) (docs/design.md §5).

Shape letters: V vocabulary, m tokens kept by the filters.

Speculation must not change a seeded stream. So there is no stateful RNG: the token at
absolute position `pos` is drawn with one uniform `u = keyed_uniform(seed, pos)`, a pure
function of (seed, pos). Plain decoding draws row `pos` once; the loop verifying
`[last, d1..dK]` draws row `pos + i` only after accepting `d1..di` (each one `accept`ed), so
both consume identical randomness, and a rejected row's draw is simply never made.

Processing of one row of fp32 logits, in this order:
  1. penalties over what has been emitted so far (`accept`), in vLLM's order
     (vllm/model_executor/layers/utils.py `apply_penalties`):
     repetition (HF `RepetitionPenaltyLogitsProcessor`, CTRL arXiv 1909.05858) over the whole
     context, prompt + output, as HF generate does (its input_ids hold both);
     frequency and presence (OpenAI API) over the output only:
     `logit -= frequency_penalty * count + presence_penalty * (count > 0)`;
  2. temperature; `temperature < 1e-5` is greedy: argmax, ties -> lowest id
     (vLLM's `_SAMPLING_EPS`; also keeps `logits / T` finite);
  3. top-k, 4. top-p, 5. min-p, each on the distribution the previous step left, as HF
     generate chains them (transformers `GenerationMixin._get_logits_processor`:
     temperature, top-k, top-p, min-p). vLLM v1 applies min-p before top-k/top-p; we follow HF.
  6. draw: inverse CDF of `u` over the kept tokens in ascending token-id order, in float64.

Logprobs (`SamplingParams.logprobs`) are "processed": the log-probabilities of the very
distribution the token was drawn from (after penalties, temperature and filters; a filtered
token has none), like vLLM's `processed_logprobs`. A greedy draw is a point mass, so its
logprobs are those of the penalised logits at temperature 1 with no filters (what vLLM
returns for a greedy request).
"""
from __future__ import annotations

import math
import operator
import secrets
from collections.abc import Sequence

import attrs
import torch

from verispec.errors import InvalidArgument

_MASK64 = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment, 2^64 / golden ratio (odd)
#: temperatures below this are greedy; vLLM v1 sampler's `_SAMPLING_EPS`.
GREEDY_TEMPERATURE = 1e-5


def mix64(z: int) -> int:
    """SplitMix64's output finaliser: a bijection on 64-bit integers.

    Source: Steele, Lea, Flood, "Fast splittable pseudorandom number generators" (OOPSLA 2014);
    constants from Vigna's splitmix64.c (prng.di.unimi.it).
    """
    z &= _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def keyed_uniform(seed: int, pos: int) -> float:
    """The uniform in [0, 1) that draws the token at absolute position `pos` under `seed`.

    It is output number `pos` of a SplitMix64 generator whose state starts at `mix64(seed)`
    (pre-mixing the seed decorrelates nearby seeds); its top 53 bits make a float64 multiple
    of 2^-53. Pure integer arithmetic: no RNG state, same value in any process or call order.
    """
    state = (mix64(operator.index(seed)) + (operator.index(pos) + 1) * _GOLDEN_GAMMA) & _MASK64
    return (mix64(state) >> 11) * 2.0**-53


def _field_error(name: str, value, allowed: str) -> ValueError:
    error = InvalidArgument(f"SamplingParams.{name}={value!r}: {allowed}")
    error.param = name  # the field, spelled as OpenAI's request field (the server's error `param`)
    return error


def _float_in(name: str, lo: float, hi: float, *, lo_open=False, hi_open=False, hint=""):
    """attrs validator: a finite float in the stated interval (the message shows the interval)."""
    interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"

    def check(inst, attribute, value):
        inside = (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
        if not (math.isfinite(value) and inside):
            raise _field_error(name, value, f"must be in {interval}{hint}")
    return check


def _int_at_least(name: str, lo: int, *, optional=False, hint=""):
    def check(inst, attribute, value):
        if optional and value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise _field_error(name, value, f"must be an integer >= {lo}{hint}")
    return check


def _check_seed(inst, attribute, value):
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise _field_error("seed", value, "must be an integer (used modulo 2^64) or None for a random one")


@attrs.frozen
class SamplingParams:
    """How one request draws its tokens; validated at construction (ValueError names the field)."""

    #: 0 (anything below GREEDY_TEMPERATURE) is greedy: argmax, ties -> lowest token id.
    temperature: float = attrs.field(default=0.0, converter=float,
                                     validator=_float_in("temperature", 0.0, math.inf, hi_open=True,
                                                         hint="; use 0 for greedy"))
    #: keep the k most likely tokens (and any tied with the k-th, as HF does); 0 = off.
    top_k: int = attrs.field(default=0, validator=_int_at_least("top_k", 0, hint="; use 0 to disable"))
    #: keep the most likely tokens until their mass reaches top_p; 1 = off.
    top_p: float = attrs.field(default=1.0, converter=float,
                               validator=_float_in("top_p", 0.0, 1.0, lo_open=True, hint="; use 1 to disable"))
    #: drop tokens less likely than min_p * (the most likely token's probability); 0 = off.
    min_p: float = attrs.field(default=0.0, converter=float,
                               validator=_float_in("min_p", 0.0, 1.0, hint="; use 0 to disable"))
    #: HF/CTRL: divide a positive logit, multiply a negative one, for tokens in prompt + output.
    repetition_penalty: float = attrs.field(
        default=1.0, converter=float,
        validator=_float_in("repetition_penalty", 0.0, math.inf, lo_open=True, hi_open=True,
                            hint="; use 1 to disable"))
    #: OpenAI: logit -= frequency_penalty * (times the token was emitted).
    frequency_penalty: float = attrs.field(default=0.0, converter=float,
                                           validator=_float_in("frequency_penalty", -2.0, 2.0))
    #: OpenAI: logit -= presence_penalty if the token was emitted at all.
    presence_penalty: float = attrs.field(default=0.0, converter=float,
                                          validator=_float_in("presence_penalty", -2.0, 2.0))
    #: None: a random 64-bit seed chosen once per request (draws are still keyed by position).
    seed: int | None = attrs.field(default=None, validator=_check_seed)
    #: None: off; N: each Draw carries the chosen token's logprob and the N most likely tokens.
    logprobs: int | None = attrs.field(default=None, validator=_int_at_least("logprobs", 0, optional=True,
                                                                             hint=" or None"))

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


@attrs.frozen
class Draw:
    """One drawn token and, when `SamplingParams.logprobs` is set, its processed logprobs."""

    token: int
    #: natural log of the chosen token's probability (see the module docstring); None when off.
    logprob: float | None = None
    #: (token, logprob) of the N most likely tokens, most likely first, ties by lower id.
    top_logprobs: tuple[tuple[int, float], ...] = ()


class InvalidLogits(ValueError):
    """A logits row has the wrong shape, a NaN, or nothing drawable."""

    def __init__(self, pos: int, problem: str):
        self.pos = pos
        self.problem = problem
        super().__init__(f"logits for position {pos}: {problem}; the trunk produced an unusable row")


class Sampler:
    """Draws one request's tokens, each from its own (seed, pos) key; owns its penalty counts.

    Protocol: `draw(logits, pos)` (or `sample`) for every row the loop needs, then
    `accept(token)` for every token that is emitted, in order, inside an accepted window too.
    A drawn-but-rejected row is never accepted, so it leaves no trace.
    """

    def __init__(self, params: SamplingParams, prompt_tokens: Sequence[int], vocab_size: int):
        """prompt_tokens: the context before the first drawn token (counts for repetition_penalty).

        vocab_size: V, the length of every logits row. Raises ValueError on a token id outside [0, V).
        """
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise InvalidArgument(
                f"vocab_size={vocab_size!r}: give the trunk's logits width, an integer >= 1")
        self.params = params
        self.vocab_size = vocab_size
        #: the seed actually used (params.seed modulo 2^64, or the random one); report it to replay.
        self.seed = secrets.randbits(64) if params.seed is None else params.seed & _MASK64
        prompt = torch.as_tensor(list(prompt_tokens), dtype=torch.int64)  # [n_prompt]
        if prompt.numel() and (int(prompt.min()) < 0 or int(prompt.max()) >= vocab_size):
            raise InvalidArgument(f"prompt_tokens hold ids outside [0, {vocab_size}); "
                             "give the token ids of the trunk's vocabulary")
        self._output_counts: dict[int, int] = {}
        # bool [V]: tokens anywhere in the context (repetition penalty), or None when unused.
        self._in_context = None
        # fp32 [V]: frequency_penalty * count + presence_penalty * (count > 0), or None when unused.
        self._penalty_offset = None
        if params.repetition_penalty != 1.0:
            self._in_context = torch.zeros(vocab_size, dtype=torch.bool)
            self._in_context[prompt] = True
        if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
            self._penalty_offset = torch.zeros(vocab_size, dtype=torch.float32)

    def accept(self, token: int) -> None:
        """Record an emitted token: it now counts for every penalty of later draws."""
        token = operator.index(token)  # an int, or a 0-d integer tensor
        if not 0 <= token < self.vocab_size:
            raise ValueError(f"accept({token!r}): token ids lie in [0, {self.vocab_size})")
        count = self._output_counts.get(token, 0) + 1
        self._output_counts[token] = count
        if self._in_context is not None:
            self._in_context[token] = True
        if self._penalty_offset is not None:
            p = self.params
            self._penalty_offset[token] = p.frequency_penalty * count + p.presence_penalty

    def sample(self, logits: torch.Tensor, pos: int) -> int:
        """The token for absolute position `pos`; see `draw`."""
        return self.draw(logits, pos).token

    def draw(self, logits: torch.Tensor, pos: int) -> Draw:
        """Draw the token at absolute position `pos` from one row of logits.

        logits: float [V] (fp32 expected; others are promoted), any device. Penalties use the
        tokens accepted so far. Same (seed, pos, logits, accepted tokens) -> same Draw.
        Raises InvalidLogits on a wrong shape, a NaN, or a row with no finite logit.
        """
        if logits.shape != (self.vocab_size,):
            raise InvalidLogits(pos, f"shape {tuple(logits.shape)}, expected ({self.vocab_size},)")
        x = self._penalised(logits.float())  # fp32 [V]
        if self.params.is_greedy:  # every filter keeps the argmax, so greedy skips them
            return self._draw_greedy(x, pos)
        ids, kept, top = self._filtered(x / self.params.temperature, pos)  # [m] | None, fp32 [m]
        shifted = kept.double() - top  # float64 [m], max 0
        cdf = torch.cumsum(torch.exp(shifted), dim=0)  # float64 [m], unnormalised
        total = cdf[-1]
        u = keyed_uniform(self.seed, pos)
        i = int(torch.searchsorted(cdf, u * total, right=True))
        # u < 1, yet u * total can round up to total: then take the last token with mass.
        i = min(i, int(torch.searchsorted(cdf, total)))
        token = i if ids is None else int(ids[i])
        if self.params.logprobs is None:
            return Draw(token)
        logp = shifted - torch.log(total)  # float64 [m]
        order = torch.sort(logp, descending=True, stable=True).indices[: self.params.logprobs]
        top_logprobs = tuple((j if ids is None else int(ids[j]), float(logp[j])) for j in order.tolist())
        return Draw(token, float(logp[i]), top_logprobs)

    def _draw_greedy(self, x: torch.Tensor, pos: int) -> Draw:
        value, index = torch.max(x, dim=0)  # ties -> first maximum, i.e. the lowest id; NaN wins
        if not math.isfinite(float(value)):
            raise InvalidLogits(pos, f"max logit after penalties is {float(value)}")
        token = int(index)
        if self.params.logprobs is None:
            return Draw(token)
        logp = torch.log_softmax(x.double(), dim=0)  # float64 [V]
        values, indices = torch.topk(logp, min(self.params.logprobs, self.vocab_size))
        top_logprobs = tuple(sorted(zip(indices.tolist(), values.tolist()), key=lambda t: (-t[1], t[0])))
        return Draw(token, float(logp[token]), top_logprobs)

    def _penalised(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 [V] -> fp32 [V]: repetition, then frequency + presence (vLLM `apply_penalties`)."""
        if self._in_context is not None:
            self._in_context = self._in_context.to(x.device)  # follows the logits once, then a no-op
            rp = self.params.repetition_penalty
            x = torch.where(self._in_context, torch.where(x > 0, x / rp, x * rp), x)
        if self._penalty_offset is not None:
            self._penalty_offset = self._penalty_offset.to(x.device)
            x = x - self._penalty_offset
        return x

    def _filtered(self, y: torch.Tensor, pos: int) -> tuple[torch.Tensor | None, torch.Tensor, float]:
        """top-k -> top-p -> min-p on the tempered logits y, fp32 [V].

        Returns the kept ids, int64 [m] ascending (None: all V kept), their logits fp32 [m],
        and the largest logit (always kept).
        """
        p = self.params
        top = float(y.max())  # NaN-propagating
        if not math.isfinite(top):
            raise InvalidLogits(pos, f"max logit after penalties and temperature is {top}")
        ids, kept = None, y
        if 0 < p.top_k < self.vocab_size:
            values, indices = torch.topk(y, p.top_k + 1)  # sorted, descending
            if values[-1] < values[-2]:
                ids = torch.sort(indices[:-1]).values
            else:  # a tie with the k-th survives, as in HF TopKLogitsWarper (drops scores < k-th)
                ids = torch.nonzero(y >= values[-2]).squeeze(1)
            kept = y[ids]
        if p.top_p < 1.0:
            ids, kept = _keep(ids, kept, _nucleus(kept, p.top_p))
        if p.min_p > 0.0:
            # p_i >= min_p * p_max  <=>  y_i - y_max >= log(min_p) (HF MinPLogitsWarper, in logit space)
            ids, kept = _keep(ids, kept, torch.nonzero(kept.double() - top >= math.log(p.min_p)).squeeze(1))
        return ids, kept, top


def _keep(ids: torch.Tensor | None, kept: torch.Tensor, where: torch.Tensor):
    """Restrict (ids [m] | None meaning arange, kept [m]) to the ascending positions `where` [m']."""
    return (where if ids is None else ids[where]), kept[where]


def _nucleus(y: torch.Tensor, top_p: float) -> torch.Tensor:
    """Ascending positions in y [m] of the top-p nucleus.

    Walking tokens from most to least likely (ties: lower position first), a token is kept
    while the mass before it is < top_p, so the most likely token always is; this is HF
    TopPLogitsWarper's set (it drops tokens whose ascending cumulative mass is <= 1 - top_p).
    Instead of sorting all m tokens, grow a top-n set until its mass reaches top_p: every
    token outside it is less likely than all inside, so it has >= top_p mass before it.
    """
    y64 = y.double()
    log_total = torch.logsumexp(y64, dim=0)
    inside = torch.arange(y.numel(), device=y.device)  # [m]
    n = 256
    while n < y.numel():
        threshold = torch.topk(y, n).values[-1]
        top_n = torch.nonzero(y >= threshold).squeeze(1)  # [n'], n' >= n with ties, ascending
        if float(torch.logsumexp(y64[top_n], dim=0) - log_total) >= math.log(top_p):
            inside = top_n
            break
        n *= 4
    order = inside[torch.sort(y[inside], descending=True, stable=True).indices]  # most likely first
    probs = torch.exp(y64[order] - log_total)
    keep = torch.cumsum(probs, dim=0) - probs < top_p
    keep[0] = True
    return torch.sort(order[keep]).values
