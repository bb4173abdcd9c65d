"""The GPU path's device check, in one go: run it on a machine with a CUDA GPU.

    python benchmarks/gpu_check.py --model smollm2-135m-instruct [--model qwen2.5-coder-1.5b-instruct --model gemma3-270m ...] [--tokens 64]
    python benchmarks/gpu_check.py --dry-run     # here, on the CPU: the same steps, Triton interpreted

Steps (each one's result, or the error it raised, goes into the JSON printed last, and --out):
1. kernels: the Triton kernels' tests on the device (pytest with TRITON_INTERPRET=0: bitwise their
   PyTorch statements, batch-invariant at 1..17 rows and mixed sequences): core/tests/test_triton_
   {qmatmul,attend,norm,glu}.py, models/qwen35/tests/test_triton_delta_rule.py,
   models/glm5/tests/test_triton_kda.py.
2. per --model (a GGUF path or a checkpoint alias; llama/qwen2, gemma3 or qwen35 files), loaded with
   `verispec.load(model, device="cuda")`: plain greedy decode of --tokens tokens for two
   repetitive prompts, then n-gram speculative greedy (every step drafts) — the streams must be
   identical; a k-row verify bitwise the k one-row decodes for k = 2..17; tok/s of both.
3. per --model: torch's own bf16 eager path on the same GPU (transformers' from_pretrained of the
   GGUF, dequantised, cast to bf16, generate(do_sample=False) with its KV cache): tok/s, and
   how many of its greedy tokens match ours (bf16 rounds differently: a count, not a check).

--dry-run (no GPU): TRITON_INTERPRET=1 and VERISPEC_TRITON=1 before triton is imported; step 1
runs the kernel tests under the interpreter (--skip-kernel-tests leaves them out); step 2 runs on
a tiny random llama GGUF written here, with the trunk placed by `to_device("cpu")` (the CUDA
trunk's code, interpreted) and its logits also compared bitwise with the CPU trunk's C path;
16-token prompts, verify rows k = 2..5, draft acceptance reported, not required; step 3 is skipped. Timings from a dry run mean nothing. Exit status 0 when every check held.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNEL_TESTS = ["core/tests/test_triton_qmatmul.py", "core/tests/test_triton_attend.py", "core/tests/test_triton_norm.py",
                "core/tests/test_triton_glu.py", "models/qwen35/tests/test_triton_delta_rule.py",
                "models/glm5/tests/test_triton_kda.py"]
PROMPTS = ["The cat sat on the mat. The cat sat on the mat. The cat sat on the",
           "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef"]


def kernel_tests(dry_run: bool) -> dict:
    """Step 1: the kernels' tests in a subprocess (TRITON_INTERPRET decides CPU or CUDA)."""
    env = {**os.environ, "TRITON_INTERPRET": "1" if dry_run else "0"}
    env.pop("VERISPEC_TRITON", None)
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *KERNEL_TESTS],
                       cwd=ROOT, env=env, capture_output=True, text=True)
    return {"ok": r.returncode == 0, "returncode": r.returncode, "seconds": round(time.perf_counter() - start, 1),
            "tail": r.stdout.strip().splitlines()[-1:] + r.stderr.strip().splitlines()[-3:]}


