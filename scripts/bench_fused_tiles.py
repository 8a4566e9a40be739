#!/usr/bin/env python3
"""The fused CPU tile kernel against PyTorch on the CPU (docs/benchmarks.md, "Masks and score
functions at the machine's speed").

b 1, h 8, hd 64. For each case, size, dtype and thread count, one child process runs every side
in alternation, REPEATS rounds after a warm-up round, and prints medians:

  attnkit fwd          attnkit.flex_attention, forward (the fused tile kernel where it takes
                       the call; the planner's record says which kernel ran)
  flex fwd             torch.compile(flex_attention) with PyTorch's BlockMask (Inductor's CPU
                       template), forward: PyTorch 2.15 refuses flex_attention's CPU backward
  attnkit fwd+bwd      forward and backward
  sdpa fwd+bwd         F.scaled_dot_product_attention with the same mask as a dense tensor:
                       bool, or float with an additive bias (what a CPU user trains with)
  dense fwd+bwd        the dense math (for a score function SDPA cannot take: softcap)
  attnkit ... f32      (bfloat16, float16) attnkit with ATTNKIT_CPU_16BIT_MATMUL=float32: the
                       16-bit call computed in float32, as before the matrix units

and the executed GFLOP/s of attnkit's tiles (the scores that its block mask does not skip) next
to this core's GEMM rate at the tile's shapes ((128 x 64) (64 x 1024) and (128 x 1024)
(1024 x 64)) in float32 and in the 16-bit dtype, measured in the same child. Each line names
the kernel attnkit ran and how its 16-bit products ran (the planner's record). With --memory, each side's peak RSS
over one forward+backward call above the RSS before it, each in a process of its own.

Usage (pip's PyTorch and the pip build's package):
  PYTHONPATH=build-pip/python "$(scripts/pip_torch.sh)" scripts/bench_fused_tiles.py \\
      [--n 4096 16384] [--threads 1 2] [--dtypes float32 bfloat16] [--cases ...] \\
      [--repeats 5] [--memory]
  ... scripts/bench_fused_tiles.py --precision   the bfloat16 table gradient's error
  ... scripts/bench_fused_tiles.py --scaling [--cases ...] [--kv-heads 1]   fwd+bwd at 1 and
      2 threads, in alternation in one process (with key/value heads shared by 8 / K queries),
      next to the machine's own scaling on a GEMM in the same rounds
  ... scripts/bench_fused_tiles.py --document-route [--n 256 1024 4096]   attnkit.attention's
      documents without a gradient: by document on SDPA against the block mask's route, in
      alternation in one process (b 1 and 8; documents of n / 8, 16 and 4 tokens)
  ... scripts/bench_fused_tiles.py --own-masks [--n 4096]   attnkit.attention's own masks
      (windows, key lengths, documents), forward and forward+backward, against
      create_block_mask of the same mask_mod then flex_attention, in alternation
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

CASES = ["documents", "documents_prefix_lm", "window_512", "window_1024",
         "window_1024_softcap", "alibi", "relative_bias", "causal",
         # general score graphs, which the fused tile kernel compiles for its rows:
         "softcap_alibi", "bias_tensor"]
# Cases whose score function adds a bias: SDPA takes it as a float mask.
ADDITIVE = ("alibi", "relative_bias", "bias_tensor")
HEADS, HEAD_DIM = 8, 64
# The sides of a 16-bit run computed in float32 (ATTNKIT_CPU_16BIT_MATMUL=float32): as attnkit
# ran them before the matrix units.
FLOAT32_SIDE = " f32"
# Above this n a dense (1, H, n, n) float32 matrix is 8 GiB and more: SDPA with a dense mask
# and the dense math do not fit this machine's memory with their backward.
DENSE_LIMIT = 8192


def problem(case, n, torch):
    """mask_mod, score_mod, the captured tensor that trains (or None), and the dense bias."""
    ids = torch.arange(n) * 8 // n  # 8 documents of n / 8 tokens
    starts = ids * (n // 8)
    prefix = 256

    def causal(b, h, q, kv):
        return kv <= q

    def documents(b, h, q, kv):
        return (ids[q] == ids[kv]) & (kv <= q)

    def documents_prefix_lm(b, h, q, kv):
        # each document's first 256 tokens see each other; the rest is causal
        return (ids[q] == ids[kv]) & ((kv <= q) | (kv - starts[kv] < prefix))

    def window(size):
        return lambda b, h, q, kv: (kv <= q) & (q - kv < size)

    def softcap(score, b, h, q, kv):
        return 30.0 * torch.tanh(score / 30.0)

    slopes = torch.pow(2.0, -8.0 * torch.arange(1, HEADS + 1) / HEADS)

    def alibi(score, b, h, q, kv):
        return score + slopes[h] * (kv - q)

    distance = 128
    table = (torch.randn(HEADS, 2 * distance + 1) * 0.1).requires_grad_(True)

    def relative(score, b, h, q, kv):
        return score + table[h, torch.clamp(kv - q, -distance, distance) + distance]

    def softcap_alibi(score, b, h, q, kv):  # a softcap over a bias: no named variant
        return 30.0 * torch.tanh((score + slopes[h] * (kv - q)) / 30.0)

    # A learnable (heads, n, n) bias tensor, created only for its case (n^2 entries).
    bias = ((torch.randn(HEADS, n, n) * 0.1).requires_grad_(True)
            if case == "bias_tensor" else None)

    def bias_tensor(score, b, h, q, kv):
        return score + bias[h, q, kv]

    return {
        "documents": (documents, None, None),
        "documents_prefix_lm": (documents_prefix_lm, None, None),
        "window_512": (window(512), None, None),
        "window_1024": (window(1024), None, None),
        "window_1024_softcap": (window(1024), softcap, None),
        "alibi": (causal, alibi, None),
        "relative_bias": (causal, relative, table),
        "causal": (causal, None, None),
        "softcap_alibi": (causal, softcap_alibi, None),
        "bias_tensor": (causal, bias_tensor, bias),
    }[case]


def gemm_rate(torch, dtype=None, repeats=50):
    """GFLOP/s of torch.mm in `dtype` (float32 by default) at the tile's two shapes, medians of
    `repeats` calls."""
    dtype = dtype or torch.float32
    rates = {}
    for name, (m, k, n) in {"q k^T (128x64)(64x1024)": (128, 64, 1024),
                            "p v (128x1024)(1024x64)": (128, 1024, 64)}.items():
        a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
        out = torch.empty(m, n, dtype=dtype)
        for _ in range(5):
            torch.mm(a, b, out=out)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(20):
                torch.mm(a, b, out=out)
            times.append((time.perf_counter() - start) / 20)
        rates[name] = 2 * m * k * n / statistics.median(times) / 1e9
    return rates


def sides(case, n, dtype_name, compiled_flex=True, kv_heads=HEADS):
    """The sides of one configuration as {name: call}; with kv_heads < HEADS, attnkit's only
    (grouped-query attention)."""
    import torch
    import torch.nn.functional as F
    import attnkit
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    dtype = getattr(torch, dtype_name)
    mask_mod, score_mod, trained = problem(case, n, torch)
    g = torch.Generator().manual_seed(0)
    q, k, v = [torch.randn(1, heads, n, HEAD_DIM, generator=g).to(dtype).requires_grad_(True)
               for heads in (HEADS, kv_heads, kv_heads)]
    ak_mask = attnkit.create_block_mask(mask_mod, None, None, n, n)
    calls = {}

    def attnkit_call():
        return attnkit.flex_attention(q, k, v, score_mod=score_mod, block_mask=ak_mask,
                                      enable_gqa=kv_heads != HEADS)
    calls["attnkit fwd"] = ("fwd", attnkit_call)
    calls["attnkit fwd+bwd"] = ("bwd", attnkit_call)
    if dtype != torch.float32:  # run() computes these in float32 (FLOAT32_SIDE)
        calls["attnkit fwd" + FLOAT32_SIDE] = ("fwd", attnkit_call)
        calls["attnkit fwd+bwd" + FLOAT32_SIDE] = ("bwd", attnkit_call)
    if kv_heads != HEADS:
        return calls, ak_mask, trained
    if compiled_flex:  # compiling takes seconds: only where flex is timed
        from inductor_link import link_inductor_against_this_torch
        link_inductor_against_this_torch()
        pt_mask = create_block_mask(mask_mod, None, None, n, n, device="cpu")
        compiled = torch.compile(flex_attention)
        # flex_attention refuses inputs that require grad on the CPU, even under no_grad
        qd, kd, vd = q.detach(), k.detach(), v.detach()
        calls["flex fwd"] = ("fwd", lambda: compiled(qd, kd, vd, score_mod=score_mod,
                                                      block_mask=pt_mask))
    if n <= DENSE_LIMIT:
        qi, ki = torch.arange(n).view(-1, 1), torch.arange(n).view(1, -1)
        allowed = mask_mod(None, None, qi, ki)
        heads = torch.arange(HEADS).view(-1, 1, 1)
        if score_mod is None:
            calls["sdpa fwd+bwd"] = ("bwd", lambda: F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed))
        elif case in ADDITIVE:
            def sdpa_bias():
                # the bias as SDPA's float mask, made in the call so that the table trains
                bias = score_mod(torch.zeros((), dtype=torch.float32), None, heads, qi, ki)
                bias = bias.masked_fill(~allowed, float("-inf")).to(dtype).unsqueeze(0)
                return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
            calls["sdpa fwd+bwd"] = ("bwd", sdpa_bias)
        else:
            def dense_math():
                s = (q @ k.transpose(-1, -2)).float() / HEAD_DIM ** 0.5
                s = score_mod(s, None, heads, qi, ki).masked_fill(~allowed, float("-inf"))
                return s.softmax(-1).to(dtype) @ v
            calls["dense fwd+bwd"] = ("bwd", dense_math)
    return calls, ak_mask, trained


def run(kind, call, name=""):
    import torch
    if name.endswith(FLOAT32_SIDE):
        # The planner reads this per call: forward and backward (a second call) in float32.
        os.environ["ATTNKIT_CPU_16BIT_MATMUL"] = "float32"
        try:
            run(kind, call)
        finally:
            del os.environ["ATTNKIT_CPU_16BIT_MATMUL"]
        return
    if kind == "fwd":  # no graph kept (and flex_attention refuses one on the CPU)
        with torch.no_grad():
            call()
        return
    out = call()
    out.backward(out.detach().clone().fill_(1.0))


def executed_scores(ak_mask):
    """Score entries attnkit's tiles compute per head: every non-empty block, whole."""
    blocks = ak_mask.kv_num_blocks.sum().item() + ak_mask.full_kv_num_blocks.sum().item()
    size = ak_mask.BLOCK_SIZE
    q_block, kv_block = (size, size) if isinstance(size, int) else size
    return blocks * q_block * kv_block


