"""Peak memory of the torch client against its memory pre-check (issue 14).

Builds a Qwen2-shaped model with random weights (transformers ``from_config``), saves two versions of it as the
coordinator publishes them (safetensors + config + tokenizer), then, in a fresh process that does what the join
client does, measures the peak resident memory of each phase:

1. the runtime: torch, transformers and the backend imported and created, no weights;
2. the first load of version 1 (``TorchBackend.load``);
3. the swap to version 2 (same architecture: loaded in place, tensor by tensor);
4. one generation of a job of the given batch.

Each phase's peak is the kernel's high-water mark of the process's resident set (``VmHWM``), reset between
phases through ``/proc/self/clear_refs``; the overall peak is the largest of them (``getrusage``'s ``ru_maxrss``
where the mark cannot be reset: then each phase shows the peak so far). Beside them it
prints the pre-check's estimate for the same folder and job (``swarm_client.footprint.torch_need``) and the
estimate of the pre-check before issue 14 (1.2 × the files + 0.5 GiB). It also checks that the swap left the
model holding version 2's weights and did not write to version 1's files.

    python bench/client_memory.py                          # the tiny shape (seconds)
    python bench/client_memory.py --shape qwen2.5-0.5b     # 494 M parameters: ~2 GB per version, ~6 GB of RAM
    python bench/client_memory.py --shape qwen2.5-0.5b --dtype bfloat16   # 16-bit files, loaded as float32

Temporary files go to a directory under $TMPDIR (or --workdir) and are removed at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GIB = 2**30
SHAPES: dict[str, dict[str, Any]] = {
    # the built-in tiny model's shape (coordinator/engine/tiny_model.py), byte-level vocabulary
    "tiny": dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=257, tie_word_embeddings=True),
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
}


# ---- the model folders ---------------------------------------------------------------------------------------
def build_versions(shape: str, dtype: str, out: Path, gguf: bool) -> list[Path]:
    """Two versions of one architecture with different random weights, saved as the coordinator publishes
    (``gguf``: also the f16 ``model.gguf`` a llama.cpp client fetches)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from coordinator.engine.tiny_model import build_tokenizer

    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096, use_sliding_window=False,
                      bos_token_id=256, eos_token_id=256, pad_token_id=256)
    tokenizer = build_tokenizer()
    folders = []
    for version in (1, 2):
        torch.manual_seed(version)
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
        folder = out / f"v{version:06d}"
        model.save_pretrained(str(folder), safe_serialization=True)
        tokenizer.save_pretrained(str(folder))
        del model
        if gguf:
            from coordinator.publish.gguf_export import export_folder

            export_folder(folder, folder / "model.gguf", "f16")
        folders.append(folder)
    return folders


# ---- the client process --------------------------------------------------------------------------------------
def _status(key: str) -> int:
    match = re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    return int(match.group(1)) * 1024 if match else 0


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set (Linux ≥ 4.0)
        return True
    except OSError:
        return False


