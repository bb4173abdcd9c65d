"""Perplexity as llama.cpp's `llama-perplexity` scores it, ours and its, for cross-checks of a
family's math against llama.cpp's own loader and graph on the same GGUF fixture.

llama-perplexity (tools/perplexity: `perplexity()`) cuts the tokenized text into chunks of
`n_ctx` tokens, replaces each chunk's first token by BOS when the vocabulary adds one, runs each
chunk as a fresh sequence and scores only the second half: the log-probability of token k + 1
from row k, k = n_ctx/2 .. n_ctx − 2. `our_perplexity` applies the same rule to a trunk's fp32
logits; `llama_cpp_perplexity` runs the binary with an fp32 KV cache and flash attention off:
its CPU flash-attention kernel (on by default, `-fa auto`) rounds even an fp32 cache's rows
(measured on a tiny glm4moe: 428.2185 with it, 428.2463 without; ours 428.2462).

`run_llama_cpp` runs any llama.cpp tool for such a cross-check (also the eagle3 plugin's): its
logger writes from a worker thread that the process does not wait for at exit (common/log.cpp:
the logger is leaked on purpose), so a run can end with its last lines unwritten. The output goes
to a file (which loses less than a pipe) and a run whose output lacks what the caller needs is
repeated.
"""
from __future__ import annotations

import math
import re
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

#: a text whose repetitions give a tiny model's perplexity something to learn within a chunk
TEXT = " ".join(["the cat sat on the mat and then the dog ran to the park with a ball"] * 12) + "\n"


def our_perplexity(trunk, text: str = TEXT, n_ctx: int = 64) -> float:
    """exp(mean NLL) over every chunk's second half, llama-perplexity's rule, from `trunk`'s logits
    (computed in float64 from the fp32 rows). Raises ValueError when the text is under one chunk."""
    import torch
    from verispec.seams import Segment

    ids = trunk.tokenizer.encode(text)
    if len(ids) < n_ctx:
        raise ValueError(f"{len(ids)} tokens of text is less than one chunk of {n_ctx}")
    nll, count = 0.0, 0
    for start in range(0, len(ids) // n_ctx * n_ctx, n_ctx):
        chunk = ids[start:start + n_ctx]
        if trunk.tokenizer.add_bos:
            chunk[0] = trunk.tokenizer.bos_id
        seq = trunk.new_sequence()
        logits = trunk.forward([Segment(seq, torch.tensor(chunk), logits="all")])[0].logits.double()
        trunk.release(seq)
        logprobs = torch.log_softmax(logits, dim=-1)
        for k in range(n_ctx // 2, n_ctx - 1):
            nll -= float(logprobs[k, chunk[k + 1]])
            count += 1
    return math.exp(nll / count)


def run_llama_cpp(binary: str | Path, args: Sequence[str], log_file: str | Path, *,
                  complete: Callable[[str], bool], attempts: int, timeout: float = 300) -> tuple[int, str]:
    """(exit status, output) of `binary args`, stdout and stderr written to `log_file`: the first
    run whose output is `complete`, or one that exited non-zero (a failure, not lost lines), else
    the last of `attempts` runs (module docstring: why a run can lose its last lines)."""
    for _ in range(attempts):
        with open(log_file, "w") as out:
            done = subprocess.run([str(binary), *map(str, args)], stdout=out, stderr=subprocess.STDOUT,
                                  timeout=timeout)
        output = Path(log_file).read_text()
        if done.returncode != 0 or complete(output):
            break
    return done.returncode, output


def _printed_perplexity(output: str) -> float | None:
    """llama-perplexity's "Final estimate", or else its running value after the last chunk (`[N]ppl`
    with N the chunk count it announced: the same exp(mean NLL), printed one line earlier); None
    when the output holds neither."""
    if found := re.search(r"Final estimate: PPL = ([0-9.]+)", output):
        return float(found.group(1))
    chunks = re.search(r"calculating perplexity over (\d+) chunks", output)
    if chunks and (last := re.search(rf"\[{chunks.group(1)}\]([0-9.]+),", output)):
        return float(last.group(1))
    return None


def llama_cpp_perplexity(binary: str | Path, model_path: str | Path, workdir: str | Path, *, text: str = TEXT,
                         n_ctx: int = 64, attempts: int = 4) -> float:
    """llama-perplexity's perplexity of `model_path` (one thread, batch = n_ctx, fp32 KV, no flash
    attention), as `_printed_perplexity` reads it from the output; `attempts` runs at most
    (`run_llama_cpp`). Raises AssertionError with the tail of its output when no run gives one."""
    text_file = Path(workdir) / "perplexity.txt"
    text_file.write_text(text)
    status, output = run_llama_cpp(binary, ["-m", model_path, "-f", text_file, "-c", n_ctx, "-b", n_ctx, "-t", 1,
                                            "-ctk", "f32", "-ctv", "f32", "-fa", "off"],
                                   Path(workdir) / "perplexity.log",
                                   complete=lambda out: _printed_perplexity(out) is not None, attempts=attempts)
    if status == 0 and (ppl := _printed_perplexity(output)) is not None:
        return ppl
    raise AssertionError(f"llama-perplexity exit {status}: " + output[-3000:])
