"""Global batch semantics: totals split over ranks, and the errors for splits that cannot work."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pimm.distributed.batch import plan_batches
from pimm.errors import ConfigError


def test_seed_page_table():
    cfg = dict(batch_size=32, num_worker=16, batch_size_val=None, batch_size_test=None)
    for world, per_rank, workers in ((1, 32, 16), (4, 8, 4), (8, 4, 2)):
        plan = plan_batches(cfg, world)
        assert (plan.events_per_rank, plan.workers_per_rank) == (per_rank, workers)
        assert plan.global_batch_size == 32


def test_none_val_batch_means_one_event_per_rank():
    plan = plan_batches(dict(batch_size=8, batch_size_val=None, batch_size_test=None), 4)
    assert plan.val_events_per_rank == 1 and plan.global_batch_size_val == 4
    assert plan.test_events_per_rank == 1


@pytest.mark.parametrize("key", ["batch_size", "batch_size_val", "batch_size_test"])
def test_non_divisible_batch_names_key_value_and_world(key):
    cfg = dict(batch_size=8, batch_size_val=None, batch_size_test=None)
    cfg[key] = 10
    with pytest.raises(ConfigError) as err:
        plan_batches(cfg, 4)
    msg = str(err.value)
    assert f"{key}=10" in msg and "world size 4" in msg and "8, 12" in msg


@pytest.mark.parametrize("bad", [0, -4, 2.5, "8", True])
def test_invalid_batch_values(bad):
    with pytest.raises(ConfigError, match="batch_size"):
        plan_batches(dict(batch_size=bad), 1)


@given(per_rank=st.integers(1, 64), world=st.integers(1, 16), workers=st.integers(0, 64))
def test_split_preserves_global_batch(per_rank, world, workers):
    plan = plan_batches(dict(batch_size=per_rank * world, num_worker=workers), world)
    assert plan.events_per_rank * plan.world_size == plan.global_batch_size
    assert plan.workers_per_rank == workers // world


def test_more_processes_than_gpus_is_refused():
    from pimm.errors import LaunchError
    from pimm.launch.plan import resolve_nproc

    assert resolve_nproc("auto", 4) == 4 and resolve_nproc("auto", 0) == 1 and resolve_nproc("3", 0) == 3
    with pytest.raises(LaunchError, match="more processes than the 4 visible GPU"):
        resolve_nproc("8", 4)