def _sha256(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.glob("*.safetensors")):
        with open(p, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def bench_job(prompts: int, group: int, prompt_tokens: int, new_tokens: int) -> Any:
    from shared import PROTOCOL_VERSION
    from shared.messages import Job, JobPrompt, SamplingParams

    now = time.time()
    return Job(protocol=PROTOCOL_VERSION, run_id="bench", job_id="bench", lease_id="bench", client_id="0" * 32,
               version=2, manifest_sha256="0" * 64,
               prompts=[JobPrompt(prompt_id=i, token_ids=[(7 * i + j) % 250 + 1 for j in range(prompt_tokens)],
                                  text="") for i in range(prompts)],
               prompt_hash="0" * 64, group_size=group,
               sampling=SamplingParams(temperature=1.0, max_tokens=new_tokens, stop_token_ids=[2**31 - 1]),
               seed=1234, issued_at=now, deadline=now + 3600, max_result_bytes=1 << 20)


def client_process(v1: Path, v2: Path, args: argparse.Namespace) -> dict[str, Any]:
    """What `echo-swarm join --backend torch|llama --device cpu` does with two versions and one job, measured."""
    out: dict[str, Any] = {"phases": {}, "backend": args.backend}
    resettable = _reset_peak()

    def phase(name: str, t0: float) -> None:
        out["phases"][name] = {"peak": _status("VmHWM"), "after": _status("VmRSS"), "s": round(time.monotonic() - t0, 2)}
        _reset_peak()

    t0 = time.monotonic()
    from swarm_client.footprint import Batch, llama_need, torch_need

    if args.backend == "llama":
        from swarm_client.backends.llama_backend import LlamaBackend

        backend: Any = LlamaBackend(device="cpu", threads=args.threads)
    else:
        from swarm_client.backends.torch_backend import TorchBackend

        backend = TorchBackend(device="cpu", threads=args.threads)
    phase("runtime", t0)
    v1_hash = _sha256(v1)
    _reset_peak()
    t0 = time.monotonic()
    backend.load(v1)
    phase("load v1", t0)
    t0 = time.monotonic()
    backend.load(v2)
    phase("swap to v2", t0)
    job = bench_job(args.prompts, args.group, args.prompt_tokens, args.new_tokens)
    t0 = time.monotonic()
    samples = backend.generate(job, lambda: False)
    phase("generate", t0)
    out["tokens"] = sum(len(s.token_ids) for s in samples)
    out["files"] = sum(p.stat().st_size for p in v2.iterdir() if p.is_file() and p.suffix != ".gguf")
    out["weight_files"] = sum(p.stat().st_size for p in v2.glob("*.safetensors"))
    # clear_refs also resets the high-water mark getrusage reports: the overall peak is the phases' largest
    peaks = [p["peak"] for p in out["phases"].values()]
    out["overall_peak"] = max(peaks) if resettable else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out["resettable"] = resettable
    if args.backend == "llama":
        need = llama_need(v2)
        out["estimate"], out["estimate_parts"] = need.total, need.parts
        out["weight_files"] = (v2 / "model.gguf").stat().st_size
        out["files"] = out["weight_files"]
        out["swap_checked"] = False  # a whole GGUF is reloaded, not swapped in place
        return out
    import torch

    # the swap left version 2's weights in the model and version 1's files untouched
    from safetensors import safe_open

    params = dict(backend.model.named_parameters())
    with safe_open(str(next(v2.glob("*.safetensors"))), "pt") as fh:
        names = list(fh.keys())
        for name in (names[0], names[len(names) // 2], names[-1]):
            stored = fh.get_tensor(name)
            assert torch.equal(params[name].detach(), stored.to(params[name].dtype)), f"{name} is not version 2's"
    assert _sha256(v1) == v1_hash, "the swap wrote to version 1's files"
    out["swap_checked"] = True
    need = torch_need(v2, Batch.of_job(job))
    out["estimate"], out["estimate_parts"] = need.total, need.parts
    return out


# ---- driver --------------------------------------------------------------------------------------------------
def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                    help="dtype of the published safetensors (the torch client computes in float32)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per job (coordinator default 8)")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt (coordinator default 8)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--backend", choices=("torch", "llama", "both"), default="torch",
                    help="llama needs llama-cpp-python and float32 files (exported to an f16 GGUF)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--workdir", type=Path, default=None, help="where the two versions are written (removed after)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--_client", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._client:
        print(json.dumps(client_process(args._client[0], args._client[1], args)))
        return
    backends = ["torch", "llama"] if args.backend == "both" else [args.backend]
    if "llama" in backends and args.dtype != "float32":
        sys.exit("--backend llama needs --dtype float32 (the GGUF export reads float32 safetensors)")
    work = Path(tempfile.mkdtemp(prefix="echo-swarm-client-memory-", dir=args.workdir))
    results = []
    try:
        t0 = time.monotonic()
        v1, v2 = build_versions(args.shape, args.dtype, work, gguf="llama" in backends)
        print(f"built 2 versions of {args.shape} ({args.dtype}) in {time.monotonic() - t0:.0f}s under {work}",
              flush=True)
        for backend in backends:
            # a fresh process per backend: the builder's memory is not the client's
            cmd = [sys.executable, __file__, "--_client", str(v1), str(v2), "--backend", backend,
                   "--prompts", str(args.prompts), "--group", str(args.group), "--prompt-tokens",
                   str(args.prompt_tokens), "--new-tokens", str(args.new_tokens)]
            cmd += ["--threads", str(args.threads)] if args.threads else []
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                                  env=os.environ | {"PYTHONPATH": str(REPO)})
            if proc.returncode != 0:
                sys.exit(f"{backend} client process failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    batch = f"{args.prompts}×{args.group} sequences, {args.prompt_tokens} prompt + {args.new_tokens} new tokens"
    for res in results:
        res |= {"shape": args.shape, "dtype": args.dtype, "batch": batch,
                "old_estimate": int(res["files"] * 1.2) + GIB // 2}
        print(f"\n{res['backend']}, shape {args.shape}, files {args.dtype}: {_gib(res['weight_files'])} GiB of "
              f"weights; job {batch}; {res['tokens']} tokens generated; swap checked: {res['swap_checked']}")
        print(f"{'phase':<12} {'peak RSS GiB':>13} {'RSS after':>10} {'seconds':>8}")
        for name, p in res["phases"].items():
            print(f"{name:<12} {_gib(p['peak']):>13} {_gib(p['after']):>10} {p['s']:>8}")
        print(f"{'overall':<12} {_gib(res['overall_peak']):>13}")
        parts = ", ".join(f"{k} {_gib(v)}" for k, v in res["estimate_parts"].items())
        print(f"pre-check estimate: {_gib(res['estimate'])} GiB ({parts}); before issue 14: "
              f"{_gib(res['old_estimate'])} GiB")
        print(f"estimate / measured peak: {res['estimate'] / res['overall_peak']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))

if __name__ == "__main__":
    main()
