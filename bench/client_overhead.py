"""Client overhead: end-to-end tokens/s of a volunteer (lease → fetch/verify snapshot → generate → submit,
including the coordinator's verification round trip) divided by the raw tokens/s of the generation library
on the same prompts, group size and lengths. Also: snapshot bytes per version, full weights vs LoRA adapter.

    PYTHONPATH=. python bench/client_overhead.py [--runs 5] [--jobs 4] [--backends llama,torch]

The client is the real join loop (``swarm_client.runner.Runner``), which submits each result in the
background while it leases and generates the next job. By default (``--pin auto``) the coordinator runs on
CPU 0 and the client and the raw baseline share the remaining CPUs, as if the coordinator had its own machine:
its verification forward passes would otherwise compete with the client for the same cores, which measures
the machine, not the client.

The coordinator runs as its own process (as in production) on a randomly initialised tiny Qwen2 (rarely
samples end-of-text, so completions run to max_tokens and the token count is the job size). One learner
step needs more jobs than the bench leases, so no training competes for the CPU while it measures. The first
job of each run (snapshot download and model load) is excluded: the ratio is the steady state.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build_model(folder: Path, hidden: int = 128, layers: int = 4) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from coordinator.engine.tiny_model import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=max(4, hidden // 64), num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, bos_token_id=256, eos_token_id=256, pad_token_id=256,
                      use_sliding_window=False, initializer_range=0.02)
    Qwen2ForCausalLM(cfg).save_pretrained(str(folder), safe_serialization=True)
    tok.save_pretrained(str(folder))
    return folder


def start_coordinator(tmp: Path, model: Path, prompts_per_job: int, group: int, max_tokens: int,
                      gguf: str, lora_rank: int = 0, steps: int = 1,
                      cpus: set[int] | None = None) -> tuple[subprocess.Popen[str], str]:
    cfg = tmp / "run.toml"
    cfg.write_text(
        f'run_dir = "{tmp / "run"}"\n[model]\npath = "{model}"\n[server]\nport = 0\n'
        f"[learner]\nmax_steps = {steps}\nprompts_per_step = {prompts_per_job * 64}\ngroup_size = {group}\n"
        f"eval_every = 0\neval_size = 16\nthreads = 1\nlora_rank = {lora_rank}\n"
        f"[jobs]\nprompts_per_job = {prompts_per_job}\nlong_poll_s = 0.0\n"
        f'[sampling]\nmax_tokens = {max_tokens}\n[snapshots]\ngguf = "{gguf}"\n')
    log = open(tmp / "coordinator.log", "w")  # noqa: SIM115 — lives as long as the process
    proc = subprocess.Popen([sys.executable, "-m", "echo_swarm", "coordinator", "--config", str(cfg)],
                            stdout=log, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus))
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        text = (tmp / "coordinator.log").read_text()
        if "listening on " in text:
            return proc, text.split("listening on ")[1].split()[0]
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"coordinator did not start:\n{(tmp / 'coordinator.log').read_text()[-2000:]}")


def client_run(url: str, home: Path, backend_name: str, jobs: int, threads: int, warmup: int = 2) -> dict[str, Any]:
    """The real join loop (swarm_client.runner.Runner, as `echo-swarm join` runs it) for ``warmup`` + ``jobs``
    accepted jobs. The rate is the accepted tokens of the last ``jobs`` over the time from the last warm-up
    job's acceptance to the last job's: the steady state a volunteer sees, with lease, snapshot check,
    generation, submission and verification all in. The warm-up jobs absorb the snapshot download, the model
    load and the coordinator's first (slower) verification."""
    from swarm_client.runner import JoinConfig, Runner

    runner = Runner(JoinConfig(url=url, home=home, backend=backend_name, device="cpu", threads=threads,
                               max_jobs=warmup + jobs, benchmark=False, panel=False))
    accepted: list[tuple[float, int]] = []
    example: list[Any] = []
    runner.submissions.on_result = lambda now, job, n_tok: (accepted.append((now, n_tok)), example.append(job))
    code = asyncio.run(runner.run())
    if code != 0 or len(accepted) != warmup + jobs:
        raise RuntimeError(f"join loop exited {code} with {len(accepted)} of {warmup + jobs} jobs accepted; see {home}")
    tokens = sum(n for _, n in accepted[warmup:])
    return {"tokens": tokens, "wall_s": accepted[-1][0] - accepted[warmup - 1][0], "job": example[-1],
            "backend": runner.backend}


