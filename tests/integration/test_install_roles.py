"""Install by role (issue 25): `pip install '.[llama]'` from the checkout into a clean virtual environment gives a
working llama.cpp client without torch, transformers or peft. The client from that venv joins a real coordinator
(run from the development venv) and has a llama.cpp result accepted, and torch is neither in its ``sys.modules``
nor mapped into the process (/proc/PID/maps); llama.cpp's own log goes to the client's log file, not over the
terminal. Prints the venv's size (README.md and docs/client.md quote it).

pip builds from a copy of the checkout's files (as installer/install.sh does) and takes llama-cpp-python's compiled
wheel from its cache (`make setup` compiled it once, with the same CMAKE_ARGS)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from swarm_client.control import read_status
from tests.integration.helpers import REPO, Proc, db_rows, start_coordinator, wait_until, write_config

pytestmark = pytest.mark.slow
LLAMA_CMAKE_ARGS = "-DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF"  # the Makefile's, so pip reuses the wheel it built
#: how llama.cpp's own log lines begin when it prints them itself (its function names)
RAW_LLAMA = re.compile(r"^(llama_|ggml_|gguf_|load_tensors|print_info|load:|main:|common_)")
HEAVY = ("torch", "transformers", "peft", "matplotlib", "prometheus_client")


def _copy_checkout(dst: Path) -> None:
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           capture_output=True, check=True, timeout=120).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


def _size_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink()) / 1e6


@pytest.mark.timeout(1800)
def test_a_llama_install_has_no_torch_and_gets_a_result_accepted(tmp_path: Path, tiny_model_dir: Path) -> None:
    src, venv = tmp_path / "src", tmp_path / "venv"
    _copy_checkout(src)
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    res = subprocess.run([str(py), "-m", "pip", "install", "--quiet", f"{src}[llama]"], capture_output=True,
                         text=True, timeout=1500, env=env | {"CMAKE_ARGS": LLAMA_CMAKE_ARGS})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    probe = subprocess.run([str(py), "-I", "-c", "import importlib.util, json; print(json.dumps({m: "
                            f"importlib.util.find_spec(m) is not None for m in {HEAVY!r} + ('llama_cpp',)}}))"],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path)
    found = json.loads(probe.stdout)
    assert found.pop("llama_cpp") and not any(found.values()), f"the llama install pulled in {found}"
    size = _size_mb(venv)
    print(f"\n`pip install '.[llama]'` venv: {size:.0f} MB")
    assert size < 400, f"the llama.cpp client's venv is {size:.0f} MB: something heavy came in"

    config = write_config(tmp_path / "run.toml", tmp_path / "run", tiny_model_dir, top={"layout": "one-process"},
                          learner={"max_steps": 50})
    coord, url = start_coordinator(config, tmp_path / "coordinator.log")
    home = tmp_path / "client"
    modules = tmp_path / "modules.json"
    # the client exactly as the console script runs it, plus a record of every module it imported, made at exit
    wrapper = ("import atexit, json, sys\n"
               f"atexit.register(lambda: open({str(modules)!r}, 'w').write(json.dumps(sorted(sys.modules))))\n"
               "from echo_swarm.cli import main\n"
               "sys.argv[0] = 'echo-swarm'\n"
               "main()\n")
    client = Proc([str(py), "-I", "-c", wrapper, "join", url, "--home", str(home), "--no-benchmark", "--no-panel",
                   "--threads", "1"], tmp_path / "client.log", env={"PYTHONPATH": ""})
    try:
        wait_until(lambda: (read_status(home) or {}).get("accepted", 0) >= 1, 300,
                   "an accepted result from the llama.cpp client")
        maps = Path(f"/proc/{client.pid}/maps").read_text()
        assert "llama" in maps, "llama.cpp's library is not mapped: the check below would prove nothing"
        assert "torch" not in maps, "torch's libraries are mapped into the llama.cpp client"
        backends = db_rows(tmp_path / "run", "SELECT DISTINCT json_extract(profile, '$.backend') FROM clients")
        assert backends == [("llama",)]
    finally:
        assert client.stop() == 0, client.output()[-3000:]
        coord.stop()
    imported = set(json.loads(modules.read_text()))
    assert "llama_cpp" in imported and "swarm_client.backends.llama_backend" in imported
    assert not imported & set(HEAVY), f"the client imported {sorted(imported & set(HEAVY))}"
    # the panel stays readable: llama.cpp's own log (model loader, context) went into the rotated log file through
    # the client's logger, and no raw llama.cpp line reached the terminal
    logged = (home / "logs" / "client.log").read_text()
    assert re.search(r" llama\.cpp: llama_(model_loader|context)", logged), logged[-3000:]
    raw = [line for line in client.output().splitlines() if RAW_LLAMA.match(line)]
    assert not raw, f"llama.cpp wrote over the terminal: {raw[:5]}"
