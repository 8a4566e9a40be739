#!/usr/bin/env python3
"""Dense float64 reference of masked attention with score functions, and its golden file.

    python3 scripts/mask_reference.py --write    # data/golden/masks/reference.pt
    python3 scripts/mask_reference.py --check    # run by the C++ suite on each LibTorch leg

The reference is attention written from the definitions, independently of attnkit: scores
q k^T * scale, the score function applied to every score with its (b, h, q_idx, kv_idx)
indices, masked scores set to -inf, softmax, rows with no visible key set to zero, times v.
Its gradients (q, k, v and the learnable bias table a score function reads) come from
autograd on the loss sum(out * w).

The golden file is one dict of tensors:
  inputs/<shape>/{q,k,v,w,bias,lengths,padding,ids,allowed,prefix}  per shape
  case/<shape>/<mask>/<score>/{out,dq,dk,dv,dbias}                   per case
  mha/...                                        torch.nn.MultiheadAttention, see mha_case()
Shapes: "square" (n = m = 13, 4 query heads on 2 key/value heads: GQA) and "offset" (7
queries at the end of 13 keys, causal masks aligned bottom-right). The C++ test
(tests/masks_test.cpp, MaskReference.*) rebuilds each named mask and score function with
attnkit and runs every backend in float64 (1e-10) and float32 (1e-5).

--check recomputes everything with this PyTorch and compares it with the file (1e-12), then
checks the reference against PyTorch itself: torch.nn.MultiheadAttention (key_padding_mask,
attn_mask; self- and cross-attention), F.scaled_dot_product_attention with bool masks (2.0
and later) and FlexAttention's eager flex_attention with score_mod and block_mask (2.5 and
later: ALiBi, softcap, documents, prefix-LM). Prints what ran; exit 1 on any mismatch.
"""
import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, "..", "data", "golden", "masks", "reference.pt")
HEADS, KV_HEADS, HEAD_DIM, BATCH = 4, 2, 4, 2
WINDOW = 4
MAX_DISTANCE = 3  # relative-position bias table: (HEADS, 2 * 3 + 1)
SOFTCAP = 1.5


# ---- masks: (b, h, q_idx, kv_idx) -> allowed, on broadcast index tensors --------------------

def causal(offset):
    return lambda b, h, q, kv: kv <= q + offset


def sliding(offset):
    return lambda b, h, q, kv: (kv <= q + offset) & (kv > q + offset - WINDOW)


def key_padding_lengths(lengths):
    return lambda b, h, q, kv: kv < lengths[b]


def key_padding_bool(padding):  # nn.MultiheadAttention's convention: True = padding
    return lambda b, h, q, kv: ~padding[b, kv]


def documents(ids, is_causal):
    same = lambda b, h, q, kv: ids[b, q] == ids[b, kv]
    return (lambda b, h, q, kv: same(b, h, q, kv) & (kv <= q)) if is_causal else same


def prefix_lm(prefix):
    return lambda b, h, q, kv: (kv <= q) | (kv < prefix)


def from_tensor(allowed):
    return lambda b, h, q, kv: allowed[b, 0, q, kv]


def both(a, c):
    return lambda *i: a(*i) & c(*i)


def either(a, c):
    return lambda *i: a(*i) | c(*i)


def masks_of(shape, inp, n, m):
    """The masks of a shape, by the names the C++ test builds them from."""
    offset = m - n
    table = {
        "none": None,
        "causal": causal(offset),
        "sliding_window": sliding(offset),
        "key_padding_lengths": key_padding_lengths(inp["lengths"]),
        "key_padding_bool": key_padding_bool(inp["padding"]),
        "tensor": from_tensor(inp["allowed"]),
        "causal_and_key_padding": both(causal(offset), key_padding_lengths(inp["lengths"])),
        "sliding_window_or_key_padding_bool": either(sliding(offset),
                                                     key_padding_bool(inp["padding"])),
    }
    if shape == "square":
        table.update({
            "documents": documents(inp["ids"], False),
            "documents_causal": documents(inp["ids"], True),
            "prefix_lm": prefix_lm(int(inp["prefix"])),
            "documents_causal_sliding_window": both(documents(inp["ids"], True), sliding(0)),
        })
    return table