def raw_rate(backend: Any, job: Any, jobs: int) -> float:
    """Tokens/s of the bare library on the job's prompts, group size and lengths, as many times as measured."""
    prompts = [list(p.token_ids) for p in job.prompts]
    t, max_tokens, stop = job.sampling.temperature, job.sampling.max_tokens, set(job.sampling.stop_token_ids)
    tokens = 0
    t0 = time.perf_counter()
    for j in range(jobs):
        if backend.name == "llama":
            llm = backend.llm
            for i, p in enumerate(prompts):
                for g in range(job.group_size):
                    llm.set_seed(1000 * j + 10 * i + g)
                    n = 0
                    for tok in llm.generate(p, temp=t, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
                        n += 1
                        if tok in stop or n >= max_tokens:
                            break
                    tokens += n
        else:
            from shared.policy import generate

            out = generate(backend.model, prompts, group_size=job.group_size, temperature=t, max_tokens=max_tokens,
                           stop_ids=sorted(stop), seed=j, pad_id=256)
            tokens += sum(len(s.token_ids) for s in out)
    return tokens / (time.perf_counter() - t0)


def snapshot_bytes(model: Path, tmp: Path) -> dict[str, int]:
    from coordinator.config import LearnerConfig, ModelConfig
    from coordinator.engine.learner import Learner

    out: dict[str, int] = {}
    for precision in ("f32", "f16", "q8_0"):
        for rank in (0, 4):
            folder = tmp / f"snap-{precision}-{rank}"
            folder.mkdir()
            Learner(model, ModelConfig(device="cpu"), LearnerConfig(lora_rank=rank), 1.0, gguf=precision).save_model(folder)
            for f in folder.iterdir():
                out[f"{precision}/r{rank}/{f.name}"] = f.stat().st_size
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="llama,torch")
    ap.add_argument("--runs", type=int, default=5, help="runs per backend; the table quotes their median")
    ap.add_argument("--jobs", type=int, default=6, help="measured jobs per run (after two warm-up jobs)")
    ap.add_argument("--prompts-per-job", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="client generation threads")
    ap.add_argument("--pin", choices=("auto", "on", "off"), default="auto",
                    help="on: coordinator on CPU 0, this client (and the raw baseline) on the other CPUs, as if the "
                    "coordinator ran on its own machine; auto: on where there are at least 2 CPUs")
    ap.add_argument("--hidden", type=int, default=128, help="model width (128: the 1 M-parameter tiny model, where "
                    "per-token Python work weighs most; 384 with --layers 6: ~11 M parameters)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--model-dir", type=Path, default=None, help="a model folder to serve instead of building one "
                    "(e.g. bench/scale.py's Qwen2.5-0.5B-shaped folder, whose 151,936-token vocabulary is what the "
                    "llama.cpp client's own sampler pays for per token)")
    ap.add_argument("--no-sizes", action="store_true", help="skip the snapshot-bytes table (it trains a learner "
                    "step on the model: at the 0.5 B shape ~10 GB)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: stop the coordinator
    cpus = sorted(os.sched_getaffinity(0))
    pin = args.pin == "on" or (args.pin == "auto" and len(cpus) >= 2)
    coordinator_cpus = {cpus[0]} if pin else None
    if pin:  # before torch or llama.cpp start their thread pools: threads inherit the mask
        os.sched_setaffinity(0, set(cpus[1:]))
    print(f"coordinator on CPUs {sorted(coordinator_cpus) if pin else cpus}, client and raw baseline on "
          f"{sorted(os.sched_getaffinity(0))}, {args.threads} generation thread(s)", flush=True)
    results: dict[str, Any] = {"pinned": pin}
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        model = args.model_dir or build_model(tmp / "model", args.hidden, args.layers)
        names = args.backends.split(",")
        per: dict[str, dict[str, list[float]]] = {n: {"ratios": [], "e2e": [], "raw": []} for n in names}
        for r in range(args.runs):  # backends interleaved run by run: both see the same machine conditions
            for name in names:
                run_tmp = tmp / f"{name}-{r}"
                run_tmp.mkdir()
                proc, url = start_coordinator(run_tmp, model, args.prompts_per_job, args.group, args.max_tokens,
                                              "f16", cpus=coordinator_cpus)
                try:
                    got = client_run(url, run_tmp / "home", name, args.jobs, args.threads)
                    raw = raw_rate(got["backend"], got["job"], args.jobs)  # coordinator up (idle), as during the run
                finally:
                    proc.terminate()
                    proc.wait(60)
                rate = got["tokens"] / got["wall_s"]
                per[name]["e2e"].append(rate)
                per[name]["raw"].append(raw)
                per[name]["ratios"].append(rate / raw)
                print(f"{name} run {r}: end-to-end {rate:,.0f} tok/s, raw {raw:,.0f} tok/s, ratio {rate / raw:.3f}",
                      flush=True)
        for name in names:
            results[name] = {"ratio_median": statistics.median(per[name]["ratios"]), "ratios": per[name]["ratios"],
                             "end_to_end_tok_s": per[name]["e2e"], "raw_tok_s": per[name]["raw"]}
        if not args.no_sizes:
            results["snapshot_bytes"] = snapshot_bytes(model, tmp)
    print("\n| backend | end-to-end tok/s (median) | raw tok/s (median) | overhead ratio (median of runs) |")
    print("|---|---|---|---|")
    for label in [k for k in results if k not in ("snapshot_bytes", "pinned")]:
        r = results[label]
        print(f"| {label} | {statistics.median(r['end_to_end_tok_s']):,.0f} | {statistics.median(r['raw_tok_s']):,.0f} "
              f"| {r['ratio_median']:.3f} ({', '.join(f'{x:.3f}' for x in r['ratios'])}) |")
    sizes = results.get("snapshot_bytes")
    if sizes is None:
        if args.json:
            args.json.write_text(json.dumps(results, indent=2, default=str))
        return
    print("\n| precision | full GGUF per version | LoRA r=4: base GGUF (once) | adapter GGUF per version | adapter / full |")
    print("|---|---|---|---|---|")
    for p in ("f32", "f16", "q8_0"):
        full, base, ad = sizes[f"{p}/r0/model.gguf"], sizes[f"{p}/r4/base.gguf"], sizes[f"{p}/r4/adapter.gguf"]
        print(f"| {p} | {full:,} | {base:,} | {ad:,} | {100 * ad / full:.2f} % |")
    print(f"safetensors per version (torch clients): {sizes['f32/r0/model.safetensors']:,} bytes")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
