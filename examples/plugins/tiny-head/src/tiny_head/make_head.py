"""Fit a tiny-head for a model and write its GGUF:

    python -m tiny_head.make_head MODEL(.gguf|alias) head.gguf [--text FILE]

The head learns, by ridge regression over the model's own final-normed rows of a text, the
row at p from the row at p-1 and the token at p: W = argmin Σ_p |W [h_{p-1}; e(t_p)] - h_p|²
+ λ|W|². Seconds on a small model; the text should look like what the head will draft for.
"""
from __future__ import annotations

import argparse

import torch

from verispec.seams import Segment

from tiny_head.head import HIDDEN_KEY, VOCAB_KEY, WEIGHT

#: the default training text: repetitive, like the quoting a drafter pays off on.
DEFAULT_TEXT = ("Shall I compare thee to a summer's day?\nThou art more lovely and more temperate:\n"
                "Rough winds do shake the darling buds of May,\nAnd summer's lease hath all too short a date;\n") * 8


def fit_head(trunk, tokens: list[int], ridge: float = 1e-3) -> torch.Tensor:
    """W fp32 [D, 2D] from one teacher-forced pass of `tokens` through `trunk`."""
    view = trunk.view()
    seq = trunk.new_sequence()
    rows = []
    for start in range(0, len(tokens), 256):  # a prefill in chunks; hidden rows [n, D], final-normed
        chunk = tokens[start:start + 256]
        rows.append(trunk.forward([Segment(seq, chunk, logits="none", hidden=True)])[0].hidden)
    trunk.release(seq)
    h = torch.cat(rows).double()  # [n, D]
    x = torch.cat([h[:-1], view.embed(torch.tensor(tokens[1:])).double()], dim=1)  # [n-1, 2D]
    y = h[1:]  # [n-1, D]
    gram = x.T @ x + ridge * len(x) * torch.eye(x.shape[1], dtype=torch.float64)
    return torch.linalg.solve(gram, x.T @ y).T.float()  # [D, 2D]


def write_head(path: str, weight: torch.Tensor, vocab_size: int) -> str:
    import gguf

    writer = gguf.GGUFWriter(path, "tiny-head")  # sets general.architecture = "tiny-head"
    writer.add_uint32(HIDDEN_KEY, weight.shape[0])
    writer.add_uint32(VOCAB_KEY, vocab_size)
    writer.add_tensor(WEIGHT, weight.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tiny_head.make_head", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="the model's GGUF path or checkpoint alias (what --model takes)")
    parser.add_argument("out", help="the head file to write (pass it to --draft-model)")
    parser.add_argument("--text", help="a UTF-8 text file to fit on (default: a few quoted lines)")
    args = parser.parse_args(argv)
    import verispec

    engine = verispec.load(args.model, enabled=False)  # the trunk alone: no speculator chosen
    text = open(args.text, encoding="utf-8").read() if args.text else DEFAULT_TEXT
    tokens = engine.tokenizer.encode(text)
    weight = fit_head(engine.trunk, tokens)
    print(write_head(args.out, weight, engine.trunk.vocab_size), f"fitted on {len(tokens)} tokens")


if __name__ == "__main__":
    main()
