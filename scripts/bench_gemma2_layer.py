#!/usr/bin/env python3
"""A Gemma 2-size decoder layer's forward on the CPU: transformers' own attention against
attnkit's (docs/models.md, docs/benchmarks.md).

The layer is transformers' Gemma2Model with one layer (hidden 2,304, 8 query heads over 4
key/value heads of width 256, GeGLU of 9,216, a window layer of 4,096, the attention softcap
50, query_pre_attn_scalar 256: Gemma 2 2B's shapes), float32, batch 1, n tokens, no
gradients. The two sides differ only in the attention function:

  transformers  its eager attention (Gemma 2 refuses SDPA, which has no softcap): the
                (n, n) scores of every head, softcapped, masked and softmaxed in full
  attnkit       attnkit.attention (causal, the window, the softcap and the scale), registered
                as a transformers attention implementation: the fused CPU tile kernel

First both sides run once on the same input in one process and their outputs are compared.
Then each measurement runs in its own process (its peak RSS is its own): one warm-up call and
one timed call; the sides alternate, ROUNDS processes each, medians reported.

  PYTHONPATH=build-pip/python "$(scripts/pip_torch.sh)" scripts/bench_gemma2_layer.py \\
      [--tokens 8192] [--threads 2] [--rounds 3]
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


def layer(tokens, implementation):
    import torch
    from transformers import AttentionInterface, Gemma2Config, Gemma2Model
    from transformers.masking_utils import AttentionMaskInterface
    import attnkit

    def attnkit_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                          sliding_window=None, softcap=None, **kwargs):
        # (b, h, n, hd) -> (b, n, h, hd), as transformers' attention functions return
        out = attnkit.attention(query, key, value, causal=True, window=sliding_window,
                                softcap=softcap, scale=scaling, training=False)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("attnkit", attnkit_attention)
    # attnkit makes its own mask from the window: transformers' (n, n) one is not built.
    AttentionMaskInterface.register("attnkit", lambda *args, **kwargs: None)
    config = Gemma2Config(
        vocab_size=256, hidden_size=2304, intermediate_size=9216, num_hidden_layers=1,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=4096, layer_types=["sliding_attention"], attn_logit_softcapping=50.0,
        max_position_embeddings=tokens, attn_implementation=implementation)
    torch.manual_seed(0)
    model = Gemma2Model(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():  # scores far from zero, so the softcap bites
            if parameter.dim() >= 2:
                parameter.normal_(0.0, 0.05)
    torch.manual_seed(1)
    embeddings = torch.randn(1, tokens, 2304) * 0.1
    return model, embeddings


def run_side(tokens, implementation, threads):
    import torch
    torch.set_num_threads(threads)
    model, embeddings = layer(tokens, implementation)
    with torch.no_grad():
        model(inputs_embeds=embeddings)  # warm-up
        start = time.perf_counter()
        model(inputs_embeds=embeddings)
        seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    print(json.dumps({"seconds": seconds, "peak_gib": peak}))


def compare(tokens, threads):
    import torch
    torch.set_num_threads(threads)
    outputs = {}
    for implementation in ("eager", "attnkit"):
        model, embeddings = layer(tokens, implementation)
        with torch.no_grad():
            outputs[implementation] = model(inputs_embeds=embeddings).last_hidden_state
    scale = outputs["eager"].abs().max().item()
    worst = (outputs["eager"] - outputs["attnkit"]).abs().max().item()
    print(json.dumps({"max_difference": worst, "relative": worst / scale}))


def measure(script, tokens, implementation, threads):
    done = subprocess.run([sys.executable, script, "--side", implementation, "--tokens",
                           str(tokens), "--threads", str(threads)], check=True,
                          capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--side", choices=("eager", "attnkit"), help=argparse.SUPPRESS)
    parser.add_argument("--compare", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        return run_side(args.tokens, args.side, args.threads)
    if args.compare:
        return compare(args.tokens, args.threads)
    check = subprocess.run([sys.executable, __file__, "--compare", "--tokens", str(args.tokens),
                            "--threads", str(args.threads)], check=True, capture_output=True,
                           text=True)
    agreement = json.loads(check.stdout.strip().splitlines()[-1])
    results = {"eager": [], "attnkit": []}
    for _ in range(args.rounds):
        for implementation in results:
            results[implementation].append(
                measure(__file__, args.tokens, implementation, args.threads))
    import torch
    import transformers
    print(f"Gemma 2-size layer, n {args.tokens}, float32, {args.threads} threads, torch "
          f"{torch.__version__}, transformers {transformers.__version__}: outputs differ by "
          f"{agreement['max_difference']:.3g} ({agreement['relative']:.3g} of the largest)")
    medians = {}
    for implementation, runs in results.items():
        medians[implementation] = statistics.median(run["seconds"] for run in runs)
        peak = statistics.median(run["peak_gib"] for run in runs)
        label = "transformers eager" if implementation == "eager" else "attnkit"
        each = ", ".join(f"{run['seconds']:.3f}" for run in runs)
        print(f"  {label:18s} {medians[implementation]:8.3f} s  peak RSS {peak:6.2f} GiB  "
              f"(runs: {each})")
    print(f"  attnkit is {medians['eager'] / medians['attnkit']:.2f}x transformers' forward")
    return 0


if __name__ == "__main__":
    sys.exit(main())
