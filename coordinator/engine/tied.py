"""The gradient of a tied input/output embedding (``tie_word_embeddings``) summed in place, in one tensor.

One weight serves as the input lookup and as the output layer, and a learner step uses each more than once (the
shared-prompt pass runs the output layer on the prompts and on the completions). Autograd computes each use's
gradient as a tensor of its own — a dense [vocab, hidden] tensor per output-layer use, one more for the lookup — and
sums them (not always in place) before it stores the weight's gradient: two to three tensors of the embedding's size
on top of the gradient itself at the end of every backward pass, 1–1.5 GB at 0.5 B parameters (vocabulary
151,936), where they made the learner's peak (bench/learner_memory.py). Here every use reads the weight detached,
and a hook on each use's output adds that use's gradient into the weight's ``.grad`` in place as backward reaches
it: the output layer's with one ``addmm_`` (no temporary), the lookup's rows with ``index_add_`` (rows of
``padding_idx`` get none, as in the embedding's own backward). Same gradient up to the order of float sums; only
where autograd records (training), never under ``no_grad`` (sampling, recomputes, evaluation).

The lookup hook recomputes the lookup's output, so it must compute what the module computes: Gemma 2 and 3 scale
their embeddings by √hidden (``embed_scale``; ×16 at width 256, ×48 to ×73 at Gemma's own widths), and a hook that
returned the plain rows trained a model that was not the policy (found by bench/families.py --learner: one device
and 2 FSDP ranks, which have no hooks, disagreed by 10 % in the gradient's norm). :func:`lookup_scale` checks the
module on two rows before the hooks go on: a plain lookup, or one scaled by its ``embed_scale``, is hooked (the rows
and their gradient times that factor); any other is left to autograd.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor, nn


def grad_buffer(param: Tensor) -> Tensor:
    """``param.grad``, created as zeros where there is none yet: for code that adds a gradient into it in place
    instead of returning one to autograd (here, and coordinator.engine.head's output layer)."""
    import torch

    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return param.grad


def lookup_scale(lookup: nn.Embedding) -> Tensor | None:
    """The factor (a 0-d tensor of the weight's dtype) by which ``lookup``'s output is the plain rows of its
    weight: 1 for a plain embedding, ``embed_scale`` for a scaled one (Gemma's); None for an embedding that computes
    anything else. Checked by computing two rows both ways, bit for bit."""
    import torch
    import torch.nn.functional as F

    scale = getattr(lookup, "embed_scale", None)
    factor = torch.as_tensor(1.0 if scale is None else scale).to(device=lookup.weight.device,
                                                                 dtype=lookup.weight.dtype)
    ids = torch.tensor([0, min(1, lookup.num_embeddings - 1)], device=lookup.weight.device)
    with torch.no_grad():
        try:
            want = lookup(ids)
        except Exception:  # an embedding that cannot be called on ids alone is not hooked
            return None
        got = F.embedding(ids, lookup.weight, lookup.padding_idx, lookup.max_norm, lookup.norm_type,
                          lookup.scale_grad_by_freq, False)
        if scale is not None:
            got = got * factor
    return factor if want.shape == got.shape and bool(torch.equal(want, got)) else None


class TiedEmbeddingGradient:
    """Forward hooks on a model's input embedding and output layer, which share ``weight``; ``scale``: the
    lookup's factor (:func:`lookup_scale`, computed here when not given). ValueError for a lookup that is not a
    plain or scaled row lookup (:func:`lookup_scale` None): its output cannot be recomputed here."""

    def __init__(self, lookup: nn.Embedding, output: nn.Linear, scale: Tensor | None = None) -> None:
        if lookup.weight is not output.weight:
            raise ValueError("the input embedding and the output layer do not share their weight")
        scale = lookup_scale(lookup) if scale is None else scale
        if scale is None:
            raise ValueError(f"the input embedding ({type(lookup).__name__}) computes more than its weight's rows "
                             f"times a factor: its gradient is left to autograd")
        self.weight = lookup.weight
        self.scale = None if float(scale) == 1.0 else scale  # None: the plain rows, multiplied by nothing
        self._handles = [lookup.register_forward_hook(self._lookup), output.register_forward_hook(self._output)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _recording(self) -> bool:
        import torch

        return torch.is_grad_enabled() and self.weight.requires_grad

    def _grad(self) -> Tensor:
        return grad_buffer(self.weight)

    def _lookup(self, module: Any, args: tuple[Any, ...], output: Tensor) -> Tensor | None:
        import torch.nn.functional as F

        if not self._recording():
            return None
        ids = args[0]
        out = F.embedding(ids, self.weight.detach(), module.padding_idx, module.max_norm, module.norm_type,
                          module.scale_grad_by_freq, False)
        scale = self.scale
        if scale is not None:
            out = out * scale  # as the module's own forward: lookup_scale checked it bit for bit
        out.requires_grad_()
        pad = module.padding_idx

        def add(grad: Tensor) -> None:
            flat, rows = ids.reshape(-1), grad.reshape(-1, grad.shape[-1])
            if scale is not None:  # d(scale · W[id]) / dW[id] = scale
                rows = rows * scale
            if pad is not None:
                keep = flat != pad
                flat, rows = flat[keep], rows[keep]
            self._grad().index_add_(0, flat, rows.to(self.weight.dtype))

        out.register_hook(add)
        return out

    def _output(self, module: Any, args: tuple[Any, ...], output: Tensor) -> Tensor | None:
        import torch.nn.functional as F

        if not self._recording():
            return None
        hidden = args[0]
        out = F.linear(hidden, self.weight.detach(), module.bias)
        saved = hidden.detach()

        def add(grad: Tensor) -> None:
            self._grad().addmm_(grad.reshape(-1, grad.shape[-1]).t().to(self.weight.dtype),
                                saved.reshape(-1, saved.shape[-1]).to(self.weight.dtype))

        out.register_hook(add)
        return out