def tiny_gguf(directory: str) -> str:
    """A random llama GGUF small enough for the interpreter: block-typed linears, embedding and head."""
    import torch
    from verispec.testing.fixture_writer import write_gguf

    g = torch.Generator().manual_seed(0)
    d, f, layers, vocab, heads, kv_heads = 64, 64, 2, 131, 4, 2
    dh = d // heads
    arch = "llama"
    metadata = {f"{arch}.context_length": 256, f"{arch}.embedding_length": d, f"{arch}.block_count": layers,
                f"{arch}.feed_forward_length": f, f"{arch}.attention.head_count": heads,
                f"{arch}.attention.head_count_kv": kv_heads, f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
                f"{arch}.rope.freq_base": 10000.0, f"{arch}.vocab_size": vocab, f"{arch}.rope.dimension_count": dh}

    def w(rows, cols, gain=None):
        return torch.randn(rows, cols, generator=g) * (gain if gain is not None else cols ** -0.5)

    tensors = {"token_embd.weight": w(vocab, d, 1.0), "output.weight": w(vocab, d),
               "output_norm.weight": 1 + 0.2 * torch.randn(d, generator=g)}
    types = {"token_embd.weight": "Q8_0", "output.weight": "Q5_1"}
    for i in range(layers):
        for name, shape, kind in (("attn_q", (heads * dh, d), "Q4_0"), ("attn_k", (kv_heads * dh, d), "Q4_0"),
                                  ("attn_v", (kv_heads * dh, d), "Q8_0"), ("attn_output", (d, heads * dh), "Q5_0"),
                                  ("ffn_gate", (f, d), "Q4_1"), ("ffn_up", (f, d), "Q4_1"),
                                  ("ffn_down", (d, f), "Q8_0")):
            tensors[f"blk.{i}.{name}.weight"] = w(*shape)
            types[f"blk.{i}.{name}.weight"] = kind
        for name in ("attn_norm", "ffn_norm"):
            tensors[f"blk.{i}.{name}.weight"] = 1 + 0.2 * torch.randn(d, generator=g)
    return write_gguf(Path(directory) / "tiny_llama.gguf", arch=arch, metadata=metadata, tensors=tensors,
                      tensor_types=types)


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _prompts(trunk, length: int = 48) -> list[list[int]]:
    tok = trunk.tokenizer
    return [[t % trunk.vocab_size for t in tok.encode(p)][:length] for p in PROMPTS]


def streams(trunk, tokens: int, max_rows: int = 17, prompt_length: int = 48, need_acceptance: bool = True) -> dict:
    """Step 2 on a placed trunk: plain vs n-gram greedy streams, verify rows vs one-row decodes, tok/s.
    need_acceptance: fail when no draft token was accepted (a random dry-run model rarely repeats
    its prompt, so there it is reported only; models/llama/tests/test_device_path.py checks it)."""
    from verispec.testing import run_greedy_requests
    from verispec.testing.gguf_weights import assert_verify_rows_are_one_row_decodes
    from verispec_ngram.speculator import NGramSpeculator

    prompts = _prompts(trunk, prompt_length)
    out = {}
    run_greedy_requests(trunk, prompts[:1], 4)  # warm-up: Triton compiles each kernel on its first call
    run_greedy_requests(trunk, prompts[:1], 4, NGramSpeculator(max_draft_tokens=8), max_draft_tokens=8, max_running=1)
    _synchronize()
    start = time.perf_counter()
    plain = [t for t, _ in run_greedy_requests(trunk, prompts, tokens, max_running=1)]
    _synchronize()
    out["plain_tok_s"] = round(len(prompts) * tokens / (time.perf_counter() - start), 2)
    start = time.perf_counter()
    spec = run_greedy_requests(trunk, prompts, tokens, NGramSpeculator(max_draft_tokens=8), max_draft_tokens=8,
                               max_running=1)
    _synchronize()
    out["ngram_tok_s"] = round(len(prompts) * tokens / (time.perf_counter() - start), 2)
    out["streams_identical"] = [t for t, _ in spec] == plain
    out["accepted_draft_tokens"] = sum(e.stats.num_accepted_tokens for _, e in spec)
    out["plain_streams"] = plain
    try:
        ids = (prompts[0] + plain[0])[:8 + max_rows]
        assert_verify_rows_are_one_row_decodes(trunk, ids, prefix=8, max_rows=max_rows)
        out[f"verify_rows_bitwise_k_2_to_{max_rows}"] = True
    except AssertionError as e:
        out[f"verify_rows_bitwise_k_2_to_{max_rows}"] = False
        out["verify_rows_error"] = str(e)
    out["ok"] = out["streams_identical"] and out[f"verify_rows_bitwise_k_2_to_{max_rows}"] \
        and (out["accepted_draft_tokens"] > 0 or not need_acceptance)
    return out


