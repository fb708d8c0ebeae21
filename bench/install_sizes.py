"""Install size by role: each of `pip install '.[llama]'`, `'.[torch]'` and `'.[coordinator]'` into its own clean
virtual environment, from a copy of this checkout (as installer/install.sh installs it), and the size of each venv.

    python bench/install_sizes.py            # the table in docs/benchmarks.md (and the figures README.md quotes)
    python bench/install_sizes.py --roles llama

torch is the CPU build (``--torch-spec``, default torch==2.13.0, installed before the extra as the installer does;
put its wheel in $PIP_FIND_LINKS or pass --torch-index-url https://download.pytorch.org/whl/cpu — pip's default
index serves the CUDA build on Linux, several GB more). llama-cpp-python is compiled with the Makefile's portable
CMAKE_ARGS, or taken from pip's wheel cache when `make setup` already compiled it.

A venv's size is the sum of its files' sizes (symlinks not followed), in MB (10^6 bytes) — what
tests/integration/test_install_roles.py prints for the llama venv and bounds. The table also lists the largest
packages of each venv and whether torch, transformers or peft are in it. Writes the table into docs/benchmarks.md
between the bench's markers.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROLES = ("llama", "torch", "coordinator")
LLAMA_CMAKE_ARGS = "-DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF"  # the Makefile's
HEAVY = ("torch", "transformers", "peft")
TABLE_START = "<!-- install-sizes:start (bench/install_sizes.py writes this table) -->"
TABLE_END = "<!-- install-sizes:end -->"


@dataclass(frozen=True)
class VenvSize:
    role: str
    mb: float
    heavy: list[str]  # which of HEAVY the venv holds
    torch: str | None  # its version, when installed
    largest: list[tuple[str, float]]  # the largest packages, MB


def copy_checkout(dst: Path) -> None:
    """The checkout's tracked and untracked-but-not-ignored files (no build/, no .venv)."""
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           capture_output=True, check=True, timeout=120).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


def size_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink()) / 1e6


def largest(site: Path, n: int = 3) -> list[tuple[str, float]]:
    """The n largest top-level entries of site-packages (packages and their data), by size."""
    sizes = [(p.name, size_mb(p) if p.is_dir() else p.stat().st_size / 1e6) for p in site.iterdir()
             if not p.name.endswith((".dist-info", ".pth")) and p.name != "__pycache__"]
    return sorted(sizes, key=lambda x: -x[1])[:n]


def pip(py: Path, *args: str, env: dict[str, str]) -> None:
    res = subprocess.run([str(py), "-m", "pip", "install", "--quiet", *args], capture_output=True, text=True,
                         timeout=3600, env=env)
    if res.returncode != 0:
        raise SystemExit(f"pip install {' '.join(args)} failed:\n{res.stdout[-3000:]}{res.stderr[-3000:]}")


def measure(role: str, src: Path, work: Path, args: argparse.Namespace) -> VenvSize:
    venv = work / f"venv-{role}"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["CMAKE_ARGS"] = env.get("CMAKE_ARGS") or LLAMA_CMAKE_ARGS
    if role != "llama":
        pip(py, args.torch_spec, *(["--index-url", args.torch_index_url] if args.torch_index_url else []), env=env)
    pip(py, f"{src}[{role}]", env=env)
    probe = subprocess.run([str(py), "-I", "-c", "import importlib.util, sys, sysconfig; "
                            f"print(sysconfig.get_paths()['purelib']); print(*[m for m in {HEAVY!r} "
                            "if importlib.util.find_spec(m)]); import importlib.metadata as md; "
                            "print(md.version('torch') if importlib.util.find_spec('torch') else '-')"],
                           capture_output=True, text=True, timeout=300, cwd=work)
    if probe.returncode != 0:
        raise SystemExit(f"the {role} venv does not import: {probe.stderr[-3000:]}")
    site, heavy, torch_version = probe.stdout.splitlines()[:3]
    result = VenvSize(role, size_mb(venv), heavy.split(), None if torch_version == "-" else torch_version,
                      largest(Path(site)))
    shutil.rmtree(venv)
    return result


def write_table(results: list[VenvSize], command: str) -> str:
    rows = ["| install | venv size | torch / transformers / peft in it | largest packages |", "|---|---|---|---|"]
    for r in results:
        heavy = ", ".join(r.heavy) or "none"
        if r.torch:
            heavy += f" (torch {r.torch})"
        big = ", ".join(f"{name} {mb:,.0f} MB" for name, mb in r.largest)
        rows.append(f"| `pip install '.[{r.role}]'` | {r.mb:,.0f} MB | {heavy} | {big} |")
    table = "\n".join([TABLE_START, f"`{command}` on {platform.system()} {platform.machine()}, Python "
                       f"{platform.python_version()}, {date.today():%Y-%m-%d}:", "", *rows, TABLE_END])
    doc = REPO / "docs" / "benchmarks.md"
    text = doc.read_text()
    if TABLE_START in text and TABLE_END in text:
        head, rest = text.split(TABLE_START, 1)
        text = head + table + rest.split(TABLE_END, 1)[1]
    else:
        text = (text.rstrip("\n") + "\n\n## Install size by role (`bench/install_sizes.py`)\n\n"
                "Each role's extra in a clean venv from a copy of the checkout (torch: the CPU build). README.md "
                "and docs/client.md quote these figures.\n\n" + table + "\n")
    doc.write_text(text)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--roles", nargs="+", choices=ROLES, default=list(ROLES), help="Which extras to measure.")
    parser.add_argument("--torch-spec", default="torch==2.13.0", help="torch for the torch and coordinator venvs "
                        "(the CPU build: its wheel in $PIP_FIND_LINKS, or --torch-index-url).")
    parser.add_argument("--torch-index-url", default=None, help="e.g. https://download.pytorch.org/whl/cpu")
    parser.add_argument("--no-write", action="store_true", help="Print the table only.")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="echo-swarm-sizes.") as tmp:
        work = Path(tmp)
        copy_checkout(work / "src")
        results = []
        for role in args.roles:
            result = measure(role, work / "src", work, args)
            print(result, flush=True)
            results.append(result)
    command = "python bench/install_sizes.py" + ("" if list(args.roles) == list(ROLES) else
                                                 " --roles " + " ".join(args.roles))
    if args.no_write:
        print("\n".join(f"{r.role}: {r.mb:,.0f} MB" for r in results))
    else:
        print(write_table(results, command))


if __name__ == "__main__":
    main()