def child(args):
    import torch
    torch.set_num_threads(args.child_threads)
    calls, ak_mask, _ = sides(args.child_case, args.child_n, args.child_dtype)
    times = {name: [] for name in calls}
    for round_index in range(args.repeats + 1):  # round 0 warms up (and compiles)
        for name, (kind, call) in calls.items():
            start = time.perf_counter()
            run(kind, call, name)
            if round_index > 0:
                times[name].append(time.perf_counter() - start)
    import attnkit
    dtype = getattr(torch, args.child_dtype)
    record = "float32" if dtype == torch.float32 else attnkit.cpu_16bit_matmul(dtype)
    gemm = {}
    if args.child_threads == 1:
        gemm = {f"float32 {name}": rate for name, rate in gemm_rate(torch).items()}
        if dtype != torch.float32:
            gemm.update({f"{args.child_dtype} {name}": rate
                         for name, rate in gemm_rate(torch, dtype).items()})
    result = {"median_ms": {name: statistics.median(t) * 1e3 for name, t in times.items()},
              "executed_scores": executed_scores(ak_mask) * HEADS,
              "gemm_gflops": gemm, "record": record}
    print(json.dumps(result))


def memory_child(args):
    import torch
    torch.set_num_threads(args.child_threads)
    calls, _, _ = sides(args.child_case, args.child_n, args.child_dtype, compiled_flex=False)
    kind, call = calls[args.memory_side]
    # The peak from here on: the setup's own (a dense mask, the block mask) is forgotten by
    # resetting the high-water mark (Linux: 5 > /proc/self/clear_refs).
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    base = status_kib("VmRSS")
    run(kind, call)
    print(json.dumps({"peak_mib": (status_kib("VmHWM") - base) / 1024}))