def logits_against_cpu(path: str, trunk, steps: int = 4) -> dict:
    """Dry run: the placed trunk's plain greedy logits vs the CPU trunk's (C kernels), bitwise."""
    import torch
    from verispec.testing import forward_one
    from verispec_llama.loader import load

    cpu = load(path, dtype="gguf", use_cache=False)
    prompt = _prompts(trunk)[0][:12]
    got, want = [], []
    for t, sink in ((cpu, want), (trunk, got)):
        seq = t.new_sequence()
        row = forward_one(t, seq, prompt, logits="last").logits[-1]
        sink.append(row)
        for _ in range(steps - 1):
            row = forward_one(t, seq, [int(row.argmax())], logits="last").logits[-1]
            sink.append(row)
        t.release(seq)
    got, want = torch.stack(got), torch.stack(want)
    return {"bitwise": torch.equal(got, want), "max_abs_diff": float((got - want).abs().max())}


def torch_bf16_eager(model_path: str, prompts: list[list[int]], tokens: int, ours: list[list[int]]) -> dict:
    """Step 3: transformers' bf16 eager greedy decode of the same prompts on the GPU, tok/s."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(model_path)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.bfloat16,
                                                 attn_implementation="eager").to("cuda").eval()
    matches, elapsed = [], 0.0
    for prompt, mine in zip(prompts, ours):
        ids = torch.tensor([prompt], device="cuda")
        _synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        _synchronize()
        elapsed += time.perf_counter() - start
        theirs = out[0, len(prompt):].tolist()
        matches.append(next((i for i, (a, b) in enumerate(zip(theirs, mine)) if a != b), len(theirs)))
    return {"tok_s": round(len(prompts) * tokens / elapsed, 2), "tokens_equal_to_ours_before_first_difference": matches}


def check_model(model: str, tokens: int, dry_run: bool) -> dict:
    import verispec

    if dry_run:
        from verispec_llama.loader import load

        trunk = load(model, dtype="gguf", use_cache=False)
        trunk.to_device("cpu")
    else:
        try:
            trunk = verispec.load(model, dtype="gguf", device="cuda").trunk
        except Exception as e:  # noqa: BLE001 -- a report, not a crash: the other models and steps still run
            return {"model": model, "ok": False, "error": f"loading: {type(e).__name__}: {e}"}
    result = {"model": model, "device": str(trunk.trunk_device)}
    try:
        result["streams"] = (streams(trunk, tokens, max_rows=5, prompt_length=16, need_acceptance=False) if dry_run
                             else streams(trunk, tokens))
    except Exception as e:  # noqa: BLE001 -- a report, not a crash: the next steps still run
        result["streams"] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    if dry_run:
        result["logits_vs_cpu"] = logits_against_cpu(model, trunk)
        result["torch_bf16_eager"] = {"skipped": "dry run: no GPU"}
    else:
        try:
            from verispec.api import resolve_model_path
            from verispec.registry import Registry

            path = resolve_model_path(model, Registry.discover())
            result["torch_bf16_eager"] = torch_bf16_eager(path, _prompts(trunk), tokens,
                                                          result["streams"].get("plain_streams", [[]] * 2))
        except Exception as e:  # noqa: BLE001
            result["torch_bf16_eager"] = {"error": f"{type(e).__name__}: {e}"}
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", default=[], help="GGUF path or checkpoint alias (repeatable)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per prompt (dry run: 8)")
    p.add_argument("--dry-run", action="store_true", help="on the CPU, Triton interpreted, a tiny fixture")
    p.add_argument("--skip-kernel-tests", action="store_true")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    if args.dry_run:  # before anything imports triton
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["VERISPEC_TRITON"] = "1"
    report = {"dry_run": args.dry_run}
    if not args.skip_kernel_tests:
        report["kernel_tests"] = kernel_tests(args.dry_run)
    with tempfile.TemporaryDirectory() as tmp:
        models = args.model or ([tiny_gguf(tmp)] if args.dry_run else [])
        if not models:
            p.error("give --model (a llama/qwen2, gemma3 or qwen35 GGUF, or an alias), or --dry-run")
        tokens = 8 if args.dry_run and args.tokens == 64 else args.tokens
        report["models"] = [check_model(m, tokens, args.dry_run) for m in models]
    for m in report["models"]:
        m.get("streams", {}).pop("plain_streams", None)
    ok = all(m.get("streams", {}).get("ok") for m in report["models"]) and report.get("kernel_tests", {"ok": True})["ok"]
    ok = ok and all(m.get("logits_vs_cpu", {"bitwise": True})["bitwise"] for m in report["models"])
    report["ok"] = ok
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
