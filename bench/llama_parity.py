"""Parity of llama.cpp clients with the learner: per-token logprob difference between what an honest llama.cpp
client reports (each GGUF precision the coordinator offers) and the learner's torch recompute of the same
sampled tokens. The verifier's per-backend tolerances (coordinator/config.py LLAMA_TOLERANCES) come from here.

    PYTHONPATH=. python bench/llama_parity.py --prompts 64 --group 8 --max-tokens 8 [--model tiny] [--json out.json]

Rollouts are sampled exactly as a client does (LlamaBackend.generate on a job-shaped request at the job's
temperature); the recompute is shared.policy.completion_logprobs, the learner's own function. Reported: mean,
p99 and max of |Δ| per token, of the per-sequence mean |Δ|, and of the per-result mean (jobs of 8 prompts ×
group, what check_logprobs compares with mean_tol). A torch client row is the baseline.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _stats(values: list[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=np.float64)
    return {"mean": float(a.mean()), "p99": float(np.percentile(a, 99)), "max": float(a.max())}


def _job(prompts: list[list[int]], group: int, max_tokens: int, temperature: float, stop: list[int], seed: int) -> Any:
    """A job-shaped object with the fields the backends read (no signature needed offline)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        prompts=[SimpleNamespace(token_ids=p) for p in prompts], group_size=group, seed=seed,
        sampling=SimpleNamespace(temperature=temperature, max_tokens=max_tokens, stop_token_ids=stop))


def measure(model_dir: Path, precisions: list[str], n_prompts: int, group: int, max_tokens: int,
            temperature: float, threads: int, per_result: int = 8) -> dict[str, Any]:
    import torch

    from coordinator.config import ArithmeticTaskConfig
    from coordinator.publish.gguf_export import export_folder
    from coordinator.tasks.builtin import ArithmeticTask
    from shared.policy import completion_logprobs, load_model, load_tokenizer, stop_token_ids
    from swarm_client.backends.llama_backend import LlamaBackend
    from swarm_client.backends.torch_backend import TorchBackend

    torch.set_num_threads(threads)
    tok = load_tokenizer(model_dir)
    stops = stop_token_ids(tok)
    task = ArithmeticTask(ArithmeticTaskConfig())
    prompts = [list(tok.encode(it.prompt)) for it in task.train[:n_prompts]]
    learner = load_model(model_dir).eval()

    def recompute(samples: list[Any]) -> list[list[float]]:
        flat_prompts = [p for p in prompts for _ in range(group)]
        out: list[list[float]] = []
        with torch.no_grad():
            for s in range(0, len(samples), 64):
                comps = [x.token_ids for x in samples[s : s + 64]]
                lp, _ = completion_logprobs(learner, flat_prompts[s : s + 64], comps, temperature=temperature,
                                            pad_id=stops[0])
                out.extend(row[: len(c)] for row, c in zip(lp.tolist(), comps, strict=True))
        return out

    def row(samples: list[Any]) -> dict[str, Any]:
        ref = recompute(samples)
        tok_d: list[float] = []
        seq_d: list[float] = []
        for smp, r in zip(samples, ref, strict=True):
            d = [abs(a - b) for a, b in zip(smp.logprobs, r, strict=True)]
            tok_d.extend(d)
            seq_d.append(sum(d) / max(1, len(d)))
        per = per_result * group
        res_d = []
        for s in range(0, len(samples), per):
            chunk = [abs(a - b) for smp, r in zip(samples[s : s + per], ref[s : s + per], strict=True)
                     for a, b in zip(smp.logprobs, r, strict=True)]
            res_d.append(sum(chunk) / max(1, len(chunk)))
        return {"tokens": len(tok_d), "per_token": _stats(tok_d), "per_sequence": _stats(seq_d),
                "per_result": _stats(res_d)}

    job = _job(prompts, group, max_tokens, temperature, stops, seed=12345)
    results: dict[str, Any] = {}
    tb = TorchBackend(device="cpu", threads=threads)
    tb.load(model_dir)
    results["torch"] = row(tb.generate(job, lambda: False))  # type: ignore[arg-type]
    with tempfile.TemporaryDirectory() as tmp:
        for precision in precisions:
            for kv in ("f16", "f32"):
                folder = Path(tmp) / f"{precision}-{kv}"
                folder.mkdir()
                export_folder(model_dir, folder / "model.gguf", precision)
                backend = LlamaBackend(device="cpu", threads=threads, n_ctx=512, kv_f32=kv == "f32")
                backend.load(folder)
                results[f"llama-{precision} (KV {kv})"] = row(backend.generate(job, lambda: False))  # type: ignore[arg-type]
                del backend
    return results


def table(results: dict[str, Any]) -> str:
    lines = ["| backend class | tokens | per token mean / p99 / max | per sequence mean / p99 / max | "
             "per result (mean) max |", "|---|---|---|---|---|"]
    for name, r in results.items():
        t, s, j = r["per_token"], r["per_sequence"], r["per_result"]
        lines.append(f"| {name} | {r['tokens']} | {t['mean']:.2e} / {t['p99']:.2e} / {t['max']:.2e} | "
                     f"{s['mean']:.2e} / {s['p99']:.2e} / {s['max']:.2e} | {j['max']:.2e} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="HF model folder, or 'tiny' (the built-in model)")
    ap.add_argument("--precisions", default="f32,f16,q8_0")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.model == "tiny":
        from coordinator.engine.tiny_model import ensure_tiny_model

        model_dir = ensure_tiny_model()
    else:
        model_dir = Path(args.model)
    res = measure(model_dir, args.precisions.split(","), args.prompts, args.group, args.max_tokens,
                  args.temperature, args.threads)
    print(table(res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
