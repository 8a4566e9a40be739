#!/usr/bin/env python3
"""Checks that README.md and docs/*.md say what the code does (CTest: docs.*).

  1. Code from files. A fenced block right after `<!-- example: PATH#REGION -->` must equal
     the lines between `[doc:REGION]` and `[doc:end]` in PATH (the whole file without
     #REGION), dedented. Every ```cpp block must be such a block: the C++ on the pages is the
     C++ that CTest compiles and runs (examples/).
  2. Help texts. A fenced block right after `<!-- help: PROGRAM -->` must equal `PROGRAM
     --help` (trailing blanks aside).
  3. Commands. In ```sh blocks, every `--flag` given to one of the programs (attnkit-train,
     also as scripts/run.sh or build/apps/attnkit-train; attnkit-bench; attnkit-decode-bench;
     attnkit-walkthrough, also as scripts/walkthrough.sh) must be in that program's --help, and every scripts/... or build/apps/... path named must exist.
  4. Links. Every relative link resolves to a file, and every #anchor to a heading of it.
  5. Source paths. Every file of src/ a page names (src/core/plan/planner.cpp, or as
     core/plan/planner.h) exists, and docs/architecture.md names each folder of src/core/.

Usage:
  scripts/check_docs.py [--program NAME=PATH ...]   check; without a program, 2 and 3 skip it
  scripts/check_docs.py --write                     rewrite the example and help blocks
  scripts/check_docs.py --self-test                 show that each check catches its error
"""
import argparse
import functools
import os
import re
import subprocess
import sys
import tempfile
import textwrap

PROGRAMS = ("attnkit-train", "attnkit-bench", "attnkit-decode-bench", "attnkit-walkthrough")
# How a command line names a program: the program itself, its build path, or a wrapper script.
PROGRAM_ALIASES = {"scripts/run.sh": "attnkit-train", "scripts/walkthrough.sh": "attnkit-walkthrough"}
MARKER = re.compile(r"^<!-- (example|help): (\S+) -->\s*$")
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def pages(root):
    found = [os.path.join(root, "README.md")]
    docs = os.path.join(root, "docs")
    if os.path.isdir(docs):
        found += sorted(os.path.join(docs, f) for f in os.listdir(docs) if f.endswith(".md"))
    tiny = os.path.join(root, "apps", "tiny_gpt", "README.md")
    if os.path.exists(tiny):
        found.append(tiny)
    return found


def blocks(lines):
    """(start, end, language, marker) of each fenced block: lines[start] is the opening fence,
    lines[end] the closing one; marker is the (kind, argument) of a marker line just above."""
    result, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not re.match(r"^\s*```\s*$", lines[end]):
            end += 1
        marker = MARKER.match(lines[i - 1]) if i > 0 else None
        result.append((i, end, opening.group(2), marker.groups() if marker else None))
        i = end + 1
    return result


def region(root, argument):
    path, _, name = argument.partition("#")
    full = os.path.join(root, path)
    if not os.path.exists(full):
        raise LookupError(f"{path} does not exist")
    lines = open(full, encoding="utf-8").read().splitlines()
    if name:
        starts = [i for i, l in enumerate(lines) if re.search(rf"\[doc:{re.escape(name)}\]", l)]
        if len(starts) != 1:
            raise LookupError(f"{path} has {len(starts)} regions [doc:{name}], expected 1")
        end = next((i for i in range(starts[0] + 1, len(lines)) if "[doc:end]" in lines[i]), None)
        if end is None:
            raise LookupError(f"{path}: region [doc:{name}] has no [doc:end]")
        lines = lines[starts[0] + 1:end]
    return textwrap.dedent("\n".join(lines)).splitlines()


def help_text(programs, name):
    if name not in programs:
        return None
    output = subprocess.run([programs[name], "--help"], capture_output=True, text=True,
                            check=True).stdout
    return [line.rstrip() for line in output.rstrip("\n").splitlines()]


def flags_of(help_lines):
    return set(re.findall(r"--([a-z][a-z0-9-]*)", "\n".join(help_lines)))


