"""Train a DFlash1 drafter for a real trunk, from nothing, on one CPU thread, and write its GGUF.

Recipe (SpecForge's `OnlineDFlashModel`, as the reference note's errata 10 and §1 summarise it;
the model is the reference `dflash.model.DFlashDraftModel`, written by our `gguf_writer`):

1. Prompts (`make_prompts`, seeded): copy / edit / reformat tasks where the answer follows the
   context: Python functions taken from the standard library (copy, rename an identifier,
   re-indent), docstring passages (copy, copy one paragraph, uppercase a title line), and random
   records (JSON with a field bumped, key renamed, as CSV, as JSON lines). Any prompt sharing a
   line of 24+ characters with a shared benchmark scenario (verispec's bundled scenarios and
   /work/shared/scenarios) is dropped: the drafter never sees them.
2. Data (`self_generate`): the trunk's own greedy continuation of each prompt (chat template, as
   `verispec bench` sends it; EOS ignored; `--new-tokens` rows), decoded by batched
   `trunk.forward` calls that also return the taps (`Segment.tap_layers` = the drafter's GGUF
   `target_layers`, the residual entering those layers): the same trunk code path that serves the
   draft head at inference, so train and inference see the same features.
3. Training: random anchors in the response, `[anchor, MASK x (B-1)]` blocks at positions
   a..a+B-1 that see the context features strictly before a (fc + norm -> per-layer K/V) and
   their own block (non-causal, no window); row k's logits through the frozen trunk's LM head
   (the trunk's view, probed as a matrix) against the token at a+k; cross-entropy weighted
   exp(-(k-1)/gamma) (gamma 4 for B = 8, 7 for B = 16); AdamW lr 6e-4, cosine, a short warm-up.
   One CPU thread cannot afford the full 49k-row softmax per row: the training softmax runs over
   the tokens of the data plus 4096 random others (inference takes the argmax over the full head;
   the held-out check below uses the full head too).
   The trunk's embedding and head are frozen (they are not in the file: the drafter borrows them).
4. Output: the GGUF (2-D weights Q8_0, norms F32, the trunk's tokenizer keys copied), loaded
   back through the plugin's loader against the trunk; a held-out teacher-forced accept length
   (mean tokens per verify incl. the bonus, gate off) is printed for a quick check.

Run (about 35 minutes on one thread; `--minutes 4 --prompts 60` is a smoke run):

    .venv/bin/python plugins/dflash/scripts/train_drafter.py --out drafter.gguf
"""
from __future__ import annotations

import argparse
import glob
import inspect
import json
import math
import os
import random
import re
import time

import torch
import torch.nn.functional as F

# --------------------------------------------------------------------------------------------
# 1. prompts

_CODE_MODULES = ("textwrap", "shlex", "heapq", "bisect", "fnmatch", "posixpath", "colorsys", "calendar",
                 "difflib", "statistics", "base64", "string", "fractions", "ipaddress", "email.utils",
                 "urllib.parse", "html", "json.encoder", "json.decoder", "csv", "random", "pprint",
                 "tokenize", "ntpath", "glob", "shutil", "quopri", "uu", "gettext", "locale", "argparse",
                 "configparser", "dataclasses", "enum", "functools", "operator", "copy", "zipfile", "tarfile")
_NAMES = ("alpha", "beta", "gamma", "delta", "ember", "flint", "grove", "harbor", "iris", "juniper", "kestrel",
          "lumen", "maple", "nimbus", "onyx", "pebble", "quill", "raven", "sable", "thistle", "umber", "vesper",
          "willow", "yarrow", "zephyr", "acorn", "bramble", "cobalt", "dune", "fern", "garnet", "hazel")
_PLACES = ("Oslo", "Lima", "Quito", "Hanoi", "Perth", "Dakar", "Turin", "Ghent", "Split", "Malmo", "Tartu",
           "Leeds", "Cork", "Bergen", "Graz", "Lyon", "Kyoto", "Pune", "Accra", "Cusco", "Sucre", "Nantes")


