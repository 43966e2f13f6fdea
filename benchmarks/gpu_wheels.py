"""``make gpu-wheels``: the wheels ``make gpu-check`` installs on a GPU machine that has no network.

That machine has Python 3.12 with a CUDA torch, Triton, Lightning, transformers, peft, accelerate,
safetensors, matplotlib, rich, hypothesis and pytest; this downloads, for Linux x86-64 and Python 3.12, what
it lacks, at the versions this environment has installed (so the GPU runs what CI tests): the peers of the
benchmarks (Cut Cross-Entropy, Liger-Kernel), jsonargparse and its signature extras for the CLI,
pytest-timeout, and bitsandbytes if it fits. The folder plus the repository's tracked files must stay within
:data:`LIMIT_BYTES`; a wheel that does not fit is left out and named (``make gpu-check`` then reports the
steps that need it as skipped).

    python -m benchmarks.gpu_wheels .gpu-wheels
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LIMIT_BYTES = 60 * 2**20
# in order of need: what is dropped first when over the limit is last
WANTED = ("cut-cross-entropy", "liger-kernel", "jsonargparse", "docstring-parser", "typeshed-client",
          "importlib-resources", "pytest-timeout", "bitsandbytes")
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_24_x86_64", "manylinux_2_28_x86_64")  # pure wheels match any


def pinned(name: str) -> str:
    """``name==version`` as installed here, or the bare name when it is not installed."""
    try:
        return f"{name}=={metadata.version(name)}"
    except metadata.PackageNotFoundError:
        return name


def repo_bytes() -> int:
    """Bytes of the repository's tracked files (what travels to the GPU machine with the wheels)."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout.split(b"\0")
    return sum((REPO / n.decode()).stat().st_size for n in names if n and (REPO / n.decode()).is_file())


def download(requirement: str, dest: Path) -> list[Path]:
    """Download one wheel (no dependencies) for CPython 3.12 on Linux x86-64; the files that appeared."""
    before = set(dest.glob("*.whl"))
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(dest), requirement],
                   check=True)
    return sorted(set(dest.glob("*.whl")) - before)


def fit(sizes: dict[str, int], budget: int) -> tuple[list[str], list[str]]:
    """Keep the wanted wheels in order while their bytes fit ``budget``; ``(kept, dropped)``.

    >>> fit({"a": 10, "b": 50, "c": 5}, 20)
    (['a', 'c'], ['b'])
    """
    kept, dropped, used = [], [], 0
    for name, size in sizes.items():
        if used + size <= budget:
            kept.append(name)
            used += size
        else:
            dropped.append(name)
    return kept, dropped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_wheels", description=__doc__.splitlines()[0])
    parser.add_argument("dest", type=Path, help="the folder to fill (emptied of wheels first)")
    args = parser.parse_args(argv)
    args.dest.mkdir(parents=True, exist_ok=True)
    for old in args.dest.glob("*.whl"):
        old.unlink()
    files = {name: download(pinned(name), args.dest) for name in WANTED}
    budget = LIMIT_BYTES - repo_bytes()
    kept, dropped = fit({n: sum(f.stat().st_size for f in fs) for n, fs in files.items()}, budget)
    for name in dropped:
        for f in files[name]:
            f.unlink()
        print(f"gpu-wheels: {name} left out: it does not fit in {LIMIT_BYTES // 2**20} MiB with the repository")
    total = sum(f.stat().st_size for n in kept for f in files[n])
    print(f"gpu-wheels: {len(kept)} wheels, {total / 2**20:.1f} MiB in {args.dest} "
          f"(+ {repo_bytes() / 2**20:.1f} MiB of repository; limit {LIMIT_BYTES // 2**20} MiB): {', '.join(kept)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