def slug(heading):
    """GitHub's anchor for a heading."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@functools.lru_cache(maxsize=None)
def anchors(path):
    found, counts, fenced = set(), {}, False
    for line in open(path, encoding="utf-8").read().splitlines():
        if FENCE.match(line) or re.match(r"^\s*```\s*$", line):
            fenced = not fenced
            continue
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading and not fenced:
            base = slug(heading.group(1))
            n = counts.get(base, 0)
            counts[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def check_page(root, page, programs, write, problems):
    rel = os.path.relpath(page, root)
    lines = open(page, encoding="utf-8").read().splitlines()
    changed = False
    help_cache = {}

    def program_help(name):
        if name not in help_cache:
            help_cache[name] = help_text(programs, name)
        return help_cache[name]

    for start, end, language, marker in reversed(blocks(lines)):
        where = f"{rel}:{start + 1}"
        body = lines[start + 1:end]
        if marker:
            kind, argument = marker
            try:
                wanted = region(root, argument) if kind == "example" else program_help(argument)
            except (LookupError, subprocess.CalledProcessError, OSError) as error:
                problems.append(f"{where}: {kind} {argument}: {error}")
                continue
            if wanted is None:
                continue  # a help text of a program that was not given
            if [l.rstrip() for l in body] != wanted:
                if write:
                    lines[start + 1:end] = wanted
                    changed = True
                else:
                    problems.append(f"{where}: the block differs from {kind} {argument} "
                                    f"(scripts/check_docs.py --write updates it)")
        elif language == "cpp":
            problems.append(f"{where}: a C++ block that is not <!-- example: examples/... --> "
                            "(the pages show only C++ that CTest compiles)")
        if language == "sh":
            check_commands(root, where, body, program_help, problems)
    if changed:
        open(page, "w", encoding="utf-8").write("\n".join(lines) + "\n")

    fenced = False
    for number, line in enumerate(lines, 1):
        if FENCE.match(line) or re.match(r"^\s*```\s*$", line):
            fenced = not fenced
        if fenced:
            continue
        for target in LINK.findall(line):
            if re.match(r"^[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            destination = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(destination):
                problems.append(f"{rel}:{number}: link to {target}: no such file")
            elif anchor and destination.endswith(".md") and anchor not in anchors(destination):
                problems.append(f"{rel}:{number}: link to {target}: no heading with that anchor")


def check_commands(root, where, body, program_help, problems):
    for line in body:
        command = line.split("#", 1)[0]
        for path in re.findall(r"(?:^|[\s(])((?:scripts|build/apps|tests|examples)/[\w./-]+)", command):
            if not os.path.exists(os.path.join(root, path)) and not path.startswith("build/"):
                problems.append(f"{where}: `{path}` does not exist")
        words = command.split()
        for i, word in enumerate(words):
            name = PROGRAM_ALIASES.get(word, os.path.basename(word))
            if name not in PROGRAMS or not (word == name or "/" in word):
                continue
            lines = program_help(name)
            if lines is None:
                continue
            known = flags_of(lines)
            for argument in words[i + 1:]:
                if argument in ("|", "&&", ";", "||"):
                    break
                flag = re.match(r"^--([a-z][a-z0-9-]*)", argument)
                if flag and flag.group(1) not in known:
                    problems.append(f"{where}: {name} has no flag --{flag.group(1)}")


SOURCE_PATH = re.compile(r"(?<![\w/.])(?:src/)?((?:core|modules|inference|io|ops|train)/[\w/]+\.(?:h|cpp|cu))\b")


def check_source_paths(root, page, problems):
    """Check 5: the files of src/ that a page names exist; architecture.md names each folder of
    src/core/."""
    rel = os.path.relpath(page, root)
    text = open(page, encoding="utf-8").read()
    for number, line in enumerate(text.splitlines(), 1):
        for path in SOURCE_PATH.findall(line):
            if not os.path.exists(os.path.join(root, "src", path)):
                problems.append(f"{rel}:{number}: names src/{path}, which does not exist")
    if rel == os.path.join("docs", "architecture.md"):
        core = os.path.join(root, "src", "core")
        for folder in sorted(os.listdir(core)) if os.path.isdir(core) else []:
            if os.path.isdir(os.path.join(core, folder)) and f"core/{folder}/" not in text:
                problems.append(f"{rel}: does not name src/core/{folder}/ (its picture shows "
                                "each folder of the core)")


def run(root, programs, write):
    problems = []
    for page in pages(root):
        check_page(root, page, programs, write, problems)
        check_source_paths(root, page, problems)
    return problems


def self_test(programs):
    """Builds a small tree with one error of each kind and checks that each is reported."""
    with tempfile.TemporaryDirectory() as root:
        os.makedirs(os.path.join(root, "docs"))
        os.makedirs(os.path.join(root, "examples"))
        os.makedirs(os.path.join(root, "scripts"))
        open(os.path.join(root, "scripts", "run.sh"), "w").close()
        with open(os.path.join(root, "examples", "a.cpp"), "w") as f:
            f.write("int x;\n// [doc:r]\nint y = 1;\n// [doc:end]\n")
        fake = os.path.join(root, "attnkit-train")
        with open(fake, "w") as f:
            f.write("#!/bin/sh\necho '  --steps arg  training steps'\n")
        os.chmod(fake, 0o755)
        with open(os.path.join(root, "README.md"), "w") as f:
            f.write("# Top\n\n[ok](docs/page.md#a-heading) [gone](docs/missing.md) "
                    "[bad anchor](docs/page.md#nowhere) [self](#top)\n\n"
                    "<!-- example: examples/a.cpp#r -->\n```cpp\nint y = 2;\n```\n\n"
                    "```cpp\nint untested;\n```\n\n"
                    "<!-- help: attnkit-train -->\n```text\n  --steps arg  old text\n```\n\n"
                    "```sh\nscripts/run.sh --steps 5 --bogus 1\nscripts/nothing.sh\n```\n")
        with open(os.path.join(root, "docs", "page.md"), "w") as f:
            f.write("## A heading\n\nThe planner: core/plan/gone.cpp.\n")
        os.makedirs(os.path.join(root, "src", "core", "plan"))
        os.makedirs(os.path.join(root, "src", "core", "unnamed"))
        open(os.path.join(root, "src", "core", "plan", "planner.cpp"), "w").close()
        with open(os.path.join(root, "docs", "architecture.md"), "w") as f:
            f.write("# Architecture\n\ncore/plan/: src/core/plan/planner.cpp\n")
        problems = run(root, {"attnkit-train": fake}, write=False)
        expected = ["docs/missing.md: no such file", "#nowhere: no heading",
                    "differs from example examples/a.cpp#r", "not <!-- example",
                    "differs from help attnkit-train", "has no flag --bogus",
                    "`scripts/nothing.sh` does not exist",
                    "names src/core/plan/gone.cpp, which does not exist",
                    "does not name src/core/unnamed/"]
        missed = [e for e in expected if not any(e in p for p in problems)]
        extra = [p for p in problems if not any(e in p for e in expected)]
        if missed or extra or len(problems) != len(expected):
            print("check_docs self-test FAILED:\n  reported: " + "\n  reported: ".join(problems)
                  + "\n  missed: " + ", ".join(missed))
            return 1
        run(root, {"attnkit-train": fake}, write=True)
        after = run(root, {"attnkit-train": fake}, write=False)
        if any("differs" in p for p in after):
            print("check_docs self-test FAILED: --write left differences: " + "; ".join(after))
            return 1
        print(f"check_docs self-test: all {len(expected)} kinds of error reported, --write fixes blocks")
        return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    parser.add_argument("--program", action="append", default=[], metavar="NAME=PATH")
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--self-test", action="store_true")
    args = parser.parse_args()
    programs = {}
    for item in args.program:
        name, _, path = item.partition("=")
        if name not in PROGRAMS or not path:
            parser.error(f"--program: expected one of {', '.join(PROGRAMS)}=PATH, got '{item}'")
        programs[name] = path
    if args.self_test:
        return self_test(programs)
    root = os.path.abspath(args.root)
    problems = run(root, programs, args.write)
    for problem in problems:
        print(problem)
    checked = len(pages(root))
    if problems:
        print(f"check_docs: {len(problems)} problem(s) in {checked} pages")
        return 1
    print(f"check_docs: {checked} pages: examples, help texts, commands and links agree")
    return 0


if __name__ == "__main__":
    sys.exit(main())
