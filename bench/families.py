"""GGUF export beyond Qwen2, one row per model family: the file loads in llama.cpp, its logits match torch's per
precision, llama.cpp tokenises and detokenises a fixed text set exactly as transformers does, and a LoRA adapter
llama.cpp applies to the base file computes what a GGUF of the merged weights computes.

    PYTHONPATH=. python bench/families.py [--families llama3,qwen3] [--precisions f16,q8_0,q4_K_M] [--threads 2]
        [--json out.json]
    PYTHONPATH=. python bench/families.py --speed 256,0.5b    # per-version export time: writer vs converter
    PYTHONPATH=. python bench/families.py --margins 1000 [--families ...] [--json out.json]   # keyed margins
    PYTHONPATH=. python bench/families.py --learner [--families ...] [--json out.json]   # step, FSDP, deltas

Each family is a random-initialised model of the family's config shape with a tokenizer built here
(coordinator.engine.family_models: width 256, so the k-quants apply to every matrix), exported by
coordinator.publish.gguf_export.export_folder — the route a published version takes (the project's writer for
Qwen2, llama.cpp's converter for the rest) — and quantised by llama.cpp's quantiser from the f16 file. Logits: every
position of a fixed prompt set evaluated in one llama.cpp batch (``logits_all``, llama.cpp's default f16 KV cache)
against the same tokens through transformers in float32; max and mean |Δ| over every position and vocabulary entry,
beside the torch logits' standard deviation for scale. Export seconds are the f16 file's wall time (the converter's
include its child process: Python, torch and transformers start-up).

``--learner``: the learner side per family instead (bench/family_learner.py): one step of the coordinator's Learner on
one device and on 2 FSDP ranks, versions 0 and 1 published with patches, each patch applied as a client applies it.
``--margins N``: honest keyed margins per family instead (bench/choice_calibration.py on the family's model: N
results per class, a torch client judged by the torch recompute, a llama.cpp f16 client by llama.cpp on its file).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from coordinator.engine.family_models import BY_NAME, FAMILIES, Family, build_family_model  # noqa: E402

PROMPTS = [
    "Question: what is 17 + 25? Answer:",
    "def greet(name):\n    return f'hello {name}'",
    "The volunteers' machines run llama.cpp; the learner runs torch.",
    "Zahlen 3.14159 und 2718, emoji 🦙, 日本語.",
]
#: The tokenizer round-trip texts: none is in the tokenizers' training corpus; unseen characters included.
TEXTS = [
    "Hello world", " leading space", "trailing space ", "  two  spaces", "tab\tand\nnewline\r\n",
    "12345 6789 0", "3.14159", "it's they're we've I'm you'll he'd", "CamelCaseWord snake_case_word",
    "naïve café résumé", "Ελληνικά και Кириллица", "中文 日本語 한국어", "emoji 🦙🚀✨ mixed", "x = [1, 2, 3]  # list",
    "    indented code\n        more", "!!! ??? ... ---", "a" * 40, "", "\n\n\n", "mixed 12abc34 def56",
]


def _torch_logits(folder: Path, ids: list[int]) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float().numpy()


def _llama_logits(path: Path, ids: list[int], threads: int, lora: Path | None = None) -> np.ndarray:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), lora_path=None if lora is None else str(lora), n_ctx=256,
                          n_batch=256, logits_all=True, n_threads=threads, n_threads_batch=threads, verbose=False)
    try:
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float32)
    finally:
        llm.close()


def _detokenize(llama_cpp: Any, vocab: Any, ids: list[int]) -> str:
    """llama.cpp's own detokenizer (``llama_detokenize``; llama-cpp-python's ``Llama.detokenize`` joins per-token
    pieces instead and so keeps the space a SentencePiece vocabulary prefixes to the first word)."""
    arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
    size = 64 + 16 * len(ids)
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, False, False)
    return buf.raw[:max(0, n)].decode("utf-8", "replace")


def _round_trips(path: Path, tok: Any) -> tuple[int, int, list[str]]:
    """(texts tokenised identically, detokenised identically, the differences) over :data:`TEXTS`."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, vocab_only=True, verbose=False)
    same_ids = same_text = 0
    diffs: list[str] = []
    try:
        for text in TEXTS:
            theirs = llm.tokenize(text.encode(), add_bos=False, special=False) if text else []
            ours = tok.encode(text, add_special_tokens=False)
            same_ids += theirs == ours
            if theirs != ours:
                diffs.append(f"tokenise {text!r}: llama.cpp {theirs[:12]} transformers {ours[:12]}")
            back = _detokenize(llama_cpp, llama_cpp.llama_model_get_vocab(llm.model), ours)
            want = tok.decode(ours)
            same_text += back == want
            if back != want:
                diffs.append(f"detokenise {text!r}: llama.cpp {back!r} transformers {want!r}")
    finally:
        llm.close()
    return same_ids, same_text, diffs


