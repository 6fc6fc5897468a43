"""Dynamic loss scaling for float16 training (PyTorch's ``torch.amp.GradScaler``), with every rank deciding alike.

float16 gradients below 6e-8 flush to zero; multiplying the loss by a large scale lifts them into range, and the
optimizer sees them divided back (in float32: ``unscale_`` hands 16-bit parameters float32 gradients, which the
optimizers' float32 master weights take as they are). A scale too large overflows to Inf: that step is skipped,
the scale halves, and the skip is logged (logger ``mpidist.amp``); after ``growth_interval`` good steps in a row
the scale doubles.

Every rank must skip the same steps, or the replicas drift apart. The decision is "is any gradient NaN or Inf":
- after DDP (or a communication hook) averaged the gradients, every rank holds the same averages and a NaN or
  Inf on any rank reaches every rank's average (Inf plus anything finite is Inf, Inf minus Inf is NaN), so
  each rank's own check gives the same answer without a message: the agreement rides in the gradient
  synchronization (``comm=None``, the default);
- where ranks hold different gradients (FSDP's shards, tensor-parallel shards, no wrapper), pass ``comm``: the
  flag is MAX-allreduced over it (one 4-byte allreduce per step).
The scale arithmetic is by powers of two (by default), so scaling and unscaling float32 gradients is exact.
"""

import logging
import math

import numpy as np

from . import collectives
from .comm import check_comm
from .xp import get_array_module

__all__ = ["GradScaler"]

log = logging.getLogger("mpidist.amp")


class GradScaler:
    """Scale the loss, unscale the gradients, skip steps with NaN/Inf gradients on any rank, adapt the scale.

    Use as in PyTorch::

        scaler.scale(loss).backward()
        scaler.unscale_(opt)          # optional: before clipping
        scaler.step(opt)              # skipped when a gradient is not finite
        scaler.update()

    ``comm``: where ranks hold different gradients, the communicator to agree over (see the module's docstring).
    """

    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                 enabled=True, comm=None):
        if not (isinstance(init_scale, (int, float)) and math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"GradScaler: init_scale must be a finite number > 0 (got {init_scale!r})")
        if not growth_factor > 1 or not 0 < backoff_factor < 1:
            raise ValueError(f"GradScaler: need growth_factor > 1 and 0 < backoff_factor < 1 "
                             f"(got growth_factor={growth_factor!r}, backoff_factor={backoff_factor!r})")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"GradScaler: growth_interval must be an int >= 1 (got {growth_interval!r})")
        if comm is not None:
            check_comm("GradScaler", comm)
        self.enabled = bool(enabled)
        self.comm = comm
        self._scale = float(init_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = growth_interval
        self._growth_tracker = 0
        self._steps = 0  # update() calls
        self._per_optimizer = {}  # id(optimizer) -> {"unscaled": bool, "found_inf": bool, "stepped": bool}
        self.skipped_steps = []  # the update() counts at which a step was skipped

    def get_scale(self):
        """Return the current scale (1.0 when disabled)."""
        return self._scale if self.enabled else 1.0

    def scale(self, loss):
        """Return ``loss`` multiplied by the scale (a Tensor stays a Tensor, so backward runs on the product)."""
        if not self.enabled:
            return loss
        return loss * self._scale

    def _state(self, optimizer):
        return self._per_optimizer.setdefault(id(optimizer), {"unscaled": False, "found_inf": False,
                                                              "stepped": False})

    def unscale_(self, optimizer):
        """Divide ``optimizer``'s gradients by the scale (in float32) and find out whether any is NaN or Inf.

        Once per optimizer between updates. float32 (and wider) gradients are divided in place; a 16-bit
        gradient is replaced by a float32 one (dividing in 16 bits would flush small values to zero again)."""
        if not self.enabled:
            return
        state = self._state(optimizer)
        if state["unscaled"]:
            raise RuntimeError("GradScaler.unscale_: already called for this optimizer since the last update()")
        inv = 1.0 / self._scale
        found = False
        # the model's parameters, as its groups hold them (a sharding optimizer's ``params`` are its shards)
        for p in (q for group in optimizer.param_groups for q in group["params"]):
            g = p.grad
            if g is None:
                continue
            xp = get_array_module(g)
            if not found and not bool(xp.isfinite(g).all()):
                found = True
            if g.dtype.itemsize >= 4:
                g *= g.dtype.type(inv)
            else:
                wide = g.astype(xp.float32)
                wide *= np.float32(inv)
                p.grad = wide
        if self.comm is not None:
            flag = np.array([int(found)], dtype=np.int32)
            collectives.allreduce(flag, self.comm, op="max")
            found = bool(flag[0])
        state["unscaled"], state["found_inf"] = True, found

    def step(self, optimizer):
        """Unscale (unless done), then step ``optimizer`` unless a gradient is NaN or Inf; return whether it stepped."""
        if not self.enabled:
            optimizer.step()
            return True
        state = self._state(optimizer)
        if state["stepped"]:
            raise RuntimeError("GradScaler.step: already called for this optimizer since the last update()")
        if not state["unscaled"]:
            self.unscale_(optimizer)
        state["stepped"] = True
        if state["found_inf"]:
            return False
        optimizer.step()
        return True

    def update(self):
        """Halve the scale if any optimizer's step was skipped (logged), else grow it after ``growth_interval``
        good steps in a row."""
        if not self.enabled:
            return
        found = any(s["found_inf"] for s in self._per_optimizer.values())
        if found:
            old = self._scale
            self._scale *= self.backoff_factor
            self._growth_tracker = 0
            self.skipped_steps.append(self._steps)
            log.warning("GradScaler: NaN or Inf gradient at update %d: step skipped, scale %g -> %g",
                        self._steps, old, self._scale)
        elif self._per_optimizer:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._scale *= self.growth_factor
                self._growth_tracker = 0
        self._per_optimizer = {}
        self._steps += 1

    def state_dict(self):
        """Return the scale, the growth tracker and the settings (what a checkpoint keeps)."""
        return {"scale": self._scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "growth_tracker": self._growth_tracker,
                "steps": self._steps}

    def load_state_dict(self, state):
        """Restore what ``state_dict`` returned."""
        missing = {"scale", "growth_tracker"} - set(state)
        if missing:
            raise KeyError(f"GradScaler.load_state_dict: missing {sorted(missing)}")
        self._scale = float(state["scale"])
        self._growth_tracker = int(state["growth_tracker"])
        self.growth_factor = float(state.get("growth_factor", self.growth_factor))
        self.backoff_factor = float(state.get("backoff_factor", self.backoff_factor))
        self.growth_interval = int(state.get("growth_interval", self.growth_interval))
        self._steps = int(state.get("steps", self._steps))
