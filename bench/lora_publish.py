"""LoRA at size: what publishing a version costs the coordinator, and what a new version costs a torch client.

For a LoRA learner (rank 4 on q_proj, v_proj, peft) this publishes ``--versions`` versions through the real
SnapshotStore, exactly as the coordinator's publisher does: ``Learner.snapshot_files()`` on the learner thread
(the adapter copied), then ``SnapshotStore.publish`` (files written, fsynced, hashed, manifest signed). Version 0
also writes the run's shared base (safetensors + GGUF) once; each later version is its adapter only. Between
versions the adapters are perturbed (a stand-in for a training step), so every version's bytes differ.

Then a torch client (swarm_client TorchBackend) loads version 1 from a folder assembled like the client's
snapshot cache (hard links to one blob per sha256) and switches to each later version: the base is loaded
once, a switch rewrites only the adapted weights.

    python bench/lora_publish.py --model tiny --versions 5
    python bench/lora_publish.py --build-qwen05 /tmp/qwen05 --versions 5   # 0.5 B-shaped, random init, ~2 GB

Prints one line per version and a summary table (markdown).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def build_qwen05(out: Path) -> Path:
    """A Qwen2.5-0.5B-shaped model (random init, f32) with the tiny model's byte tokenizer
    (../shared/notes/scale.md; the rope base does not matter for what is measured here)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from coordinator.engine.tiny_model import build_tokenizer

    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=151_936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                      num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
                      bos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    Qwen2ForCausalLM(cfg).save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return out


def perturb(learner: Any, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in learner.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.01)


def client_folder(store: Any, version: int, dest: Path) -> tuple[Path, int]:
    """The torch client's folder for a version: its "hf" files, hard-linked to one blob per sha256."""
    from shared import wire
    from shared.messages import Manifest, SignedManifest

    signed = wire.decode((store.folder(version) / "manifest.msgpack").read_bytes(), SignedManifest)
    manifest = wire.decode(signed.manifest, Manifest)
    blobs = dest / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    folder = dest / f"v{version:06d}"
    folder.mkdir()
    fetched = 0
    for f in manifest.files:
        if f.form != "hf":
            continue
        blob = blobs / f.sha256
        if not blob.exists():
            shutil.copyfile(store.blob_path(f.sha256), blob)
            fetched += f.size
        os.link(blob, folder / f.path)
    return folder, fetched


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="a Hugging Face folder, or 'tiny'")
    ap.add_argument("--build-qwen05", type=Path, help="build (or reuse) a 0.5 B-shaped model here and use it")
    ap.add_argument("--versions", type=int, default=5)
    ap.add_argument("--gguf", default="f16")
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    from coordinator.config import LearnerConfig, ModelConfig
    from coordinator.engine.learner import Learner
    from coordinator.publish.snapshots import SnapshotStore
    from shared import crypto
    from swarm_client.backends.torch_backend import TorchBackend

    if args.build_qwen05 is not None:
        t0 = time.perf_counter()
        model = build_qwen05(args.build_qwen05)
        print(f"model at {model} ({time.perf_counter() - t0:.1f}s)")
    elif args.model == "tiny":
        from coordinator.engine.tiny_model import ensure_tiny_model

        model = ensure_tiny_model()
    else:
        model = Path(args.model)
    learner = Learner(model, ModelConfig(device="cpu"), LearnerConfig(lora_rank=args.rank, threads=args.threads),
                      temperature=1.0, gguf=args.gguf)
    params = sum(p.numel() for p in learner.model.parameters())
    tmp = Path(tempfile.mkdtemp(prefix="lora-publish-"))
    try:
        store = SnapshotStore(tmp / "snapshots", crypto.generate_key(), "bench")
        rows = []
        for version in range(args.versions + 1):
            if version:
                perturb(learner, version)
            t0 = time.perf_counter()
            files = learner.snapshot_files()
            handover = time.perf_counter() - t0
            t1 = time.perf_counter()
            store.publish(version, files, float(version))
            publish = time.perf_counter() - t1
            own = sum(p.stat().st_size for p in store.folder(version).iterdir())
            rows.append((version, handover, publish, own))
            print(f"v{version}: hand-over {handover * 1e3:.1f} ms, publish {publish * 1e3:.1f} ms, "
                  f"version folder {own:,} B", flush=True)
        base = {p.name: p.stat().st_size for p in store.base_dir.iterdir() if not p.name.startswith(".")}
        base_bytes = sum(base.values())

        backend = TorchBackend(device="cpu", threads=args.threads)
        cdir = tmp / "client"
        swaps = []
        first_fetch = 0
        later_fetch = []
        for version in range(1, args.versions + 1):
            folder, fetched = client_folder(store, version, cdir)
            t0 = time.perf_counter()
            backend.load(folder)
            took = time.perf_counter() - t0
            if version == 1:
                first_load, first_fetch = took, fetched
            else:
                swaps.append(took)
                later_fetch.append(fetched)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        later = rows[1:]
        print()
        print(f"model: {model} ({params / 1e6:.1f} M parameters), LoRA rank {args.rank}, GGUF {args.gguf}")
        print(f"shared base, written once at version 0: {base_bytes:,} B "
              f"({', '.join(f'{k} {v:,}' for k, v in sorted(base.items()) if v > 100_000)})")
        print()
        print("| figure | value |")
        print("|---|---|")
        print(f"| version 0 publish (writes the shared base) | {rows[0][2]:.2f} s |")
        print(f"| later versions: learner hand-over (adapter copy), median | "
              f"{statistics.median(r[1] for r in later) * 1e3:.1f} ms |")
        print(f"| later versions: publish (write, fsync, hash, sign), median / max | "
              f"{statistics.median(r[2] for r in later) * 1e3:.1f} / {max(r[2] for r in later) * 1e3:.1f} ms |")
        print(f"| bytes per version on the coordinator (adapter safetensors + config + GGUF + manifest) | "
              f"{statistics.median(r[3] for r in later):,.0f} B |")
        full = base.get("model.safetensors", 1)
        print(f"| torch client: first version (base + adapter) fetched / load | {first_fetch:,} B / {first_load:.2f} s |")
        print(f"| torch client: later version fetched, median (÷ full safetensors) | "
              f"{statistics.median(later_fetch):,.0f} B ({statistics.median(later_fetch) / full:.3%}) |")
        print(f"| torch client: switch to a later version, median | {statistics.median(swaps) * 1e3:.1f} ms |")
        print(f"| peak RSS of this process (learner + client) | {rss:.2f} GiB |")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