#: The adapter of the LoRA parity column: rank 4 on every linear module of the family, B drawn at this scale (peft
#: starts B at 0, so the adapter would change nothing), which moves the logits by ~1.5 (the "adapter's effect").
LORA_RANK, LORA_ALPHA, LORA_B_STD = 4, 8.0, 0.05
LORA_PRECISIONS = ("f32", "f16")


def lora_parity(family: Family, folder: Path, ids: list[int], threads: int, work: Path) -> dict[str, Any]:
    """A LoRA version of the family as the learner writes it (coordinator.engine.lora.write_adapter: peft files,
    then adapter.gguf by the base's route) applied by llama.cpp to the base GGUF, against llama.cpp on a GGUF of the
    merged weights (base + scale · B·A, shared.adapters, as torch clients and the verifier merge), per precision:
    max and mean |Δ| of the logits, and the adapter's own effect (base alone vs merged) for scale."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from coordinator.config import LearnerConfig
    from coordinator.engine import lora
    from coordinator.publish.gguf_export import export_folder
    from shared.adapters import read_adapter

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    peft_model = lora.wrap(model, LearnerConfig(lora_rank=LORA_RANK, lora_alpha=LORA_ALPHA,
                                                lora_targets=list(family.linear)))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * LORA_B_STD)
    snap = lora.adapter_snapshot(peft_model)
    static = {p.name: p.read_bytes() for p in folder.iterdir() if p.suffix in (".json", ".model")}
    merged = work / f"{family.name}-merged"
    merged.mkdir()
    for name, data in static.items():
        (merged / name).write_bytes(data)
    out: dict[str, Any] = {}
    for p in LORA_PRECISIONS:
        version = work / f"{family.name}-lora-{p}"
        version.mkdir()
        t0 = time.perf_counter()
        lora.write_adapter(version, snap, static, p)
        out["adapter_s"] = round(time.perf_counter() - t0, 2)
        if p == LORA_PRECISIONS[0]:
            adapter = read_adapter(version)
            state = {k: v for shard in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(shard)).items()}
            for name in adapter.factors:
                state[name] = (state[name].float() + adapter.delta(name)).to(state[name].dtype)
            save_file(state, str(merged / "model.safetensors"), metadata={"format": "pt"})
        base_gguf, merged_gguf = work / f"{family.name}.base.{p}.gguf", work / f"{family.name}.merged.{p}.gguf"
        export_folder(folder, base_gguf, p)
        export_folder(merged, merged_gguf, p)
        applied = _llama_logits(base_gguf, ids, threads, lora=version / lora.ADAPTER_GGUF)
        want = _llama_logits(merged_gguf, ids, threads)
        d = np.abs(applied - want)
        out[p] = {"max": float(d.max()), "mean": float(d.mean())}
        if p == LORA_PRECISIONS[0]:
            out["effect"] = float(np.abs(_llama_logits(base_gguf, ids, threads) - want).max())
    return out


def measure(family: Family, precisions: list[str], threads: int, work: Path) -> dict[str, Any]:
    from transformers import PreTrainedTokenizerFast

    from coordinator.publish.gguf_export import export_folder, route
    from coordinator.publish.quantise import quantise

    folder = build_family_model(family, work / family.name)
    tok = PreTrainedTokenizerFast.from_pretrained(str(folder))
    row: dict[str, Any] = {"family": family.label, "architecture": family.architecture, "route": route(folder)}
    f16 = work / f"{family.name}.f16.gguf"
    t0 = time.perf_counter()
    export_folder(folder, f16, "f16")
    row["export_s"] = round(time.perf_counter() - t0, 2)
    ids: list[int] = []
    for prompt in PROMPTS:
        ids += ([tok.bos_token_id] if family.bos else []) + tok.encode(prompt, add_special_tokens=False)
    ref = _torch_logits(folder, ids)
    row["logit_std"] = float(ref.std())
    for p in precisions:
        path = f16 if p == "f16" else work / f"{family.name}.{p}.gguf"
        if p == "f32":  # written by the family's route, as f16 is; the rest are llama.cpp's quantiser's from f16
            export_folder(folder, path, "f32")
        elif p != "f16":
            quantise(f16, path, p, threads=threads)
        row.setdefault("bytes", {})[p] = path.stat().st_size
        got = _llama_logits(path, ids, threads)
        d = np.abs(got - ref)
        row[p] = {"max": float(d.max()), "mean": float(d.mean()),
                  "argmax_agree": float((got.argmax(-1) == ref.argmax(-1)).mean())}
    same_ids, same_text, diffs = _round_trips(f16, tok)
    row["tokenise_same"] = f"{same_ids}/{len(TEXTS)}"
    row["detokenise_same"] = f"{same_text}/{len(TEXTS)}"
    row["diffs"] = diffs
    row["lora"] = lora_parity(family, folder, ids, threads, work)
    return row


#: Qwen2.5-0.5B's shape (bench/scale.py), as a Llama: both routes write it, so they are timed on the same model.
SHAPES = {"256": {}, "0.5b": {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
                              "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151_936}}


def _rss_mb(pid: int | None) -> float | None:
    """A process's resident memory in MB (Linux /proc), None elsewhere or when it has ended."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except (OSError, TypeError):
        pass
    return None


