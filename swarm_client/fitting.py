"""Whether a version fits this machine: before downloading it (memory and disk, from the manifest's sizes), before
loading it for a job (memory, from the verified files and the job's batch), and which GGUF precision a llama.cpp
client leases in (the best offered that fits, or `--precision`).

One object because the three judge alike (swarm_client/footprint.py's estimates against swarm_client/resources.py's
limits) and learn from the same things: the backend and the version it holds (the model's shape and dtype), the
machine's GPUs, the batch and precision of the job in hand. It is made once the backend exists, and handed to the
snapshot cache as its pre-check and to the leasing loop.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

from shared.adapters import ADAPTER_WEIGHTS
from shared.errors import ProtocolError
from shared.messages import Job, Manifest
from swarm_client.backends import Backend, backend_kind
from swarm_client.footprint import (
    BF16_BYTES,
    DEFAULT_BATCH,
    TORCH_DTYPE_BYTES,
    Batch,
    Need,
    Weights,
    llama_need,
    llama_need_from,
    read_shape,
    torch_need,
    torch_need_from,
    torch_weights,
)
from swarm_client.hardware import Hardware, free_disk_gb, total_memory_gb
from swarm_client.precision import choose_precision, offered_precisions
from swarm_client.resources import GIB, Limits, ResourceRefusal, check_disk, check_gpu_memory, check_memory
from swarm_client.settings import JoinConfig
from swarm_client.snapshots import SnapshotCache, wanted_files

#: the join loop's lines keep the logger name they always had in client.log (grep-able across versions)
logger = logging.getLogger("swarm_client.runner")


class Fit:
    """This machine's judge of a version's size. ``backend``: what generates (its kind, dtype and the version it
    holds); ``hardware``: the GPUs checked on a CUDA device (None: not detected); ``device``: the backend's device;
    ``forms``: the snapshot file forms the backend needs (None: all); ``say``: where the precision chosen is said."""

    def __init__(self, cfg: JoinConfig, backend: Backend, hardware: Hardware | None, device: str,
                 forms: frozenset[str] | None, say: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.backend = backend
        self.hardware = hardware
        self.device = device
        self.forms = forms
        self.say = say
        self.batch = DEFAULT_BATCH  # the batch of the job in hand (or the last one): what the memory checks assume
        # the GGUF precision a llama.cpp client leases in (swarm_client.precision), once chosen from a manifest
        self._precision: str | None = None
        self._precision_chosen = False
        self._file_precision: str | None = None  # the GGUF precision of the job in hand (what the pre-check sizes)

    def take(self, job: Job) -> None:
        """The job in hand: its batch and the precision of its file are what the next checks assume."""
        self.batch = Batch.of_job(job)
        self._file_precision = job.precision

    def choose_again(self) -> None:
        """The operator stopped offering the precision chosen: the next lease chooses again."""
        self._precision_chosen = False

    def _limits(self) -> Limits:
        return Limits(
            memory_bytes=None if self.cfg.max_memory_gb is None else int(self.cfg.max_memory_gb * GIB),
            total_memory_bytes=int(total_memory_gb() * GIB),
            min_free_disk_bytes=int(self.cfg.min_free_disk_gb * GIB),
            cache_max_bytes=None if self.cfg.cache_max_gb is None else int(self.cfg.cache_max_gb * GIB))

    def _is_llama(self) -> bool:
        return backend_kind(self.backend) == "llama"

    def _check_need(self, need: Need, version: int, limits: Limits | None = None) -> None:
        check_memory(need, need.model_bytes, limits or self._limits(), version)
        gpus = self.hardware.gpus if self.hardware else ()
        if self.device.startswith("cuda") and gpus:
            check_gpu_memory(need, int(gpus[0].memory_gb * GIB), gpus[0].name, version)

    def precheck(self, manifest: Manifest, missing_bytes: int) -> None:
        """Before downloading a version: does it fit this machine's memory ceiling and disk? Only the files'
        sizes are known yet; the model's shape and dtype come from the version the backend holds (the same run,
        so almost always the same architecture), else from the fallbacks of swarm_client/footprint.py. The check
        before loading (:meth:`check_fits`) is exact."""
        limits = self._limits()
        files = wanted_files(manifest, self.forms, self._file_precision)
        held: Path | None = getattr(self.backend, "folder", None)
        shape = like = None
        if held is not None:
            with contextlib.suppress(OSError, ValueError):
                shape = read_shape(held)
                like = None if self._is_llama() else torch_weights(held, self._torch_width())
        if self._is_llama():
            need = llama_need_from(sum(f.size for f in files if f.path.endswith(".gguf")), shape)
        else:
            weight_bytes = sum(f.size for f in files if f.path.endswith(".safetensors") and f.path != ADAPTER_WEIGHTS)
            width = self._torch_width()
            need = torch_need_from(Weights.from_file_bytes(weight_bytes, like, width), shape, self.batch, width)
        self._check_need(need, manifest.version, limits)
        check_disk(missing_bytes, int(free_disk_gb(self.cfg.home) * GIB), limits, manifest.version)

    def _torch_width(self) -> int:
        """Bytes per element the torch backend holds the model in (its compute dtype)."""
        return BF16_BYTES if getattr(self.backend, "precision", "f32") == "bf16" else TORCH_DTYPE_BYTES

    async def lease_precision(self, cache: SnapshotCache, version: int) -> str | None:
        """The precision this client leases in: a torch backend's compute dtype ("bf16"; None for the default
        float32, what every coordinator accepts); for llama.cpp the one chosen from
        ``version``'s signed manifest (swarm_client.precision: --precision, or the best offered that fits), once
        per run. A manifest that cannot be read now leaves the choice to the next lease (the run's default
        meanwhile)."""
        if not self._is_llama():
            return "bf16" if getattr(self.backend, "precision", "f32") == "bf16" else None
        if self._precision_chosen:
            return self._precision
        try:
            manifest, _ = await cache.manifest(version)
        except ProtocolError as exc:
            logger.info("could not read version %d's manifest to choose a precision: %s", version, exc)
            return None
        offered = offered_precisions(manifest)
        chosen = choose_precision(offered, self.cfg.precision, lambda size: self._fits_gguf(size, version))
        self._precision, self._precision_chosen = chosen, True
        cache.precision = self._file_precision = chosen  # prefetches fetch the same file
        if chosen is not None and len(offered) > 1:
            self.say(f"running the {chosen} GGUF ({offered[chosen] / GIB:.2f} GiB) of the precisions this run "
                     f"offers ({', '.join(offered)})")
        return chosen

    @property
    def chosen(self) -> bool:
        """Whether a llama.cpp client has chosen its precision from a manifest (so a refusal of it is news)."""
        return self._precision_chosen

    def _fits_gguf(self, size: int, version: int) -> bool:
        """Whether a GGUF of ``size`` bytes fits this machine's memory ceiling (and GPU), as the download's
        pre-check will judge it."""
        held: Path | None = getattr(self.backend, "folder", None)
        shape = None
        if held is not None:
            with contextlib.suppress(OSError, ValueError):
                shape = read_shape(held)
        try:
            self._check_need(llama_need_from(size, shape), version)
        except ResourceRefusal:
            return False
        return True

    def check_fits(self, folder: Path, batch: Batch, version: int) -> None:
        """Before loading a verified version to generate ``batch``: the estimate from the version's own files
        (safetensors or GGUF headers, config.json) and the batch, so that nothing passes the check to be killed
        by the OOM killer while loading or generating."""
        try:
            need = llama_need(folder) if self._is_llama() else torch_need(folder, batch, self._torch_width())
        except (OSError, ValueError) as exc:  # a verified folder reads; if not, loading it says what is wrong
            logger.info("could not estimate the memory for %s: %s", folder, exc)
            return
        self._check_need(need, version)
