"""What each GGUF precision costs a llama.cpp volunteer: file bytes per parameter, the client's memory once loaded,
its decode speed, and how long the coordinator takes to make the file — measured on one model, projected to 7 B.

    PYTHONPATH=. nice -n 5 python bench/gguf_precisions.py [--model qwen0.5b | --model-dir DIR]
        [--precisions f16,q8_0,q6_K,q5_K_M,q4_K_M,q4_0] [--threads 2] [--tokens 64] [--json out.json]

``--model qwen0.5b`` builds Qwen2.5-0.5B's shape with random weights (hidden 896, 24 layers, vocabulary 151,936;
494 M parameters; ~25 s), saved in float32. Each precision is written the coordinator's way
(coordinator.publish.gguf_export: f16 by our writer, the rest by llama.cpp's quantiser from it) and loaded the
client's way (swarm_client.backends.llama_backend.LlamaBackend, n_ctx 2048 as `join` uses, f16 KV cache). Memory
is the peak resident set (VmHWM) of a fresh process that loads the file and decodes ``--tokens`` tokens with the
keyed sampler (each precision in its own process, so nothing of an earlier one is counted). Speeds need a quiet
machine: run it alone. The 7 B column scales the measured
bytes per parameter to Qwen2.5-7B's 7.62 B parameters and adds the measured non-weight memory unchanged (an
underestimate: a 7 B model's KV cache and compute buffers are larger).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PARAMS_7B = 7.62e9
PROBE = r"""
import json, sys, time
from pathlib import Path
from swarm_client.backends.llama_backend import LlamaBackend
folder, threads, tokens = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
b = LlamaBackend(device="cpu", threads=threads)
t0 = time.monotonic(); b.load(folder); load_s = time.monotonic() - t0
prompt = list(range(3, 35))
b.sample(prompt, temperature=1.0, max_tokens=4, stop_ids=frozenset({-1}), key=1, rollout=0)  # warm
t0 = time.monotonic(); n = 0
for r in range(4):
    n += len(b.sample(prompt, temperature=1.0, max_tokens=tokens, stop_ids=frozenset({-1}), key=2, rollout=r).token_ids)
# VmHWM, not ru_maxrss: a child's ru_maxrss starts at its parent's peak at fork (the bench holds a float32 model)
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"load_s": load_s, "tokens_per_s": n / (time.monotonic() - t0), "peak_rss": hwm * 1024}))
"""


def build_qwen05(out: Path) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from coordinator.engine.tiny_model import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=151_936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                      num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32_768,
                      rope_theta=1e6, tie_word_embeddings=True, bos_token_id=tok.eos_token_id,
                      eos_token_id=tok.eos_token_id)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("qwen0.5b",), default=None)
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--precisions", default="f16,q8_0,q6_K,q5_K_M,q4_K_M,q4_0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    from safetensors import safe_open

    from coordinator.publish.gguf_export import export_folder

    rows = []
    with tempfile.TemporaryDirectory(prefix="gguf-precisions-") as tmp:
        if args.model_dir is not None:
            model_dir = args.model_dir
        elif args.model == "qwen0.5b":
            model_dir = build_qwen05(Path(tmp) / "model")
        else:
            from coordinator.engine.tiny_model import ensure_tiny_model

            model_dir = ensure_tiny_model()
        params = 0
        for shard in model_dir.glob("*.safetensors"):
            with safe_open(str(shard), "np") as fh:
                for name in fh.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    params += int(math.prod(fh.get_slice(name).get_shape()))
        for precision in args.precisions.split(","):
            folder = Path(tmp) / precision
            folder.mkdir()
            t0 = time.monotonic()
            export_folder(model_dir, folder / "model.gguf", precision)
            made_s = time.monotonic() - t0
            size = (folder / "model.gguf").stat().st_size
            probe = subprocess.run([sys.executable, "-c", PROBE, str(folder), str(args.threads), str(args.tokens)],
                                   capture_output=True, text=True, check=True)
            measured = json.loads(probe.stdout.strip().splitlines()[-1])
            rss = measured["peak_rss"]
            row = {"precision": precision, "bytes": size, "bytes_per_param": size / params, "made_s": made_s,
                   "client_peak_rss": rss, "tokens_per_s": measured["tokens_per_s"], "load_s": measured["load_s"],
                   "est_7b_bytes": size / params * PARAMS_7B + max(0, rss - size)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            (folder / "model.gguf").unlink()
    print(f"\n{params / 1e6:.0f} M parameters ({model_dir.name})\n")
    print("| precision | GGUF bytes | bytes/param | made in | client peak memory | decode tokens/s | est. 7 B memory |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['precision']} | {r['bytes'] / 2**20:,.0f} MiB | {r['bytes_per_param']:.3f} | {r['made_s']:.1f} s | "
              f"{r['client_peak_rss'] / 2**30:.2f} GiB | {r['tokens_per_s']:.1f} | {r['est_7b_bytes'] / 2**30:.1f} GiB |")
    if args.json:
        args.json.write_text(json.dumps({"params": params, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
