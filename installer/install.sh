#!/usr/bin/env bash
# echo-swarm installer for volunteers (Linux and macOS).
#
# Detects the OS, CPU architecture and GPU, finds Python >= 3.11, creates an isolated virtual environment,
# installs the torch build that fits the hardware, installs echo-swarm, checks the result and links the
# `echo-swarm` command into ~/.local/bin. Run with --help for the options; see installer/README.md.
#
# Written for bash 3.2 as well (macOS's /bin/bash): no associative arrays, no empty-array expansions.
if [ -z "${BASH_VERSION:-}" ]; then
    echo "install.sh needs bash: run it as: bash installer/install.sh" >&2
    exit 2
fi
set -euo pipefail
set -E

readonly MIN_PY_MAJOR=3
readonly MIN_PY_MINOR=11
readonly CPU_INDEX_URL="https://download.pytorch.org/whl/cpu"
# Used when the torch requirement cannot be read from the source checkout's pyproject.toml (--from-pypi).
# Keep in sync with pyproject.toml so that installing echo-swarm afterwards never swaps the torch build.
readonly DEFAULT_TORCH_REQ="torch>=2.2,<3"
readonly STEPS=7
readonly PROG="install.sh"

# ---------------------------------------------------------------------------------------------- output

CURRENT_STEP="starting"

heading() { # heading N TITLE
    CURRENT_STEP=$2
    printf '\n==> [%s/%s] %s\n' "$1" "$STEPS" "$2"
}

banner() { # an unnumbered heading
    CURRENT_STEP=$1
    printf '\n==> %s\n' "$1"
}

info() { printf '    %s\n' "$*"; }

warn() { printf 'warning: %s\n' "$*" >&2; }

# die MESSAGE [WHAT-TO-DO...]: say what failed and what to do about it, then exit 1.
die() {
    local line
    printf '\nerror: %s\n' "$1" >&2
    shift
    if [ $# -gt 0 ]; then
        printf 'what to do:\n' >&2
        for line in "$@"; do
            printf '  %s\n' "${line//$'\n'/$'\n'  }" >&2
        done
    fi
    exit 1
}

usage_error() {
    printf '%s: %s\n' "$PROG" "$1" >&2
    printf 'Run "bash installer/install.sh --help" for the options.\n' >&2
    exit 2
}

on_unexpected_error() { # only the main shell reports, not command substitutions
    local rc=$1 line=$2
    if [ "${BASH_SUBSHELL:-0}" -eq 0 ]; then
        printf '\nerror: step "%s" failed unexpectedly (exit %s at %s line %s).\n' \
            "$CURRENT_STEP" "$rc" "$PROG" "$line" >&2
        printf 'what to do: re-run with "bash -x installer/install.sh ..." to see where, and report it.\n' >&2
    fi
}
trap 'on_unexpected_error $? $LINENO' ERR

quote_arg() { # quote_arg ARG: ARG as the shell would need it typed (single quotes only when needed)
    case $1 in
        "") printf "''" ;;
        *[!A-Za-z0-9_./:=@%+,-]*) printf "'%s'" "$(printf '%s' "$1" | sed "s/'/'\\\\''/g")" ;;
        *) printf '%s' "$1" ;;
    esac
}

quote_cmd() { # quote_cmd ARGS...: the command as one shell-pasteable line
    local out="" arg
    for arg in "$@"; do
        out+="$(quote_arg "$arg") "
    done
    printf '%s' "${out% }"
}

# run HINT CMD...: print the command; under --dry-run only print it. On failure say what failed and HINT.
run() {
    local hint=$1 rc=0
    shift
    if [ "$DRY_RUN" = 1 ]; then
        printf '    would run: %s\n' "$(quote_cmd "$@")"
        return 0
    fi
    printf '    $ %s\n' "$(quote_cmd "$@")"
    "$@" || rc=$?
    if [ "$rc" -ne 0 ]; then
        die "this command failed (exit $rc): $(quote_cmd "$@")" "$hint"
    fi
}

