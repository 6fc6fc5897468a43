"""Memory accounting: bytes FSDP owns, counted from its arrays (not from the process's RSS)."""

from ..interface import optimizer_state_bytes

__all__ = ["Transient", "memory_stats"]


class Transient:
    """Bytes of gathered parameters and unsharded grads alive now, and their peaks since the last reset."""

    def __init__(self):
        self.gathered = self.grads = 0
        self.reset_peak()

    def add(self, gathered=0, grads=0):
        """Count ``gathered``/``grads`` bytes more (negative: freed) and update the peaks."""
        self.gathered += gathered
        self.grads += grads
        self.peak_gathered = max(self.peak_gathered, self.gathered)
        self.peak_grads = max(self.peak_grads, self.grads)
        self.peak_total = max(self.peak_total, self.gathered + self.grads)

    def reset_peak(self):
        """Restart the peaks from what is alive now."""
        self.peak_gathered, self.peak_grads, self.peak_total = self.gathered, self.grads, self.gathered + self.grads


def memory_stats(shards, transient, optimizer=None):
    """Return this rank's bytes for the shard Parameters ``shards`` (see ``FSDP.memory_stats``)."""
    optimizer_bytes = optimizer_state_bytes(optimizer, shards, "FSDP.memory_stats")
    param_bytes = sum(int(s.data.nbytes) for s in shards)
    grad_bytes = sum(int(s.grad.nbytes) for s in shards if s.grad is not None)
    persistent = param_bytes + grad_bytes + optimizer_bytes
    t = transient
    return {"param_shard_bytes": param_bytes, "grad_shard_bytes": grad_bytes,
            "optimizer_state_bytes": optimizer_bytes, "persistent_bytes": persistent,
            "gathered_bytes": t.gathered, "unsharded_grad_bytes": t.grads,
            "peak_gathered_bytes": t.peak_gathered, "peak_unsharded_grad_bytes": t.peak_grads,
            "peak_bytes": persistent + t.peak_total}
