"""pip install . -- the Python package attnkit (python/attnkit) with its operators' library,
compiled against the torch of the environment that pip installs into (docs/python.md#install).

The library is src/core (attnkit's kernels, which include only LibTorch's headers) and
src/ops (the operators), built by torch.utils.cpp_extension; or, with ATTNKIT_PREBUILT_OPS set to
a CMake build's python/attnkit/lib/libattnkit_ops.so made against this same torch, that library
as it is (scripts/test.sh --pip). A CUDA torch
needs no CUDA toolkit here: attnkit has no CUDA sources of its own, and its operators' CUDA
registrations call LibTorch's CUDA operators, so this one build serves CPU and CUDA tensors.
"""
import os
import re
import shutil
import sys
import sysconfig
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
# setuptools' default, build/, is the CMake default preset's build tree.
BUILD_BASE = "build-python"
NEEDS = ("attnkit's operators compile against the PyTorch of the environment that installs "
         "them, with a C++17 compiler and OpenMP (Debian: g++; scripts/setup.sh installs it)")


def environment_torch():
    """The environment's torch. pip's build isolation leaves the target environment's
    packages off sys.path, so they are appended (after the isolated ones) when torch is not
    importable otherwise: the library must match the torch it will load into, not a copy
    downloaded for the build."""
    try:
        import torch
        return torch
    except ImportError:
        pass
    paths = sysconfig.get_paths(vars={"base": sys.prefix, "platbase": sys.prefix})
    for key in ("purelib", "platlib"):
        if paths[key] not in sys.path:
            sys.path.append(paths[key])
    try:
        import torch
        return torch
    except ImportError:
        sys.exit(f"attnkit: no torch importable by {sys.executable} (prefix {sys.prefix}). "
                 f"{NEEDS}: install torch into this environment first (pip install torch), "
                 "then pip install . (offline: pip install --no-build-isolation .)")


def project_version():
    """attnkit's version, from CMakeLists.txt's project() (the one place it is written)."""
    text = (ROOT / "CMakeLists.txt").read_text()
    match = re.search(r"project\(attnkit VERSION ([0-9.]+)", text)
    if not match:
        sys.exit("attnkit: no 'project(attnkit VERSION x.y.z' in CMakeLists.txt")
    return match.group(1)


torch = environment_torch()
from torch.utils.cpp_extension import BuildExtension, CppExtension  # noqa: E402

VERSION = project_version()
# The torch release: 2.15.0+cu132 -> (2, 15, 0), 1.13.0a0 -> (1, 13, 0).
TORCH_RELEASE = tuple(int(part) for part in
                      re.match(r"\d+(?:\.\d+)*", torch.__version__).group().split("."))
GENERATED = ROOT / BUILD_BASE / "include"