def speed(shape: str, threads: int, work: Path) -> dict[str, Any]:
    """One version's f16 GGUF written by the project's writer and by llama.cpp's converter from the same Llama
    folder (llama-bpe tokenizer, no rope scaling: both routes apply), each timed, and the two files' llama.cpp
    logits compared on the prompt set."""
    import dataclasses

    from safetensors.numpy import load_file
    from transformers import PreTrainedTokenizerFast

    from coordinator.publish.converter_worker import WORKER
    from coordinator.publish.gguf_export import write_model_gguf
    from coordinator.publish.hf_convert import convert

    family = dataclasses.replace(BY_NAME["llama3"], config={"tie_word_embeddings": True, **SHAPES[shape]})
    folder = build_family_model(family, work / f"speed-{shape}")
    tok = PreTrainedTokenizerFast.from_pretrained(str(folder))
    ids = [tok.bos_token_id] + [i for p in PROMPTS for i in tok.encode(p, add_special_tokens=False)]
    out: dict[str, Any] = {"shape": shape}
    t0 = time.perf_counter()
    state = {k: v for shard in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(shard)).items()}
    write_model_gguf(work / "writer.gguf", folder, state, "f16")
    out["writer_s"] = round(time.perf_counter() - t0, 2)
    del state
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()  # as every version was converted before the worker: a fresh Python per file
    subprocess.run([sys.executable, "-m", "coordinator.publish.hf_convert", str(folder), str(work / "alone.gguf"),
                    "f16"], env=env, check=True, capture_output=True)
    out["converter_one_process_s"] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    convert(folder, work / "converter.gguf", "f16")  # the worker's first request starts its child
    out["converter_first_s"] = round(time.perf_counter() - t0, 2)
    nexts = []
    for _ in range(3):  # the next versions: the child is warm
        t0 = time.perf_counter()
        convert(folder, work / "converter.gguf", "f16")
        nexts.append(time.perf_counter() - t0)
    out["converter_next_s"] = round(statistics.median(nexts), 3)
    out["converter_child_rss_mb"] = _rss_mb(WORKER.pid)
    out["same_file"] = (work / "alone.gguf").read_bytes() == (work / "converter.gguf").read_bytes()
    a, b = _llama_logits(work / "writer.gguf", ids, threads), _llama_logits(work / "converter.gguf", ids, threads)
    out["logits_max_diff"] = float(np.abs(a - b).max())
    out["bytes"] = {"writer": (work / "writer.gguf").stat().st_size, "converter": (work / "converter.gguf").stat().st_size}
    return out