# ---- score functions: (score, b, h, q_idx, kv_idx) -> score ---------------------------------

def alibi_slopes(heads):  # the ALiBi paper's geometric slopes, 2^(-8 i / heads), i = 1..heads
    return torch.tensor([2.0 ** (-8.0 * i / heads) for i in range(1, heads + 1)])


def scores_of(inp):
    slopes = alibi_slopes(HEADS).to(torch.float64)
    bias = inp["bias"]
    return {
        "none": None,
        "alibi": lambda s, b, h, q, kv: s + slopes[h] * (kv - q),
        "softcap": lambda s, b, h, q, kv: SOFTCAP * torch.tanh(s / SOFTCAP),
        "relative_position_bias": lambda s, b, h, q, kv: s + bias[
            h, (kv - q).clamp(-MAX_DISTANCE, MAX_DISTANCE) + MAX_DISTANCE],
    }


# ---- the reference ---------------------------------------------------------------------------

def indices(b, h, n, m):
    return (torch.arange(b).view(b, 1, 1, 1), torch.arange(h).view(1, h, 1, 1),
            torch.arange(n).view(1, 1, n, 1), torch.arange(m).view(1, 1, 1, m))


def reference(q, k, v, mask_mod=None, score_mod=None, scale=None):
    """q (b, h, n, d), k and v (b, g, m, d) with g dividing h -> (b, h, n, d)."""
    b, h, n, d = q.shape
    m = k.shape[2]
    group = h // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # query head i reads key/value head i // group
    v = v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale
    idx = indices(b, h, n, m)
    if score_mod is not None:
        scores = score_mod(scores, *idx)
    allowed = torch.ones(b, h, n, m, dtype=torch.bool)
    if mask_mod is not None:
        allowed = mask_mod(*idx).expand(b, h, n, m)
    scores = scores.masked_fill(~allowed, float("-inf"))
    visible = allowed.any(-1, keepdim=True)
    # A row with no visible key: zeros, with gradients that stay finite.
    weights = torch.softmax(torch.where(visible, scores, torch.zeros_like(scores)), dim=-1)
    weights = torch.where(visible & allowed, weights, torch.zeros_like(weights))
    return weights @ v


def make_inputs(generator, shape):
    n, m = (13, 13) if shape == "square" else (7, 13)
    kv_heads = KV_HEADS if shape == "square" else HEADS
    r = lambda *s: torch.randn(*s, generator=generator, dtype=torch.float64)
    inp = {
        "q": r(BATCH, HEADS, n, HEAD_DIM) * 1.5,
        "k": r(BATCH, kv_heads, m, HEAD_DIM) * 1.5,
        "v": r(BATCH, kv_heads, m, HEAD_DIM),
        "w": r(BATCH, HEADS, n, HEAD_DIM),
        "bias": r(HEADS, 2 * MAX_DISTANCE + 1),
        "lengths": torch.tensor([m, 5]),
        "prefix": torch.tensor(5),
    }
    padding = torch.zeros(BATCH, m, dtype=torch.bool)
    padding[0, 10:] = True
    padding[1, 3:7] = True
    inp["padding"] = padding
    inp["ids"] = torch.tensor([[0] * 4 + [1] * 6 + [2] * 3, [0] * 2 + [1] * 9 + [2] * 2])
    allowed = torch.rand(BATCH, 1, n, m, generator=generator) < 0.6
    allowed[1, 0, 2, :] = False  # a row with no visible key
    allowed[0, 0, 1, :] = False
    inp["allowed"] = allowed
    return inp


