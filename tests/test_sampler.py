"""The global data order: one permutation per (seed, epoch), split per global batch over ranks."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pimm.data.sampler import GlobalBatchSampler, ShardedEvalSampler


def global_steps(num, batch, world, seed, epoch, samples_consumed=0):
    """The events of each global step, assembled from every rank's sampler."""
    ranks = []
    for rank in range(world):
        sampler = GlobalBatchSampler(num, batch, world, rank, seed)
        sampler.set_cursor(epoch, samples_consumed)
        ranks.append(list(sampler))
    return [[key for rank_batches in ranks for key in rank_batches[step]] for step in range(len(ranks[0]))]


@given(per_rank=st.integers(1, 6), world=st.sampled_from([1, 2, 3, 4]), extra=st.integers(0, 40))
@settings(max_examples=40)
def test_same_global_steps_at_any_world_size(per_rank, world, extra):
    batch = per_rank * world * (12 // world if 12 % world == 0 else 1)
    num = batch * 3 + extra
    reference = global_steps(num, batch, 1, seed=5, epoch=2)
    assert global_steps(num, batch, world, seed=5, epoch=2) == reference
    # no event twice inside an epoch, and only the incomplete tail is dropped
    seen = [i for step in reference for _, i in step]
    assert len(seen) == len(set(seen)) == (num // batch) * batch


@pytest.mark.parametrize("world_before,world_after", [(1, 2), (2, 1), (2, 3), (3, 2)])
def test_cursor_maps_to_any_topology(world_before, world_after):
    num, batch, consumed = 100, 12, 36
    full = global_steps(num, batch, 1, seed=1, epoch=0)
    before = global_steps(num, batch, world_before, seed=1, epoch=0)[: consumed // batch]
    after = global_steps(num, batch, world_after, seed=1, epoch=0, samples_consumed=consumed)
    assert before + after == full


def test_epochs_differ_and_are_reproducible():
    a = global_steps(50, 10, 2, seed=3, epoch=0)
    assert a == global_steps(50, 10, 2, seed=3, epoch=0)
    assert a != global_steps(50, 10, 2, seed=3, epoch=1)
    assert all(e == 1 for step in global_steps(50, 10, 2, seed=3, epoch=1) for e, _ in step)


def test_cursor_must_sit_on_a_global_batch_boundary():
    sampler = GlobalBatchSampler(50, 10, 2, 0, 0)
    with pytest.raises(ValueError, match="global-batch boundary"):
        sampler.set_cursor(0, 15)


@given(num=st.integers(1, 60), per_rank=st.integers(1, 5), world=st.integers(1, 5))
def test_eval_sampler_covers_every_event_once(num, per_rank, world):
    seen = []
    for rank in range(world):
        for batch in ShardedEvalSampler(num, per_rank, world, rank):
            assert 1 <= len(batch) <= per_rank
            seen.extend(batch)
    assert sorted(seen) == list(range(num))


def test_permutation_is_numpy_stable():
    from pimm.data.sampler import epoch_permutation

    assert np.array_equal(epoch_permutation(10, 0, 0), epoch_permutation(10, 0, 0))
    assert sorted(epoch_permutation(10, 0, 0)) == list(range(10))
