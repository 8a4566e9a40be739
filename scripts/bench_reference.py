#!/usr/bin/env python3
"""The Python side of attnkit-bench: the same implementations in Python PyTorch.

    python3 scripts/bench_reference.py --batch 8 --tokens 1024 --d-model 768 --heads 12 \
        --json py.json                       # time them, same JSON as attnkit-bench --json
    python3 scripts/bench_reference.py --compare a.json b.json ...   # side by side

Implementations (names as attnkit-bench --only): wrapper, mha, combined, einsum (the book's
classes from reference_attention.py, and an einsum formulation), torch-mha and
torch-mha-noweights (torch.nn.MultiheadAttention), and on PyTorch >= 2.0 sdpa: what a
PyTorch 2.x user would write (one QKV Linear, F.scaled_dot_product_attention, out_proj).
fused and chunked are attnkit's own.

--compare reads JSON files of attnkit-bench and of this script, from any LibTorch / PyTorch
version (each file says which), and prints one column per language and version, then the
fastest attnkit implementation of each LibTorch version against the book's MHA in Python
and against PyTorch 2.x sdpa.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reference_attention as ref  # noqa: E402
import threads  # noqa: E402


class EinsumMHA(nn.Module):
    """The book's MultiHeadAttention parameters, computed with einsum."""

    def __init__(self, d, heads, context, causal):
        super().__init__()
        self.mha = ref.MultiHeadAttention(d, d, context, 0.0, heads, causal=causal)
        self.heads, self.causal = heads, causal

    def forward(self, x):
        b, n, d = x.shape

        def project(linear):  # (b, n, d) -> (b, h, n, hd)
            return torch.einsum("bnd,od->bno", x, linear.weight).view(b, n, self.heads, -1).transpose(1, 2)

        q, k, v = project(self.mha.W_query), project(self.mha.W_key), project(self.mha.W_value)
        scores = torch.einsum("bhnd,bhmd->bhnm", q, k) / math.sqrt(q.shape[-1])
        if self.causal:
            mask = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), 1)
            scores = scores.masked_fill(mask, -torch.inf)
        context = torch.einsum("bhnm,bhmd->bhnd", torch.softmax(scores, -1), v)
        return self.mha.out_proj(context.transpose(1, 2).reshape(b, n, d))


class SdpaMHA(nn.Module):
    """Multi-head attention as a PyTorch 2.x user writes it: one QKV Linear, SDPA, out_proj."""

    def __init__(self, d, heads, causal):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out_proj = nn.Linear(d, d)
        self.heads, self.causal = heads, causal

    def forward(self, x):
        b, n, d = x.shape
        # (b, n, 3 * d) -> (b, n, 3, h, hd) -> (3, b, h, n, hd)
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        context = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.out_proj(context.transpose(1, 2).reshape(b, n, d))  # (b, h, n, hd) -> (b, n, d)


class TorchMHA(nn.Module):
    def __init__(self, d, heads, causal, need_weights):
        super().__init__()
        self.attention = nn.MultiheadAttention(d, heads, bias=False, batch_first=True)
        self.causal, self.need_weights = causal, need_weights

    def forward(self, x):
        n = x.shape[1]
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), 1) if self.causal else None
        return self.attention(x, x, x, attn_mask=mask, need_weights=self.need_weights)[0]


PYTHON_IMPLEMENTATIONS = ("wrapper", "mha", "combined", "einsum", "torch-mha", "torch-mha-noweights",
                          "sdpa")
HAS_SDPA = hasattr(F, "scaled_dot_product_attention")  # PyTorch >= 2.0


