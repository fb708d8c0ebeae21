"""installer/install.sh: options, the dry-run plan, hardware detection (with stand-in commands), errors, and
one real install into a fresh temporary HOME (slow: it builds a venv with torch and echo-swarm)."""

from __future__ import annotations

import os
import platform
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "installer" / "install.sh"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
OPTIONS = ["--python", "--prefix", "--torch-spec", "--torch-index-url", "--no-torch-index", "--source",
           "--from-pypi", "--bin-dir", "--no-link", "--with-llama", "--with-p2p", "--dry-run", "--help"]
STEP_HEADINGS = [f"==> [{n}/7]" for n in range(1, 8)]


def _path_without_test_venv() -> str:
    """PATH without the virtualenv that runs pytest, so the installer finds Python as a user's shell would."""
    entries = os.environ.get("PATH", "").split(os.pathsep)
    if sys.prefix == sys.base_prefix:
        return os.pathsep.join(entries)
    venv = Path(sys.prefix).resolve()
    return os.pathsep.join(e for e in entries if e and not Path(e).resolve().is_relative_to(venv))


def installer_env(home: Path, path_prefix: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTHON", "XDG_DATA_HOME", "XDG_CACHE_HOME",
                        "XDG_CONFIG_HOME", "XDG_STATE_HOME", "ECHO_SWARM_HOME"}}
    path = _path_without_test_venv()
    if path_prefix is not None:
        path = f"{path_prefix}{os.pathsep}{path}"
    env.update(HOME=str(home), XDG_DATA_HOME=str(home / ".local" / "share"), XDG_CACHE_HOME=str(home / ".cache"),
               XDG_CONFIG_HOME=str(home / ".config"), XDG_STATE_HOME=str(home / ".local" / "state"), PATH=path)
    return env