def _stdlib_sources():
    """(functions' source, docstring passages) from the standard library modules above."""
    import importlib

    functions, passages = [], []
    for name in _CODE_MODULES:
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module this Python lacks
            continue
        if module.__doc__ and len(module.__doc__) > 200:
            passages.append(module.__doc__)
        for _, obj in inspect.getmembers(module, lambda o: inspect.isfunction(o) or inspect.isclass(o)):
            if getattr(obj, "__module__", None) != module.__name__:
                continue
            try:
                source = inspect.getsource(obj)
            except (OSError, TypeError):
                continue
            if inspect.isfunction(obj) and 5 <= source.count("\n") <= 30:
                functions.append(inspect.cleandoc("\n" + source) if source.startswith(" ") else source)
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 250:
                passages.append(doc)
    return functions, passages


def _records(rng):
    fields = rng.sample(["id", "name", "city", "active", "score", "level", "tag", "count"], rng.randint(3, 5))
    if "id" not in fields:
        fields[0] = "id"
    base = rng.randrange(10, 900)
    rows = []
    for i in range(rng.randint(3, 6)):
        value = {"id": base + i, "name": rng.choice(_NAMES).title(), "city": rng.choice(_PLACES),
                 "active": rng.random() < 0.5, "score": rng.randrange(10, 99), "level": rng.randrange(1, 9),
                 "tag": rng.choice(_NAMES), "count": rng.randrange(0, 500)}
        rows.append({f: value[f] for f in fields})
    return fields, rows


def _code_task(rng, functions):
    code = rng.choice(functions).rstrip() + "\n"
    words = sorted(set(re.findall(r"\b[a-z_][a-z0-9_]{3,}\b", code)) - {"self", "return", "None", "True", "False"})
    kind = rng.randrange(4)
    fence = f"```python\n{code}```"
    if kind == 0 and words:
        old, new = rng.choice(words), rng.choice(_NAMES) + "_" + rng.choice(_NAMES)
        return f"{rng.choice(['Python code:', 'Here is a function:', 'Source:'])}\n\n{fence}\n\n" \
               f"Rewrite it with `{old}` renamed to `{new}` everywhere:\n\n```python\n"
    if kind == 1:
        return f"{fence}\n\nRepeat this code exactly, character for character:\n\n```python\n"
    if kind == 2:
        return f"Code:\n{fence}\n\nThe same code indented with two spaces per level instead of four:\n\n```python\n"
    return f"{fence}\n\nCopy the function above, adding a comment line `# reviewed` before it:\n\n```python\n"


def _text_task(rng, passages):
    text = rng.choice(passages).strip()
    paragraphs = [p for p in text.split("\n\n") if len(p) > 80]
    kind = rng.randrange(3)
    if kind == 0 or not paragraphs:
        return f"Text:\n{text[:1200]}\n\nReproduce the text above verbatim:\n\n"
    if kind == 1:
        return f"Document:\n{text[:1200]}\n\nQuote the first paragraph exactly, then stop:\n\n"
    return f"{text[:1200]}\n\nRepeat the passage above word for word, as plain text:\n\n"


def _records_task(rng):
    fields, rows = _records(rng)
    shown = json.dumps(rows, indent=rng.choice([1, 2]))
    kind = rng.randrange(4)
    if kind == 0:
        f = rng.choice([x for x in fields if x in ("score", "level", "count")] or ["id"])
        k = rng.randint(1, 5)
        return f"Records:\n{shown}\n\nThe same records as JSON with every {f} increased by {k}:\n["
    if kind == 1:
        f = rng.choice(fields[1:] or fields)
        new = rng.choice(["label", "value", "place", "flag", "rank"])
        return f"Data:\n{shown}\n\nRewrite the JSON with the key \"{f}\" renamed to \"{new}\":\n["
    if kind == 2:
        return f"{shown}\n\nConvert these records to CSV with a header row ({','.join(fields)}):\n"
    return f"Input:\n{shown}\n\nWrite each record as one line of JSON (JSON Lines), in the same order:\n"


