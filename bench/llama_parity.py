"""Parity of honest llama.cpp clients with the verifier: per-token and per-result |Δ logprob| between what a
llama.cpp client reports (each GGUF precision the coordinator offers) and the verifier's recompute of the same
tokens. The logprob check's per-class tolerances (coordinator/config/verification.py LLAMA_TOLERANCES,
coordinator.core.verify.check_logprobs: a result's mean |Δ| ≤ mean_tol, every token's |Δ| ≤ max_tol) come from here.

    PYTHONPATH=. python bench/llama_parity.py [--model-dir DIR ...] [--precisions f32,f16,q8_0] [--results 3000]
        [--shape 2,4,8] [--temperatures 1.0,0.7] [--threads 1] [--json out.json]

Each result is made as a client makes it: ``LlamaBackend.generate`` on a job of P prompts × G completions of at
most T tokens (a fresh sampling key per job, arithmetic-task prompts in turn), from a GGUF exported by
coordinator.publish.gguf_export at the class's precision, with llama.cpp's default f16 KV cache. The recompute is
the verifier's own call (shared.policy.completion_stats with shared prompts, as coordinator.engine.verifier).

Why results, and small ones: the gap is heavy-tailed and clustered. A position where llama.cpp's f16 rounding moves
a logit repeats across a group's completions that share the prefix, so a few tokens can carry most of a small
result's mean; and the tail grows as training sharpens the policy. The calibration therefore uses the smallest
job shape in use (tests/adversarial: 2 prompts × 4) and sharply trained checkpoints. Reported per class,
checkpoint and temperature: tokens per result, per-token mean / p99 / max, the largest per-result mean and token,
results refused at the class's configured tolerances, and the per-result false-refusal rate beyond the sample —
an exponential fitted to the largest 2 % of the per-result statistic (maximum likelihood), and, as a pessimistic
bound, a power law fitted to the same values (Hill estimator).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sampling_calibration import _job, job_shape, load_setup  # noqa: E402

TAIL_SHARE = 0.02  # share of the largest per-result values the tail fits use
JOBS_PER_PASS = 8  # jobs recomputed in one forward pass (the verifier batches concurrent results too)


@dataclass
class ParityRow:
    cls: str
    model: str
    temperature: float
    mean_tol: float
    max_tol: float
    tokens: list[float] = field(default_factory=list)  # every token's |Δ|
    means: list[float] = field(default_factory=list)  # each result's mean |Δ|
    maxes: list[float] = field(default_factory=list)  # each result's largest |Δ|
    sizes: list[int] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def refused(self) -> int:
        return sum(1 for m, x in zip(self.means, self.maxes, strict=True) if m > self.mean_tol or x > self.max_tol)

    def fitted(self, values: list[float], tol: float) -> tuple[float, float]:
        """Per-result rate of a value above ``tol``: (exponential fit, power-law fit) on the largest TAIL_SHARE."""
        top = sorted(values)[-max(16, int(len(values) * TAIL_SHARE)):]
        u = top[0]
        if u <= 0 or tol <= u:
            rate = sum(1 for v in values if v > tol) / len(values)
            return rate, rate
        share = len(top) / len(values)
        scale = max(1e-12, sum(v - u for v in top) / len(top))
        logs = sum(math.log(v / u) for v in top)
        alpha = len(top) / logs if logs > 0 else float("inf")
        return share * math.exp(-(tol - u) / scale), share * (tol / u) ** -alpha

    def rates(self) -> tuple[float, float]:
        """Per-result false-refusal rate at the class's tolerances (either check), exponential and power law."""
        m_exp, m_pow = self.fitted(self.means, self.mean_tol)
        x_exp, x_pow = self.fitted(self.maxes, self.max_tol)
        return min(1.0, m_exp + x_exp), min(1.0, m_pow + x_pow)