def learner_side(family: Family, work: Path) -> dict[str, Any]:
    """The learner side of the family (bench/family_learner.py): one step of the coordinator's Learner on one device
    while the same step runs on 2 FSDP ranks (gloo, real processes) beside it; versions 0 and 1 published by the
    coordinator's SnapshotStore with deltas (bf16 safetensors, f16 GGUF by the family's route), and each patch of
    version 1 applied to version 0's file as a client applies it."""
    from bench import family_learner as fl
    from coordinator.config import SnapshotConfig
    from coordinator.publish.snapshots import SnapshotStore
    from shared import crypto
    from shared.policy import load_tokenizer

    folder = build_family_model(family, work / family.name)
    load_tokenizer(folder).save_pretrained(str(folder))  # the tokenizer files as the learner publishes them
    snap = SnapshotConfig()  # the run's defaults, as coordinator.run.runfiles makes the store
    store = SnapshotStore(work / f"{family.name}-snapshots", crypto.generate_key(), "run",
                          anchor_every=snap.anchor_every, lag_tolerance=snap.lag_tolerance,
                          lag_cap=snap.lag_steps * fl.LR)
    ranks = fl.start_ranks(work / f"{family.name}-ranks", folder)
    try:
        one = fl.step_and_publish(folder, store, work / f"{family.name}-single")
    finally:
        two = fl.finish(ranks, work / f"{family.name}-ranks")
    base, after = fl.weights(folder), fl.weights(work / f"{family.name}-single" / fl.FULL)
    largest, share = fl.moved({k: base[k] for k in after}, after)
    return {"family": family.label, "step": one, "moved_max": largest, "moved_share": share, "fsdp": two,
            "fsdp_max": fl.max_diff(after, fl.weights(work / f"{family.name}-ranks" / fl.FULL)),
            "fsdp_grad_norm_rel": abs(two["grad_norm"] - one["grad_norm"]) / one["grad_norm"],
            "patches": fl.rebuilt(store, 1)}


