#!/usr/bin/env python3
"""Bar charts of attnkit-bench results (needs Debian's python3-matplotlib).

    python3 scripts/plot_bench.py bench.json bench.png [python.json]

One panel per pass (forward, forward+backward): median time per implementation, with
min-max error bars; with a second JSON from scripts/bench_reference.py, the Python bars
beside the C++ ones.
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    cpp = json.load(open(sys.argv[1]))
    python = json.load(open(sys.argv[3]))["results"] if len(sys.argv) == 4 else []
    config = cpp["config"]
    figure, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for axis, pass_name in zip(axes, ("forward", "forward+backward")):
        rows = [r for r in cpp["results"] if r["pass"] == pass_name]
        names = [r["name"] for r in rows]
        positions = range(len(rows))
        width = 0.4 if python else 0.8
        medians = [r["median_ms"] for r in rows]
        errors = [[m - r["min_ms"] for m, r in zip(medians, rows)],
                  [r["max_ms"] - m for m, r in zip(medians, rows)]]
        axis.bar([p - (width / 2 if python else 0) for p in positions], medians, width,
                 yerr=errors, capsize=3, label="C++ (attnkit-bench)")
        if python:
            by_name = {r["name"]: r for r in python if r["pass"] == pass_name}
            python_medians = [by_name[n]["median_ms"] if n in by_name else 0 for n in names]
            axis.bar([p + width / 2 for p in positions], python_medians, width, label="Python")
            axis.legend()
        axis.set_xticks(list(positions))
        axis.set_xticklabels(names, rotation=30, ha="right")
        axis.set_ylabel("median time (ms)")
        axis.set_title(pass_name)
    figure.suptitle(f"b={config['batch']} n={config['tokens']} d={config['d_model']} h={config['heads']}"
                    f"{' causal' if config['causal'] else ''}, {config['dtype']} on {config['device']}, "
                    f"sgemm {cpp['sgemm_gflops']:.0f} GFLOP/s")
    figure.tight_layout()
    figure.savefig(sys.argv[2], dpi=110)
    print(f"wrote {sys.argv[2]}")


if __name__ == "__main__":
    main()
