#!/usr/bin/env python3
"""attnkit-train at several thread counts: training tokens/s and CPU cores used.

For each case (a task and a module at attnkit-train's defaults otherwise) it runs the program
at every --threads value, alternating the values case by case so that a slow minute on a
shared machine hits both sides of a ratio. Tokens/s is the program's own figure (training
steps only); cores is the process's CPU time (user + system) over its wall time, start-up
and evaluations included. Prints one table; --json also writes every run.

Usage: scripts/bench_train_threads.py --program build/apps/attnkit-train [--threads 1,2,0]
           [--steps N] [--only text-mha,copy-mha] [--label "LibTorch 1.13"] [--json FILE]
Steps: the task's default (600) for copy, reverse and recall, whose steps take about a
millisecond; 150 for text; --steps N sets every case's.
"""

import argparse
import json
import re
import resource
import subprocess
import sys
import time

CASES = {
    "copy-mha": ["--task", "copy"],
    "reverse-mha": ["--task", "reverse"],
    "recall-mha": ["--task", "recall"],
    "text-mha": ["--task", "text"],
    "text-mha-combined": ["--task", "text", "--module", "mha-combined"],
    "text-gqa": ["--task", "text", "--module", "gqa"],
    "text-mqa": ["--task", "text", "--module", "mqa"],
    "text-mla": ["--task", "text", "--module", "mla"],
    "text-causal": ["--task", "text", "--module", "causal"],
    "text-mha-wrapper": ["--task", "text", "--module", "mha-wrapper"],
    "reverse-sa-v1": ["--task", "reverse", "--module", "sa-v1"],
    "reverse-sa-v2": ["--task", "reverse", "--module", "sa-v2"],
    "text-mha-dropout": ["--task", "text", "--dropout", "0.1"],
}
DONE = re.compile(r"done after step \d+: .*?([\d.]+) s wall, (\d+) tokens/s")


def run_once(program, case_args, threads, steps):
    command = [program, *case_args, "--threads", str(threads), "--steps", str(steps),
               "--device", "cpu", "--quiet"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True)
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        sys.exit(f"bench_train_threads: {' '.join(command)} failed ({result.returncode}):\n"
                 f"{result.stderr}")
    match = DONE.search(result.stdout)
    if not match:
        sys.exit(f"bench_train_threads: no 'done after step' line from {' '.join(command)}:\n"
                 f"{result.stdout}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"tokens_per_s": int(match.group(2)), "cores": cpu / wall, "wall_s": wall}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--program", required=True, help="an attnkit-train binary")
    parser.add_argument("--threads", default="1,2,0",
                        help="comma-separated --threads values (0 = the program's default)")
    parser.add_argument("--steps", type=int, default=0, help="0 = the steps above")
    parser.add_argument("--only", default=",".join(CASES), help="comma-separated cases")
    parser.add_argument("--label", default="", help="printed above the table")
    parser.add_argument("--json", help="also write every run to this file")
    args = parser.parse_args()
    thread_counts = [int(t) for t in args.threads.split(",")]
    cases = args.only.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"--only: unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}")

    runs = []
    for index, case in enumerate(cases):
        order = thread_counts if index % 2 == 0 else list(reversed(thread_counts))
        for threads in order:
            steps = args.steps or (150 if case.startswith("text") else 600)
            run = run_once(args.program, CASES[case], threads, steps)
            run.update(case=case, threads=threads, steps=steps)
            runs.append(run)
            print(f"  {case} --threads {threads}: {run['tokens_per_s']} tokens/s, "
                  f"{run['cores']:.2f} cores", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"label": args.label, "runs": runs}, out, indent=1)

    def name(t):
        return "default" if t == 0 else f"{t} thread" + ("s" if t > 1 else "")

    print(f"\n{args.label}: attnkit-train training tokens/s (CPU cores used)")
    header = ["case"] + [name(t) for t in thread_counts]
    if 1 in thread_counts and 2 in thread_counts:
        header.append("2 vs 1")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for case in cases:
        by_threads = {r["threads"]: r for r in runs if r["case"] == case}
        cells = [case] + [f"{by_threads[t]['tokens_per_s']:,} ({by_threads[t]['cores']:.2f})"
                          for t in thread_counts]
        if 1 in by_threads and 2 in by_threads:
            ratio = by_threads[2]["tokens_per_s"] / by_threads[1]["tokens_per_s"]
            cells.append(f"{ratio:.2f}x")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
