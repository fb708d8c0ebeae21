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
           "--from-pypi", "--bin-dir", "--no-link", "--with-llama", "--with-p2p", "--no-torch", "--uninstall",
           "--purge", "--dry-run", "--help"]
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


def _torch_wheel_dirs(tag: str) -> list[Path]:
    """Folders holding a torch 2.13.0 wheel for ``tag``: the one `make setup` fills (``$VENV/wheels``, the wheel the
    test venv's own torch was installed from) and any in PIP_FIND_LINKS."""
    candidates = [Path(sys.prefix) / "wheels"] + [Path(p) for p in os.environ.get("PIP_FIND_LINKS", "").split() if p]
    return [d for d in candidates if d.is_dir() and any(d.glob(f"torch-2.13.0*-{tag}-*.whl"))]


@pytest.mark.slow
@pytest.mark.timeout(1900)
def test_full_install_into_a_fresh_home(tmp_path: Path, home: Path) -> None:
    env = installer_env(home)
    tag = _python3_tag(env)
    assert tag is not None, "no python3 on PATH for the installer to find"
    wheels = _torch_wheel_dirs(tag)
    # torch==2.13.0 from the index would be a multi-GB download of the CUDA build: `make setup` keeps the wheel
    assert wheels, (f"no local torch 2.13.0 wheel for {tag} in {Path(sys.prefix) / 'wheels'} or PIP_FIND_LINKS: "
                    "run `make setup` (it saves the wheel it installed there)")
    env["PIP_FIND_LINKS"] = " ".join(str(d) for d in wheels)
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


# ---- install by role, uninstall (issue 25) -------------------------------------------------------------------------
def test_no_torch_plans_a_llama_client_without_torch(tmp_path: Path, home: Path) -> None:
    env = installer_env(home)
    env.pop("CMAKE_ARGS", None)
    res = run_installer("--no-torch", "--dry-run", "--no-link", env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "torch:               none (--no-torch: a llama.cpp client)" in out
    assert "skipped (--no-torch)" in out and "pip install torch" not in out and "'torch" not in out
    assert "echo-swarm[llama]" in out and "[llama]'" in out  # the extra, from the checkout's copy
    # llama.cpp is built before echo-swarm[llama] is installed, so the extra finds it built for this machine
    assert out.index("llama-cpp-python>=0.3.36") < out.index("[llama]'")
    assert "import llama_cpp, swarm_client.backends.llama_backend" in out
    assert tree(home) == []


def test_the_default_installs_the_torch_extra(tmp_path: Path, home: Path) -> None:
    res = run_installer("--dry-run", "--no-link", env=installer_env(home), cwd=tmp_path)
    assert res.returncode == 0 and "echo-swarm[torch] from the checkout" in res.stdout
    res = run_installer("--dry-run", "--no-link", "--with-llama", env=installer_env(home), cwd=tmp_path)
    assert "echo-swarm[torch,llama] from the checkout" in res.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--no-torch", "--torch-spec", "torch==2.13.0"], "--no-torch installs no torch"),
    (["--purge"], "--purge only goes with --uninstall"),
])
def test_contradictory_role_options_are_refused(tmp_path: Path, home: Path, args: list[str], message: str) -> None:
    res = run_installer(*args, "--dry-run", env=installer_env(home), cwd=tmp_path)
    assert res.returncode == 2 and message in res.stderr


def test_a_cuda_download_on_a_machine_without_gpu_is_warned_about_before_it_starts(tmp_path: Path,
                                                                                   home: Path) -> None:
    if platform.system() != "Linux" or shutil.which("nvidia-smi") is not None:
        fakes = tmp_path / "fakes"  # a Linux machine without an NVIDIA GPU, whatever runs the test
        fake_command(fakes, "uname", 'case "$1" in -m) echo x86_64 ;; *) echo Linux ;; esac\n')
        env = installer_env(home, fakes)
    else:
        env = installer_env(home)
    for var in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
        env.pop(var, None)
    res = run_installer("--no-torch-index", "--dry-run", "--no-link", env=env, cwd=tmp_path)
    assert res.returncode == 0
    assert "pip's default index serves the CUDA build of torch" in res.stderr and "--no-torch" in res.stderr
    quiet = run_installer("--dry-run", "--no-link", env=env, cwd=tmp_path)  # the CPU index: nothing to warn about
    assert "CUDA build of torch" not in quiet.stderr


