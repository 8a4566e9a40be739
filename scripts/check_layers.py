#!/usr/bin/env python3
"""Checks the library's layers (docs/architecture.md, "Layers"): each file of src/ and each
public header includes only headers of its own layer and of the layers below it.

Layers, lowest first: core; modules; inference and io (side by side: neither includes the
other); train. The deprecated shims of USERS_ONLY are included by no file of the library. A
header of src/<layer>/ belongs to that layer, a public header to the layer that PUBLIC_LAYERS
names (where its code lives).

Inside core, its folders are layers too, lowest first: base; masks and scores (side by side);
plan; kernels; api (docs/architecture.md, "Inside core"). Core's public headers are its
interface types, below every folder, except the entry points' headers (PUBLIC_CORE_FOLDERS),
which are api's. No header of src/ takes part in an include cycle (inside a folder, where no
rank orders the files, an include that runs back up closes one).

Exits 1 and names each include that breaks a rule, each cycle, or a public header that no
layer claims.

Usage: scripts/check_layers.py [--root DIR] | --self-test
"""

import argparse
import re
import sys
import tempfile
from pathlib import Path

# The folders of src/core, lowest first; equal ranks are side by side.
CORE_RANK = {"base": 0, "masks": 1, "scores": 1, "plan": 2, "kernels": 3, "api": 4}

RANK = {"core": 0, "modules": 1, "inference": 2, "io": 2, "ops": 2, "train": 3}

# Each public header's layer: the folder of src/ that holds its code.
PUBLIC_LAYERS = {
    "attention.h": "core",
    "attention_types.h": "core",
    "autocast.h": "core",
    "block_mask.h": "core",
    "context_parallel.h": "core",
    "book_steps.h": "core",
    "functional.h": "core",
    "kernel_record.h": "core",
    "mask.h": "core",
    "memory_budget.h": "core",
    # Every option struct (data only) and AttentionBackend, whose names core/api/attention.cpp
    # defines.
    "options.h": "core",
    "paged_attention.h": "core",
    "rope.h": "core",
    "score_graph.h": "core",
    # ScoreMod alone, so that options.h can hold one without attention.h.
    "score_mod.h": "core",
    "score_mods.h": "core",
    "threads.h": "core",
    "version.h": "core",
    "cached_attention.h": "modules",
    "causal_attention.h": "modules",
    "decode.h": "modules",
    "grouped_query_attention.h": "modules",
    "kv_cache.h": "modules",
    "latent_attention.h": "modules",
    "multi_head_attention.h": "modules",
    "paged_kv_cache.h": "modules",
    "python_state.h": "modules",
    "rms_norm.h": "modules",
    "self_attention.h": "modules",
    "generate.h": "inference",
    "serving.h": "inference",
    "safetensors.h": "io",
    "serialize.h": "io",
    # Everything, for programs and models outside the library.
    "attnkit.h": "train",
}

# The public headers of core that are entry points, by the folder that defines them; core's
# other public headers are types and values that every folder may include.
PUBLIC_CORE_FOLDERS = {
    "attention.h": "api",
    "book_steps.h": "api",
    "context_parallel.h": "api",
    "functional.h": "api",
    "paged_attention.h": "api",
}

# Public headers for users only: deprecated shims that no file of the library includes but the
# umbrella header and the one file that defines them.
USERS_ONLY = {"functional.h": ("include/attnkit/attnkit.h", "src/core/api/functional.cpp")}

INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def layer_of_include(name, including_layer):
    """The layer of a quoted include as a file of `including_layer` writes it; None: unknown."""
    if name.startswith("attnkit/"):
        return PUBLIC_LAYERS.get(name[len("attnkit/"):])
    first = name.split("/")[0]
    if first in RANK:
        return first
    # A header beside the file (src/train writes "model.h").
    return including_layer if "/" not in name else None


def may_include(own, other):
    return other == own or RANK[other] < RANK[own]


def core_folder_of_include(name):
    """The core folder of a quoted include ("core/plan/planner.h": plan); None: not ranked."""
    parts = name.split("/")
    if parts[0] == "core" and len(parts) == 3 and parts[1] in CORE_RANK:
        return parts[1]
    if name.startswith("attnkit/"):
        return PUBLIC_CORE_FOLDERS.get(name[len("attnkit/"):])
    return None


def core_folder_of_file(path, root):
    """The core folder of a file of src/core/ ("" for one outside every folder); None: not
    in src/core."""
    relative = path.relative_to(root).parts
    if relative[:2] != ("src", "core"):
        return None
    return relative[2] if len(relative) == 4 else ""


