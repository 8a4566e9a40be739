"""Thread counts for the Python side of the benchmarks, as attnkit::set_num_threads sets them.

torch.set_num_threads sets PyTorch's OpenMP pool (and MKL's), not OpenBLAS or BLIS, which
Debian's PyTorch reaches through libblas.so.3 and which start one thread per core. Both are
set here, so that "--threads N" means N threads on both sides of a comparison.
"""

import ctypes

import torch

# (name, getter, setter) of the BLAS libraries whose thread count can be set at run time.
_BLAS_CONTROLS = (("OpenBLAS", "openblas_get_num_threads", "openblas_set_num_threads"),
                  ("BLIS", "bli_thread_get_num_threads", "bli_thread_set_num_threads"))


def _loaded_libraries():
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if ".so" in line.split()[-1]}
    return sorted(p for p in paths if "blas" in p or "blis" in p)


def _blas_control():
    for path in _loaded_libraries():
        library = ctypes.CDLL(path)
        for name, getter, setter in _BLAS_CONTROLS:
            if hasattr(library, getter) and hasattr(library, setter):
                return name, getattr(library, getter), getattr(library, setter)
    return None


def blas_threads():
    """(name, threads) of the BLAS torch calls; ("unknown", -1) when it is none of the known."""
    control = _blas_control()
    if control is None:
        return "unknown", -1
    name, getter, _ = control
    return name, int(getter())


def set_num_threads(threads):
    """Sets torch's intra-op threads and the BLAS's to `threads` (>= 1)."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    control = _blas_control()
    if control is not None:
        control[2](ctypes.c_int(threads))
