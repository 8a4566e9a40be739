#!/usr/bin/env python3
"""attnkit.flex_attention against PyTorch's flex_attention on the CPU (docs/benchmarks.md).

Each measurement runs in its own process (so that its peak RSS is its own): a warm-up call,
then REPEATS timed calls, median reported. The implementations of a case alternate within each
round, so the machine's drift hits both sides alike. b 1, h 8, hd 64, float32.

  attnkit        attnkit.flex_attention (forward, or forward + backward)
  flex_eager     PyTorch's eager flex_attention (forward only: 2.15 refuses a CPU backward)
  flex_compiled  torch.compile(flex_attention): Inductor's CPU template (forward only)
  dense_math     the dense math with autograd (FlexAttention's eager math; what a CPU backward
                 costs in PyTorch): scores, score_mod, mask, softmax, all materialised

Usage (pip's PyTorch and the pip build's package):
  PYTHONPATH=build-pip/python "$(scripts/pip_torch.sh)" scripts/bench_flex_python.py \
      [--threads 1 2] [--repeats 3] [--cases ...]
  ... scripts/bench_flex_python.py --overhead   the Python package's cost over the operator:
      attnkit.flex_attention against the same operator call from C++ (flex_call_timer.cpp,
      built on demand) and torch.ops.attnkit.flex_attention with its arguments made once,
      causal n 1,024 forward, 15 rounds in alternation, 1 thread
"""

import argparse
import json
import math
import os
import resource
import statistics
import shutil
import subprocess
import sys
import tempfile
import time

CASES = {
    "documents_4096": dict(n=4096, mask="documents"),
    "documents_16384": dict(n=16384, mask="documents"),
    "causal_4096": dict(n=4096, mask="causal"),
    "window512_softcap_4096": dict(n=4096, mask="window", softcap=True),
}
# Where eager's (B, H, S, S) float32 scores (and their softmax and mask copies) cannot fit in
# this machine's 24 GiB: 8 x 16384^2 x 4 B = 8 GiB per matrix.
EAGER_LIMIT = 8192


def problem(case):
    import torch
    n = case["n"]
    ids = torch.arange(n) * 8 // n  # 8 documents of n/8 tokens

    def documents(b, h, q, kv):
        return (ids[q] == ids[kv]) & (kv <= q)

    def causal(b, h, q, kv):
        return kv <= q

    def window(b, h, q, kv):
        return (kv <= q) & (q - kv < 512)

    def softcap(score, b, h, q, kv):
        return 30.0 * torch.tanh(score / 30.0)

    mask_mod = {"documents": documents, "causal": causal, "window": window}[case["mask"]]
    return mask_mod, softcap if case.get("softcap") else None


def measure(impl, case_name, threads, backward, repeats):
    """Runs in the child: [seconds per call], peak RSS growth in MiB."""
    import torch
    torch.set_num_threads(threads)
    case = CASES[case_name]
    n = case["n"]
    mask_mod, score_mod = problem(case)
    g = torch.Generator().manual_seed(0)
    q, k, v = [torch.randn(1, 8, n, 64, generator=g, requires_grad=backward) for _ in range(3)]
    if impl == "attnkit":
        import attnkit
        bm = attnkit.create_block_mask(mask_mod, None, None, n, n)

        def call():
            return attnkit.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)
    elif impl in ("flex_eager", "flex_compiled"):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        bm = create_block_mask(mask_mod, None, None, n, n, device="cpu")
        if impl == "flex_compiled":
            from inductor_link import link_inductor_against_this_torch
            link_inductor_against_this_torch()
        flex = torch.compile(flex_attention) if impl == "flex_compiled" else flex_attention

        def call():
            return flex(q, k, v, score_mod=score_mod, block_mask=bm)
    else:  # dense_math
        qi = torch.arange(n).view(-1, 1)
        ki = torch.arange(n).view(1, -1)
        allowed = mask_mod(None, None, qi, ki)

        def call():
            s = q @ k.transpose(-1, -2) / math.sqrt(64)
            if score_mod is not None:
                s = score_mod(s, None, None, qi, ki)
            return s.masked_fill(~allowed, -math.inf).softmax(-1) @ v
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def once():
        out = call()
        if backward:
            out.backward(torch.ones_like(out))
    once()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    return times, peak


