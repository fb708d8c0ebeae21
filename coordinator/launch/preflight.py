"""Pre-flight checks of `echo-swarm coordinator`: what would make the run fail, found before any role starts
and before anything is written.

Without them a port in use showed up as the API role dying and being restarted five times (six tracebacks,
24 s) after the learner had already published version 0 into the new run directory, and a missing model folder
only after three roles had started and written the coordinator key and the database. Each check here reads only;
a failure is one line that says what is wrong and what to change, with its own exit code (shared.exit_codes), so
a script or a service manager can tell the causes apart.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

from coordinator.config import CoordinatorConfig
from shared.adapters import SafetensorsFile
from shared.exit_codes import ExitCode

#: Bytes per element of a published version's safetensors weights, by snapshots.dtype (or model.dtype).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: Bytes per weight of the GGUF form, by snapshots.gguf: q8_0 34 bytes per block of 32, q4_0 18; q6_K 210 per
#: super-block of 256; the K_M mixtures keep some tensors at a higher type (llama.cpp's own bits-per-weight
#: figures, 5.69 and 4.85, rounded up).
GGUF_BYTES = {"off": 0.0, "f32": 4.0, "f16": 2.0, "q8_0": 34 / 32, "q6_K": 210 / 256, "q5_K_M": 0.72,
              "q4_K_M": 0.62, "q4_0": 18 / 32}
#: Headroom over the estimate of one version: tokenizer files, manifests, the version being replaced.
HEADROOM = 1.25
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


@dataclass(frozen=True)
class PreflightError(Exception):
    """One reason the run cannot start: the exit code and the one-line message (what is wrong, what to do)."""

    code: ExitCode
    message: str

    def __str__(self) -> str:
        return self.message


def check_port(host: str, port: int) -> None:
    """The API's address must be free (and an address of this machine). Port 0 picks a free port: nothing to
    check. Bound with SO_REUSEADDR, as aiohttp binds, so a port in TIME_WAIT after a restart does not count."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PreflightError(ExitCode.PORT_IN_USE, f"port {port} on {host} is in use (another coordinator "
                                     f"or program listens there): pass another --port (server.port in the run "
                                     f"config; 0 picks a free one), or stop what uses it") from None
            if exc.errno == errno.EACCES:
                raise PreflightError(ExitCode.PORT_IN_USE, f"port {port} on {host} needs privileges this user "
                                     f"lacks (ports below 1024): pass --port 1024 or above") from None
            raise PreflightError(ExitCode.USAGE, f"cannot listen on {host}:{port} ({exc.strerror}): server.host "
                                 f"must be an address of this machine, 127.0.0.1 or 0.0.0.0 (all)") from None


def model_weight_count(folder: Path) -> int:
    """Number of weights in the folder's safetensors files (from their headers; nothing else is read)."""
    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        with SafetensorsFile(path) as fh:
            for entry in fh.entries.values():
                n = 1
                for d in entry.get("shape", ()):
                    n *= int(d)
                total += n
    return total


def check_model(path_text: str) -> Path | None:
    """model.path must be a Hugging Face model folder: config.json (valid JSON), *.safetensors weights and a
    tokenizer. Returns the folder, or None for the built-in 'tiny' model (built into the cache on first use)."""
    if path_text == "tiny":
        return None
    folder = Path(path_text).expanduser()
    hint = "point model.path (--model) at a local folder holding config.json, *.safetensors and tokenizer files, " \
           "or use 'tiny'"
    if not folder.is_dir():
        what = "does not exist" if not folder.exists() else "is not a folder"
        raise PreflightError(ExitCode.MODEL_INVALID, f"model folder {folder} {what}: {hint}")
    try:
        json.loads((folder / "config.json").read_text())
    except FileNotFoundError:
        raise PreflightError(ExitCode.MODEL_INVALID, f"model folder {folder} has no config.json, so it is not a "
                             f"Hugging Face model folder: {hint}") from None
    except (OSError, ValueError) as exc:
        raise PreflightError(ExitCode.MODEL_INVALID, f"model folder {folder}: config.json does not read as JSON "
                             f"({exc}): {hint}") from None
    if not any(folder.glob("*.safetensors")):
        raise PreflightError(ExitCode.MODEL_INVALID, f"model folder {folder} has no *.safetensors weights (only "
                             f"safetensors are loaded; convert .bin weights with save_pretrained(..., "
                             f"safe_serialization=True)): {hint}")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise PreflightError(ExitCode.MODEL_INVALID, f"model folder {folder} has no tokenizer (none of "
                             f"{', '.join(TOKENIZER_FILES)}): copy the model's tokenizer files into it")
    try:
        model_weight_count(folder)
    except (OSError, ValueError) as exc:
        raise PreflightError(ExitCode.MODEL_INVALID, f"model folder {folder}: a weights file does not read "
                             f"({exc}): download it again") from None
    return folder