def _scenario_lines():
    here = os.path.dirname(os.path.abspath(__file__))
    roots = [os.path.join(here, "..", "..", "..", "core", "src", "verispec", "scenarios"), "/work/shared/scenarios"]
    lines = set()
    for path in sorted(p for r in roots for p in glob.glob(os.path.join(r, "*.json"))):
        s = json.load(open(path))
        for text in [s.get("prompt", "")] + list(s.get("turns", [])):
            lines.update(x.strip() for x in text.splitlines() if len(x.strip()) >= 24)
    return lines


def make_prompts(n: int, seed: int = 0) -> list[str]:
    """n prompts: code 45 %, text 25 %, records 30 %; none shares a 24+ character line with a scenario."""
    rng = random.Random(seed)
    functions, passages = _stdlib_sources()
    banned = _scenario_lines()
    out = []
    while len(out) < n:
        r = rng.random()
        p = _code_task(rng, functions) if r < 0.45 else _text_task(rng, passages) if r < 0.7 else _records_task(rng)
        if not any(x.strip() in banned for x in p.splitlines()):
            out.append(p)
    return out


# --------------------------------------------------------------------------------------------
# 2. the trunk's own greedy continuations, with its taps


@torch.no_grad()
def self_generate(engine, prompts, taps, new_tokens, batch=8, max_prompt=480, log=print):
    """[(ids int64 [L], taps fp16 [L, T*H], response start)] for each prompt (too-long ones skipped)."""
    from verispec.seams import Segment

    trunk = engine.trunk
    data, t0 = [], time.time()
    todo = [engine.encode([{"role": "user", "content": p}], chat=True) for p in prompts]
    todo = [ids for ids in todo if len(ids) <= max_prompt]
    for start in range(0, len(todo), batch):
        group = todo[start:start + batch]
        seqs = [trunk.new_sequence() for _ in group]
        ids = [list(g) for g in group]
        rows = [[] for _ in group]
        outs = trunk.forward([Segment(s, g, logits="last", hidden=True, tap_layers=taps) for s, g in zip(seqs, group)])
        for _ in range(new_tokens):
            for i, o in enumerate(outs):
                rows[i].append(o.hidden.half())
                ids[i].append(int(o.logits[-1].argmax()))
            outs = trunk.forward([Segment(s, [x[-1]], logits="last", hidden=True, tap_layers=taps)
                                  for s, x in zip(seqs, ids)])
        for i, s in enumerate(seqs):
            rows[i].append(outs[i].hidden.half())  # the last token's taps (context for nothing, kept for shape)
            trunk.release(s)
            data.append((torch.tensor(ids[i]), torch.cat(rows[i]), len(group[i])))
        log(f"  generated {len(data)}/{len(todo)} ({sum(len(d[0]) - d[2] for d in data)} new tokens, "
            f"{time.time() - t0:.0f} s)")
    return data


# --------------------------------------------------------------------------------------------
# 3. training


def build_drafter(trunk, taps_hf, block_size, mask_id, layers, ffn):
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config

    H = trunk.hidden_size
    config = Qwen3Config(
        vocab_size=trunk.vocab_size, hidden_size=H, intermediate_size=ffn,
        num_hidden_layers=layers, num_attention_heads=9 if H % 9 == 0 else 8, num_key_value_heads=3 if H % 9 == 0 else 2,
        head_dim=64, rms_norm_eps=1e-6, max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, attention_bias=False,
        layer_types=["full_attention"] * layers, num_target_layers=trunk.num_layers,
        dflash_config={"target_layer_ids": list(taps_hf), "block_size": block_size, "mask_token_id": mask_id})
    config.is_causal = False
    torch.manual_seed(0)
    return DFlashDraftModel(config).float()