def overhead():
    """attnkit.flex_attention against the same operator call from C++ (scripts/
    flex_call_timer.cpp, built here with torch.utils.cpp_extension) and from Python with its
    arguments made once: causal n 1,024 forward, 1 thread, 15 rounds in alternation."""
    import attnkit
    import torch
    from torch.utils import cpp_extension
    timer = cpp_extension.load(
        "attnkit_flex_call_timer",
        [os.path.join(os.path.dirname(os.path.abspath(__file__)), "flex_call_timer.cpp")])
    torch.set_num_threads(1)
    n = 1024
    q, k, v = [torch.randn(1, 8, n, 64) for _ in range(3)]
    bm = attnkit.create_block_mask(lambda b, h, qi, kv: kv <= qi, None, None, n, n)
    q_block, kv_block, lists = attnkit._block_mask.partial_tiles(bm, q, k)

    def timed(call):
        start = time.perf_counter()
        call()
        return time.perf_counter() - start
    calls = {
        "attnkit.flex_attention": lambda: timed(
            lambda: attnkit.flex_attention(q, k, v, block_mask=bm)),
        "torch.ops.attnkit.flex_attention": lambda: timed(
            lambda: torch.ops.attnkit.flex_attention(q, k, v, *lists, "", [], q_block, kv_block, "", [],
                                                     1 / 8, 0.0, -1)),
        "C++ (the dispatcher)": lambda: timer.seconds_per_call(
            q, k, v, list(lists), q_block, kv_block, 1 / 8, 1),
    }
    times = {name: [] for name in calls}
    with torch.no_grad():
        for call in calls.values():
            call()
        for _ in range(15):
            for name, call in calls.items():
                times[name].append(call())
    medians = {name: statistics.median(t) for name, t in times.items()}
    cpp = medians["C++ (the dispatcher)"]
    print(f"causal n {n} forward, 1 thread, medians of 15: " + ", ".join(
        f"{name} {m * 1e3:.3f} ms ({m / cpp:.3f}x C++)" for name, m in medians.items()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--overhead", action="store_true")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.overhead:
        overhead()
        return
    if args.child:
        impl, case_name, threads, backward = args.child
        times, peak = measure(impl, case_name, int(threads), backward == "1", args.repeats)
        print(json.dumps({"times": times, "peak_mib": peak}))
        return
    inductor_cache = tempfile.mkdtemp(prefix="bench_flex_inductor_")
    try:
        compare(args, inductor_cache)
    finally:
        shutil.rmtree(inductor_cache, ignore_errors=True)


def compare(args, inductor_cache):
    """Runs each case's implementations in alternation, one child process each, and prints
    a line per case and pass."""
    rows = []
    for threads in args.threads:
        for case_name in args.cases:
            n = CASES[case_name]["n"]
            for backward, impls in ((False, ["attnkit", "flex_eager", "flex_compiled"]),
                                    (True, ["attnkit", "dense_math"])):
                results = {}
                for impl in impls:
                    if impl in ("flex_eager", "dense_math") and n > EAGER_LIMIT:
                        results[impl] = None  # its (B, H, S, S) scores do not fit
                        continue
                    command = [sys.executable, __file__, "--repeats", str(args.repeats),
                               "--child", impl, case_name, str(threads), str(int(backward))]
                    # Inductor's kernels in a cache of this run's own (kernels another run
                    # linked elsewhere are not reused).
                    env = dict(os.environ, PYTHONWARNINGS="ignore",
                               TORCHINDUCTOR_CACHE_DIR=inductor_cache)
                    done = subprocess.run(command, capture_output=True, text=True, env=env)
                    if done.returncode != 0:
                        errors = [line for line in done.stderr.splitlines() if "Error" in line]
                        results[impl] = {"error": (errors or done.stderr.splitlines())[-1:]}
                        continue
                    results[impl] = json.loads(done.stdout.strip().splitlines()[-1])
                rows.append((threads, case_name, "fwd+bwd" if backward else "fwd", results))
                mine = results["attnkit"]
                line = (f"threads {threads}  {case_name:24s} {rows[-1][2]:8s} attnkit "
                        f"{statistics.median(mine['times']) * 1e3:9.1f} ms {mine['peak_mib']:7.0f} "
                        "MiB")
                for other_name in impls[1:]:
                    other = results[other_name]
                    line += f" | {other_name} "
                    if other is None:
                        line += f"not run (n {n}: (B, H, S, S) float32 = " \
                                f"{8 * n * n * 4 / 2 ** 30:.0f} GiB per matrix)"
                    elif "error" in other:
                        line += f"failed: {other['error']}"
                    else:
                        ratio = statistics.median(other["times"]) / \
                            statistics.median(mine["times"])
                        line += (f"{statistics.median(other['times']) * 1e3:9.1f} ms "
                                 f"{other['peak_mib']:7.0f} MiB  attnkit {ratio:.2f}x faster")
                print(line, flush=True)


if __name__ == "__main__":
    main()