def status_kib(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def spawn(extra, args, env):
    command = [sys.executable, os.path.abspath(__file__), "--repeats", str(args.repeats), *extra]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        return {"error": lines[-1] if lines else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def scaling(args):
    """attnkit's forward+backward at 1 and 2 threads in alternation, in one process per case
    (torch.set_num_threads between calls): the ratio of the medians. Each round also times the
    machine's own scaling in the same alternation: torch.mm of two 1,024 x 1,024 float32
    matrices (MKL's threaded GEMM in pip's LibTorch, compute-bound and evenly split), so that
    a run on a machine whose second core is slower than its first says so."""
    import torch
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    product = torch.empty(1024, 1024)

    def gemm():
        for _ in range(4):
            torch.mm(a, b, out=product)

    for case in args.cases:
        calls, _, _ = sides(case, args.n[0], args.dtypes[0], compiled_flex=False,
                            kv_heads=args.kv_heads)
        kind, call = calls["attnkit fwd+bwd"]
        times = {(side, threads): [] for side in ("attnkit", "gemm") for threads in (1, 2)}
        for round_index in range(args.repeats + 1):
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for side, work in (("attnkit", lambda: run(kind, call)), ("gemm", gemm)):
                    start = time.perf_counter()
                    work()
                    if round_index > 0:
                        times[side, threads].append(time.perf_counter() - start)

        def ratios(side):
            one, two = (times[side, t] for t in (1, 2))
            # Each round's own ratio too: the machine's speed drifts within a run, and a pair
            # of calls made back to back shares its speed.
            return (statistics.median(one) * 1e3, statistics.median(two) * 1e3,
                    statistics.median(x / y for x, y in zip(one, two)))

        one, two, paired = ratios("attnkit")
        gemm_one, gemm_two, gemm_paired = ratios("gemm")
        print(f"{case:20s} n {args.n[0]:5d} {args.dtypes[0]:8s} kv heads {args.kv_heads} "
              f"attnkit fwd+bwd: 1 thread "
              f"{one:8.1f} ms, 2 threads {two:8.1f} ms: {one / two:.2f}x (pair by pair "
              f"{paired:.2f}x); the machine's GEMM in the same rounds: {gemm_one / gemm_two:.2f}x "
              f"(pair by pair {gemm_paired:.2f}x)", flush=True)


def document_route(args):
    """attnkit.attention(document_ids=...) without a gradient: its route by document on SDPA
    (taken where its rule says) against the block mask's route it replaces (create_block_mask
    of the same mask_mod, then flex_attention), both sides in alternation."""
    import torch
    import attnkit
    torch.set_num_threads(args.threads[0])
    for n in args.n:
        for batch in (1, 8):
            for tokens in sorted({n // 8, 16, 4} - {0}, reverse=True):
                q, k, v = (torch.randn(batch, 8, n, 64) for _ in range(3))
                ids = torch.arange(n) // tokens
                for causal in (False, True):
                    def mask_mod(b, h, qi, kv):
                        same = ids[qi] == ids[kv]
                        return same & (kv <= qi) if causal else same
                    sides = {
                        "by document": lambda: attnkit.attention(q, k, v, causal=causal,
                                                                 document_ids=ids),
                        "block mask": lambda: attnkit.flex_attention(
                            q, k, v, block_mask=attnkit.create_block_mask(mask_mod, 1, 1, n, n)),
                    }
                    times = {name: [] for name in sides}
                    with torch.no_grad():
                        taken = attnkit._attention_by_document(q, k, v, ids, causal,
                                                               None) is not None
                        for round_index in range(args.repeats + 1):
                            for name, call in sides.items():
                                start = time.perf_counter()
                                call()
                                if round_index > 0:
                                    times[name].append(time.perf_counter() - start)
                    mine, theirs = (statistics.median(times[name]) * 1e3 for name in sides)
                    paired = statistics.median(
                        b / a for a, b in zip(times["by document"], times["block mask"]))
                    print(f"b {batch} n {n:5d} documents of {tokens:4d} causal {causal!s:5s} "
                          f"route {'taken' if taken else 'declined':8s} attention {mine:8.2f} ms, "
                          f"block mask's route {theirs:8.2f} ms: {theirs / mine:.2f}x (pair by "
                          f"pair {paired:.2f}x)", flush=True)


def own_masks(args):
    """attnkit.attention with its own masks (b 1, causal; passed to the operator as they are)
    against create_block_mask of the same mask_mod, then flex_attention; forward (no
    gradient) and forward+backward, in alternation."""
    import torch
    import attnkit
    torch.set_num_threads(args.threads[0])
    n = args.n[0]
    ids = torch.arange(n) * 8 // n
    lengths = torch.tensor([n * 3 // 4])
    cases = {
        "window 512": (dict(window=512), lambda b, h, q, kv: (kv <= q) & (kv > q - 512)),
        "window 1,024": (dict(window=1024), lambda b, h, q, kv: (kv <= q) & (kv > q - 1024)),
        "key lengths": (dict(key_lengths=lengths),
                        lambda b, h, q, kv: (kv <= q) & (kv < lengths[b])),
        "documents": (dict(document_ids=ids), lambda b, h, q, kv: (kv <= q) & (ids[q] == ids[kv])),
    }
    for gradient in (False, True):
        for name, (mask, mask_mod) in cases.items():
            q, k, v = (torch.randn(1, 8, n, 64, requires_grad=gradient) for _ in range(3))

            def own():
                return attnkit.attention(q, k, v, causal=True, **mask)

            def evaluated():
                blocks = attnkit.create_block_mask(mask_mod, 1, 1, n, n)
                return attnkit.flex_attention(q, k, v, block_mask=blocks)
            times = {own: [], evaluated: []}
            with torch.set_grad_enabled(gradient):
                for round_index in range(args.repeats + 1):
                    for call in times:
                        start = time.perf_counter()
                        out = call()
                        if gradient:
                            out.sum().backward()
                        if round_index > 0:
                            times[call].append(time.perf_counter() - start)
            mine, theirs = (statistics.median(times[call]) * 1e3 for call in (own, evaluated))
            paired = statistics.median(b / a for a, b in zip(times[own], times[evaluated]))
            print(f"{'fwd+bwd' if gradient else 'fwd':7s} n {n:5d} {name:12s} attention "
                  f"{mine:8.1f} ms, create_block_mask + flex_attention {theirs:8.1f} ms: "
                  f"{theirs / mine:.2f}x (pair by pair {paired:.2f}x)", flush=True)


def precision():
    """The relative-position table's gradient in bfloat16 (causal, n 1,024): the mean absolute
    error of attnkit's and of the dense math's (scores in float32, as FlexAttention's eager
    math computes a 16-bit call), each against the float64 dense math."""
    import torch
    import attnkit
    n, distance = 1024, 128
    g = torch.Generator().manual_seed(1)
    q, k, v = [torch.randn(1, HEADS, n, HEAD_DIM, generator=g, dtype=torch.float64)
               for _ in range(3)]
    table64 = torch.randn(HEADS, 2 * distance + 1, generator=g, dtype=torch.float64) * 0.5
    grad_out = torch.randn(1, HEADS, n, HEAD_DIM, generator=g, dtype=torch.float64)
    qi, ki = torch.arange(n).view(-1, 1), torch.arange(n).view(1, -1)
    heads = torch.arange(HEADS).view(-1, 1, 1)

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    def dense(dtype):
        table = table64.to(dtype).clone().requires_grad_(True)
        s = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)).to(torch.promote_types(dtype,
                                                                                torch.float32))
        s = s / HEAD_DIM ** 0.5 + table[heads, torch.clamp(ki - qi, -distance, distance)
                                        + distance]
        p = s.masked_fill(ki > qi, float("-inf")).softmax(-1).to(dtype)
        (p @ v.to(dtype)).backward(grad_out.to(dtype))
        return table.grad.double()

    def fused():
        table = table64.to(torch.bfloat16).clone().requires_grad_(True)

        def relative(score, b, h, q_idx, kv_idx):
            return score + table[h, torch.clamp(kv_idx - q_idx, -distance, distance) + distance]
        block_mask = attnkit.create_block_mask(causal, None, None, n, n)
        out = attnkit.flex_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(),
                                     score_mod=relative, block_mask=block_mask)
        out.backward(grad_out.bfloat16())
        return table.grad.double()

    reference = dense(torch.float64)
    errors = {"attnkit (bfloat16)": (fused() - reference).abs().mean().item(),
              "dense math (bfloat16)": (dense(torch.bfloat16) - reference).abs().mean().item()}
    print("relative-position table gradient, causal n 1,024, mean |error| against float64: " +
          ", ".join(f"{name} {error:.3e}" for name, error in errors.items()) +
          f"; attnkit / dense {errors['attnkit (bfloat16)'] / errors['dense math (bfloat16)']:.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[4096])
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--dtypes", nargs="+", default=["float32"],
                        choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--cases", nargs="+", default=CASES, choices=CASES)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--scaling", action="store_true",
                        help="attnkit's fwd+bwd at 1 and 2 threads in alternation instead, "
                        "next to a GEMM's (the machine's own scaling)")
    parser.add_argument("--kv-heads", type=int, default=HEADS,
                        help=f"with --scaling: key/value heads, a divisor of {HEADS} "
                        f"(grouped-query attention; default {HEADS})")
    parser.add_argument("--document-route", action="store_true",
                        help="attnkit.attention's documents by document on SDPA against the "
                        "block mask's route instead (no gradient)")
    parser.add_argument("--own-masks", action="store_true",
                        help="attnkit.attention's own masks against create_block_mask of the "
                        "same mask_mod then flex_attention instead")
    parser.add_argument("--precision", action="store_true",
                        help="the bfloat16 table gradient's error instead of timings")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--memory-side", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1 (timed rounds after the warm-up), got {args.repeats}")
    for name in ("n", "threads"):
        bad = [value for value in getattr(args, name) if value < 1]
        if bad:
            parser.error(f"--{name} must be >= 1, got {bad[0]}")
    if args.kv_heads < 1 or HEADS % args.kv_heads != 0:
        parser.error(f"--kv-heads must divide {HEADS} (the query heads), got {args.kv_heads}")
    if args.kv_heads != HEADS and not args.scaling:
        parser.error("--kv-heads is taken with --scaling only (the baselines use 8 key/value "
                     f"heads), got --kv-heads {args.kv_heads} without it")
    if args.precision:
        precision()
        return
    if args.scaling:
        scaling(args)
        return
    if args.document_route:
        document_route(args)
        return
    if args.own_masks:
        own_masks(args)
        return
    if args.child:
        args.child_case, n, args.child_dtype, threads = args.child
        args.child_n, args.child_threads = int(n), int(threads)
        (memory_child if args.memory_side else child)(args)
        return
    cache = tempfile.mkdtemp(prefix="bench_fused_tiles_inductor_")
    env = dict(os.environ, PYTHONWARNINGS="ignore", TORCHINDUCTOR_CACHE_DIR=cache)
    try:
        for n in args.n:
            for dtype in args.dtypes:
                for threads in args.threads:
                    for case in args.cases:
                        report(case, n, dtype, threads, args, env)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def report(case, n, dtype, threads, args, env):
    result = spawn(["--child", case, str(n), dtype, str(threads)], args, env)
    head = f"{case:20s} n {n:5d} {dtype:8s} threads {threads}:"
    if "error" in result:
        print(f"{head} failed: {result['error']}", flush=True)
        return
    ms = result["median_ms"]
    fwd, both = ms["attnkit fwd"], ms["attnkit fwd+bwd"]
    line = f"{head} attnkit fwd {fwd:8.1f} ms"
    if "flex fwd" in ms:
        line += f" | flex fwd {ms['flex fwd']:8.1f} ms: {ms['flex fwd'] / fwd:5.2f}x"
    if "attnkit fwd f32" in ms:
        line += f" | attnkit fwd f32 {ms['attnkit fwd f32']:8.1f} ms: " \
                f"{ms['attnkit fwd f32'] / fwd:5.2f}x"
    line += f" || attnkit fwd+bwd {both:8.1f} ms"
    for other in ("attnkit fwd+bwd f32", "sdpa fwd+bwd", "dense fwd+bwd"):
        if other in ms:
            line += f" | {other} {ms[other]:8.1f} ms: {ms[other] / both:5.2f}x"
    if n > DENSE_LIMIT:
        line += " | dense sides not run (an (h, n, n) float32 matrix is " \
                f"{HEADS * n * n * 4 / 2 ** 30:.0f} GiB)"
    scores = result["executed_scores"]
    line += f" || executed GFLOP/s fwd {4 * HEAD_DIM * scores / fwd / 1e6:5.1f}, " \
            f"fwd+bwd {14 * HEAD_DIM * scores / both / 1e6:5.1f}"
    if result["gemm_gflops"]:
        line += " (GEMM " + ", ".join(f"{name} {rate:.1f}"
                                      for name, rate in result["gemm_gflops"].items()) + ")"
    line += f" || ran: {result['record']}"
    if args.memory:
        peaks = []
        for side in ("attnkit fwd+bwd", "sdpa fwd+bwd", "dense fwd+bwd"):
            if side not in ms:
                continue
            peak = spawn(["--child", case, str(n), dtype, str(threads), "--memory-side", side],
                         args, env)
            peaks.append(f"{side} {peak.get('peak_mib', float('nan')):.0f} MiB")
        line += " || peak RSS growth: " + ", ".join(peaks)
    print(line, flush=True)


if __name__ == "__main__":
    main()