def write_if_changed(path, text):
    """Keeps the file's time when its text is the same, so that nothing rebuilds for it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)


def generate_version_header():
    """include/attnkit/version.h, as CMake writes it from cmake/version.h.in."""
    major, minor, patch = VERSION.split(".")
    values = {"PROJECT_VERSION": VERSION, "PROJECT_VERSION_MAJOR": major,
              "PROJECT_VERSION_MINOR": minor, "PROJECT_VERSION_PATCH": patch}
    template = (ROOT / "cmake" / "version.h.in").read_text()
    write_if_changed(GENERATED / "attnkit" / "version.h",
                     re.sub(r"@(\w+)@", lambda m: values[m.group(1)], template))


class BuildOperators(BuildExtension):
    """Names the library as attnkit.library_path() expects it (attnkit/lib/libattnkit_ops.so,
    loaded with torch.ops.load_library, not imported), and records the torch it was built
    against beside it (attnkit/_built_for.py, checked on import)."""

    def _add_compile_flag(self, extension, flag):
        # torch/torch.h would include torch/extension.h, with Python's and pybind11's headers:
        # the library is loaded by torch.ops.load_library and needs neither (and Debian's
        # python3-torch has no pybind11 headers).
        if flag != "-DTORCH_API_INCLUDE_EXTENSION_H":
            super()._add_compile_flag(extension, flag)

    def get_ext_filename(self, ext_name):
        return os.path.join(*ext_name.split(".")) + ".so"

    def run(self):
        super().run()
        record_torch(Path(self.get_ext_fullpath("attnkit.lib.libattnkit_ops")).parent.parent)

    def copy_extensions_to_source(self):
        """pip install -e .: the library and its record go into python/attnkit."""
        package = ROOT / "python" / "attnkit"
        (package / "lib").mkdir(exist_ok=True)
        super().copy_extensions_to_source()
        record_torch(package)


def record_torch(package):
    write_if_changed(package / "_built_for.py",
                     f'"""Written by setup.py: the torch this build compiled against."""\n'
                     f'TORCH_VERSION = "{torch.__version__}"\n')


PREBUILT = os.environ.get("ATTNKIT_PREBUILT_OPS")


def check_prebuilt(library):
    """ATTNKIT_PREBUILT_OPS: a libattnkit_ops.so that a CMake build compiled against this same
    torch (its package folder's _built_for.py, which CMake writes, says which)."""
    path = Path(library)
    record = path.parent.parent / "_built_for.py"
    if not path.is_file() or not record.is_file():
        missing = path if not path.is_file() else record
        sys.exit(f"attnkit: ATTNKIT_PREBUILT_OPS={library}: expected a CMake build's "
                 "python/attnkit/lib/libattnkit_ops.so with python/attnkit/_built_for.py (build "
                 f"the target attnkit_ops), but {missing} does not exist")
    recorded = re.search(r'TORCH_VERSION = "(\d+(?:\.\d+)*)[^"]*"', record.read_text())
    if not recorded or recorded.group(1) != ".".join(str(part) for part in TORCH_RELEASE):
        sys.exit(f"attnkit: ATTNKIT_PREBUILT_OPS={library} was built against PyTorch "
                 f"{recorded.group(1) if recorded else '(unrecorded)'}, this environment has "
                 f"{torch.__version__}: build it against this one, or unset "
                 "ATTNKIT_PREBUILT_OPS")
    return path


class PackagePrebuilt(build_py):
    """The operators' library of ATTNKIT_PREBUILT_OPS, packaged as it is instead of compiled
    again: CI's pip leg, whose CMake build compiled the same sources with the same compiler
    against the same torch a minute before (docs/building.md#ci)."""

    def run(self):
        super().run()
        package = Path(self.build_lib) / "attnkit"
        (package / "lib").mkdir(parents=True, exist_ok=True)
        shutil.copy2(check_prebuilt(PREBUILT), package / "lib" / "libattnkit_ops.so")
        record_torch(package)


class PlatformDistribution(Distribution):
    """A wheel for this platform and this torch, whether it compiled the library or not."""

    def has_ext_modules(self):
        return True


generate_version_header()
sources = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "src" / "core").rglob("*.cpp"))
sources += sorted(str(path.relative_to(ROOT)) for path in (ROOT / "src" / "ops").glob("*.cpp"))

setup(
    name="attnkit",
    # The local label records the torch the operators were compiled against: 0.1.0+torch2.15.0.cu132.
    version=f"{VERSION}+torch{torch.__version__.replace('+', '.')}",
    description="FlexAttention's API on attnkit's kernels: a CPU backward, memory linear in n",
    python_requires=">=3.8",
    # The same release of torch: its operators' ABI differs between releases.
    install_requires=[f"torch=={torch.__version__.split('+')[0]}"],
    package_dir={"": "python"},
    packages=["attnkit"],
    distclass=PlatformDistribution,
    ext_modules=[] if PREBUILT else [CppExtension(
        "attnkit.lib.libattnkit_ops", sources,
        include_dirs=[str(ROOT / "include"), str(GENERATED), str(ROOT / "src")],
        # attnkit's kernels run at::parallel_for's OpenMP loops (src/core/base/parallel.h); C++17 at
        # least, where torch before 2.0 would ask for C++14.
        extra_compile_args=["-O3", "-g0", "-fopenmp"] + (["-std=c++17"] if TORCH_RELEASE < (2,)
                                                          else []),
        extra_link_args=["-fopenmp"])],
    cmdclass={"build_ext": BuildOperators, **({"build_py": PackagePrebuilt} if PREBUILT else {})},
    options={"build": {"build_base": BUILD_BASE}, "egg_info": {"egg_base": BUILD_BASE}},
    zip_safe=False,
)