def run_class(cls: str, folder: Path, temperature: float, results: int, shape: tuple[int, int, int], threads: int,
              tolerances: dict[str, Any], seed: int = 0) -> ParityRow:
    import torch

    from coordinator.publish.gguf_export import export_folder
    from shared.policy import completion_stats
    from swarm_client.backends.llama_backend import LlamaBackend

    torch.set_num_threads(threads)
    setup = load_setup(folder, temperature)
    per_result, group, max_tokens = shape
    tol = tolerances[cls]
    row = ParityRow(cls, folder.name, temperature, tol.mean_tol, tol.max_tol)
    rng = random.Random(seed)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        gguf_dir = Path(tmp)
        export_folder(folder, gguf_dir / "model.gguf", cls.removeprefix("llama-"))
        backend = LlamaBackend(device="cpu", threads=threads)
        backend.load(gguf_dir)
        at = 0
        for first in range(0, results, JOBS_PER_PASS):
            jobs = []
            for _ in range(min(JOBS_PER_PASS, results - first)):
                idx = [(at + i) % len(setup.prompts) for i in range(per_result)]
                at += per_result
                job = _job([setup.prompts[i] for i in idx], group, max_tokens, temperature, setup.stops,
                           rng.getrandbits(63))
                jobs.append((idx, backend.generate(job, lambda: False)))
            prompts = [setup.prompts[i] for idx, _ in jobs for i in idx for _ in range(group)]
            samples = [s for _, ss in jobs for s in ss]
            with torch.no_grad():
                stats = completion_stats(setup.model, prompts, [s.token_ids for s in samples],
                                         temperature=temperature, pad_id=setup.pad, share_prompts=True)
            recomputed = stats.logprobs.tolist()
            per = per_result * group
            for j in range(len(jobs)):
                gaps = [abs(a - b) for s, r in zip(samples[j * per : (j + 1) * per], recomputed[j * per : (j + 1) * per],
                                                   strict=True) for a, b in zip(s.logprobs, r, strict=False)]
                row.tokens.extend(gaps)
                row.means.append(sum(gaps) / len(gaps))
                row.maxes.append(max(gaps))
                row.sizes.append(len(gaps))
        del backend
    row.seconds = time.monotonic() - t0
    return row


def table(rows: list[ParityRow], shape: tuple[int, int, int]) -> str:
    lines = [f"Results of {shape[0]} prompts × {shape[1]} completions of ≤ {shape[2]} tokens; |Δ| in nats.", "",
             "| class (tolerances mean / max) | checkpoint | T | results | tokens/result | per token mean / p99 / max "
             "| largest result mean | largest token | refused | fitted rate per result: exponential / power law |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = np.asarray(r.tokens)
        exp_rate, pow_rate = r.rates()
        lines.append(f"| {r.cls} ({r.mean_tol} / {r.max_tol}) | {r.model} | {r.temperature} | {len(r.means)} | "
                     f"{np.mean(r.sizes):.0f} | {t.mean():.1e} / {np.percentile(t, 99):.1e} / {t.max():.3f} | "
                     f"{max(r.means):.4f} | {max(r.maxes):.3f} | {r.refused} | {exp_rate:.1e} / {pow_rate:.1e} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, action="append", default=None,
                    help="checkpoint folder (repeatable); default: the built-in tiny model as built")
    ap.add_argument("--precisions", default="f32,f16,q8_0")
    ap.add_argument("--results", type=int, default=3000, help="results per class, checkpoint and temperature")
    ap.add_argument("--shape", default="2,4,8", help="P,G,T: prompts per result, completions per prompt, tokens")
    ap.add_argument("--temperatures", default="1.0,0.7")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    from coordinator.config import LLAMA_TOLERANCES

    folders = args.model_dir
    if not folders:
        from coordinator.engine.tiny_model import ensure_tiny_model

        folders = [ensure_tiny_model()]
    shape = job_shape(args.shape)
    rows = []
    for folder in folders:
        for temperature in (float(t) for t in args.temperatures.split(",")):
            for precision in args.precisions.split(","):
                row = run_class(f"llama-{precision}", folder, temperature, args.results, shape, args.threads,
                                LLAMA_TOLERANCES)
                print(f"{row.cls} {row.model} T={temperature}: {len(row.means)} results in {row.seconds:.0f}s, "
                      f"largest mean {max(row.means):.4f}, token {max(row.maxes):.3f}, refused {row.refused}",
                      flush=True)
                rows.append(row)
    print(table(rows, shape))
    if args.json:
        args.json.write_text(json.dumps([{k: v for k, v in r.__dict__.items() if k != "tokens"} for r in rows]))


if __name__ == "__main__":
    main()