def learner_table(rows: list[dict[str, Any]]) -> str:
    files = ("model.safetensors", "model.gguf")
    head = ["family", "step: loss / grad norm", "weights moved: max abs Δ / share changed",
            "2 FSDP ranks vs 1: max abs Δ weights / grad norm rel. Δ",
            *[f"{f} v0→v1: patch / file bytes, rebuilt sha256 = published" for f in files], "step s (1 / 2 ranks)",
            "publish v0 / v1 s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        p = r["patches"]
        cells = [r["family"], f"{r['step']['loss']:.2g} / {r['step']['grad_norm']:.3g}",
                 f"{r['moved_max']:.2g} / {r['moved_share']:.1%}", f"{r['fsdp_max']:.2g} / {r['fsdp_grad_norm_rel']:.1g}",
                 *[f"{p[f]['patch_bytes']:,} / {p[f]['file_bytes']:,}, {'yes' if p[f]['same'] else 'NO'}"
                   if f in p else "no patch" for f in files],
                 f"{r['step']['step_s']:.2f} / {r['fsdp']['step_s']:.2f}",
                 " / ".join(f"{s:.1f}" for s in r["step"]["publish_s"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: The classes of the keyed-margin table: a torch client checked by the verifier's torch recompute, a llama.cpp client
#: on the f16 GGUF checked by the verifier's llama.cpp recompute on the same file (coordinator.engine.llama_verifier).
MARGIN_CLASSES = ("torch-f32", "llama-f16")


def margins(family: Family, results: int, work: Path, temperature: float = 1.0,
            classes: tuple[str, ...] = MARGIN_CLASSES) -> dict[str, Any]:
    """Honest keyed margins of the family: bench/choice_calibration.py (the clients' own backends generating
    default-shaped jobs with the keyed sampler, the verifier's own recompute and ``check_choices`` at the class's
    default tolerance) on the family model, ``results`` results per class, run as its own process."""
    import subprocess

    from shared.policy import load_tokenizer

    folder = build_family_model(family, work / family.name)
    load_tokenizer(folder).save_pretrained(str(folder))  # the tokenizer files as the learner publishes them
    out = work / f"{family.name}.margins.json"
    bench = Path(__file__).resolve().parent / "choice_calibration.py"
    subprocess.run([sys.executable, str(bench), "--model-dir", str(folder), "--classes", ",".join(classes),
                    "--temperatures", str(temperature), "--results", str(results), "--attacks", "0", "--json",
                    str(out)], check=True, stdout=sys.stderr)
    rows = json.loads(out.read_text())["classes"]
    return {"family": family.label, "classes": [{k: v for k, v in r.items() if k != "positive"}
                                                | {"positive": len(r["positive"])} for r in rows]}


def margin_table(rows: list[dict[str, Any]]) -> str:
    head = ["family", *[f"{c}: results / tokens / off the argmax / worst margin (tolerance) / refused / largest "
                        f"token abs Δ logprob / s per result"
                        for c in ([f"{c['name']} T={c['temperature']:g}" for c in rows[0]["classes"]] if rows else [])]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["family"]]
        for c in r["classes"]:
            cells.append(f"{c['results']:,} / {c['tokens']:,} / {c['positive']} / {c['worst']:.3g} "
                         f"({c['tolerance']:g}) / {c['refused']} / {c['lp_max']:.1e} / "
                         f"{c['seconds'] / max(1, c['results']):.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(rows: list[dict[str, Any]], precisions: list[str]) -> str:
    head = ["family", "HF architecture", "route", "export f16 s", "loads",
            *[f"{p} max / mean abs Δ" for p in precisions], "tokenise = / detok. =", "logit std",
            *[f"LoRA {p}: adapter vs merged max / mean abs Δ" for p in LORA_PRECISIONS], "adapter's effect",
            "adapter.gguf s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["family"], r["architecture"], r["route"], f"{r['export_s']:.2f}", "yes",
                 *[f"{r[p]['max']:.3g} / {r[p]['mean']:.2g}" for p in precisions],
                 f"{r['tokenise_same']} / {r['detokenise_same']}", f"{r['logit_std']:.3g}",
                 *[f"{r['lora'][p]['max']:.2g} / {r['lora'][p]['mean']:.2g}" for p in LORA_PRECISIONS],
                 f"{r['lora']['effect']:.3g}", f"{r['lora']['adapter_s']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(f.name for f in FAMILIES))
    ap.add_argument("--precisions", default="f16,q8_0,q4_K_M",
                    help="f32, f16 and any of coordinator.publish.quantise.QUANTISED (every one snapshots.gguf offers)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--speed", help="shapes to time writer vs converter on instead (256, 0.5b)")
    ap.add_argument("--margins", type=int, help="instead: honest keyed margins over this many results per class")
    ap.add_argument("--margin-classes", default=",".join(MARGIN_CLASSES),
                    help="with --margins: bench/choice_calibration.py's classes (e.g. llama-q8_0,llama-q4_K_M)")
    ap.add_argument("--temperature", type=float, default=1.0, help="with --margins: the jobs' sampling temperature")
    ap.add_argument("--learner", action="store_true", help="instead: a learner step, FSDP on 2 ranks, deltas")
    args = ap.parse_args()
    if args.learner:
        steps: list[dict[str, Any]] = []
        with tempfile.TemporaryDirectory(prefix="families-learner-") as tmp:
            for name in args.families.split(","):
                print(f"[{name}] a learner step on 1 and 2 ranks, versions 0 and 1 with patches", file=sys.stderr,
                      flush=True)
                steps.append(learner_side(BY_NAME[name], Path(tmp)))
                if args.json:
                    args.json.write_text(json.dumps(steps, indent=2))
        print(learner_table(steps))
        return
    if args.margins:
        done: list[dict[str, Any]] = []
        with tempfile.TemporaryDirectory(prefix="families-margins-") as tmp:
            for name in args.families.split(","):
                print(f"[{name}] {args.margins} honest results per class", file=sys.stderr, flush=True)
                done.append(margins(BY_NAME[name], args.margins, Path(tmp), args.temperature,
                                    tuple(args.margin_classes.split(","))))
                if args.json:  # what is done so far, so a run cut short keeps its figures
                    args.json.write_text(json.dumps(done, indent=2))
        print(margin_table(done))
        return
    if args.speed:
        with tempfile.TemporaryDirectory(prefix="families-speed-") as tmp:
            for shape in args.speed.split(","):
                print(json.dumps(speed(shape, args.threads, Path(tmp) / shape)), flush=True)
        return
    precisions = args.precisions.split(",")
    rows = []
    with tempfile.TemporaryDirectory(prefix="families-") as tmp:
        for name in args.families.split(","):
            print(f"[{name}] building, exporting, comparing", file=sys.stderr, flush=True)
            rows.append(measure(BY_NAME[name], precisions, args.threads, Path(tmp)))
            for diff in rows[-1]["diffs"]:
                print(f"[{name}]   {diff}", file=sys.stderr)
    print(table(rows, precisions))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
