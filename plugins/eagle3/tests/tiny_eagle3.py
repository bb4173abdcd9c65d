"""A tiny llama target, tiny random EAGLE-3 heads for it, and the plain PyTorch reference of the head's graph.

`build_target()` is a seeded transformers llama (TARGET: hidden 48, 5 layers, vocabulary 131)
written to GGUF by models/llama's tiny_llama; `head_tensors(...)` draws a random head's tensors by
GGUF name (unit-gain weights, as tiny_llama does, so logits are far from ties); `write_head`
writes them with our writer.

`reference_logits` is the oracle of the parity tests, written from llama.cpp's eagle3 graph
(src/models/eagle3.cpp) with nothing of the plugin's code: every row of a sequence recomputed
from scratch each time (no KV cache, no truncation), its own RMSNorm, its own NORM-pairing RoPE
(pairs (2i, 2i+1), angle pos·θ^(-2i/Dh)), GQA by index, d2t by scatter into -inf.
"""
from __future__ import annotations

import math

import torch

#: the tiny target: a transformers llama config (untied head), 5 layers so three taps sit inside it.
TARGET = {"vocab_size": 131, "hidden_size": 48, "intermediate_size": 37, "num_hidden_layers": 5,
          "num_attention_heads": 3, "num_key_value_heads": 1, "tie_word_embeddings": False,
          "rms_norm_eps": 1e-5, "max_position_embeddings": 512,
          "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
#: llama.cpp's converter default for an L-layer target: [2, L//2, L-3] -> [2, 2, 2] at 5 layers;
#: distinct ids make a swapped tap visible, so the tests use these.
TAPS = (1, 2, 4)
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 12  # the head's attention: D = 48 = H·Dh, GQA 2:1


def build_target(seed: int = 0, arch: str = "llama", **overrides):
    """The seeded transformers model of TARGET (with `overrides`; arch "llama" or "qwen2", whose q/k/v
    carry biases), fp32, unit-gain weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tiny_llama import redraw_unit_gain

    config = AutoConfig.for_model(arch, **{**TARGET, **overrides})
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    return redraw_unit_gain(model, seed)


def head_tensors(seed: int = 0, *, hidden: int = 48, target_hidden: int = 48, intermediate: int = 29,
                 draft_vocab: int | None = 40, vocab: int = TARGET["vocab_size"], own_output: bool = True,
                 own_embedding: bool = False, norm_before_fc: bool = False, rope_freqs: bool = False):
    """(tensors by GGUF name, d2t int64 [Vd] or None): a random head. draft_vocab None: no d2t (Vd = V).
    d2t: a seeded random choice of distinct target ids, ascending (as a vocabulary trimmed by counts)."""
    g = torch.Generator().manual_seed(100 + seed)

    def lin(out, inp):
        return torch.randn(out, inp, generator=g) / math.sqrt(inp)

    def norm(n):
        return 1 + 0.2 * torch.randn(n, generator=g)

    d, q, kv = hidden, HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    t = {"fc.weight": lin(d, 3 * target_hidden), "output_norm.weight": norm(d),
         "blk.0.attn_norm.weight": norm(d), "blk.0.attn_norm_2.weight": norm(d),
         "blk.0.attn_q.weight": lin(q, 2 * d), "blk.0.attn_k.weight": lin(kv, 2 * d),
         "blk.0.attn_v.weight": lin(kv, 2 * d), "blk.0.attn_output.weight": lin(d, q),
         "blk.0.ffn_norm.weight": norm(d), "blk.0.ffn_gate.weight": lin(intermediate, d),
         "blk.0.ffn_up.weight": lin(intermediate, d), "blk.0.ffn_down.weight": lin(d, intermediate)}
    rows = vocab if draft_vocab is None else draft_vocab
    if own_output:
        t["output.weight"] = torch.randn(rows, d, generator=g)
    if own_embedding:
        t["token_embd.weight"] = torch.randn(vocab, d, generator=g)
    if norm_before_fc:
        t["enc.output_norm.weight"] = norm(3 * target_hidden)
    if rope_freqs:
        t["rope_freqs.weight"] = 1 + 3 * torch.rand(HEAD_DIM // 2, generator=g)
    d2t = None if draft_vocab is None else torch.sort(torch.randperm(vocab, generator=g)[:draft_vocab]).values
    return t, d2t


def write_head(path, tensors, d2t, *, taps=TAPS, vocab=True, **kwargs) -> str:
    from verispec.testing.fixture_writer import byte_level_vocab
    from verispec_eagle3.gguf_writer import write_eagle3_gguf

    return write_eagle3_gguf(path, tensors, target_layers=taps, num_heads=HEADS, num_kv_heads=KV_HEADS, d2t=d2t,
                             vocab=byte_level_vocab(TARGET["vocab_size"]) if vocab else None, **kwargs)


# --- the reference (llama.cpp's graph, recomputed from scratch) ------------------------------------

def _rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rope_norm(x, positions, theta, factors):
    """x [m, heads, Dh]: each adjacent pair (2i, 2i+1) rotated by pos · θ^(-2i/Dh) / factor_i."""
    dh = x.shape[-1]
    out = x.clone()
    for i in range(dh // 2):
        freq = theta ** (-2.0 * i / dh) / (1.0 if factors is None else float(factors[i]))
        angle = positions.double()[:, None] * freq  # [m, 1]
        c, s = torch.cos(angle).float(), torch.sin(angle).float()
        a, b = x[..., 2 * i], x[..., 2 * i + 1]
        out[..., 2 * i], out[..., 2 * i + 1] = a * c - b * s, a * s + b * c
    return out


def _rope_neox(x, positions, theta, factors):
    """transformers' rotate_half RoPE: dim i pairs with i + Dh/2 (the layout before the converter's permute)."""
    dh = x.shape[-1]
    out = x.clone()
    for i in range(dh // 2):
        freq = theta ** (-2.0 * i / dh) / (1.0 if factors is None else float(factors[i]))
        angle = positions.double()[:, None] * freq
        c, s = torch.cos(angle).float(), torch.sin(angle).float()
        a, b = x[..., i], x[..., i + dh // 2]
        out[..., i], out[..., i + dh // 2] = a * c - b * s, a * s + b * c
    return out


def reference_logits(t, d2t, *, embed, lm_head, taps, tokens, drafts, vocab, eps=1e-5, theta=10000.0,
                     norm_before_residual=False, norm_before_fc=False, rope=_rope_norm):
    """The draft logits fp32 [len(drafts) + 1, V] of one round, from scratch.

    taps fp32 [n, 3·Dt]: the trunk's rows of positions 0..n-1; tokens [n + 1]: positions 0..n (the
    last is the pending token); drafts: the draft tokens fed to steps 2.. (the chain's inputs).
    embed(ids) -> [m, D] and lm_head(rows) -> [m, Vd]: the head's own tables or the trunk's.
    Rows: (tokens[r+1], fc(taps[r])) at position r for r < n, then (drafts[j], out of the row
    before) at position n + j."""
    factors = t.get("rope_freqs.weight")
    x = taps.float()
    if norm_before_fc:
        x = _rms(x, t["enc.output_norm.weight"], eps)
    g_rows = list(x @ t["fc.weight"].T)
    in_tokens = list(tokens[1:])
    results = []
    for step in range(len(drafts) + 1):
        if step:
            in_tokens.append(drafts[step - 1])
        m = len(in_tokens)
        g = torch.stack(g_rows[:m])
        positions = torch.arange(m)
        e = _rms(embed(torch.tensor(in_tokens)), t["blk.0.attn_norm.weight"], eps)
        gn = _rms(g, t["blk.0.attn_norm_2.weight"], eps)
        xcat = torch.cat([e, gn], dim=-1)
        q = rope((xcat @ t["blk.0.attn_q.weight"].T).view(m, HEADS, HEAD_DIM), positions, theta, factors)
        k = rope((xcat @ t["blk.0.attn_k.weight"].T).view(m, KV_HEADS, HEAD_DIM), positions, theta, factors)
        v = (xcat @ t["blk.0.attn_v.weight"].T).view(m, KV_HEADS, HEAD_DIM)
        attn = torch.zeros(m, HEADS, HEAD_DIM)
        causal = torch.tril(torch.ones(m, m, dtype=torch.bool))
        for h in range(HEADS):
            kh = h // (HEADS // KV_HEADS)
            scores = (q[:, h] @ k[:, kh].T) / math.sqrt(HEAD_DIM)
            attn[:, h] = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v[:, kh]
        r = attn.reshape(m, -1) @ t["blk.0.attn_output.weight"].T + (gn if norm_before_residual else g)
        hn = _rms(r, t["blk.0.ffn_norm.weight"], eps)
        gate, up = hn @ t["blk.0.ffn_gate.weight"].T, hn @ t["blk.0.ffn_up.weight"].T
        out = r + (torch.nn.functional.silu(gate) * up) @ t["blk.0.ffn_down.weight"].T
        last = out[-1:]
        draft_logits = lm_head(_rms(last, t["output_norm.weight"], eps))[0]
        if d2t is None:
            row = draft_logits
        else:
            row = torch.full((vocab,), float("-inf"))
            row[d2t] = draft_logits
        results.append(row)
        g_rows = g_rows[:m] + [last[0]]  # the recurrence: this row's pre-norm output is the next g
    return torch.stack(results)


# --- an HF EAGLE-3 checkpoint and llama.cpp's conversion of it --------------------------------------

#: HF EAGLE-3 (SafeAILab / SpecForge) parameter -> GGUF name, as conversion/llama.py maps them
#: (midlayer.* -> model.layers.0.* -> the llama tensor map; hidden_norm -> attn_norm_2).
HF_TO_GGUF = {
    "fc.weight": "fc.weight", "norm.weight": "output_norm.weight", "lm_head.weight": "output.weight",
    "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",
    "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight", "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight",
}


def hf_checkpoint(seed: int = 7):
    """(HF state dict, d2t offsets int64 [Vd]): a random head under HF EAGLE-3 names, its d2t as HF stores
    it (draft id i -> target id i + d2t[i])."""
    t, d2t = head_tensors(seed=seed)
    by_gguf = {gguf: hf for hf, gguf in HF_TO_GGUF.items()}
    return {by_gguf[name]: tensor for name, tensor in t.items()}, d2t - torch.arange(d2t.numel())


def _permute(w, n_head):
    """llama.cpp's LlamaModel.permute: each head's rotate-half pairs (i, i + Dh/2) made adjacent (2i, 2i + 1)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert_like_llama_cpp(state, d2t_offsets):
    """What conversion/llama.py writes for an HF EAGLE-3 checkpoint: GGUF names, q/k rows permuted
    (undo_permute, so llama.cpp's NORM RoPE applies), d2t made absolute (offsets + arange)."""
    out = {HF_TO_GGUF[name]: tensor for name, tensor in state.items()}
    out["blk.0.attn_q.weight"] = _permute(out["blk.0.attn_q.weight"], HEADS)
    out["blk.0.attn_k.weight"] = _permute(out["blk.0.attn_k.weight"], KV_HEADS)
    return out, d2t_offsets + torch.arange(d2t_offsets.numel())