def build(name, args):
    d, h, n, causal = args.d_model, args.heads, args.tokens, args.causal
    if name == "wrapper":
        return ref.MultiHeadAttentionWrapper(d, d // h, n, 0.0, h)
    if name == "mha":
        return ref.MultiHeadAttention(d, d, n, 0.0, h, causal=causal)
    if name == "combined":
        return ref.MultiHeadAttentionCombinedQKV(d, d, n, 0.0, h, causal=causal)
    if name == "einsum":
        return EinsumMHA(d, h, n, causal)
    if name == "sdpa":
        return SdpaMHA(d, h, causal)
    return TorchMHA(d, h, causal, need_weights=name == "torch-mha")


def peak_rss_mb():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return -1.0


def measure(name, backward, args):
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model = build(name, args).to(device, dtype)
    x = torch.randn(args.batch, args.tokens, args.d_model, device=device, dtype=dtype,
                    requires_grad=backward)
    cuda = device.type == "cuda"

    def run_once():
        if backward:
            model.zero_grad()
            model(x).sum().backward()
        else:
            with torch.no_grad():
                model(x)

    with open("/proc/self/clear_refs", "w") as refs:  # reset the peak RSS
        refs.write("5")
    for _ in range(args.warmup):
        run_once()
    times = []
    for _ in range(args.repeats):
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run_once()
        if cuda:  # the GPU's work, not only its launch
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return {"name": name, "pass": "forward+backward" if backward else "forward",
            "median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times),
            "peak_memory_mb": -1.0 if cuda else peak_rss_mb()}


def ms(value):
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


def label(config):
    """'C++ 1.13' or 'Python 2.6': the language and the LibTorch / PyTorch version."""
    major_minor = ".".join(config.get("torch", "?").split("+")[0].split(".")[:2])
    return f"{config.get('language', '?')} {major_minor}"


def compare(files):
    """One column per language and version; rows are (implementation, pass) medians in ms."""
    columns = {}  # label -> {(name, pass): result}
    for path in files:
        data = json.load(open(path))
        columns.setdefault(label(data["config"]), {}).update(
            {(r["name"], r["pass"]): r for r in data["results"]})
    labels = sorted(columns, key=lambda l: (not l.startswith("C++"), l))
    rows = []
    for results in columns.values():
        rows += [key for key in results if key not in rows]
    print(f"{'implementation':21}{'pass':18}" + "".join(f"{l:>13}" for l in labels) + "   (median ms)")
    for key in rows:
        cells = [columns[l].get(key) for l in labels]
        print(f"{key[0]:21}{key[1]:18}" + "".join(f"{ms(c['median_ms']):>13}" if c else f"{'':13}"
                                                  for c in cells))

    def python(name, pass_name):
        found = [(l, columns[l][(name, pass_name)]) for l in labels
                 if l.startswith("Python") and (name, pass_name) in columns[l]]
        return found[-1] if found else None  # the newest PyTorch that has it

    for l in labels:
        if not l.startswith("C++"):
            continue
        for pass_name in ("forward", "forward+backward"):
            # attnkit's whole-module implementations (not LibTorch's, not the core-only entries)
            ours = [r for k, r in columns[l].items() if k[1] == pass_name
                    and not k[0].startswith("torch-") and not k[0].endswith("-core")]
            if not ours:
                continue
            best = min(ours, key=lambda r: r["median_ms"])
            line = f"fastest attnkit on {l.split()[1]} {pass_name}: {best['name']} {ms(best['median_ms'])} ms"
            for name, what in (("sdpa", "sdpa"), ("mha", "the book's MHA")):
                reference = python(name, pass_name)
                if reference:
                    ratio = reference[1]["median_ms"] / best["median_ms"]
                    line += f"; {ratio:.2f}x {reference[0]} {what} ({ms(reference[1]['median_ms'])} ms)"
            print(line)


def scaling(files):
    """Per language and version: each (implementation, pass) median at each thread count, and
    its speed-up over the fewest threads; 'SLOWER' marks a speed-up below 1."""
    tables = {}  # label -> {(name, pass): {threads: result}}
    for path in files:
        data = json.load(open(path))
        threads = data["config"]["threads"]
        table = tables.setdefault(label(data["config"]), {})
        for r in data["results"]:
            table.setdefault((r["name"], r["pass"]), {})[threads] = r
    for l, table in tables.items():
        counts = sorted({t for by_threads in table.values() for t in by_threads})
        print(f"-- {l}: median ms at {', '.join(map(str, counts))} threads, speed-up over {counts[0]} --")
        print(f"{'implementation':21}{'pass':18}" + "".join(f"{str(t) + ' thr':>11}" for t in counts)
              + "".join(f"{'x' + str(t):>8}" for t in counts[1:]))
        for (name, pass_name), by_threads in table.items():
            cells = "".join(f"{ms(by_threads[t]['median_ms']):>11}" if t in by_threads else f"{'':11}"
                            for t in counts)
            ratios = ""
            for t in counts[1:]:
                if t in by_threads and counts[0] in by_threads:
                    ratio = by_threads[counts[0]]["median_ms"] / by_threads[t]["median_ms"]
                    ratios += f"{ratio:8.2f}" + (" SLOWER" if ratio < 1 else "")
            print(f"{name:21}{pass_name:18}{cells}{ratios}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--causal", type=lambda s: s.lower() != "false", default=True)
    parser.add_argument("--threads", type=int, default=0,
                        help="threads for torch and its BLAS; 0: their defaults")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    parser.add_argument("--dtype", default="float32",
                        choices=("float32", "float64", "bfloat16", "float16"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--only", default=",".join(PYTHON_IMPLEMENTATIONS))
    parser.add_argument("--json")
    parser.add_argument("--compare", nargs="+", metavar="JSON",
                        help="print the results of these files side by side, with ratios")
    parser.add_argument("--scaling", nargs="+", metavar="JSON",
                        help="print the results of these files by thread count, with speed-ups")
    args = parser.parse_args()
    if args.compare:
        compare(args.compare)
        return
    if args.scaling:
        scaling(args.scaling)
        return
    if args.threads:
        threads.set_num_threads(args.threads)  # and the BLAS's, as attnkit-bench does
    torch.manual_seed(0)
    results = []
    for name in args.only.split(","):
        if name not in PYTHON_IMPLEMENTATIONS:
            print(f"{name}: attnkit only, no Python counterpart")
            continue
        if name == "sdpa" and not HAS_SDPA:
            print(f"sdpa: needs PyTorch >= 2.0 (this is {torch.__version__})")
            continue
        if name == "wrapper" and not args.causal:
            continue
        for backward in (False, True):
            results.append(measure(name, backward, args))
            r = results[-1]
            print(f"{r['name']:21}{r['pass']:18}{r['median_ms']:10.1f} ms  peak {r['peak_memory_mb']:.0f} MB")
    if args.json:
        config = {k: getattr(args, k) for k in ("batch", "tokens", "d_model", "heads", "causal", "repeats",
                                             "device", "dtype")}
        blas, blas_threads = threads.blas_threads()
        config.update(threads=torch.get_num_threads(), blas=blas, blas_threads=blas_threads,
                      language="Python", torch=torch.__version__)
        json.dump({"config": config, "results": results}, open(args.json, "w"))


if __name__ == "__main__":
    main()