def block_batch(ids, feats, starts, anchors, B, mask_id):
    """Reference forward inputs for blocks at `anchors` of one sequence: (noise ids [m*B], position_ids
    [1, L + m*B], bool mask [1, 1, m*B, L + m*B], targets [m, B-1])."""
    L, m = len(ids), len(anchors)
    a = torch.tensor(anchors)
    k = torch.arange(B)
    block_pos = (a[:, None] + k[None]).reshape(-1)
    noise = torch.full((m, B), mask_id)
    noise[:, 0] = ids[a]
    ctx_visible = torch.arange(L)[None, :] < a.repeat_interleave(B)[:, None]  # strictly before the anchor
    block_of = torch.arange(m).repeat_interleave(B)
    own = block_of[:, None] == block_of[None, :]
    mask = torch.cat([ctx_visible, own], dim=1)[None, None]
    positions = torch.cat([torch.arange(L), block_pos])[None]
    targets = ids[(a[:, None] + k[None, 1:])]
    return noise.reshape(-1), positions, mask, targets


def block_loss(model, embed, head, sample, anchors, B, mask_id, gamma, vocab=None):
    """Weighted block cross-entropy and accepted drafts per block. vocab: token ids int64 [V'] the softmax
    runs over (training: the data's tokens plus random others; None: the full head)."""
    ids, feats, start = sample
    noise, positions, mask, targets = block_batch(ids, feats, start, anchors, B, mask_id)
    z = model(position_ids=positions, attention_mask=mask, noise_embedding=embed[noise][None],
              target_hidden=feats.float()[None])[0]
    z = z.reshape(len(anchors), B, -1)[:, 1:]
    if vocab is not None:
        head = head[vocab]
        targets = torch.searchsorted(vocab, targets)  # vocab is sorted and holds every target
    logits = z @ head.T  # [m, B-1, V']
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    w = torch.exp(-torch.arange(B - 1) / gamma)
    loss = (ce.reshape(len(anchors), B - 1) * w).sum() / (w.sum() * len(anchors))
    hit = (logits.argmax(-1) == targets).int()
    accepted = hit.cumprod(dim=1).sum(dim=1).float()  # drafts accepted per block (gate off)
    return loss, accepted


def pick_anchors(sample, B, m, rng):
    ids, _, start = sample
    last = len(ids) - B
    if last < start:
        return []
    pool = list(range(start, last + 1))
    return sorted(rng.sample(pool, min(m, len(pool))))


@torch.no_grad()
def held_out_tau(model, embed, head, data, B, mask_id, gamma):
    """Mean tokens per verify (accepted drafts + 1) over every block of the held-out sequences, teacher-forced."""
    total, n = 0.0, 0
    for sample in data:
        anchors = list(range(sample[2], len(sample[0]) - B + 1, 2))
        for i in range(0, len(anchors), 32):
            _, acc = block_loss(model, embed, head, sample, anchors[i:i + 32], B, mask_id, gamma)
            total, n = total + float(acc.sum()) + len(acc), n + len(acc)
    return total / max(n, 1)


