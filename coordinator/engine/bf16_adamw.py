"""AdamW with bfloat16 weights and moments, every stored value stochastically rounded (``learner.precision = "bf16"``).

Why: float32 AdamW holds 16 bytes per parameter (weights, gradients and the two moments, 4 B each) before any
activation; at 7 B parameters that is 112 GB. Keeping all four in bfloat16 halves it to 8 B/param. Rounding each
update to the *nearest* bfloat16 does not learn like float32, though: bfloat16 keeps 8 significant bits, so a
weight of 0.02 moves in steps of 1.2e-4 and any AdamW update below half of that (lr 1e-5 gives ~1e-5) is lost
entirely, every step; the second moment's decay by β2 = 0.999 (a 0.1 % change) never registers either, so it
freezes at its first values. Stochastic rounding rounds up with a probability equal to the discarded fraction:
every stored value equals the float32 result *in expectation*, so small updates accumulate as they do in float32
on average (Gupta et al. 2015; Zamirai et al. 2020, "Revisiting BFloat16 Training"; torchao's
``_AdamW(bf16_stochastic_round=True)`` rounds the weights so, here the moments are rounded the same way).

One step is torch's AdamW arithmetic (decoupled weight decay, bias-corrected moments, ``eps`` outside the square
root), done in float32 on ``CHUNK`` elements at a time (four float32 buffers of 4 MiB, kept; not temporaries of the
largest tensor: the 0.5 B model's embedding alone is 136 M parameters), then rounded into the bfloat16 storage.

Random bits: drawing three fresh 16-bit numbers per parameter per step would cost more than the update itself
(1.5 G draws per step at 0.5 B; torch's CPU generator takes ~7 ns each). Instead a pool of random 16-bit numbers
is drawn once from the seed, and each (step, parameter, chunk, tensor) reads a window of it at an offset drawn from
a generator seeded by (seed, step, parameter): an element's noise is uniform at every step and independent from one
step to the next, which is all that unbiased rounding needs. Everything follows from the seed and the step count
held in the optimizer state, so a restart that replays steps from a checkpoint (docs/run-dir.md §5) reproduces
every bit.

The optimizer state is torch's AdamW's own (an ``torch.optim.AdamW`` holds it and writes and loads the state dict:
``step``, ``exp_avg``, ``exp_avg_sq`` per parameter, its param groups), so a checkpoint reads the same either way:
resuming a float32 run with ``precision = "bf16"`` rounds its moments to bfloat16 on load, and back.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch
    from torch import Tensor
    from torch.optim.optimizer import StateDict  # torch's own open shape of an optimizer's state

#: Elements updated at once: four float32 buffers of 4 MiB each, whatever the tensor. They stay resident for the
#: process's life, under every step's peak. 16 MiB chunks (64 MiB, with a 32 MiB pool) were slower: an AdamW step at the
#: 0.5 B shape took 1.5 s, 0.9 s with these (chunks that stay in the caches between the arithmetic's passes).
CHUNK = 2**20
#: Random 16-bit numbers in the pool a window is read from (the pool holds twice as many, so any offset below
#: POOL has a whole window after it; a window is CHUNK long, so POOL ≥ CHUNK).
POOL = 2**21
_LOW16 = 0xFFFF
_HIGH16 = -65536  # 0xFFFF0000 as an int32


def round_stochastically(dest: Tensor, value: Tensor, noise: Tensor) -> None:
    """Write float32 ``value`` into bfloat16 ``dest``, each element rounded away from zero with probability equal
    to the part of its magnitude below bfloat16's last place (``noise``: int32 uniform in [0, 2¹⁶), one per
    element). ``value`` is used as scratch. bfloat16 is float32's upper 16 bits, so adding the noise to the lower
    16 bits carries into the kept part exactly when noise ≥ 2¹⁶ − (lower bits); then the lower bits are cleared
    and the copy into bfloat16 is exact."""
    import torch

    bits = value.view(torch.int32)
    bits.add_(noise)
    bits.bitwise_and_(_HIGH16)
    dest.copy_(value)


def _mix(*parts: int) -> int:
    """A 63-bit generator seed from several integers (splitmix64's finaliser over a running sum)."""
    x = 0
    for part in parts:
        x = (x + (part & 0xFFFFFFFFFFFFFFFF) + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x & 0x7FFFFFFFFFFFFFFF


class StochasticBf16AdamW:
    """AdamW over bfloat16 parameters with bfloat16 moments (module docstring); the learner's optimizer when
    ``learner.precision = "bf16"``. ``zero_grad``, ``state_dict`` and ``load_state_dict`` are torch's AdamW's."""

    def __init__(self, params: Iterable[Any], *, lr: float, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, seed: int = 0) -> None:
        import torch

        self.inner = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        for group in self.inner.param_groups:
            for p in group["params"]:
                if p.dtype != torch.bfloat16:
                    raise TypeError(f"StochasticBf16AdamW updates bfloat16 parameters; got one of {p.dtype} "
                                    f"{list(p.shape)} (load the model in bfloat16 first)")
        self.seed = int(seed)
        self._pools: dict[str, Tensor] = {}
        self._scratch: dict[str, Tensor] = {}

    @property
    def state(self) -> Any:
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> StateDict:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: StateDict) -> None:
        """torch's: floating state is cast to each parameter's dtype (a float32 run's moments become bfloat16)."""
        self.inner.load_state_dict(state_dict)

    def _pool(self, device: torch.device) -> Tensor:
        import torch

        pool = self._pools.get(str(device))
        if pool is None:
            gen = torch.Generator().manual_seed(_mix(self.seed, 0x706F6F6C))
            pool = torch.randint(0, _LOW16 + 1, (2 * POOL,), generator=gen, dtype=torch.int32).to(device)
            self._pools[str(device)] = pool
        return pool

    def _scratch_for(self, device: torch.device) -> Tensor:
        """Four float32 buffers of CHUNK elements, kept: fresh temporaries per chunk cost more in page faults
        than the arithmetic."""
        import torch

        buf = self._scratch.get(str(device))
        if buf is None:
            buf = self._scratch[str(device)] = torch.empty((4, CHUNK), dtype=torch.float32, device=device)
        return buf

    def step(self) -> None:
        """One AdamW step of every parameter with a gradient; each gradient is freed (set to None) as soon as it
        is applied. The learner zeroes them before its next backward pass anyway, and what follows a step (the
        hand-over copy for publication, the publisher's buffers) then does not stack on 2 B/param of gradients."""
        import torch

        with torch.no_grad():
            for group in self.inner.param_groups:
                if group.get("amsgrad") or group.get("maximize"):
                    raise ValueError("StochasticBf16AdamW implements plain AdamW (no amsgrad, no maximize)")
                lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
                for index, p in enumerate(group["params"]):
                    if p.grad is None:
                        continue
                    state = self.inner.state[p]
                    if "step" not in state:  # as torch's AdamW initialises it
                        state["step"] = torch.tensor(0.0)
                        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["step"] += 1
                    step = int(state["step"].item())
                    gen = torch.Generator().manual_seed(_mix(self.seed, step, index))
                    _update(p, p.grad, state["exp_avg"], state["exp_avg_sq"], step, (lr, beta1, beta2, eps, decay),
                            self._pool(p.device), gen, self._scratch_for(p.device))
                    p.grad = None  # applied: freed now, not at the next zero_grad (see step's docstring)


def _update(p: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: int,
            hyper: tuple[float, float, float, float, float], pool: Tensor, gen: torch.Generator,
            scratch: Tensor) -> None:
    """One AdamW step of one parameter, CHUNK elements at a time, in float32, rounded into bfloat16."""
    import torch

    lr, beta1, beta2, eps, decay = hyper
    if not (p.is_contiguous() and exp_avg.is_contiguous() and exp_avg_sq.is_contiguous()):
        raise ValueError("StochasticBf16AdamW needs contiguous parameters and moments")
    if exp_avg.dtype != torch.bfloat16 or exp_avg_sq.dtype != torch.bfloat16:
        raise TypeError(f"the AdamW moments of a bfloat16 parameter must be bfloat16, not {exp_avg.dtype}")
    flat, g, m, v = p.view(-1), grad.reshape(-1), exp_avg.view(-1), exp_avg_sq.view(-1)
    step_size = lr / (1 - beta1**step)
    bc2_sqrt = (1 - beta2**step) ** 0.5  # as torch's AdamW computes it, to the bit
    n = flat.numel()
    offsets = torch.randint(0, POOL, (3 * math.ceil(n / CHUNK),), generator=gen).tolist()
    for k, start in enumerate(range(0, n, CHUNK)):
        sl = slice(start, min(n, start + CHUNK))
        size = sl.stop - start
        g32, m32, v32, p32 = (buf[:size].copy_(t[sl]) for buf, t in zip(scratch, (g, m, v, flat), strict=True))
        m32.lerp_(g32, 1 - beta1)
        v32.mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
        denom = g32.copy_(v32).sqrt_().div_(bc2_sqrt).add_(eps)  # the gradient's copy, no longer needed
        p32.mul_(1 - lr * decay).addcdiv_(m32, denom, value=-step_size)
        for j, (dest, value) in enumerate(((flat, p32), (m, m32), (v, v32))):
            off = offsets[3 * k + j]
            round_stochastically(dest[sl], value, pool[off : off + size])