abspath() { # abspath PATH: absolute form of a path that may not exist yet (no symlink resolution)
    local p=$1
    case $p in
        /*) ;;
        \~) p=${HOME:-} ;; # --opt=~/dir reaches us unexpanded
        \~/*) p="${HOME:-}/${p#\~/}" ;;
        *) p="$PWD/$p" ;;
    esac
    while [ "${#p}" -gt 1 ] && [ "${p%/}" != "$p" ]; do
        p=${p%/}
    done
    printf '%s' "$p"
}

# ---------------------------------------------------------------------------------------------- options

usage() {
    cat <<'EOF'
Usage: bash installer/install.sh [OPTIONS]

Install the echo-swarm volunteer client into its own Python virtual environment, with the torch build
that fits this machine (or no torch at all: --no-torch), and link the `echo-swarm` command. Linux and macOS.

Steps: detect OS / CPU / GPU, find Python >= 3.11, create the venv (and upgrade pip in it), install torch,
install echo-swarm, self-check, link the executable. Each step prints a "==> [n/7]" heading.

What is installed:
  default      the torch client: echo-swarm[torch] and the torch build for this machine (below)
  --no-torch   a llama.cpp client: echo-swarm[llama], compiled for the GPU found; no torch, transformers or
               peft (a venv of about 220 MB instead of 1-6 GB)

torch build chosen by default:
  Linux + NVIDIA GPU (nvidia-smi works)  torch from PyPI (CUDA build)
  Linux, no GPU                          CPU build from --index-url https://download.pytorch.org/whl/cpu
  macOS (Apple silicon: Metal / MPS)     torch from PyPI
After installing, the self-check warns when the torch build does not match the machine (a CUDA build without an
NVIDIA GPU: gigabytes for nothing; a CPU build with one: the GPU unused) and says how to fix it.

Options:
  --python PATH          Python interpreter to build the venv from (>= 3.11). Default: $PYTHON if set,
                         else the first of python3, python3.13, python3.12, python3.11, python3.14, python
                         on PATH that is new enough.
  --prefix DIR           Directory of the virtual environment.
                         Default: ${XDG_DATA_HOME:-$HOME/.local/share}/echo-swarm/venv
                         An existing venv there is reused and updated.
  --torch-spec SPEC      The torch requirement to install, e.g. torch==2.13.0.
                         Default: the torch range from the source's pyproject.toml (torch>=2.2,<3).
  --torch-index-url URL  Install torch from this package index (pip --index-url) instead of the default
                         for this hardware, e.g. https://download.pytorch.org/whl/cu126 for a CUDA 12.6
                         build, or https://download.pytorch.org/whl/cpu to force the CPU build.
  --no-torch-index       Install torch with pip's own index settings (PyPI, plus any PIP_INDEX_URL /
                         PIP_FIND_LINKS / pip.conf), never the CPU index.
  --source PATH          Install echo-swarm from this local checkout. Default: the repository that
                         contains this script (installer/..).
  --from-pypi            Install echo-swarm from PyPI instead of a local checkout.
  --bin-dir DIR          Where to symlink the echo-swarm command. Default: ~/.local/bin
  --no-link              Do not create the symlink; print the executable's full path instead.
  --with-llama           Also install the llama.cpp backend (llama-cpp-python, which compiles llama.cpp:
                         a few minutes, needs a C/C++ compiler). Built for the GPU found: Metal on Apple
                         silicon (CMAKE_ARGS=-DGGML_METAL=on), CUDA on NVIDIA (-DGGML_CUDA=on, needs the
                         CUDA toolkit's nvcc), else the CPU. Set CMAKE_ARGS yourself to override.
  --with-p2p             Also install peer-to-peer snapshot transfer (hivemind==1.1.12 with its bundled
                         libp2p daemon; wheels for Linux and macOS only). Turn it on with `join --p2p`.
                         hivemind depends on torch, so with --no-torch it brings torch in.
  --no-torch             A llama.cpp client without torch: installs echo-swarm[llama] (implies --with-llama)
                         and skips the torch step.
  --uninstall            Remove what this installer installed: the service (`echo-swarm client
                         uninstall-service`), the link and the virtual environment at --prefix. Your identity,
                         settings and credit stay, unless --purge.
  --purge                With --uninstall: also delete the client's identity key, settings, snapshot cache and
                         logs (the echo-swarm folders in your config, cache and state dirs).
  --dry-run              Detect the machine and print the plan and the commands it would run, without
                         creating, downloading or changing anything.
  -h, --help             Show this help and exit.

Continuous integration (no GPU, a local torch wheel via PIP_FIND_LINKS):
  bash installer/install.sh --torch-spec torch==2.13.0 --no-torch-index --source .

After installing, join a swarm with:
  echo-swarm join <COORDINATOR_URL>

Exit status: 0 installed (or dry run done), 1 a step failed (the message says what to do),
2 bad usage.
EOF
}

DRY_RUN=0
PY_ARG=${PYTHON:-}
PREFIX=""
TORCH_SPEC=""
TORCH_INDEX_URL=""
NO_TORCH_INDEX=0
SOURCE=""
FROM_PYPI=0
BIN_DIR=""
NO_LINK=0
WITH_LLAMA=0
WITH_P2P=0
NO_TORCH=0
UNINSTALL=0
PURGE=0
readonly LLAMA_REQ="llama-cpp-python>=0.3.36,<0.4"
readonly P2P_REQ="hivemind==1.1.12"  # pyproject.toml's [p2p] extra

while [ $# -gt 0 ]; do
    opt=$1
    val=""
    has_val=0
    case $opt in
        --*=*)
            val=${opt#*=}
            opt=${opt%%=*}
            has_val=1
            ;;
    esac
    case $opt in
        --python | --prefix | --torch-spec | --torch-index-url | --source | --bin-dir)
            if [ "$has_val" = 0 ]; then
                if [ $# -lt 2 ]; then
                    usage_error "option $opt needs a value"
                fi
                val=$2
                shift
            fi
            case $val in
                "" | --*) usage_error "option $opt needs a value (got '${val}')" ;;
            esac
            ;;
        *)
            if [ "$has_val" = 1 ]; then
                usage_error "option $opt takes no value"
            fi
            ;;
    esac
    case $opt in
        -h | --help)
            usage
            exit 0
            ;;
        --dry-run) DRY_RUN=1 ;;
        --python) PY_ARG=$val ;;
        --prefix) PREFIX=$val ;;
        --torch-spec) TORCH_SPEC=$val ;;
        --torch-index-url) TORCH_INDEX_URL=$val ;;
        --no-torch-index) NO_TORCH_INDEX=1 ;;
        --source) SOURCE=$val ;;
        --from-pypi) FROM_PYPI=1 ;;
        --bin-dir) BIN_DIR=$val ;;
        --no-link) NO_LINK=1 ;;
        --with-llama) WITH_LLAMA=1 ;;
        --with-p2p) WITH_P2P=1 ;;
        --no-torch) NO_TORCH=1 ;;
        --uninstall) UNINSTALL=1 ;;
        --purge) PURGE=1 ;;
        -*) usage_error "unknown option: $opt" ;;
        *) usage_error "unexpected argument: $opt (this installer takes options only)" ;;
    esac
    shift
done

if [ -n "$TORCH_INDEX_URL" ] && [ "$NO_TORCH_INDEX" = 1 ]; then
    usage_error "--torch-index-url and --no-torch-index contradict each other; pass one"
fi
if [ "$NO_TORCH" = 1 ] && { [ -n "$TORCH_SPEC" ] || [ -n "$TORCH_INDEX_URL" ] || [ "$NO_TORCH_INDEX" = 1 ]; }; then
    usage_error "--no-torch installs no torch, so --torch-spec / --torch-index-url / --no-torch-index make no sense with it"
fi
if [ "$PURGE" = 1 ] && [ "$UNINSTALL" = 0 ]; then
    usage_error "--purge only goes with --uninstall"
fi
if [ "$NO_TORCH" = 1 ]; then
    WITH_LLAMA=1 # a client without torch generates with llama.cpp
fi
if [ -n "$SOURCE" ] && [ "$FROM_PYPI" = 1 ]; then
    usage_error "--source and --from-pypi contradict each other; pass one"
fi
if [ -z "$PREFIX" ] || { [ -z "$BIN_DIR" ] && [ "$NO_LINK" = 0 ]; }; then
    if [ -z "${HOME:-}" ]; then
        die "HOME is not set, so there is no default for --prefix / --bin-dir" \
            "set HOME, or pass --prefix DIR and --bin-dir DIR (or --no-link)"
    fi
fi
if [ -z "$PREFIX" ]; then
    PREFIX="${XDG_DATA_HOME:-$HOME/.local/share}/echo-swarm/venv"
fi
PREFIX=$(abspath "$PREFIX")
if [ -z "$BIN_DIR" ]; then
    BIN_DIR="${HOME:-}/.local/bin"
fi
BIN_DIR=$(abspath "$BIN_DIR")

# ---------------------------------------------------------------------------------------------- --uninstall

# remove_path PATH WHAT: delete PATH (a file, link or folder), or under --dry-run say that it would.
remove_path() {
    if [ ! -e "$1" ] && [ ! -L "$1" ]; then
        return 0
    fi
    if [ "$DRY_RUN" = 1 ]; then
        info "would remove $2: $1"
    else
        rm -rf -- "$1" || die "could not remove $1" "check its permissions and remove it by hand"
        info "removed $2: $1"
    fi
}

uninstall() {
    local venv_cli="$PREFIX/bin/echo-swarm" link="$BIN_DIR/echo-swarm" target
    if [ "$DRY_RUN" = 1 ]; then
        banner "Uninstalling (dry run: nothing will be changed)"
    else
        banner "Uninstalling echo-swarm"
    fi
    if [ -e "$PREFIX" ] && [ ! -f "$PREFIX/pyvenv.cfg" ]; then
        die "$PREFIX is not a virtual environment, so it was left alone" \
            "pass --prefix DIR with the folder the installer created (default ${XDG_DATA_HOME:-$HOME/.local/share}/echo-swarm/venv)"
    fi
    if [ -x "$venv_cli" ]; then  # the service runs this venv's python: stop it before the venv goes
        if [ "$DRY_RUN" = 1 ]; then
            info "would run: $(quote_cmd "$venv_cli" client uninstall-service)"
        else
            "$venv_cli" client uninstall-service | sed 's/^/    /' ||
                warn "could not remove the service; run: echo-swarm client uninstall-service (before the venv goes) or remove its unit by hand"
        fi
    fi
    if [ -L "$link" ]; then
        target=$(readlink "$link" 2>/dev/null) || target=""
        if [ "$target" = "$venv_cli" ]; then
            remove_path "$link" "the command link"
        else
            info "left $link alone: it points to $target, not to this installation"
        fi
    fi
    if [ -e "$PREFIX" ]; then
        remove_path "$PREFIX" "the virtual environment"
    else
        info "no virtual environment at $PREFIX (already removed?)"
    fi
    local config_dir cache_dir state_dir
    if [ "$OS_NAME" = Darwin ]; then
        config_dir="$HOME/Library/Application Support/echo-swarm"
        cache_dir="$HOME/Library/Caches/echo-swarm"
        state_dir="$HOME/Library/Application Support/echo-swarm"
    else
        config_dir="${XDG_CONFIG_HOME:-$HOME/.config}/echo-swarm"
        cache_dir="${XDG_CACHE_HOME:-$HOME/.cache}/echo-swarm"
        state_dir="${XDG_STATE_HOME:-$HOME/.local/state}/echo-swarm"
    fi
    if [ "$PURGE" = 1 ]; then
        remove_path "$config_dir" "identity, settings and pause files"
        # the client's snapshots only: the same cache folder holds a coordinator's model cache (models/), which a
        # volunteer who also runs a coordinator on this machine did not ask to lose
        remove_path "$cache_dir/snapshots" "snapshot cache"
        if [ -d "$cache_dir" ] && [ -z "$(ls -A "$cache_dir" 2>/dev/null)" ]; then
            remove_path "$cache_dir" "the empty cache folder"
        elif [ -d "$cache_dir" ]; then
            info "left $cache_dir's other contents alone (e.g. a coordinator's model cache, models/)"
        fi
        remove_path "$state_dir" "logs"
    else
        info "kept your identity and settings ($config_dir), snapshot cache ($cache_dir/snapshots) and logs ($state_dir);"
        info "re-run with --uninstall --purge to delete them too"
    fi
    if [ "$DRY_RUN" = 1 ]; then
        banner "Dry run finished: nothing was changed"
    else
        banner "Done: echo-swarm is uninstalled"
    fi
}

if [ "$UNINSTALL" = 1 ]; then
    OS_NAME=$(uname -s)
    uninstall
    exit 0
fi

if [ "$FROM_PYPI" = 0 ]; then
    if [ -z "$SOURCE" ]; then
        script_path=${BASH_SOURCE[0]:-}
        if [ -z "$script_path" ] || [ ! -f "$script_path" ]; then
            die "cannot tell where this script lives, so there is no default echo-swarm checkout" \
                "run it from a checkout (bash path/to/echo-swarm/installer/install.sh), or pass --source PATH" \
                "or --from-pypi"
        fi
        SOURCE="$(dirname "$script_path")/.."
    fi
    if [ ! -d "$SOURCE" ]; then
        die "--source $SOURCE is not a directory" "pass --source PATH to an echo-swarm checkout, or --from-pypi"
    fi
    SOURCE=$(CDPATH='' cd -- "$SOURCE" && pwd -P)
    if [ ! -f "$SOURCE/pyproject.toml" ]; then
        die "$SOURCE has no pyproject.toml, so it is not an echo-swarm checkout" \
            "pass --source PATH to an echo-swarm checkout, or --from-pypi"
    fi
fi

# ---------------------------------------------------------------------------------------------- 1. detect

heading 1 "Detecting this machine"

OS=$(uname -s)
ARCH=$(uname -m)
case $ARCH in
    aarch64 | arm64) ARCH_FAMILY=arm64 ;;
    x86_64 | amd64) ARCH_FAMILY=x86_64 ;;
    *) ARCH_FAMILY=$ARCH ;;
esac
case $OS in
    Linux | Darwin) ;;
    MINGW* | MSYS* | CYGWIN*)
        die "Windows ($OS) is not supported by this installer" \
            "install WSL2 with Ubuntu, then run this installer inside it (NVIDIA GPUs work under WSL2)"
        ;;
    *) die "unsupported operating system: $OS" "this installer supports Linux and macOS" ;;
esac

GPU_KIND=none # none | nvidia | mps
GPU_DESC="none detected"
NVIDIA_CUDA=""

if [ "$OS" = Linux ]; then
    if command -v nvidia-smi >/dev/null 2>&1; then
        timeout_cmd=""
        if command -v timeout >/dev/null 2>&1; then
            timeout_cmd="timeout 30"
        fi
        smi_rc=0
        # shellcheck disable=SC2086 # $timeout_cmd is empty or two words on purpose
        gpu_list=$($timeout_cmd nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1) || smi_rc=$?
        if [ "$smi_rc" -eq 0 ] && [ -n "$gpu_list" ]; then
            GPU_KIND=nvidia
            # shellcheck disable=SC2086
            smi_table=$($timeout_cmd nvidia-smi 2>/dev/null) || smi_table=""
            NVIDIA_CUDA=$(printf '%s\n' "$smi_table" | sed -n 's/.*CUDA Version: *\([0-9][0-9.]*\).*/\1/p')
            NVIDIA_CUDA=${NVIDIA_CUDA%%$'\n'*}
            gpu_count=0
            GPU_DESC=""
            while IFS= read -r gpu_line; do
                [ -n "$gpu_line" ] || continue
                gpu_count=$((gpu_count + 1))
                gpu_name=${gpu_line%,*}
                gpu_driver=${gpu_line##*, }
                if [ "$gpu_count" = 1 ]; then
                    GPU_DESC="NVIDIA $gpu_name (driver $gpu_driver, CUDA ${NVIDIA_CUDA:-unknown})"
                    GPU_DESC=${GPU_DESC/NVIDIA NVIDIA/NVIDIA}
                fi
            done <<EOF
$gpu_list
EOF
            if [ "$gpu_count" -gt 1 ]; then
                GPU_DESC="$GPU_DESC, $gpu_count GPUs in all"
            fi
        else
            GPU_DESC="none usable (nvidia-smi is installed but failed: ${gpu_list%%$'\n'*})"
            warn "nvidia-smi failed, so the NVIDIA driver seems not to be loaded; installing the CPU build of torch."
            warn "If this machine has an NVIDIA GPU, fix the driver (nvidia-smi must work), then re-run."
        fi
    fi
elif [ "$OS" = Darwin ]; then
    chip=$(sysctl -n machdep.cpu.brand_string 2>/dev/null) || chip=""
    if [ "$ARCH_FAMILY" = arm64 ]; then
        GPU_KIND=mps
        GPU_DESC="Apple silicon${chip:+ ($chip)}: Metal (MPS)"
    else
        translated=$(sysctl -n sysctl.proc_translated 2>/dev/null) || translated=0
        if [ "$translated" = 1 ]; then
            die "this shell runs under Rosetta (x86_64 emulation) on an Apple silicon Mac; torch would install without Metal (MPS)" \
                "open a native (arm64) terminal, or run: arch -arm64 /bin/bash installer/install.sh ..."
        fi
        GPU_DESC="none usable by torch (Intel Mac${chip:+, $chip}): CPU only"
        warn "torch stopped publishing Intel-Mac builds after 2.2; pip will pick the newest that exists."
    fi
fi

info "OS:           $OS"
info "Architecture: $ARCH"
info "GPU:          $GPU_DESC"

# ---------------------------------------------------------------------------------------------- 2. Python

heading 2 "Finding Python >= $MIN_PY_MAJOR.$MIN_PY_MINOR"

python_install_hint() {
    if [ "$OS" = Darwin ]; then
        printf '%s\n' \
            "install Python 3.12 (3.11 or newer), e.g. with Homebrew: brew install python@3.12" \
            "or the macOS installer from python.org, then re-run with --python \"\$(brew --prefix)/bin/python3.12\"" \
            "(or the path of the new python3)."
    else
        printf '%s\n' \
            "install Python 3.11 or newer with its venv module, e.g.:" \
            "  Debian / Ubuntu: sudo apt install python3.11 python3.11-venv   (older releases: the deadsnakes PPA)" \
            "  Fedora / RHEL:   sudo dnf install python3.11" \
            "  any distro:      uv python install 3.12, or pyenv install 3.12" \
            "then re-run with --python /path/to/python3.11 (or set PYTHON=...)."
    fi
}

# probe_python EXE: prints "VERSION OK EXECUTABLE MACHINE" (OK is True/False); fails if EXE does not run.
probe_python() {
    "$1" -I -B -c "import platform, sys
print('%d.%d.%d' % sys.version_info[:3], sys.version_info >= ($MIN_PY_MAJOR, $MIN_PY_MINOR), platform.machine(), sys.executable)" \
        2>/dev/null
}

PY=""
PY_VERSION=""
PY_MACHINE=""
if [ -n "$PY_ARG" ]; then
    candidates=$PY_ARG
else
    candidates="python3 python3.13 python3.12 python3.11 python3.14 python"
fi
rejected=""
for cand in $candidates; do
    if [ -n "$PY_ARG" ]; then
        cand=$PY_ARG # a path with spaces stays whole
    fi
    if ! command -v "$cand" >/dev/null 2>&1; then
        [ -z "$PY_ARG" ] || die "Python interpreter not found: $cand" "$(python_install_hint)"
        continue
    fi
    probe=$(probe_python "$cand") || probe=""
    if [ -z "$probe" ]; then
        [ -z "$PY_ARG" ] || die "$cand does not run as a Python interpreter" "$(python_install_hint)"
        continue
    fi
    read -r p_version p_ok p_machine p_exe <<EOF
$probe
EOF
    if [ "$p_ok" != True ]; then
        rejected="$rejected $cand ($p_version)"
        [ -z "$PY_ARG" ] || die "$cand is Python $p_version; echo-swarm needs Python >= $MIN_PY_MAJOR.$MIN_PY_MINOR" \
            "$(python_install_hint)"
        continue
    fi
    PY=$p_exe
    PY_VERSION=$p_version
    PY_MACHINE=$p_machine
    break
done
if [ -z "$PY" ]; then
    die "no Python >= $MIN_PY_MAJOR.$MIN_PY_MINOR found on PATH${rejected:+ (too old:$rejected)}" "$(python_install_hint)"
fi
info "Python $PY_VERSION at $PY ($PY_MACHINE)"

if ! "$PY" -I -B -c "import venv, ensurepip" >/dev/null 2>&1; then
    py_mm=${PY_VERSION%.*}
    die "Python $PY_VERSION at $PY lacks the venv / ensurepip modules needed to create a virtual environment" \
        "Debian / Ubuntu: sudo apt install python$py_mm-venv   (other systems: install the full Python)" \
        "or pass --python with another interpreter"
fi
if [ "$OS" = Darwin ] && [ "$ARCH_FAMILY" = arm64 ] && [ "$PY_MACHINE" != arm64 ]; then
    warn "$PY is an $PY_MACHINE (Intel) build running under Rosetta; torch will not see Metal (MPS)."
    warn "Install a native arm64 Python (Homebrew in /opt/homebrew, or python.org's universal2 installer)."
fi

# ---------------------------------------------------------------------------------------------- plan

# What the source checkout is called and which torch it asks for (tomllib needs Python >= 3.11: checked).
SOURCE_TORCH_REQ=""
if [ "$FROM_PYPI" = 0 ]; then
    meta=$("$PY" -I -B -c '
import re, sys, tomllib
with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f).get("project", {})
deps = project.get("dependencies", []) + project.get("optional-dependencies", {}).get("torch", [])
torch = [d for d in deps if re.match(r"torch\s*(?:[<>=!~;\[]|$)", d)]
print(project.get("name", ""))
print(torch[0].strip() if torch else "")' "$SOURCE/pyproject.toml" 2>&1) ||
        die "cannot read $SOURCE/pyproject.toml: ${meta##*$'\n'}" "pass --source PATH to an echo-swarm checkout"
    source_name=${meta%%$'\n'*}
    SOURCE_TORCH_REQ=${meta#*$'\n'}
    if [ "$source_name" != echo-swarm ]; then
        die "$SOURCE is the project '${source_name}', not echo-swarm" \
            "pass --source PATH to an echo-swarm checkout, or --from-pypi"
    fi
fi

if [ -z "$TORCH_SPEC" ]; then
    TORCH_SPEC=${SOURCE_TORCH_REQ:-$DEFAULT_TORCH_REQ}
fi
if [ "$NO_TORCH_INDEX" = 1 ]; then
    TORCH_INDEX=""
    torch_why="as requested (--no-torch-index)"
elif [ -n "$TORCH_INDEX_URL" ]; then
    TORCH_INDEX=$TORCH_INDEX_URL
    torch_why="as requested (--torch-index-url)"
elif [ "$OS" = Linux ] && [ "$GPU_KIND" = nvidia ]; then
    TORCH_INDEX=""
    torch_why="the CUDA build from PyPI, for the NVIDIA GPU"
elif [ "$OS" = Linux ]; then
    TORCH_INDEX=$CPU_INDEX_URL
    torch_why="the CPU-only build, as there is no usable GPU"
elif [ "$GPU_KIND" = mps ]; then
    TORCH_INDEX=""
    torch_why="the macOS build from PyPI, which uses Metal (MPS)"
else
    TORCH_INDEX=""
    torch_why="the macOS build from PyPI (CPU only on an Intel Mac)"
fi

# llama.cpp is compiled for the accelerator found (CMAKE_ARGS reaches llama-cpp-python's CMake build).
if [ -n "${CMAKE_ARGS:-}" ]; then
    LLAMA_CMAKE=$CMAKE_ARGS
    llama_why="CMAKE_ARGS from the environment"
elif [ "$GPU_KIND" = nvidia ]; then
    LLAMA_CMAKE="-DGGML_CUDA=on"
    llama_why="CUDA build for the NVIDIA GPU (needs the CUDA toolkit: nvcc)"
elif [ "$GPU_KIND" = mps ]; then
    LLAMA_CMAKE="-DGGML_METAL=on"
    llama_why="Metal build for Apple silicon"
else
    LLAMA_CMAKE="-DLLAVA_BUILD=OFF"
    llama_why="CPU build"
fi

VENV_PY="$PREFIX/bin/python"
EXE="$PREFIX/bin/echo-swarm"
LINK="$BIN_DIR/echo-swarm"

# echo-swarm's extras (pyproject.toml): only what this client's backend needs
if [ "$NO_TORCH" = 1 ]; then
    EXTRAS="llama"
elif [ "$WITH_LLAMA" = 1 ]; then
    EXTRAS="torch,llama"
else
    EXTRAS="torch"
fi

if [ "$DRY_RUN" = 1 ]; then
    banner "Plan (dry run: nothing will be created, downloaded or changed)"
else
    banner "Plan"
fi
info "virtual environment: $PREFIX"
if [ "$NO_TORCH" = 1 ]; then
    info "torch:               none (--no-torch: a llama.cpp client)"
else
    info "torch:               $TORCH_SPEC, $torch_why"
    if [ -n "$TORCH_INDEX" ]; then
        info "torch index:         $TORCH_INDEX"
    else
        info "torch index:         pip's default (PyPI, plus PIP_* variables and pip.conf)"
    fi
fi
if [ "$FROM_PYPI" = 1 ]; then
    info "echo-swarm:          echo-swarm[$EXTRAS] from PyPI"
else
    info "echo-swarm:          echo-swarm[$EXTRAS] from the checkout $SOURCE"
fi
if [ "$WITH_LLAMA" = 1 ]; then
    info "llama.cpp backend:   $LLAMA_REQ, $llama_why (CMAKE_ARGS=$LLAMA_CMAKE)"
else
    info "llama.cpp backend:   not installed (add --with-llama for llama.cpp clients)"
fi
if [ "$WITH_P2P" = 1 ]; then
    info "p2p snapshots:       $P2P_REQ (turn on with: echo-swarm join --p2p)"
else
    info "p2p snapshots:       not installed (add --with-p2p to fetch snapshots from other volunteers)"
fi
if [ "$NO_LINK" = 1 ]; then
    info "command:             $EXE (no link: --no-link)"
else
    info "command:             $LINK -> $EXE"
fi
if [ "$NO_TORCH" = 0 ] && [ "$OS" = Linux ] && [ "$GPU_KIND" != nvidia ] && [ -z "$TORCH_INDEX" ] &&
    [ -z "${PIP_FIND_LINKS:-}" ] && [ -z "${PIP_INDEX_URL:-}" ] && [ -z "${PIP_EXTRA_INDEX_URL:-}" ]; then
    warn "this machine has no NVIDIA GPU, but pip's default index serves the CUDA build of torch on Linux (several GB"
    warn "of NVIDIA libraries it cannot use). Drop --no-torch-index for the CPU build, or use --no-torch for a llama.cpp client."
fi

# ---------------------------------------------------------------------------------------------- 3. venv

heading 3 "Creating the virtual environment"

if [ -e "$VENV_PY" ] || [ -L "$VENV_PY" ]; then
    venv_probe=$(probe_python "$VENV_PY") || venv_probe=""
    if [ -z "$venv_probe" ]; then
        die "the existing virtual environment at $PREFIX is broken (its python does not run; was Python removed or upgraded?)" \
            "remove it (rm -rf $(quote_cmd "$PREFIX")) and re-run, or pass --prefix DIR for a new one"
    fi
    read -r v_version v_ok _ <<EOF
$venv_probe
EOF
    if [ "$v_ok" != True ]; then
        die "the existing virtual environment at $PREFIX has Python $v_version; echo-swarm needs >= $MIN_PY_MAJOR.$MIN_PY_MINOR" \
            "remove it (rm -rf $(quote_cmd "$PREFIX")) and re-run, or pass --prefix DIR for a new one"
    fi
    info "reusing the existing virtual environment at $PREFIX (Python $v_version)"
else
    if [ -e "$PREFIX" ] && [ -n "$(ls -A "$PREFIX" 2>/dev/null)" ]; then
        die "$PREFIX exists, is not empty and is not a virtual environment" \
            "pass --prefix DIR with a new or empty directory, or move $PREFIX away"
    fi
    run "check that the parent directory of $PREFIX is writable and the disk is not full, or pass --prefix DIR" \
        "$PY" -m venv "$PREFIX"
fi
run "pip could not reach the package index: check the network connection / proxy (HTTPS_PROXY) and re-run" \
    "$VENV_PY" -m pip install --upgrade pip

# ---------------------------------------------------------------------------------------------- 4. torch

heading 4 "Installing torch"
if [ "$NO_TORCH" = 1 ]; then
    info "skipped (--no-torch): this client generates with llama.cpp"
else
    info "$torch_why"
    if [ "$GPU_KIND" = nvidia ] && [ -z "$TORCH_INDEX" ] && [ "$NO_TORCH_INDEX" = 0 ]; then
        info "the CUDA build of torch and its NVIDIA libraries are a few GB: this download takes a while"
    fi
    torch_hint="check the network connection and free disk space (torch needs several GB); to pick another build pass
  --torch-spec SPEC (e.g. torch==2.6.0) and/or --torch-index-url URL (e.g. $CPU_INDEX_URL), or --no-torch"
    if [ -n "$TORCH_INDEX" ]; then
        run "$torch_hint" "$VENV_PY" -m pip install "$TORCH_SPEC" --index-url "$TORCH_INDEX"
    else
        run "$torch_hint" "$VENV_PY" -m pip install "$TORCH_SPEC"
    fi
fi

# ---------------------------------------------------------------------------------------------- 5. echo-swarm

heading 5 "Installing echo-swarm"

# The checkout is built from a temporary copy of its source files (git's tracked and unignored files when it
# is a git work tree): pip would otherwise build inside the checkout, writing build/ and *.egg-info there, and
# a stale build/lib can carry deleted modules into the wheel.
COPY_SOURCE='import os, shutil, subprocess, sys
src, dst = sys.argv[1], sys.argv[2]
files = None
if os.path.exists(os.path.join(src, ".git")):
    try:
        out = subprocess.run(["git", "-C", src, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             capture_output=True, check=True).stdout
        files = [f for f in out.decode("utf-8", "surrogateescape").split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        files = None
if files:
    for rel in files:
        path = os.path.join(src, rel)
        if os.path.isfile(path):  # a tracked file deleted in the work tree is left out, as a build would
            os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
            shutil.copy2(path, os.path.join(dst, rel))
else:
    skip = {".git", ".hg", "build", "dist", "__pycache__", "node_modules", ".tox", ".nox", ".hypothesis"}
    def ignore(folder, names):
        return [n for n in names if n in skip or n.endswith((".egg-info", "_cache")) or n.endswith(".pyc")
                or os.path.exists(os.path.join(folder, n, "pyvenv.cfg"))]
    shutil.copytree(src, dst, ignore=ignore, dirs_exist_ok=True)
print(len(files) if files else "all")'

# llama.cpp first: echo-swarm[llama] then finds it built for this machine's accelerator
if [ "$WITH_LLAMA" = 1 ]; then
    info "building llama.cpp for the llama backend ($llama_why); this compiles C++ for a few minutes"
    if [ "$DRY_RUN" = 0 ] && ! command -v c++ >/dev/null 2>&1; then
        die "no C++ compiler found; llama-cpp-python compiles llama.cpp" \
            "install one (Debian/Ubuntu: sudo apt-get install build-essential; macOS: xcode-select --install), then re-run"
    fi
    if [ "$GPU_KIND" = nvidia ] && [ -z "${CMAKE_ARGS:-}" ] && ! command -v nvcc >/dev/null 2>&1; then
        warn "nvcc (the CUDA toolkit) is not on PATH: the CUDA build of llama.cpp will fail without it."
        warn "Install the CUDA toolkit, or set CMAKE_ARGS=-DLLAVA_BUILD=OFF for a CPU build."
    fi
    run "check the compiler output above; for a CPU-only build set CMAKE_ARGS=-DLLAVA_BUILD=OFF and re-run" \
        env "CMAKE_ARGS=$LLAMA_CMAKE" "$VENV_PY" -m pip install "$LLAMA_REQ"
fi

# only-if-needed: the torch installed in step 4 satisfies echo-swarm's range and is kept as it is.
if [ "$FROM_PYPI" = 1 ]; then
    run "check the network connection; to install from a checkout instead pass --source PATH" \
        "$VENV_PY" -m pip install --upgrade --upgrade-strategy only-if-needed "echo-swarm[$EXTRAS]"
else
    if [ "$DRY_RUN" = 1 ]; then
        info "would copy the source files of $SOURCE to a temporary folder and install from there"
        BUILD_SRC="<temporary copy of $SOURCE>"
    else
        BUILD_TMP=$(mktemp -d "${TMPDIR:-/tmp}/echo-swarm-install.XXXXXX") ||
            die "cannot create a temporary folder" "check that ${TMPDIR:-/tmp} is writable, or set TMPDIR"
        trap 'rm -rf "$BUILD_TMP"' EXIT
        BUILD_SRC="$BUILD_TMP/echo-swarm"
        copy_rc=0
        copied=$("$PY" -I -B -c "$COPY_SOURCE" "$SOURCE" "$BUILD_SRC" 2>&1) || copy_rc=$?
        if [ "$copy_rc" -ne 0 ]; then
            printf '%s\n' "$copied" >&2
            die "copying the source files of $SOURCE failed" \
                "check that $SOURCE is readable and ${TMPDIR:-/tmp} has free space (or set TMPDIR)"
        fi
        info "copied $copied source files of $SOURCE to $BUILD_SRC"
    fi
    run "check that $SOURCE is a complete echo-swarm checkout and that PyPI is reachable (dependencies come from there)" \
        "$VENV_PY" -m pip install --upgrade --upgrade-strategy only-if-needed "$BUILD_SRC[$EXTRAS]"
fi

if [ "$WITH_P2P" = 1 ]; then
    info "installing peer-to-peer snapshot transfer ($P2P_REQ and its libp2p daemon)"
    # --prefer-binary: one dependency (prefetch_generator) exists only as a source package
    run "hivemind 1.1.12 has wheels for Linux and macOS (x86_64, arm64) only; without it, leave --with-p2p off (snapshots then come over HTTP)" \
        "$VENV_PY" -m pip install --prefer-binary "$P2P_REQ"
fi

# ---------------------------------------------------------------------------------------------- 6. self-check

heading 6 "Checking the installation"

# -I: ignore the current directory and PYTHON* variables, so that this tests the venv and not a checkout.
# The device rule is the client's own (shared.policy.pick_device): CUDA, then Apple MPS, then CPU.
SELF_CHECK='import sys
import torch
import transformers
import swarm_client.backends.torch_backend
if torch.cuda.is_available():
    device, detail = "cuda", torch.cuda.get_device_name(0)
elif getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
    device, detail = "mps", "Apple Metal"
else:
    device, detail = "cpu", "%d threads" % torch.get_num_threads()
print("python %s, torch %s (CUDA build: %s), transformers %s" % (
    sys.version.split()[0], torch.__version__, torch.version.cuda or "none", transformers.__version__))
print("torch_cuda=%s" % (torch.version.cuda or ""))
print("device=%s (%s)" % (device, detail))'

# --no-torch: the llama.cpp backend must import, and torch must be absent (unless --with-p2p brought it)
LLAMA_CHECK='import importlib.util, sys
import llama_cpp
import swarm_client.backends.llama_backend
print("python %s, llama-cpp-python %s, GPU offload: %s" % (
    sys.version.split()[0], llama_cpp.__version__, "yes" if llama_cpp.llama_supports_gpu_offload() else "no (CPU)"))
print("torch=%s" % ("installed" if importlib.util.find_spec("torch") else "absent"))'

if [ "$DRY_RUN" = 1 ]; then
    info "would run: $(quote_cmd "$EXE" --help)"
    if [ "$NO_TORCH" = 1 ]; then
        info "would run: $(quote_cmd "$VENV_PY" -I -c "import llama_cpp, swarm_client.backends.llama_backend")"
    else
        info "would run: $(quote_cmd "$VENV_PY" -I -c "import torch, transformers, swarm_client.backends.torch_backend; print(device)")"
    fi
else
    help_rc=0
    help_out=$("$EXE" --help 2>&1) || help_rc=$?
    if [ "$help_rc" -ne 0 ] || [ -z "$help_out" ]; then
        printf '%s\n' "$help_out" >&2
        die "'$EXE --help' failed (exit $help_rc)" \
            "the echo-swarm install is incomplete: re-run this installer; if it fails again, report the output above"
    fi
    info "ok: echo-swarm --help"
fi
if [ "$DRY_RUN" = 0 ] && [ "$NO_TORCH" = 1 ]; then
    check_rc=0
    check_out=$("$VENV_PY" -I -c "$LLAMA_CHECK" 2>&1) || check_rc=$?
    if [ "$check_rc" -ne 0 ]; then
        printf '%s\n' "$check_out" >&2
        die "importing llama_cpp / swarm_client.backends.llama_backend in the venv failed (exit $check_rc)" \
            "read the Python error above; a broken llama.cpp build is fixed by re-running this installer" \
            "(with a C/C++ compiler, and CMAKE_ARGS=-DLLAVA_BUILD=OFF for a CPU build)"
    fi
    info "ok: $(printf '%s\n' "$check_out" | sed -n '1p')"
    if [ "$(printf '%s\n' "$check_out" | sed -n 's/^torch=//p')" = absent ]; then
        info "no torch installed: this client generates with llama.cpp (echo-swarm join picks it)"
    else
        info "torch is installed too (hivemind, for --with-p2p, depends on it)"
    fi
elif [ "$DRY_RUN" = 0 ]; then
    check_rc=0
    check_out=$("$VENV_PY" -I -c "$SELF_CHECK" 2>&1) || check_rc=$?
    if [ "$check_rc" -ne 0 ]; then
        printf '%s\n' "$check_out" >&2
        die "importing torch / transformers / swarm_client.backends.torch_backend in the venv failed (exit $check_rc)" \
            "read the Python error above; a broken torch download is fixed by re-running this installer," \
            "or start clean: rm -rf $(quote_cmd "$PREFIX") and re-run"
    fi
    device_line=$(printf '%s\n' "$check_out" | sed -n 's/^device=//p')
    torch_cuda=$(printf '%s\n' "$check_out" | sed -n 's/^torch_cuda=//p')
    info "ok: $(printf '%s\n' "$check_out" | sed -n '1p')"
    info "torch will use: $device_line"
    device=${device_line%% *}
    if [ "$GPU_KIND" = nvidia ] && [ "$device" != cuda ]; then
        if [ -z "$torch_cuda" ]; then
            warn "an NVIDIA GPU was found but the installed torch is a CPU-only build (an earlier install?)."
            warn "Fix: $(quote_cmd "$VENV_PY" -m pip install --force-reinstall "$TORCH_SPEC"), or re-run into a new --prefix."
        else
            warn "an NVIDIA GPU was found but torch (built for CUDA $torch_cuda) cannot use it; the driver supports CUDA ${NVIDIA_CUDA:-?}."
            warn "Fix: update the NVIDIA driver, or re-run with --torch-index-url https://download.pytorch.org/whl/cuXYZ"
            warn "for a CUDA version your driver supports (e.g. cu118). echo-swarm still works, on the CPU."
        fi
    elif [ "$GPU_KIND" != nvidia ] && [ -n "$torch_cuda" ]; then
        warn "torch is a CUDA $torch_cuda build (several GB of NVIDIA libraries), but this machine has no usable NVIDIA GPU:"
        warn "it runs on the CPU and the NVIDIA libraries are dead weight. Fix: $(quote_cmd "$VENV_PY" -m pip install --force-reinstall "$TORCH_SPEC" --index-url "$CPU_INDEX_URL")"
        warn "(the CPU build), or reinstall with --no-torch for a llama.cpp client."
    elif [ "$GPU_KIND" = mps ] && [ "$device" != mps ]; then
        warn "this is an Apple silicon Mac but torch cannot use Metal (MPS): macOS 12.3+ and an arm64 Python are needed."
        warn "echo-swarm still works, on the CPU."
    fi
fi

# ---------------------------------------------------------------------------------------------- 7. link

heading 7 "Linking the echo-swarm command"

if [ "$NO_LINK" = 1 ]; then
    info "skipped (--no-link); the executable is $EXE"
    RUN_CMD=$EXE
else
    if [ -L "$LINK" ]; then
        old_target=$(readlink "$LINK" 2>/dev/null) || old_target="?"
        if [ "$old_target" != "$EXE" ]; then
            info "replacing the existing link $LINK -> $old_target"
        fi
    elif [ -e "$LINK" ]; then
        die "$LINK already exists and is not a symlink, so it was left alone" \
            "move it away and re-run, or pass --bin-dir DIR (another directory) or --no-link"
    fi
    run "check that $BIN_DIR is writable, or pass --bin-dir DIR or --no-link" mkdir -p "$BIN_DIR"
    run "check that $BIN_DIR is writable, or pass --bin-dir DIR or --no-link" ln -sfn "$EXE" "$LINK"
    [ "$DRY_RUN" = 1 ] || info "linked $LINK -> $EXE"
    RUN_CMD=$LINK
    case ":$PATH:" in
        *":$BIN_DIR:"* | *":$BIN_DIR/:"*)
            found=$(command -v echo-swarm 2>/dev/null) || found=""
            if [ "$DRY_RUN" = 1 ] || [ "$found" = "$LINK" ]; then
                RUN_CMD=echo-swarm
            elif [ -n "$found" ]; then
                warn "another echo-swarm comes first on PATH ($found); use the full path below."
            fi
            ;;
        *)
            info "$BIN_DIR is not on your PATH; to run plain 'echo-swarm', add this line to ~/.bashrc or ~/.zshrc:"
            info "  export PATH=\"$BIN_DIR:\$PATH\""
            ;;
    esac
fi

# ---------------------------------------------------------------------------------------------- done

if [ "$RUN_CMD" != echo-swarm ]; then
    RUN_CMD=$(quote_cmd "$RUN_CMD")
fi
if [ "$DRY_RUN" = 1 ]; then
    banner "Dry run finished: nothing was changed"
    info "After a real install, the command to run would be:"
else
    banner "Done: echo-swarm is installed in $PREFIX"
    info "To contribute this machine to a swarm, run:"
fi
printf '\n    %s join <COORDINATOR_URL>\n\n' "$RUN_CMD"