def existing_ancestor(path: Path) -> Path:
    """``path`` itself if it exists, else its nearest existing parent."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_run_dir(run_dir: Path) -> None:
    """The run directory (or, when it does not exist yet, the folder it would be created in) must be a writable
    folder. Checked by permission, then by making and at once removing an empty folder in it: root passes every
    permission check, yet cannot create anything in /proc, /sys or a read-only mount. A refused start writes
    nothing, and an accepted one leaves nothing of the check."""
    run_dir = Path(run_dir).expanduser()
    if run_dir.exists() and not run_dir.is_dir():
        raise PreflightError(ExitCode.RUN_DIR_UNWRITABLE, f"run_dir {run_dir} exists and is not a folder: pass "
                             f"another --run-dir (run_dir in the run config)")
    base = existing_ancestor(run_dir)
    if not base.is_dir():
        raise PreflightError(ExitCode.RUN_DIR_UNWRITABLE, f"run_dir {run_dir} cannot be created: {base} is not a "
                             f"folder; pass another --run-dir")
    if not os.access(base, os.W_OK | os.X_OK):
        what = "is not writable" if base == run_dir.absolute() else f"cannot be created: {base} is not writable"
        raise PreflightError(ExitCode.RUN_DIR_UNWRITABLE, f"run_dir {run_dir} {what} by this user: pass a "
                             f"--run-dir in a folder you can write, or fix its permissions")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".echo-swarm-check-", dir=base))
    except OSError as exc:
        what = "cannot be written" if base == run_dir.absolute() else f"cannot be created in {base}"
        raise PreflightError(ExitCode.RUN_DIR_UNWRITABLE, f"run_dir {run_dir} {what} ({exc.strerror}): pass a "
                             f"--run-dir in a folder you can write") from None


def version_bytes(config: CoordinatorConfig, folder: Path | None) -> int:
    """Disk one published version takes: its safetensors weights in the published dtype, plus the GGUF form."""
    if folder is None:
        return 0  # the built-in tiny model: a few MB
    weights = model_weight_count(folder)
    training = "bfloat16" if config.learner.precision == "bf16" else config.model.dtype  # as Learner loads it
    dtype = training if config.snapshots.dtype == "training" else config.snapshots.dtype
    return int(weights * (DTYPE_BYTES[dtype] + sum(GGUF_BYTES[p] for p in config.snapshots.offered())))


def check_disk(run_dir: Path, need_bytes: int) -> None:
    free = shutil.disk_usage(existing_ancestor(Path(run_dir).expanduser())).free
    need = int(need_bytes * HEADROOM)
    if need > free:
        raise PreflightError(ExitCode.NO_DISK_SPACE, f"not enough free disk for run_dir {run_dir}: one policy "
                             f"version needs about {need / 2**30:.2f} GiB (weights, plus GGUF for llama.cpp "
                             f"clients), {free / 2**30:.2f} GiB are free; free some space, put run_dir on a larger "
                             f"disk, or publish smaller versions (snapshots.dtype = 'bfloat16', snapshots.gguf = "
                             f"'q4_K_M' or 'off')")


def check_gguf_family(config: CoordinatorConfig, folder: Path | None) -> None:
    """A run that publishes GGUF (snapshots.gguf not 'off') needs a model family the exporter writes
    (coordinator.publish.gguf_export.route): otherwise the first publication would fail after the roles started.
    A LoRA run's adapters are written by the same route as its base. None (the tiny model) is a Qwen2."""
    # the exporter is read only when a run publishes GGUF: a torch-only run's start-up does not load it
    from coordinator.publish.gguf_export import GGUFExportError, route

    if folder is None or not config.snapshots.offered():
        return
    try:
        route(folder)
    except GGUFExportError as exc:
        raise PreflightError(ExitCode.MODEL_INVALID, f"model folder {folder}: {exc}") from None


def check_lora_targets(config: CoordinatorConfig, folder: Path | None) -> None:
    """A LoRA run's learner.lora_targets must each name linear modules of the model (peft's rule: the module's name,
    or the end of its dotted path). Families name their projections their own way (Phi-3: qkv_proj, gate_up_proj),
    and peft refuses a run none of them matches only once the learner has loaded the model, and ignores a target
    that matches nothing when another does. Read from the safetensors headers only. None (the tiny model): a Qwen2."""
    if folder is None or config.learner.lora_rank == 0:
        return
    modules: set[str] = set()
    for path in sorted(folder.glob("*.safetensors")):
        with SafetensorsFile(path) as fh:
            modules.update(name.removesuffix(".weight") for name, entry in fh.entries.items()
                           if name.endswith(".weight") and len(entry.get("shape", ())) == 2)
    missing = [t for t in config.learner.lora_targets if not any(m == t or m.endswith(f".{t}") for m in modules)]
    if missing:
        names = sorted({m.rpartition(".")[2] for m in modules})
        raise PreflightError(ExitCode.MODEL_INVALID, f"model folder {folder}: learner.lora_targets {', '.join(missing)} "
                             f"name no linear module of this model; its matrices are {', '.join(names)}: set "
                             f"learner.lora_targets to those to adapt (e.g. the attention projections)")


def check(config: CoordinatorConfig, role: str) -> None:
    """Every check that applies to ``role`` ('all' runs them all); raises the first PreflightError."""
    if role in ("all", "api"):
        check_port(config.server.host, config.server.port)
    folder = check_model(config.model.path) if role in ("all", "learner", "verifier") else None
    if role in ("all", "learner"):
        check_gguf_family(config, folder)
        check_lora_targets(config, folder)
    check_run_dir(config.run_dir)
    if role in ("all", "learner"):
        check_disk(config.run_dir, version_bytes(config, folder))
