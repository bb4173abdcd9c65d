"""Side-by-side decode speed: verispec vs HF transformers (and llama.cpp when importable).

Same process, same prompts (ids from our GGUF tokenizer, which matches transformers' GGUF
tokenizer id for id), greedy, stop tokens ignored, `--new` tokens each. For every system:
plain greedy, then its prompt-lookup / n-gram speculation; decode tok/s excludes the
first token (prefill), and `identical` compares each speculative stream with that
system's own plain greedy stream.

    python benchmarks/compare_peers.py [--model gemma3-270m] [--scenarios quote-code quote-text prose]

Peers: transformers `generate(prompt_lookup_num_tokens=N)` on the same GGUF loaded with
`gguf_file=` (fp32, as transformers dequantises); llama-cpp-python's
`LlamaPromptLookupDecoding` if `llama_cpp` is importable (it is not installed by default:
building it takes ~13 minutes here). `--with-llama-cpp` adds llama.cpp's own `llama-bench`
tg128 / pp512 on the same file, built once into the verispec cache (`benchmarks/llama_cpp.py
--build`, nothing in the venv; done here when missing), and our plain decode ÷ its tg128 per
scenario.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import verispec
from verispec.api import resolve_model_path
from verispec.bench.run import load_scenarios
from verispec.engine import SpecOptions
from verispec.registry import Registry


def prompt_ids(engine, scenario) -> list[int]:
    text = scenario.get("prompt") or "".join(scenario["turns"][:1])
    if engine.tokenizer.chat_template is not None:
        return engine.encode([{"role": "user", "content": text}])
    return engine.encode(text)


def run_verispec(engine, ids, new, spec: SpecOptions):
    engine.update_speculation(spec)
    engine.reset_cache()
    generation = engine.generate(ids, max_tokens=new, ignore_eos=True)
    for _ in generation:
        pass
    r = generation.result
    return r.tokens, r.decode_tokens_per_s, r.spec.num_accepted_tokens


class _Clock:
    """A transformers streamer that timestamps every batch of new tokens."""

    def __init__(self):
        self.stamps, self.count, self.first = [], 0, True

    def put(self, value):
        if self.first:  # the prompt
            self.first = False
            return
        self.count += value.numel()
        self.stamps.append((time.perf_counter(), self.count))

    def end(self):
        pass


def run_transformers(model, ids, new, lookup: int | None):
    clock = _Clock()
    kwargs = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=new, min_new_tokens=new,
                             streamer=clock, eos_token_id=None, pad_token_id=0, **kwargs)
    tokens = out[0, len(ids):].tolist()
    (t0, n0), (t1, n1) = clock.stamps[0], clock.stamps[-1]
    return tokens, (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0


def load_llama_cpp(path: str, threads: int, lookup: int | None):
    """llama-cpp-python's `Llama` on the same GGUF (its own Q4/Q8 kernels), or None when not importable.

    Built with GGML_NATIVE on this Xeon, llama.cpp's AMX matmul (an "extra buffer type")
    segfaults in its first decode, so extra buffer types are turned off (`use_extra_bufts`;
    this also turns off its weight repacking): its plain AVX-512 kernels run.
    """
    try:
        import llama_cpp.llama_cpp as low_level
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        return None
    defaults = low_level.llama_model_default_params

    def without_extra_buffers():
        params = defaults()
        params.use_extra_bufts = False
        return params

    draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup) if lookup else None
    low_level.llama_model_default_params = without_extra_buffers  # read by Llama.__init__
    try:
        return Llama(model_path=path, n_ctx=4096, n_threads=threads, n_batch=512, draft_model=draft,
                               logits_all=draft is not None, verbose=False)
    finally:
        low_level.llama_model_default_params = defaults


def run_llama_cpp(llm, ids, new):
    """Greedy `new` tokens through `Llama.generate` (which runs its draft model, if any, and
    verifies the drafts in one batch); stop tokens ignored. Returns (tokens, decode tok/s)."""
    llm.reset()
    tokens, stamps = [], []
    for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        tokens.append(token)
        stamps.append(time.perf_counter())
        if len(tokens) == new:
            break
    return tokens, (len(tokens) - 1) / (stamps[-1] - stamps[0]) if stamps[-1] > stamps[0] else 0.0


def llama_bench_figures(path: str, threads: int) -> dict[str, float]:
    """llama-bench tg128 / pp512 on `path` (benchmarks/llama_cpp.py, loaded by path: its name
    would shadow the llama_cpp package), building llama-bench first when it is missing."""
    spec = importlib.util.spec_from_file_location("llama_bench", Path(__file__).with_name("llama_cpp.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    if bench.bench_binary() is None:
        bench.build()
    return bench.llama_bench(path, threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="alias or GGUF path (default: the embedded default)")
    parser.add_argument("--scenarios", nargs="+", default=["quote-code", "quote-text", "prose"])
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--lookup", type=int, default=10, help="transformers prompt_lookup_num_tokens")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default=None, help="our weight dtype (default: the model's choice)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--with-llama-cpp", action="store_true",
                        help="add llama-bench tg128/pp512 (builds it once into the verispec cache, ~15 min)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    path = resolve_model_path(args.model, Registry.discover())
    engine = verispec.load(path, dtype=args.dtype)

    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    hf_load_s = time.perf_counter() - t0
    bench = llama_bench_figures(path, args.threads) if args.with_llama_cpp else None
    llama_plain = load_llama_cpp(path, args.threads, None)
    llama_lookup = load_llama_cpp(path, args.threads, args.lookup)
    rows = []
    warm = engine.encode("Warm up the caches.")
    run_verispec(engine, warm, 8, SpecOptions(enabled=False))
    run_transformers(hf, warm, 8, None)
    for scenario in load_scenarios(args.scenarios):
        ids = prompt_ids(engine, scenario)
        plain, plain_tps, _ = run_verispec(engine, ids, args.new, SpecOptions(enabled=False))
        spec, spec_tps, accepted = run_verispec(engine, ids, args.new, SpecOptions(spec_type="ngram"))
        hf_plain, hf_plain_tps = run_transformers(hf, ids, args.new, None)
        hf_spec, hf_spec_tps = run_transformers(hf, ids, args.new, args.lookup)
        rows.append({
            "scenario": scenario["name"], "prompt_tokens": len(ids),
            "verispec_plain_tps": round(plain_tps, 2), "verispec_ngram_tps": round(spec_tps, 2),
            "verispec_identical": spec == plain,
            "transformers_plain_tps": round(hf_plain_tps, 2),
            f"transformers_lookup{args.lookup}_tps": round(hf_spec_tps, 2),
            "transformers_identical": hf_spec == hf_plain,
            "plain_ratio_verispec_over_transformers": round(plain_tps / hf_plain_tps, 2),
            "spec_ratio_verispec_over_transformers": round(spec_tps / hf_spec_tps, 2),
            "same_plain_stream_as_transformers": plain == hf_plain,
        })
        if llama_plain is not None:
            cpp_plain, cpp_plain_tps = run_llama_cpp(llama_plain, ids, args.new)
            cpp_spec, cpp_spec_tps = run_llama_cpp(llama_lookup, ids, args.new)
            rows[-1].update({
                "llama_cpp_plain_tps": round(cpp_plain_tps, 2),
                f"llama_cpp_lookup{args.lookup}_tps": round(cpp_spec_tps, 2),
                "llama_cpp_identical": cpp_spec == cpp_plain,
                "spec_ratio_verispec_over_llama_cpp": round(spec_tps / cpp_spec_tps, 2),
            })
        if bench is not None:
            rows[-1].update({"llama_bench_tg128": round(bench["llama_cpp_tg128"], 2),
                             "plain_ratio_verispec_over_llama_bench_tg128":
                                 round(plain_tps / bench["llama_cpp_tg128"], 2)})
        print(json.dumps(rows[-1]), flush=True)
    if bench is not None:
        print(json.dumps({"llama_bench": {k: round(v, 2) for k, v in bench.items()}}))
    if llama_plain is None:
        print("llama-cpp-python not importable: llama.cpp columns skipped")
    if not args.json:
        keys = list(rows[0])
        print("| " + " | ".join(keys) + " |")
        print("|" + "---|" * len(keys))
        for r in rows:
            print("| " + " | ".join(str(r[k]) for k in keys) + " |")
    print(f"transformers GGUF load: {hf_load_s:.1f} s")


if __name__ == "__main__":
    main()
