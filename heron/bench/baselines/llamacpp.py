"""llama.cpp's own ``llama-server`` as a baseline: built from the llama.cpp sources vendored in the
llama-cpp-python sdist (fetched with pip) into heron's cache, then launched with continuous batching.

Nothing of llama.cpp is kept in heron's repository: sources and binary live under ``~/.cache/heron/llamacpp``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Sequence
from pathlib import Path

from heron.errors import ConfigError

SDIST = "llama-cpp-python"
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
               "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF")
# ggml ISA options and the CPU flag each needs. AMX stays off whatever the CPU has: ggml's AMX path segfaults in
# ggml_backend_amx_mul_mat on the Sapphire Rapids machines heron is measured on, and a baseline that crashes is
# no baseline; hence no GGML_NATIVE either (it would turn AMX on).
_ISA = (("GGML_AVX", "avx"), ("GGML_AVX2", "avx2"), ("GGML_FMA", "fma"), ("GGML_F16C", "f16c"),
        ("GGML_AVX512", "avx512f"), ("GGML_AVX512_VBMI", "avx512vbmi"), ("GGML_AVX512_VNNI", "avx512_vnni"),
        ("GGML_AVX512_BF16", "avx512_bf16"))


def isa_flags(cpu_flags: frozenset[str] | None = None) -> list[str]:
    """cmake options for this CPU's instruction sets, explicitly, with AMX off."""
    from heron.cpu import cpu_flags as detected

    flags = detected() if cpu_flags is None else cpu_flags
    options = [f"-D{option}={'ON' if flag in flags else 'OFF'}" for option, flag in _ISA]
    return ["-DGGML_NATIVE=OFF", *options, "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


def cache_dir() -> Path:
    """Where sources and build live: ``<heron cache>/llamacpp``."""
    from heron.model.default_model import heron_cache_dir

    return heron_cache_dir() / "llamacpp"


def build_dir() -> Path:
    """The build folder, one per set of ISA options (a build for another CPU is never reused)."""
    key = hashlib.sha256(" ".join(isa_flags()).encode()).hexdigest()[:12]
    return cache_dir() / f"build-{key}"


def tool_binary(target: str) -> Path:
    """Path of a built llama.cpp program (cmake target): ``llama-server``, ``llama-perplexity``, ..."""
    return build_dir() / "bin" / target


def server_binary() -> Path:
    """Path of the built ``llama-server``."""
    return tool_binary("llama-server")


def perplexity_binary() -> Path:
    """Path of the built ``llama-perplexity``."""
    return tool_binary("llama-perplexity")


def _run(cmd: list[str], what: str) -> None:
    print("+", " ".join(cmd), flush=True)
    if subprocess.run(cmd).returncode != 0:
        raise ConfigError(f"{what} failed (command above); see docs/benchmarks.md for the llama-cpp-python "
                          "fallback (heron baseline llamacpp --runtime python)")


def fetch_sources(version: str | None = None) -> Path:
    """Download the llama-cpp-python sdist with pip and unpack it; return its ``vendor/llama.cpp`` directory."""
    src = cache_dir() / "src"
    src.mkdir(parents=True, exist_ok=True)
    spec = f"{SDIST}=={version}" if version else SDIST
    found = sorted(src.glob("llama_cpp_python-*.tar.gz"))
    if version:
        found = [p for p in found if p.name == f"llama_cpp_python-{version}.tar.gz"]
    if not found:
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", spec, "-d", str(src)],
             f"pip download of the {spec} sdist")
        found = sorted(src.glob("llama_cpp_python-*.tar.gz"))
    sdist = found[-1]
    root = src / sdist.name.removesuffix(".tar.gz")
    if not (root / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        with tarfile.open(sdist) as tar:
            tar.extractall(src, filter="data")
    vendor = root / "vendor" / "llama.cpp"
    if not (vendor / "CMakeLists.txt").is_file():
        raise ConfigError(f"{sdist.name} has no vendor/llama.cpp sources")
    return vendor


def build(jobs: int | None = None, version: str | None = None, force: bool = False,
          targets: Sequence[str] = ("llama-server",)) -> Path:
    """Build the cmake ``targets`` (default ``llama-server``; CPU, this CPU's instruction sets without AMX) unless
    already built, all with the same flags into the same folder; return the first target's binary."""
    binaries = [tool_binary(target) for target in targets]
    if all(b.is_file() for b in binaries) and not force:
        return binaries[0]
    if not shutil.which("cmake"):
        raise ConfigError("building llama-server needs cmake and a C++ compiler (apt-get install cmake g++)")
    vendor = fetch_sources(version)
    folder = build_dir()
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    _run(["cmake", "-S", str(vendor), "-B", str(folder), *generator, *CMAKE_FLAGS, *isa_flags()], "cmake configure")
    _run(["cmake", "--build", str(folder), "--target", *targets, "-j", str(jobs or os.cpu_count() or 1)],
         f"cmake build of {', '.join(targets)}")
    return binaries[0]


def server_command(gguf: Path, host: str, port: int, parallel: int, slot_ctx: int, threads: int | None,
                   alias: str, binary: Path | None = None) -> list[str]:
    """The llama-server command line: ``parallel`` slots of ``slot_ctx`` tokens each, continuous batching."""
    cmd = [str(binary or server_binary()), "-m", str(gguf), "--host", host, "--port", str(port),
           "--parallel", str(parallel), "--cont-batching", "--ctx-size", str(parallel * slot_ctx),
           "--alias", alias, "--no-webui"]
    return cmd + (["--threads", str(threads)] if threads else [])


def perplexity_command(gguf: Path, text_file: Path, ctx: int, threads: int | None, binary: Path | None = None,
                       chunks: int | None = None) -> list[str]:
    """The ``llama-perplexity`` command line: ``text_file`` cut into chunks of ``ctx`` tokens (the first ``chunks``
    of them if given), each evaluated from an empty cache, scoring the second half of each chunk (positions
    ctx/2+1 .. ctx-1; the first half is context)."""
    cmd = [str(binary or perplexity_binary()), "-m", str(gguf), "-f", str(text_file), "--ctx-size", str(ctx)]
    cmd += ["--chunks", str(chunks)] if chunks else []
    return cmd + (["--threads", str(threads)] if threads else [])


def python_server_command(gguf: Path, host: str, port: int, slot_ctx: int, threads: int | None,
                          alias: str) -> list[str]:
    """The fallback: llama-cpp-python's own server (one sequence at a time, no continuous batching)."""
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", host, "--port", str(port),
           "--n_ctx", str(slot_ctx), "--model_alias", alias]
    return cmd + (["--n_threads", str(threads)] if threads else [])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``heron baseline llamacpp``."""
    from heron.config import DEFAULT_MODEL

    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"a .gguf file or built-in model name "
                        f"(default: {DEFAULT_MODEL})")
    parser.add_argument("--served-model-name", default=None, help="model alias the API reports (default: --model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8002, help="port to listen on (default: 8002)")
    parser.add_argument("--parallel", type=int, default=16, help="server slots = requests decoded together "
                        "(default: 16)")
    parser.add_argument("--slot-ctx", type=int, default=1024, help="context tokens per slot (default: 1024)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: llama.cpp's choice)")
    parser.add_argument("--runtime", choices=["native", "python"], default="native",
                        help="native: build and run llama-server (default); python: llama-cpp-python[server], "
                        "which must already be installed")
    parser.add_argument("--build-only", action="store_true", help="build llama-server into the cache and exit")
    parser.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: all cores)")
    parser.add_argument("--version", default=None, help="llama-cpp-python sdist version (default: newest)")


def main(args: argparse.Namespace) -> int:
    """Build llama-server if needed, then replace this process with it."""
    from heron.bench.resolve import resolve_model_files

    if args.build_only:
        print(build(args.jobs, args.version))
        return 0
    gguf = resolve_model_files(args.model).gguf_path
    if gguf is None:
        raise ConfigError(f"llama.cpp needs a .gguf model; {args.model!r} is not one")
    alias = args.served_model_name or args.model
    if args.runtime == "python":
        cmd = python_server_command(gguf, args.host, args.port, args.slot_ctx, args.threads, alias)
    else:
        cmd = server_command(gguf, args.host, args.port, args.parallel, args.slot_ctx, args.threads, alias,
                             build(args.jobs, args.version))
    print("+", " ".join(cmd), flush=True)
    os.execv(cmd[0], cmd)
    return 0  # not reached
