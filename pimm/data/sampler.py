"""Samplers whose order is defined globally, so a cursor means the same thing on any topology.

Training: epoch e visits a permutation of the whole data set seeded by (seed, e), consumed in
global batches of B events; rank r of W takes the r-th contiguous slice of B/W events of each
global batch. The cursor (epoch, global samples consumed) therefore names the same next events
whatever the world size or the number of loader workers.

Evaluation: every event exactly once over all ranks (no padding, no duplicates); ranks may
run different numbers of batches.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np


def epoch_permutation(num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The global visiting order of epoch `epoch` (the same on every rank and topology)."""
    if not shuffle:
        return np.arange(num_samples)
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


class GlobalBatchSampler:
    """Yields this rank's list of `(epoch, index)` keys for each global batch; resumable by cursor."""

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        world_size: int,
        rank: int,
        seed: int,
        shuffle: bool = True,
    ) -> None:
        if global_batch_size % world_size:
            raise ValueError(f"global batch {global_batch_size} not divisible by world size {world_size}")
        if num_samples < global_batch_size:
            raise ValueError(f"{num_samples} events cannot fill one global batch of {global_batch_size}")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.events_per_rank = global_batch_size // world_size
        # the incomplete last global batch is dropped: steps per epoch never depend on world size
        self.steps_per_epoch = num_samples // global_batch_size
        self.epoch = 0
        self.start_step = 0

    def set_cursor(self, epoch: int, samples_consumed: int = 0) -> None:
        """Position at `samples_consumed` global samples into `epoch` (a multiple of the global batch)."""
        if samples_consumed % self.global_batch_size:
            raise ValueError(
                f"cursor at {samples_consumed} samples is not on a global-batch boundary "
                f"({self.global_batch_size})"
            )
        self.epoch = epoch
        self.start_step = samples_consumed // self.global_batch_size

    def global_batch(self, step: int) -> np.ndarray:
        """Event indices of global batch `step` of the current epoch (all ranks together)."""
        order = epoch_permutation(self.num_samples, self.seed, self.epoch, self.shuffle)
        return order[step * self.global_batch_size : (step + 1) * self.global_batch_size]

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        order = epoch_permutation(self.num_samples, self.seed, self.epoch, self.shuffle)
        lo = self.rank * self.events_per_rank
        for step in range(self.start_step, self.steps_per_epoch):
            first = step * self.global_batch_size + lo
            yield [(self.epoch, int(i)) for i in order[first : first + self.events_per_rank]]

    def __len__(self) -> int:
        return self.steps_per_epoch - self.start_step


class ShardedEvalSampler:
    """Rank r of W evaluates events r, r+W, r+2W, ... in batches of `events_per_rank`."""

    def __init__(self, num_samples: int, events_per_rank: int, world_size: int, rank: int) -> None:
        self.indices = list(range(rank, num_samples, world_size))
        self.events_per_rank = events_per_rank

    def __iter__(self) -> Iterator[list[int]]:
        for lo in range(0, len(self.indices), self.events_per_rank):
            yield self.indices[lo : lo + self.events_per_rank]

    def __len__(self) -> int:
        return math.ceil(len(self.indices) / self.events_per_rank)
