"""Inductor's CPU kernels against the torch that compiles them, where a system LibTorch is
installed too (tests/python_ops_test.py and scripts/bench_flex_python.py use it)."""

import os


def link_inductor_against_this_torch():
    """Inductor links its CPU kernels with -ltorch_cpu, searching Python's LIBDIR first. Where a
    system LibTorch lives there (Debian's libtorch-dev in /usr/lib/<triplet>), the kernels link
    against it instead of this torch: its vector-ISA probe then fails to load ("InvalidVecISA")
    and its kernels would load the other LibTorch. Inductor links no libpython on Linux, so
    that folder is dropped from its search when it holds a libtorch_cpu.so."""
    import torch._inductor.cpp_builder as builder
    python_args = builder._get_python_related_args

    def without_system_libtorch():
        include_dirs, library_dirs = python_args()
        return include_dirs, [d for d in library_dirs
                              if not os.path.exists(os.path.join(d, "libtorch_cpu.so"))]
    builder._get_python_related_args = without_system_libtorch
