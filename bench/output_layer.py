"""The learner's output layer, whole vs a vocabulary slice at a time (coordinator.engine.head): seconds and added
peak RSS of one forward + backward pass of the logprobs of N tokens, side by side in one run.

    PYTHONPATH=. python bench/output_layer.py [--rows 128,1024,4096] [--dtypes bfloat16,float32] [--threads 2]

The layer is the Qwen2.5-0.5B shape's (151,936 × 896, random weights), the loss a random weighting of the chosen
tokens' logprobs at temperature 0.9 — what the learner's GRPO loss asks of it. "whole" is the plain pass
(shared.policy.completion_logprobs' arithmetic: logits, float32, log-softmax, gather, autograd's backward);
"streamed" is the learner's (coordinator.engine.head). Each (dtype, rows) runs both twice, alternating, and keeps
the second of each (the first warms the allocator and the kernels). Peak RSS is ``VmHWM`` after resetting it, less
the RSS before the pass.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GIB = 2**30
VOCAB, HIDDEN = 151_936, 896


def _kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _pass(mode: str, layer: Any, hidden: Any, ids: Any, weights: Any) -> tuple[float, float]:
    import torch

    from coordinator.engine import head

    layer.weight.grad = torch.zeros_like(layer.weight)
    h = hidden.clone().requires_grad_()
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # VmHWM := VmRSS
    before = _kib("VmRSS")
    t0 = time.perf_counter()
    if mode == "whole":
        logp = torch.log_softmax(layer(h).float() / 0.9, -1).gather(1, ids[:, None]).squeeze(1)
    else:
        logp = head._function().apply(h, ids, layer, 0.9)
    (logp * weights).sum().backward()
    seconds = time.perf_counter() - t0
    return seconds, (_kib("VmHWM") - before) / GIB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="128,1024,4096", help="tokens per pass, comma-separated")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch

    from coordinator.memory import return_freed_memory

    return_freed_memory()  # as the learner's process does
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows_list = [int(r) for r in args.rows.split(",")]
    results: list[dict[str, Any]] = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        layer = torch.nn.Linear(HIDDEN, VOCAB, bias=False).to(dtype)
        for rows in rows_list:
            hidden = (torch.randn(rows, HIDDEN) * 0.5).to(dtype)
            ids = torch.randint(0, VOCAB, (rows,))
            weights = torch.randn(rows)
            got: dict[str, tuple[float, float]] = {}
            for mode in ("whole", "streamed", "whole", "streamed"):
                got[mode] = _pass(mode, layer, hidden, ids, weights)
            row = {"dtype": dtype_name, "rows": rows, "whole_s": got["whole"][0], "whole_gib": got["whole"][1],
                   "streamed_s": got["streamed"][0], "streamed_gib": got["streamed"][1]}
            results.append(row)
            print(json.dumps(row), flush=True)
        del layer
    print("\n| dtype | tokens | whole: s / added peak | streamed: s / added peak | time ratio | memory ratio |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['dtype']} | {r['rows']} | {r['whole_s']:.2f} s / {r['whole_gib']:.2f} GiB | "
              f"{r['streamed_s']:.2f} s / {r['streamed_gib']:.2f} GiB | ×{r['streamed_s'] / r['whole_s']:.2f} | "
              f"{r['whole_gib'] / max(r['streamed_gib'], 1e-3):.0f}× less |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