def include_cycles(root, files):
    """Cycles among the headers of src/ (an include that runs back up inside a folder closes
    one): each as its files in order, once."""
    graph = {}
    for path, _ in files:
        relative = path.relative_to(root)
        if relative.parts[0] != "src" or path.suffix != ".h":
            continue
        targets = []
        for name in INCLUDE.findall(path.read_text(encoding="utf-8")):
            target = root / "src" / name
            if not target.exists():
                target = path.parent / name
            if target.exists() and target.suffix == ".h":
                targets.append(target.relative_to(root))
        graph[relative] = targets
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for child in graph.get(node, []):
            if state.get(child) == "open":
                cycle = stack[stack.index(child):]
                if sorted(cycle) not in [sorted(c) for c in cycles]:
                    cycles.append(list(cycle))
            elif child not in state:
                visit(child, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return cycles


def check(root):
    """The rules' breaches under `root`, one line each."""
    problems = []
    files = []
    for layer in RANK:
        for path in sorted((root / "src" / layer).rglob("*")):
            if path.suffix in (".h", ".cpp", ".cu"):
                files.append((path, layer))
    public = root / "include" / "attnkit"
    for path in sorted(public.glob("*.h")):
        layer = PUBLIC_LAYERS.get(path.name)
        if layer is None:
            problems.append(f"{path.relative_to(root)}: a public header no layer claims "
                            "(add it to PUBLIC_LAYERS in scripts/check_layers.py)")
            continue
        files.append((path, layer))
    for path, layer in files:
        folder = core_folder_of_file(path, root)
        if folder is not None and folder not in CORE_RANK:
            problems.append(f"{path.relative_to(root)}: outside core's folders "
                            f"({', '.join(CORE_RANK)})")
            continue
        for name in INCLUDE.findall(path.read_text(encoding="utf-8")):
            if name.endswith(".h.in") or name == "attnkit/version.h":
                continue
            other = layer_of_include(name, layer)
            shim = name[len("attnkit/"):] if name.startswith("attnkit/") else None
            if shim in USERS_ONLY and str(path.relative_to(root)) not in USERS_ONLY[shim]:
                problems.append(f'{path.relative_to(root)} includes "{name}": a deprecated '
                                "shim for users, which the library does not include")
            elif other is None:
                problems.append(f'{path.relative_to(root)}: includes "{name}", which no layer '
                                "claims")
            elif not may_include(layer, other):
                problems.append(f'{path.relative_to(root)} ({layer}) includes "{name}" '
                                f"({other}): a layer may include only its own and those below")
            elif folder is not None:
                other_folder = core_folder_of_include(name)
                if other_folder is not None and other_folder != folder and (
                        CORE_RANK[other_folder] >= CORE_RANK[folder]):
                    problems.append(f'{path.relative_to(root)} (core/{folder}) includes "{name}" '
                                    f"(core/{other_folder}): a folder of core may include only "
                                    "its own and those below")
    for cycle in include_cycles(root, files):
        problems.append("an include cycle (an include that runs back up): " +
                        " -> ".join(str(p) for p in cycle + cycle[:1]))
    return problems


def self_test():
    """Each kind of breach is reported, and a tree that keeps the rules passes."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for layer in RANK:
            (root / "src" / layer).mkdir(parents=True)
        (root / "include" / "attnkit").mkdir(parents=True)
        (root / "include" / "attnkit" / "mask.h").write_text('#include "attnkit/attention.h"\n')
        for folder in CORE_RANK:
            (root / "src" / "core" / folder).mkdir()
        (root / "src" / "core" / "kernels" / "a.cpp").write_text(
            '#include "core/plan/planner.h"\n#include "core/kernels/chunked.h"\n'
            '#include "attnkit/mask.h"\n')
        (root / "src" / "modules" / "b.cpp").write_text(
            '#include "attnkit/mask.h"\n#include "core/plan/planner.h"\n')
        (root / "src" / "train" / "c.cpp").write_text('#include "model.h"\n')
        assert check(root) == [], check(root)
        (root / "src" / "core" / "base" / "d.cpp").write_text(
            '#include "modules/module_attention.h"\n')
        (root / "src" / "core" / "plan" / "h.cpp").write_text('#include "core/kernels/chunked.h"\n')
        (root / "src" / "core" / "masks" / "i.h").write_text('#include "core/scores/row_score.h"\n')
        (root / "src" / "core" / "scores" / "j.cpp").write_text('#include "attnkit/attention.h"\n')
        (root / "src" / "core" / "k.cpp").write_text("")
        (root / "src" / "core" / "base" / "x.h").write_text('#include "core/base/y.h"\n')
        (root / "src" / "core" / "base" / "y.h").write_text('#include "core/base/x.h"\n')
        (root / "src" / "inference" / "e.cpp").write_text('#include "attnkit/serialize.h"\n')
        (root / "include" / "attnkit" / "attention.h").write_text(
            '#include "attnkit/kv_cache.h"\n')
        (root / "include" / "attnkit" / "new_thing.h").write_text("")
        (root / "src" / "io" / "f.cpp").write_text('#include "elsewhere/x.h"\n')
        (root / "src" / "modules" / "g.cpp").write_text('#include "attnkit/functional.h"\n')
        problems = check(root)
        expected = [
            'src/core/base/d.cpp (core) includes "modules/module_attention.h" (modules)',
            'src/core/plan/h.cpp (core/plan) includes "core/kernels/chunked.h" (core/kernels)',
            'src/core/masks/i.h (core/masks) includes "core/scores/row_score.h" (core/scores)',
            'src/core/scores/j.cpp (core/scores) includes "attnkit/attention.h" (core/api)',
            "src/core/k.cpp: outside core's folders",
            "an include cycle (an include that runs back up): src/core/base/x.h -> "
            "src/core/base/y.h -> src/core/base/x.h",
            'src/inference/e.cpp (inference) includes "attnkit/serialize.h" (io)',
            'include/attnkit/attention.h (core) includes "attnkit/kv_cache.h" (modules)',
            "include/attnkit/new_thing.h: a public header no layer claims",
            'src/io/f.cpp: includes "elsewhere/x.h", which no layer claims',
            'src/modules/g.cpp includes "attnkit/functional.h": a deprecated shim',
        ]
        for text in expected:
            assert any(p.startswith(text) for p in problems), (text, problems)
        assert len(problems) == len(expected), problems
    print("check_layers self-test: each kind of breach is reported")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--self-test", action="store_true")
    args = parser.parse_args()
    if args.self_test:
        self_test()
        return 0
    problems = check(args.root)
    for problem in problems:
        print(problem)
    if problems:
        return 1
    print("layers hold: every include of src/ and include/attnkit/ is of its layer or below")
    return 0


if __name__ == "__main__":
    sys.exit(main())