def test_uninstall_removes_the_venv_and_the_link_and_keeps_the_volunteers_data(tmp_path: Path, home: Path) -> None:
    venv = home / ".local" / "share" / "echo-swarm" / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    marker = tmp_path / "uninstall-service-ran"
    fake_command(venv / "bin", "echo-swarm", f'[ "$1 $2" = "client uninstall-service" ] && touch {marker}\n'
                                             'echo "removed the unit"\n')
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "echo-swarm").symlink_to(venv / "bin" / "echo-swarm")
    (bin_dir / "other").symlink_to("/bin/true")
    identity = home / ".config" / "echo-swarm" / "identity.key"
    identity.parent.mkdir(parents=True)
    identity.write_text("secret")
    env = installer_env(home)

    dry = run_installer("--uninstall", "--dry-run", "--bin-dir", str(bin_dir), env=env, cwd=tmp_path)
    assert dry.returncode == 0 and "would remove the virtual environment" in dry.stdout
    assert venv.exists() and (bin_dir / "echo-swarm").is_symlink() and not marker.exists()

    res = run_installer("--uninstall", "--bin-dir", str(bin_dir), env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert marker.exists(), "the service was not removed before the venv"
    assert not venv.exists() and not (bin_dir / "echo-swarm").exists() and (bin_dir / "other").is_symlink()
    assert identity.read_text() == "secret" and "--uninstall --purge" in res.stdout

    snapshot = home / ".cache" / "echo-swarm" / "snapshots" / "blobs" / "ab"
    model = home / ".cache" / "echo-swarm" / "models" / "tiny" / "config.json"  # a coordinator's model cache
    for path in (snapshot, model):
        path.parent.mkdir(parents=True)
        path.write_text("{}")
    purge = run_installer("--uninstall", "--purge", "--bin-dir", str(bin_dir), env=env, cwd=tmp_path)
    assert purge.returncode == 0 and not identity.exists()
    assert not snapshot.parent.parent.exists() and model.read_text() == "{}", purge.stdout  # the client's data only
    assert "left " in purge.stdout and "models/" in purge.stdout


def test_uninstall_leaves_a_folder_that_is_not_a_venv_alone(tmp_path: Path, home: Path) -> None:
    prefix = tmp_path / "precious"
    prefix.mkdir()
    (prefix / "thesis.tex").write_text("...")
    res = run_installer("--uninstall", "--prefix", str(prefix), "--no-link", env=installer_env(home), cwd=tmp_path)
    assert res.returncode == 1 and "is not a virtual environment" in res.stderr
    assert (prefix / "thesis.tex").exists()


def _stand_in_venv(prefix: Path, torch_cuda: str, device: str) -> None:
    """An existing venv at ``prefix`` whose python is a stand-in: pip installs succeed without doing anything and
    the self-check prints what a torch with ``torch_cuda`` (empty: the CPU build) on ``device`` prints — so that the
    installer's own decisions after the self-check run without downloading torch."""
    (prefix / "bin").mkdir(parents=True)
    (prefix / "pyvenv.cfg").write_text("home = /usr/bin\n")
    fake_command(prefix / "bin", "python", f"""case "$*" in
  *"import platform, sys"*) echo "3.11.2 True x86_64 {prefix}/bin/python" ;;
  "-m pip "*) exit 0 ;;
  *"import torch"*) echo "python 3.11.2, torch 2.13.0 (CUDA build: {torch_cuda or 'none'}), transformers 4.57.0"
                    echo "torch_cuda={torch_cuda}"
                    echo "device={device} (2 threads)" ;;
  *) echo "unexpected: $*" >&2; exit 9 ;;
esac
""")
    fake_command(prefix / "bin", "echo-swarm", 'echo "Usage: echo-swarm [OPTIONS] COMMAND"\n')


@pytest.mark.parametrize(("torch_cuda", "warned"), [("13.0", True), ("", False)])
def test_the_self_check_warns_when_the_installed_torch_does_not_fit_the_machine(
        tmp_path: Path, home: Path, torch_cuda: str, warned: bool) -> None:
    """The issue's install: a CUDA build of torch on a machine without an NVIDIA GPU passed the self-check with
    "torch will use: cpu" and no word about the GBs of NVIDIA libraries it cannot use. Now it warns, with the fix;
    the CPU build on the same machine does not."""
    fakes = tmp_path / "fakes"  # a Linux x86_64 machine without a usable NVIDIA GPU, whatever runs the test
    fake_command(fakes, "uname", 'case "$1" in -m) echo x86_64 ;; *) echo Linux ;; esac\n')
    fake_command(fakes, "nvidia-smi", "echo 'NVIDIA-SMI has failed: no driver' >&2; exit 9\n")
    prefix = tmp_path / "venv"
    _stand_in_venv(prefix, torch_cuda, "cpu")
    env = installer_env(home, fakes) | {"TMPDIR": str(tmp_path)}
    res = run_installer("--prefix", str(prefix), "--source", str(REPO), "--no-link", env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "torch will use: cpu" in res.stdout and "reusing the existing virtual environment" in res.stdout
    if warned:
        assert "torch is a CUDA 13.0 build" in res.stderr and "no usable NVIDIA GPU" in res.stderr
        assert "--index-url https://download.pytorch.org/whl/cpu" in res.stderr and "--no-torch" in res.stderr
    else:
        assert "torch is a CUDA" not in res.stderr and "dead weight" not in res.stderr, res.stderr