def run_installer(*args: str, env: dict[str, str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def fake_command(folder: Path, name: str, body: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    h = tmp_path / "home"
    h.mkdir()
    return h


def test_help_explains_every_option(tmp_path: Path, home: Path) -> None:
    res = run_installer("--help", env=installer_env(home), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    for opt in OPTIONS:
        assert opt in res.stdout, f"--help does not mention {opt}"
    assert "--torch-spec torch==2.13.0 --no-torch-index" in res.stdout  # the CI invocation
    assert "echo-swarm join <COORDINATOR_URL>" in res.stdout
    assert tree(home) == []


def test_dry_run_prints_detection_and_plan_and_creates_nothing(tmp_path: Path, home: Path) -> None:
    before = tree(tmp_path)
    res = run_installer("--dry-run", "--bin-dir", str(tmp_path / "bin"), env=installer_env(home), cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert f"OS:           {platform.system()}" in out
    assert f"Architecture: {platform.machine()}" in out
    for heading in STEP_HEADINGS:
        assert heading in out
    assert "Plan (dry run" in out
    venv = home / ".local" / "share" / "echo-swarm" / "venv"
    assert f"virtual environment: {venv}" in out
    assert f"would run: {venv}/bin/python -m pip install --upgrade pip" in out
    assert f"from the checkout {REPO}" in out
    assert f"ln -sfn {venv}/bin/echo-swarm {tmp_path}/bin/echo-swarm" in out
    assert "join <COORDINATOR_URL>" in out
    if platform.system() == "Linux" and shutil.which("nvidia-smi", path=installer_env(home)["PATH"]) is None:
        assert f"--index-url {CPU_INDEX}" in out  # no GPU: the CPU build
    assert tree(tmp_path) == before, "--dry-run created files"


def test_dry_run_with_nvidia_gpu_plans_the_cuda_build(tmp_path: Path, home: Path) -> None:
    fakes = tmp_path / "fakes"
    fake_command(fakes, "uname", 'case "$1" in -m) echo x86_64 ;; *) echo Linux ;; esac\n')
    fake_command(fakes, "nvidia-smi", """case "$1" in
  --query-gpu=*) echo 'NVIDIA H200, 550.54.15' ;;
  *) echo '| NVIDIA-SMI 550.54.15    Driver Version: 550.54.15    CUDA Version: 12.4 |' ;;
esac
""")
    res = run_installer("--dry-run", env=installer_env(home, fakes), cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "GPU:          NVIDIA H200 (driver 550.54.15, CUDA 12.4)" in res.stdout
    assert "CUDA build from PyPI" in res.stdout
    assert "--index-url" not in res.stdout
    assert "pip install 'torch>=2.2,<3'" in res.stdout  # the range from pyproject.toml


def test_dry_run_on_apple_silicon_plans_the_mps_build(tmp_path: Path, home: Path) -> None:
    fakes = tmp_path / "fakes"
    fake_command(fakes, "uname", 'case "$1" in -m) echo arm64 ;; *) echo Darwin ;; esac\n')
    fake_command(fakes, "sysctl", 'case "$2" in machdep.cpu.brand_string) echo "Apple M2" ;; *) echo 0 ;; esac\n')
    res = run_installer("--dry-run", "--no-link", env=installer_env(home, fakes), cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "OS:           Darwin" in res.stdout
    assert "GPU:          Apple silicon (Apple M2): Metal (MPS)" in res.stdout
    assert "--index-url" not in res.stdout
    assert "skipped (--no-link)" in res.stdout


def test_torch_overrides_reach_the_plan(tmp_path: Path, home: Path) -> None:
    env = installer_env(home)
    res = run_installer("--dry-run", "--torch-spec", "torch==2.13.0", "--no-torch-index", env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "pip install torch==2.13.0\n" in res.stdout
    res = run_installer("--dry-run", "--torch-index-url=https://example.invalid/whl", env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "--index-url https://example.invalid/whl" in res.stdout


@pytest.mark.parametrize("args, message", [
    (["--frobnicate"], "unknown option: --frobnicate"),
    (["--prefix"], "option --prefix needs a value"),
    (["--dry-run=yes"], "option --dry-run takes no value"),
    (["--source", ".", "--from-pypi"], "contradict"),
    (["--torch-index-url", "https://example.invalid", "--no-torch-index"], "contradict"),
    (["stray"], "unexpected argument: stray"),
])
def test_bad_usage_exits_non_zero_with_a_message(tmp_path: Path, home: Path, args: list[str], message: str) -> None:
    res = run_installer(*args, "--dry-run", env=installer_env(home), cwd=tmp_path)
    assert res.returncode == 2
    assert message in res.stderr
    assert "--help" in res.stderr


@pytest.mark.parametrize(("uname", "gpu", "cmake"), [
    ("Linux x86_64", None, "-DLLAVA_BUILD=OFF"),
    ("Linux x86_64", "nvidia", "-DGGML_CUDA=on"),
    ("Darwin arm64", "apple", "-DGGML_METAL=on"),
])
def test_with_llama_plans_the_build_for_the_accelerator(tmp_path: Path, home: Path, uname: str, gpu: str | None,
                                                        cmake: str) -> None:
    fakes = tmp_path / "fakes"
    os_name, arch = uname.split()
    fake_command(fakes, "uname", f'case "$1" in -m) echo {arch} ;; *) echo {os_name} ;; esac\n')
    if gpu == "nvidia":
        fake_command(fakes, "nvidia-smi", """case "$1" in
  --query-gpu=*) echo 'NVIDIA H200, 550.54.15' ;;
  *) echo '| NVIDIA-SMI 550.54.15    Driver Version: 550.54.15    CUDA Version: 12.4 |' ;;
esac
""")
    if gpu == "apple":
        fake_command(fakes, "sysctl", 'case "$2" in machdep.cpu.brand_string) echo "Apple M2" ;; *) echo 0 ;; esac\n')
    env = installer_env(home, fakes)
    env.pop("CMAKE_ARGS", None)
    res = run_installer("--with-llama", "--with-p2p", "--dry-run", "--no-link", env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"CMAKE_ARGS={cmake}" in res.stdout
    assert "llama-cpp-python>=0.3.36,<0.4" in res.stdout
    assert "--prefer-binary hivemind==1.1.12" in res.stdout  # the [p2p] extra, pinned exactly
    assert tree(home) == []


def test_missing_or_old_python_says_how_to_install_it(tmp_path: Path, home: Path) -> None:
    env = installer_env(home)
    res = run_installer("--dry-run", "--python", str(tmp_path / "no-such-python"), env=env, cwd=tmp_path)
    assert res.returncode == 1
    assert "Python interpreter not found" in res.stderr
    assert "install Python 3.11 or newer" in res.stderr
    old = tmp_path / "fakes"
    fake_command(old, "python3.9", 'echo "3.9.18 False x86_64 $0"\n')
    env["PYTHON"] = str(old / "python3.9")  # $PYTHON is honoured like --python
    res = run_installer("--dry-run", env=env, cwd=tmp_path)
    assert res.returncode == 1
    assert "is Python 3.9.18; echo-swarm needs Python >= 3.11" in res.stderr
    assert "what to do:" in res.stderr


def _python3_tag(env: dict[str, str]) -> str | None:
    python3 = shutil.which("python3", path=env["PATH"])
    if python3 is None:
        return None
    res = subprocess.run([python3, "-c", "import sys; print('cp%d%d' % sys.version_info[:2])"], env=env,
                         capture_output=True, text=True, timeout=60)
    return res.stdout.strip() if res.returncode == 0 else None


@pytest.mark.slow
@pytest.mark.timeout(1900)
def test_full_install_into_a_fresh_home(tmp_path: Path, home: Path) -> None:
    env = installer_env(home)
    tag = _python3_tag(env)
    links = [Path(p) for p in os.environ.get("PIP_FIND_LINKS", "").split() if p]
    if tag is None or not any(d.is_dir() and any(d.glob(f"torch-2.13.0*-{tag}-*.whl")) for d in links):
        pytest.skip(f"no local torch 2.13.0 wheel for {tag} in PIP_FIND_LINKS: torch==2.13.0 would be a multi-GB "
                    "download of the CUDA build")
    env["TMPDIR"] = str(tmp_path / "tmp")
    (tmp_path / "tmp").mkdir()
    bin_dir = tmp_path / "bin"
    had_build_dir = (REPO / "build").exists()
    args = ["--torch-spec", "torch==2.13.0", "--no-torch-index", "--source", str(REPO), "--bin-dir", str(bin_dir)]

    res = run_installer(*args, env=env, cwd=tmp_path, timeout=900)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-6000:]
    for heading in STEP_HEADINGS:
        assert heading in res.stdout
    assert "torch will use: cpu" in res.stdout or "torch will use: cuda" in res.stdout
    assert f"{bin_dir}/echo-swarm join <COORDINATOR_URL>" in res.stdout  # bin dir is not on PATH: full path

    venv = home / ".local" / "share" / "echo-swarm" / "venv"
    link = bin_dir / "echo-swarm"
    assert link.is_symlink() and Path(os.readlink(link)) == venv / "bin" / "echo-swarm"
    cli = subprocess.run([str(link), "--help"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    assert "join" in cli.stdout
    probe = subprocess.run(
        [str(venv / "bin" / "python"), "-I", "-c",
         "import swarm_client, swarm_client.backends.torch_backend, torch; print(swarm_client.__file__); "
         "print(torch.__version__)"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr
    module_file, torch_version = probe.stdout.split()
    assert Path(module_file).is_relative_to(venv), "swarm_client was not installed into the venv"
    assert torch_version.startswith("2.13.0")
    if not had_build_dir:
        assert not (REPO / "build").exists(), "the install built inside the checkout"
    assert not list((tmp_path / "tmp").glob("echo-swarm-install.*")), "the temporary source copy was not removed"

    # Running it again reuses the venv and keeps the link.
    again = run_installer(*args, env=env, cwd=tmp_path, timeout=900)
    assert again.returncode == 0, (again.stdout + again.stderr)[-6000:]
    assert "reusing the existing virtual environment" in again.stdout
    assert link.is_symlink() and Path(os.readlink(link)) == venv / "bin" / "echo-swarm"
