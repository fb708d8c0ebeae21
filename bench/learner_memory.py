"""Where the learner process's bytes go (issue 23): peak RSS per phase of a step, hand-over and publication.

Runs the learner role's own pipeline in one process, without the other roles: the coordinator's
:class:`~coordinator.engine.learner.Learner` (f32 AdamW, full fine-tuning) trains GRPO steps on random completions
with random advantages (a real gradient on every weight; no sampling, which the learner role never does), hands
each version over (``snapshot_files``, plus a checkpoint where due) and publishes it with the coordinator's own
:class:`~coordinator.publish.publisher.Publisher` (bf16 safetensors, GGUF, patches against the previous version,
sha256, manifest; checkpoints with the optimizer state), one phase at a time, as in sequential pull.

For each phase it reports the peak RSS (``VmHWM`` after resetting it through ``/proc/self/clear_refs``, so short
peaks are not missed) and what the peak is made of (anonymous memory vs mapped file pages, sampled every 5 ms), in
GiB and bytes per parameter. The floor of f32 AdamW is 16 B/param (weights, gradients, two moments).

    python bench/learner_memory.py --model tiny --steps 3
    flock /tmp/echo-heavy.lock nice -n 5 python bench/learner_memory.py --model qwen0.5b --steps 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GIB = 2**30


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(rest.split()[0]) * 1024
    return out


class Phases:
    """Peak RSS per named phase (VmHWM reset at the start of each), and the anon/file split at that peak."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self._peak: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            s = _status()
            with self._lock:
                if s["VmRSS"] > self._peak.get("VmRSS", -1):
                    self._peak = s

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # resets VmHWM to the current RSS
        with self._lock:
            self._peak = _status()
        t0 = time.monotonic()
        try:
            yield
        finally:
            end = _status()
            with self._lock:
                at_peak = dict(self._peak)
            self.rows.append({"phase": name, "seconds": time.monotonic() - t0, "peak": end["VmHWM"],
                              "anon_at_peak": at_peak.get("RssAnon", 0), "file_at_peak": at_peak.get("RssFile", 0),
                              "rss_after": end["VmRSS"]})
            print(json.dumps(self.rows[-1]), flush=True)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def samples(learner: Any, rng: random.Random, prompts: int, group: int, tokens: int) -> list[Any]:
    """Random completions with random group-normalised advantages (a non-zero gradient everywhere), their old
    logprobs recomputed as the verifier would (π_b = the current policy)."""
    from coordinator.engine.learner import Sample

    vocab = learner.vocab_size
    ps = [[rng.randrange(3, 256) for _ in range(8)] for _ in range(prompts)]
    flat_p = [p for p in ps for _ in range(group)]
    comps = [[rng.randrange(3, vocab) for _ in range(tokens)] for _ in flat_p]
    advs = [rng.choice((-1.0, 1.0)) for _ in flat_p]
    old = learner.recompute(flat_p, comps)
    return [Sample(p, c, o, o, a) for p, c, o, a in zip(flat_p, comps, old, advs, strict=True)]


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from coordinator.memory import return_freed_memory

    if not args.keep_malloc:
        return_freed_memory()  # as every coordinator process does (coordinator.launch.main)
    phases = Phases()
    with phases.phase("imports (torch, transformers, coordinator)"):
        from bench.scale import build_model
        from coordinator.config import LearnerConfig, ModelConfig
        from coordinator.engine.learner import Learner
        from coordinator.publish.checkpoints import CheckpointStore
        from coordinator.publish.publisher import Publication, Publisher
        from coordinator.publish.snapshots import SnapshotStore
        from shared import crypto
    model_dir = build_model(args.model, work)
    with phases.phase("load the model"):
        learner = Learner(model_dir, ModelConfig(device="cpu"), LearnerConfig(lr=args.lr, weight_decay=0.0,
                                                                                 threads=args.threads,
                                                                                 precision=args.precision), 1.0,
                          gguf=args.gguf)
    params = sum(p.numel() for p in learner.model.parameters())
    store = SnapshotStore(work / "snapshots", crypto.generate_key(), "bench", anchor_every=args.anchor_every,
                          **({"lag_tolerance": args.lag_tolerance} if args.lag_tolerance is not None else {}))
    publisher = Publisher(store, CheckpointStore(work / "checkpoints"))
    rng = random.Random(0)

    def publish(version: int, checkpoint: bool, label: str) -> None:
        with phases.phase(f"{label}: hand-over copy" + (" + checkpoint refs" if checkpoint else "")):
            files = learner.snapshot_files("bfloat16")  # bf16 learner: its live weights
            state = learner.checkpoint_state() if checkpoint else None
        with phases.phase(f"{label}: publication" + (" + checkpoint" if checkpoint else "")):
            publisher.submit(Publication(version, files, time.time(), state)).result()
            del files, state
        store.prune({version - 1, version})

    try:
        publish(0, True, "v0")
        for v in range(1, args.steps + 1):
            batch = samples(learner, rng, args.prompts, args.group, args.max_tokens)
            with phases.phase(f"v{v}: train step (fwd, bwd, AdamW)"):
                learner.train_step(batch)
            publish(v, v == args.steps, f"v{v}")
    finally:
        publisher.close()
        phases.close()
    return {"parameters": params, "rows": phases.rows}


def table(result: dict[str, Any]) -> str:
    n = result["parameters"]
    lines = ["| phase | peak RSS | B/param | anon / file-mapped at the peak | RSS after | seconds |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['phase']} | {r['peak'] / GIB:.2f} GiB | {r['peak'] / n:.1f} | "
                     f"{r['anon_at_peak'] / GIB:.2f} / {r['file_at_peak'] / GIB:.2f} GiB | "
                     f"{r['rss_after'] / GIB:.2f} GiB | {r['seconds']:.1f} |")
    peak = max(r["peak"] for r in result["rows"])
    lines.append(f"\nwhole run: peak {peak / GIB:.2f} GiB = {peak / n:.1f} B/param ({n / 1e6:.0f} M parameters)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["tiny", "qwen0.5b"], default="tiny")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--gguf", default="f16")
    ap.add_argument("--precision", choices=["float32", "bf16"], default="float32", help="learner.precision (bf16: "
                    "weights and moments in bfloat16; published bf16 snapshots are then its live weights, no copy)")
    ap.add_argument("--anchor-every", type=int, default=50)
    ap.add_argument("--lag-tolerance", type=float, default=None, help="snapshots.lag_tolerance (default: the config's)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--keep-malloc", action="store_true", help="leave glibc's malloc as it is (the 'before' figure)")
    ap.add_argument("--out", default="bench-out/learner_memory")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="echo-swarm-lmem-"))
    try:
        result = run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps({"args": vars(args), **result}, indent=1))
    print()
    print(table(result))


if __name__ == "__main__":
    main()