# --------------------------------------------------------------------------------------------
# 4. main


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=400)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--gen-minutes", type=float, default=12.0, help="stop generating after this long")
    ap.add_argument("--minutes", type=float, default=18.0, help="training time")
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--ffn", type=int, default=1536, help="drafter FFN width")
    ap.add_argument("--anchors", type=int, default=24, help="blocks per sequence per step")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--negatives", type=int, default=4096, help="random tokens added to the training softmax")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--f32", action="store_true", help="write F32 weights instead of Q8_0")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    t_start = time.time()

    import verispec
    from dflash.model import build_target_layer_ids
    from verispec.gguf.io import GGUFFile
    from verispec.model_files import resolve_model_path
    from verispec.registry import Registry
    from verispec_dflash.gguf_writer import write_dflash_gguf
    from verispec_dflash.loader import load as load_drafter

    engine = verispec.load(args.model, threads=1, enabled=False)
    trunk = engine.trunk
    taps_hf = build_target_layer_ids(trunk.num_layers, 3)  # 3 taps (z-lab's rule): HF ids, GGUF +1
    taps = tuple(t + 1 for t in taps_hf)
    gguf = GGUFFile.open(resolve_model_path(args.model, Registry.discover()))
    tokens = gguf.get("tokenizer.ggml.tokens")
    mask_id = next(i for i, t in enumerate(tokens) if t in ("<empty_output>", "<reponame>", "<|mask|>")) \
        if any(t in ("<empty_output>", "<reponame>", "<|mask|>") for t in tokens) else len(tokens) - 1
    print(f"trunk {args.model}: {trunk.num_layers} layers, H {trunk.hidden_size}, V {trunk.vocab_size}; "
          f"taps {taps}; mask {mask_id} {tokens[mask_id]!r}")

    prompts = make_prompts(args.prompts, args.seed)
    print(f"{len(prompts)} prompts; generating (stops after {args.gen_minutes} min)")
    data, t_gen = [], time.time()
    for i in range(0, len(prompts), 16):
        data += self_generate(engine, prompts[i:i + 16], taps, args.new_tokens)
        if time.time() - t_gen > 60 * args.gen_minutes:
            break
    rng.shuffle(data)
    held = data[:max(2, len(data) // 20)]
    train = data[len(held):]
    print(f"data: {len(train)} train / {len(held)} held-out sequences, "
          f"{sum(len(d[0]) - d[2] for d in train)} train response tokens, {time.time() - t_gen:.0f} s")

    view = trunk.view()
    with torch.no_grad():
        embed = view.embed(torch.arange(trunk.vocab_size)).float()
        head = view.logits(torch.eye(trunk.hidden_size)).float().T.contiguous()  # [V, H], the LM head as a matrix
    B, gamma = args.block_size, 7.0 if args.block_size >= 16 else 4.0
    model = build_drafter(trunk, taps_hf, B, mask_id, args.layers, args.ffn)
    with torch.no_grad():  # start with logits of unit scale (the drafter's final norm feeds the trunk's head)
        model.norm.weight.fill_(1.0 / float(head.norm(dim=1).mean()))
    seen = torch.unique(torch.cat([d[0] for d in data]))
    others = torch.randperm(trunk.vocab_size)[:args.negatives]
    vocab = torch.unique(torch.cat([seen, others]))
    print(f"training softmax over {len(vocab)} tokens ({len(seen)} in the data, {args.negatives} random)")
    print(f"drafter: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, B {B}, gamma {gamma}")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    budget, t_train, step, ema = 60 * args.minutes, time.time(), 0, None
    model.train()
    while (elapsed := time.time() - t_train) < budget:
        frac = elapsed / budget
        lr = args.lr * min(1.0, (step + 1) / 30) * 0.5 * (1 + math.cos(math.pi * frac))
        for group in opt.param_groups:
            group["lr"] = lr
        sample = rng.choice(train)
        anchors = pick_anchors(sample, B, args.anchors, rng)
        if not anchors:
            continue
        loss, acc = block_loss(model, embed, head, sample, anchors, B, mask_id, gamma, vocab)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tau = float(acc.mean()) + 1
        ema = (loss.item(), tau) if ema is None else (0.98 * ema[0] + 0.02 * loss.item(), 0.98 * ema[1] + 0.02 * tau)
        if step % 50 == 0:
            print(f"  step {step} {elapsed:.0f} s lr {lr:.2e} loss {ema[0]:.3f} train tau {ema[1]:.2f}", flush=True)
        step += 1
    model.eval()
    print(f"trained {step} steps in {time.time() - t_train:.0f} s; held-out teacher-forced tau "
          f"{held_out_tau(model, embed, head, held, B, mask_id, gamma):.2f}")

    vocab = {k: v for k, v in gguf.metadata.items() if k.startswith("tokenizer.") and k != "tokenizer.chat_template"}
    path = write_dflash_gguf(args.out, model, vocab=vocab, quantize=None if args.f32 else "Q8_0",
                             extra_metadata={"general.name": f"DFlash drafter for {args.model} (train_drafter.py)"})
    load_drafter(path, trunk)  # binds to the trunk, or raises naming why
    print(f"wrote {path} ({os.path.getsize(path) / 1e6:.1f} MB); total {(time.time() - t_start) / 60:.1f} min")


if __name__ == "__main__":
    main()
