"""The learner's per-token logprobs with gradients, without ever holding the [tokens × vocabulary] logits.

Why: the plain pass (shared.policy.completion_logprobs) materialises the tempered logits of every completion
position and autograd keeps or rebuilds several tensors of that size for the backward pass — the float32 logits,
the log-softmax, its gradient, the gradient of the bf16 logits. At a 151,936-token vocabulary that is 0.6 MB per
token each: ~0.3 GiB for the 0.5 B bench's 8 × 16 tokens (below that step's peak) and ~10 GB each for one 64 ×
256-token micro-batch, more than the model (bench/output_layer.py measures both ways). Here the output layer is applied a slice of the
vocabulary at a time, twice: the forward pass keeps only each row's log-sum-exp (an online log-sum-exp over the
slices) and the chosen token's logit; the backward pass recomputes each slice's logits and turns them into the
gradients of the hidden states (each slice's product in the weight's dtype, summed in float32) and of the output weight (added in place into its
``.grad``, each element rounded once per backward pass as in the plain pass; the weight is read detached, as
coordinator.engine.tied does for a tied embedding, so autograd never builds a [vocab, hidden] temporary for it).
The cost is one more pass of the output layer's matrix product in the backward pass.

The numbers are the plain pass's up to float rounding (the log-sum-exp is summed slice by slice; the hidden
states' gradient is summed in float32): tests/unit/test_streamed_head.py bounds the logprobs and every gradient.
Only padding positions differ: their logprob is 0 here (the loss masks them in both).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from coordinator.engine.tied import grad_buffer
from shared.policy import LOGIT_ELEMENTS, completion_hidden

if TYPE_CHECKING:
    import torch
    from torch import nn

#: Fewest vocabulary entries per slice: narrower products waste the matrix kernels' blocking.
MIN_SLICE = 256


def _slice_width(rows: int, vocab: int, hidden: int) -> int:
    """Vocabulary entries per slice: a [rows, slice] float32 temporary of at most LOGIT_ELEMENTS entries, and the
    slice of the weight ([slice, hidden]) no larger either."""
    return max(MIN_SLICE, min(vocab, LOGIT_ELEMENTS // max(1, rows), LOGIT_ELEMENTS // max(1, hidden)))


def _picked_and_lse(hidden: Any, ids: Any, weight: Any, bias: Any, temperature: float, width: int
                    ) -> tuple[Any, Any]:
    """The forward pass's two float32 rows: each row's tempered logit of its token, and the log-sum-exp of its
    tempered logits, a vocabulary slice of ``width`` at a time with a running maximum (never the whole row)."""
    import torch
    import torch.nn.functional as F

    rows, vocab = hidden.shape[0], weight.shape[0]
    run_max = torch.full((rows,), float("-inf"), dtype=torch.float32, device=hidden.device)
    run_sum = torch.zeros(rows, dtype=torch.float32, device=hidden.device)
    picked = torch.zeros(rows, dtype=torch.float32, device=hidden.device)
    for v0 in range(0, vocab, width):
        v1 = min(vocab, v0 + width)
        z = F.linear(hidden, weight[v0:v1], bias[v0:v1] if bias is not None else None).float()
        z.div_(temperature)
        inside = torch.nonzero((ids >= v0) & (ids < v1)).squeeze(1)
        picked[inside] = z[inside, ids[inside] - v0]
        new_max = torch.maximum(run_max, z.max(-1).values)
        run_sum.mul_(torch.exp(run_max - new_max)).add_(z.sub_(new_max[:, None]).exp_().sum(-1))
        run_max = new_max
    return picked, run_max + torch.log(run_sum)


def _make_function() -> Any:
    import torch
    import torch.nn.functional as F

    class HeadLogprobs(torch.autograd.Function):
        """logp[n] = log_softmax(head(hidden[n]) / T)[ids[n]] for rows of hidden states [N, H], one vocabulary slice
        at a time (module docstring). ``head`` is passed as a module, not as tensors, so autograd expects no
        gradient for its weight: backward adds it into ``head.weight.grad`` in place."""

        @staticmethod
        def forward(ctx: Any, hidden: torch.Tensor, ids: torch.Tensor, head: nn.Linear,  # type: ignore[override]
                    temperature: float) -> torch.Tensor:
            weight = head.weight.detach()
            bias = head.bias.detach() if head.bias is not None else None
            width = _slice_width(hidden.shape[0], weight.shape[0], weight.shape[1])
            picked, lse = _picked_and_lse(hidden, ids, weight, bias, temperature, width)
            ctx.save_for_backward(hidden, ids, lse)
            ctx.head, ctx.temperature, ctx.width = head, temperature, width
            return picked - lse

        @staticmethod
        def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
            hidden, ids, lse = ctx.saved_tensors
            head, temperature, width = ctx.head, ctx.temperature, ctx.width
            weight = head.weight.detach()
            bias = head.bias.detach() if head.bias is not None else None
            train_weight = head.weight.requires_grad
            train_bias = head.bias is not None and head.bias.requires_grad
            g = grad_out.float()
            grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
            vocab = weight.shape[0]
            with torch.no_grad():
                for v0 in range(0, vocab, width):
                    v1 = min(vocab, v0 + width)
                    w = weight[v0:v1]
                    z = F.linear(hidden, w, bias[v0:v1] if bias is not None else None).float()
                    # d logp / d logits = onehot − softmax, times the incoming gradient, through the temperature
                    d = z.div_(temperature).sub_(lse[:, None]).exp_().mul_(-g[:, None])
                    inside = torch.nonzero((ids >= v0) & (ids < v1)).squeeze(1)
                    d[inside, ids[inside] - v0] += g[inside]
                    d.div_(temperature)
                    low = d.to(weight.dtype)  # what the plain pass's backward multiplies: the logits' dtype
                    # the slice's product in the weight's dtype (a bf16 product is 3x faster on a CPU than a float32
                    # one over a converted copy), summed over the slices in float32
                    grad_hidden.add_(low @ w)
                    if train_weight or train_bias:
                        if train_weight:
                            grad_buffer(head.weight)[v0:v1].addmm_(low.t(), hidden.detach().to(weight.dtype))
                        if train_bias:
                            grad_buffer(head.bias)[v0:v1].add_(low.sum(0))
            return grad_hidden.to(hidden.dtype), None, None, None

    return HeadLogprobs


def contiguous_input(output_layer: nn.Module) -> Any:
    """A forward pre-hook on the output layer that hands it a contiguous input while autograd records; returns its
    handle.

    Why: the model applies its output layer to a strided slice of the hidden states (Hugging Face's
    ``hidden[:, -1:, :]`` for the prompts' last positions, shared.policy's prefill). For an input that needs
    gradients and cannot be viewed as rows, torch's matmul does not fold the batch into one product but broadcasts
    the weight to a batched one, copying it once per sequence: [B, vocab, hidden] in the forward pass and again in
    the backward pass — 0.51 GiB for two prompts at the 0.5 B shape, which set the bf16 learner's peak
    (docs/benchmarks.md, "Rerun 2026-12-03 (issue 23, afternoon)"). A contiguous copy of the slice is a few kB."""

    def hook(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        import torch

        if not args or not torch.is_grad_enabled() or args[0].is_contiguous():
            return None
        return (args[0].contiguous(), *args[1:])

    return output_layer.register_forward_pre_hook(hook)


_FUNCTION: Any = None


def _function() -> Any:
    global _FUNCTION
    if _FUNCTION is None:
        _FUNCTION = _make_function()
    return _FUNCTION


def streamed_logprobs(model: Any, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], *,
                      temperature: float, pad_id: int, share_prompts: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """shared.policy.completion_logprobs' (logprobs [B, T], mask [B, T]) with the output layer applied a vocabulary
    slice at a time, forward and backward (module docstring); only real (unpadded) positions go through it. For a
    model whose head is plain (shared.policy.plain_head), not FSDP-sharded."""
    import torch

    hidden, first, ids, mask = completion_hidden(model, prompts, completions, pad_id=pad_id,
                                                 share_prompts=share_prompts)
    head = model.get_output_embeddings()
    bsz, width = ids.shape
    values: list[torch.Tensor] = []
    where: list[torch.Tensor] = []
    offset = 0
    if first is not None:  # position 0 from the prompt's own pass: [B, V] logits, small
        b0 = torch.nonzero(mask[:, 0]).squeeze(1)  # not for an empty completion
        values.append(torch.log_softmax(first[b0].float() / temperature, -1).gather(1, ids[b0, :1]).squeeze(1))
        where.append(b0 * width)
        offset = 1
    if hidden is not None and width > offset:
        real = torch.nonzero(mask[:, offset:]).t()  # (b, t − offset) of every real token after the first column
        b, t = real[0], real[1]
        rows = hidden[b, t]
        values.append(_function().apply(rows, ids[b, t + offset], head, float(temperature)))
        where.append(b * width + t + offset)
    flat = torch.zeros(bsz * width, dtype=torch.float32, device=ids.device)
    if values:
        flat = flat.index_put((torch.cat(where),), torch.cat(values))
    return flat.view(bsz, width), mask.to(torch.float32)
