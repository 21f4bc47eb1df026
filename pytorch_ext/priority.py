"""PrioritySampler: a weighted epoch (hard-example mining, importance sampling) whose order
the dataset knows in advance, so remote samples are fetched ahead as with ClairvoyantSampler.

Each epoch is one seeded multinomial draw over the whole dataset; rank r takes the draws at
positions r, r + R, r + 2R, ... of it, so the ranks' shares are disjoint slices of the same
draw and every rank computes it alone (no communication). `set_weights` between epochs
changes the distribution (hard-example mining); the new plan reaches DataLoader workers that
start afterwards, as `set_epoch` does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .prefetch import ClairvoyantSampler, EpochPlan


def checked_weights(weights: Sequence[float] | np.ndarray, length: int) -> np.ndarray:
    """The weights as float64, or ValueError saying what is wrong with them."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) != length:
        raise ValueError(f"weights must be one per sample ({length}), not of shape {w.shape}")
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError("weights must be finite and not negative")
    if not w.any():
        raise ValueError("at least one weight must be positive")
    return w


@dataclasses.dataclass(frozen=True)
class PriorityPlan(EpochPlan):
    """An EpochPlan whose order is this rank's share of the epoch's weighted draw."""

    draws: int = 0  # the whole draw, over all ranks
    replacement: bool = True
    weights_digest: str = ""
    # The weights travel with the plan (8 bytes a sample) but are compared by their digest.
    weights: bytes = dataclasses.field(default=b"", compare=False, repr=False)

    def draw(self) -> np.ndarray:
        """The epoch's whole draw, before it is dealt to the ranks."""
        w = np.frombuffer(self.weights, dtype=np.float64)
        rng = np.random.default_rng([self.seed, self.epoch])
        return rng.choice(len(w), size=self.draws, replace=self.replacement, p=w / w.sum())

    def order(self) -> np.ndarray:  # type: ignore[override]
        return self.draw()[self.rank :: self.num_replicas].astype(np.int64)


class PrioritySampler(ClairvoyantSampler):
    """Draws `num_samples` indices per epoch (default: the dataset's length) with probability
    proportional to `weights`, with or without replacement, split over `num_replicas` ranks
    (from torch.distributed when not given). `len(sampler)` is this rank's share: the draw is
    rounded up to a multiple of the ranks (with replacement) or down (without, so that no
    index repeats). `depth` is how many batches each reader fetches ahead."""

    def __init__(
        self,
        dataset: Any,
        weights: Sequence[float] | np.ndarray,
        num_samples: int | None = None,
        replacement: bool = True,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        depth: int = 4,
    ):
        requested = len(dataset) if num_samples is None else num_samples
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ValueError(f"num_samples must be a positive int, not {num_samples!r}")
        self.requested = requested
        self.replacement = bool(replacement)
        self._set(checked_weights(weights, len(dataset)))
        super().__init__(dataset, num_replicas, rank, shuffle=True, seed=seed, depth=depth)
        self.num_samples = self._draws() // self.num_replicas
        self.total_size = self._draws()

    def _set(self, w: np.ndarray) -> None:
        if not self.replacement and self.requested > np.count_nonzero(w):
            raise ValueError(
                f"cannot draw {self.requested} samples without replacement from"
                f" {np.count_nonzero(w)} with a positive weight"
            )
        self._weights = w.tobytes()
        self._digest = hashlib.sha256(self._weights).hexdigest()

    def _draws(self) -> int:
        r = self.num_replicas
        per_rank = math.ceil(self.requested / r) if self.replacement else self.requested // r
        return per_rank * r

    def set_weights(self, weights: Sequence[float] | np.ndarray) -> None:
        """New weights for the epochs to come (for example each sample's last loss)."""
        self._set(checked_weights(weights, len(self.dataset)))  # type: ignore[arg-type]
        self._publish()

    def weights(self) -> np.ndarray:
        return np.frombuffer(self._weights, dtype=np.float64).copy()

    def plan(self) -> PriorityPlan:
        base = super().plan()
        return PriorityPlan(
            **dataclasses.asdict(base),
            draws=self._draws(),
            replacement=self.replacement,
            weights_digest=self._digest,
            weights=self._weights,
        )

    def state_dict(self) -> dict[str, Any]:
        """The base's, with the draw's size and the weights in use (`set_weights` may have
        changed them since the sampler was made: the rest of the epoch follows these)."""
        return dict(
            super().state_dict(),
            requested=self.requested,
            replacement=self.replacement,
            weights=np.frombuffer(self._weights, dtype=np.float64).copy(),
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("requested", "replacement"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"sampler state is for {key}={state.get(key)!r}, this sampler has "
                    f"{getattr(self, key)!r}"
                )
        self._set(checked_weights(state["weights"], len(self.dataset)))  # type: ignore[arg-type]
        super().load_state_dict(state)

    def __len__(self) -> int:
        return self._draws() // self.num_replicas