def compute(inputs):
    """Every case's output and gradients: {"case/<shape>/<mask>/<score>/<what>": tensor}."""
    out = {}
    for shape, inp in inputs.items():
        n, m = inp["q"].shape[2], inp["k"].shape[2]
        for mask_name, mask_mod in masks_of(shape, inp, n, m).items():
            for score_name, _ in scores_of(inp).items():
                q, k, v, bias = (inp[x].clone().requires_grad_() for x in ("q", "k", "v", "bias"))
                score_mod = scores_of(dict(inp, bias=bias))[score_name]
                result = reference(q, k, v, mask_mod, score_mod)
                (result * inp["w"]).sum().backward()
                key = f"case/{shape}/{mask_name}/{score_name}/"
                out[key + "out"] = result.detach()
                out[key + "dq"], out[key + "dk"], out[key + "dv"] = q.grad, k.grad, v.grad
                if score_name == "relative_position_bias":
                    out[key + "dbias"] = bias.grad
    return out


# ---- torch.nn.MultiheadAttention ------------------------------------------------------------

def mha_case(generator):
    """nn.MultiheadAttention(8, 2, bias=True, batch_first=True) in float64: its weights, inputs,
    masks (its convention: True = not allowed) and outputs, self- and cross-attention."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, bias=True, batch_first=True).double().eval()
    with torch.no_grad():
        for p in mha.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64) * 0.5)
    query = torch.randn(2, 5, 8, generator=generator, dtype=torch.float64)
    memory = torch.randn(2, 9, 8, generator=generator, dtype=torch.float64)
    key_padding = torch.zeros(2, 9, dtype=torch.bool)
    key_padding[1, 6:] = True
    cross_mask = torch.zeros(5, 9, dtype=torch.bool)
    cross_mask[0, 3:5] = True  # no row loses every key (nn.MultiheadAttention gives NaN there)
    self_mask = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)  # causal
    self_padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    with torch.no_grad():
        cross, _ = mha(query, memory, memory, key_padding_mask=key_padding, attn_mask=cross_mask,
                       need_weights=False)
        own, _ = mha(query, query, query, key_padding_mask=self_padding, attn_mask=self_mask,
                     need_weights=False)
    return {
        "mha/in_proj_weight": mha.in_proj_weight.detach().clone(),
        "mha/in_proj_bias": mha.in_proj_bias.detach().clone(),
        "mha/out_proj_weight": mha.out_proj.weight.detach().clone(),
        "mha/out_proj_bias": mha.out_proj.bias.detach().clone(),
        "mha/query": query, "mha/memory": memory,
        "mha/cross_key_padding": key_padding, "mha/cross_attn_mask": cross_mask,
        "mha/self_key_padding": self_padding, "mha/self_attn_mask": self_mask,
        "mha/cross_out": cross, "mha/self_out": own,
    }


def mha_from_file(golden):
    """The module of mha_case() with the weights in the file, for recomputing its outputs."""
    mha = torch.nn.MultiheadAttention(8, 2, bias=True, batch_first=True).double().eval()
    with torch.no_grad():
        mha.in_proj_weight.copy_(golden["mha/in_proj_weight"])
        mha.in_proj_bias.copy_(golden["mha/in_proj_bias"])
        mha.out_proj.weight.copy_(golden["mha/out_proj_weight"])
        mha.out_proj.bias.copy_(golden["mha/out_proj_bias"])
    return mha


def everything():
    generator = torch.Generator().manual_seed(2026)
    inputs = {shape: make_inputs(generator, shape) for shape in ("square", "offset")}
    golden = {f"inputs/{shape}/{k}": t for shape, inp in inputs.items() for k, t in inp.items()}
    golden.update(compute(inputs))
    golden.update(mha_case(generator))
    return inputs, golden


# ---- --check: the file, then PyTorch itself ---------------------------------------------------

class Checker:
    def __init__(self):
        self.failures = 0
        self.counts = {}

    def close(self, what, actual, expected, tol):
        self.counts[what.split(":")[0]] = self.counts.get(what.split(":")[0], 0) + 1
        diff = (actual - expected).abs().max().item() if actual.numel() else 0.0
        if not (diff <= tol):  # NaN fails too
            self.failures += 1
            print(f"MISMATCH {what}: max |diff| {diff:.3g} > {tol}")


def check_against_file(c, golden):
    inputs = {shape: {k.split("/")[2]: t for k, t in golden.items()
                      if k.startswith(f"inputs/{shape}/")} for shape in ("square", "offset")}
    for key, value in compute(inputs).items():
        c.close(f"file: {key}", value, golden[key], 1e-12)
    mha = mha_from_file(golden)
    with torch.no_grad():
        cross, _ = mha(golden["mha/query"], golden["mha/memory"], golden["mha/memory"],
                       key_padding_mask=golden["mha/cross_key_padding"],
                       attn_mask=golden["mha/cross_attn_mask"], need_weights=False)
        own, _ = mha(golden["mha/query"], golden["mha/query"], golden["mha/query"],
                     key_padding_mask=golden["mha/self_key_padding"],
                     attn_mask=golden["mha/self_attn_mask"], need_weights=False)
    c.close("nn.MultiheadAttention: cross-attention", cross, golden["mha/cross_out"], 1e-12)
    c.close("nn.MultiheadAttention: self-attention", own, golden["mha/self_out"], 1e-12)
    return inputs


def check_mha_against_reference(c, golden):
    """nn.MultiheadAttention = in-projection, the reference with the masks turned around, out."""
    w, bias = golden["mha/in_proj_weight"], golden["mha/in_proj_bias"]
    split = lambda t: t.view(2, t.shape[1], 2, 4).transpose(1, 2)  # (b, n, 8) -> (b, 2, n, 4)
    for name, kv in (("cross", golden["mha/memory"]), ("self", golden["mha/query"])):
        q = split(F.linear(golden["mha/query"], w[:8], bias[:8]))
        k = split(F.linear(kv, w[8:16], bias[8:16]))
        v = split(F.linear(kv, w[16:], bias[16:]))
        padding, attn = golden[f"mha/{name}_key_padding"], golden[f"mha/{name}_attn_mask"]
        context = reference(q, k, v, lambda b, h, qi, ki: ~padding[b, ki] & ~attn[qi, ki])
        out = F.linear(context.transpose(1, 2).reshape(2, -1, 8), golden["mha/out_proj_weight"],
                       golden["mha/out_proj_bias"])
        c.close(f"nn.MultiheadAttention vs reference: {name}", out, golden[f"mha/{name}_out"],
                1e-10)


def check_sdpa(c, inputs):
    """F.scaled_dot_product_attention with the allowed mask as its bool attn_mask (True = may
    attend), every mask without an empty row, no score function."""
    if not hasattr(F, "scaled_dot_product_attention"):
        print(f"skipped F.scaled_dot_product_attention: not in torch {torch.__version__}")
        return
    for shape, inp in inputs.items():
        q, k, v = inp["q"], inp["k"], inp["v"]
        b, h, n, _ = q.shape
        m = k.shape[2]
        group = h // k.shape[1]
        for name, mask_mod in masks_of(shape, inp, n, m).items():
            allowed = (torch.ones(b, h, n, m, dtype=torch.bool) if mask_mod is None
                       else mask_mod(*indices(b, h, n, m)).expand(b, h, n, m))
            if not allowed.any(-1).all():
                continue  # empty rows: NaN or zeros depending on the version
            sdpa = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1),
                                                  v.repeat_interleave(group, 1),
                                                  attn_mask=allowed)
            c.close(f"F.scaled_dot_product_attention: {shape}/{name}", sdpa,
                    reference(q, k, v, mask_mod), 1e-10)


def flex_runs_backward_on(device):
    """PyTorch 2.6's eager flex_attention runs backward on the CPU; later versions refuse it
    there (NotImplementedError), so without a GPU only their outputs are compared."""
    from torch.nn.attention.flex_attention import flex_attention
    x = torch.zeros(1, 1, 2, 2, device=device, requires_grad=True)
    try:
        flex_attention(x, x, x).sum().backward()
        return True
    except NotImplementedError:
        return False


def check_flex(c, inputs):
    """FlexAttention's eager flex_attention (on the GPU where there is one, else the CPU) with
    score_mod and block_mask: ALiBi, softcap, documents and prefix-LM, outputs and the
    gradients of q, k and v."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        print(f"skipped flex_attention: not in torch {torch.__version__}")
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with_grad = flex_runs_backward_on(device)
    if not with_grad:
        print(f"flex_attention: torch {torch.__version__} refuses backward on the {device}; "
              "outputs only")
    inp = inputs["square"]  # the reference runs on the CPU, flex_attention on `device`
    n = inp["q"].shape[2]

    def cases_on(where):
        slopes = alibi_slopes(HEADS).to(where, torch.float64)
        ids, prefix = inp["ids"].to(where), int(inp["prefix"])
        alibi = lambda s, b, h, q, kv: s + slopes[h] * (kv - q)
        return {
            "alibi": (None, alibi),
            "softcap": (None, lambda s, b, h, q, kv: SOFTCAP * torch.tanh(s / SOFTCAP)),
            "documents_causal": (documents(ids, True), None),
            "prefix_lm": (prefix_lm(prefix), None),
            "alibi_documents_causal": (documents(ids, True), alibi),
        }

    on_cpu = cases_on("cpu")
    for name, (mask_mod, score_mod) in cases_on(device).items():
        q, k, v = (inp[x].detach().to(device, copy=True).requires_grad_(with_grad)
                   for x in ("q", "k", "v"))
        block_mask = None
        if mask_mod is not None:
            block_mask = create_block_mask(mask_mod, BATCH, None, n, n, device=device,
                                           BLOCK_SIZE=4)
        flex = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                              enable_gqa=True)
        q2, k2, v2 = (inp[x].clone().requires_grad_() for x in ("q", "k", "v"))
        ours = reference(q2, k2, v2, *on_cpu[name])
        c.close(f"flex_attention: {name} out", flex.detach().cpu(), ours.detach(), 1e-10)
        if not with_grad:
            continue
        (flex * inp["w"].to(device)).sum().backward()
        (ours * inp["w"]).sum().backward()
        for label, g, r in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad),
                               (q2.grad, k2.grad, v2.grad)):
            c.close(f"flex_attention: {name} {label}", g.cpu(), r, 1e-10)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", action="store_true", help=f"write {os.path.relpath(GOLDEN)}")
    action.add_argument("--check", action="store_true",
                        help="compare with the file and with PyTorch's own attention")
    args = parser.parse_args()
    torch.set_default_dtype(torch.float64)
    if args.write:
        _, golden = everything()
        os.makedirs(os.path.dirname(GOLDEN), exist_ok=True)
        torch.save(golden, GOLDEN)
        cases = sum(1 for k in golden if k.startswith("case/") and k.endswith("/out"))
        print(f"wrote {os.path.relpath(GOLDEN)}: {cases} cases (torch {torch.__version__})")
        return 0
    golden = torch.load(GOLDEN, weights_only=True)
    c = Checker()
    inputs = check_against_file(c, golden)
    check_mha_against_reference(c, golden)
    check_sdpa(c, inputs)
    check_flex(c, inputs)
    summary = ", ".join(f"{what} {count}" for what, count in c.counts.items())
    print(f"{'FAILED' if c.failures else 'OK'} torch {torch.__version__}: {summary}")
    return 1 if c.failures else 0


if __name__ == "__main__":
    sys.exit(main())
