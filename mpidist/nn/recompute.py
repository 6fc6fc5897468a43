"""Activation checkpointing: keep a block's inputs, recompute its activations in backward.

``recompute(fn, *inputs)`` runs ``fn`` without building a graph and records two things: the
parameters it read (so their gradients still flow, through the recompute's own node, and each one's
post-accumulate-grad hook still fires once) and the state of every generator it drew from before its
first draw (so the recompute applies the same dropout masks). In backward it recomputes ``fn`` with a
graph and differentiates that.
"""

from mpidist.nn import autograd
from mpidist.nn.autograd import Tensor, make_results
from mpidist.nn.random import track_generators

__all__ = ["recompute"]


def recompute(fn, *inputs, **kwargs):
    """Return ``fn(*inputs, **kwargs)``, saving only the inputs; gradients equal those without checkpointing."""
    if not autograd.is_grad_enabled():
        return fn(*inputs, **kwargs)
    with track_generators() as generators, autograd.record_leaves() as leaves, autograd.no_grad():
        out = fn(*inputs, **kwargs)
    single = not isinstance(out, (tuple, list))
    outs = (out,) if single else tuple(out)
    for i, o in enumerate(outs):
        if not isinstance(o, Tensor):
            raise TypeError(f"recompute: output {i} of the function is a {type(o).__name__}, not a Tensor")
    # Keyword tensors are inputs too (a mask computed by the model): their gradients must flow.
    names = list(kwargs)
    flat = list(inputs) + [kwargs[k] for k in names]
    tensor_positions = [i for i, x in enumerate(flat) if isinstance(x, Tensor)]
    input_ids = {id(flat[i]) for i in tensor_positions}
    params = [p for p in leaves.values() if id(p) not in input_ids]
    starts = [(gen, state) for gen, state in generators.values()]
    edges_inputs = [flat[i] for i in tensor_positions] + params

    def backward(grads, needs):
        if len(outs) == 1:  # the engine hands a one-output node its gradient, not a tuple
            grads = (grads,)
        # Start every generator where the forward did, and put it back afterwards: the recompute must
        # not change what later draws see.
        now = [(gen, gen.bit_generator.state) for gen, _ in starts]
        for gen, state in starts:
            gen.bit_generator.state = state
        try:
            replay = list(flat)
            fresh = []
            for i in tensor_positions:
                x = flat[i]
                replay[i] = Tensor(x.data, requires_grad=x.requires_grad)
                fresh.append(replay[i])
            with autograd.enable_grad():
                out2 = fn(*replay[:len(inputs)], **dict(zip(names, replay[len(inputs):])))
        finally:
            for gen, state in now:
                gen.bit_generator.state = state
        outs2 = (out2,) if single else tuple(out2)
        pairs = [(o, g) for o, g in zip(outs2, grads) if g is not None and o.requires_grad]
        targets = [t for t, need in zip(fresh + params, needs) if need and t.requires_grad]
        if not pairs or not targets:
            return (None,) * len(needs)
        found = autograd.grad([o for o, _ in pairs], targets, [g for _, g in pairs], allow_unused=True)
        by_id = {id(t): g for t, g in zip(targets, found)}
        return tuple(by_id.get(id(t)) if need else None for t, need in zip(fresh + params, needs))

    results = make_results("Recompute", [o.data for o in outs], edges_inputs, backward)
    return results[0] if single else type(out)(results) if isinstance(out, tuple) else list(results)
