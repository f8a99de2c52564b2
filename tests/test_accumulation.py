"""Gradient accumulation: batch_size stays the global events per optimizer step at any
(world size, grad_accum_steps); 1 rank x 4, 2 x 2 (DDP and FSDP2) and 4 x 1 take the same steps on
the same events."""

import pytest
import torch
from conftest import TINY, launch, launch_args, losses, pimm_in_process, steps, weights

from pimm.data.collate import collate_events, split_events
from pimm.distributed.batch import plan_batches
from pimm.errors import ConfigError

# float32 on CPU: the runs differ only in the order partial gradients are summed (a rank's micro-steps
# vs the gloo all-reduce): measured <= 1.4e-7 relative over 12 steps. 1e-5 leaves room for AdamW to
# amplify that; real errors are far larger (dropping all but the last micro-step's gradient: 5e-2 to
# 1e-1 from step 2; a missed 1/grad_accum_steps multiplies the logged loss by grad_accum_steps)
RTOL = 1e-5
BATCH = 8  # 48 tiny train events -> 6 steps per epoch; 8 splits 1-, 2- and 4-way into micro-batches of 2
TOPOLOGIES = {  # name -> (ranks, grad_accum_steps, overrides)
    "1x4": (1, 4, ()), "2x2": (2, 2, ()), "4x1": (4, 1, ()), "2x2 fsdp2": (2, 2, ("parallel.strategy=fsdp2",)),
}


def test_plan_splits_each_rank_into_micro_batches():
    plan = plan_batches(dict(batch_size=16, grad_accum_steps=2), 2)
    assert (plan.global_batch_size, plan.events_per_rank, plan.grad_accum_steps, plan.micro_batch_per_rank) == (
        16, 8, 2, 4)
    plan = plan_batches(dict(batch_size=16), 4)
    assert (plan.grad_accum_steps, plan.micro_batch_per_rank) == (1, plan.events_per_rank)


def test_non_divisible_accumulation_names_value_world_accumulation_and_valid_values():
    with pytest.raises(ConfigError) as err:
        plan_batches(dict(batch_size=12, grad_accum_steps=4), 2)
    msg = str(err.value)
    assert "batch_size=12" in msg and "world size 2 x grad_accum_steps 4 = 8" in msg and "8, 16" in msg


@pytest.mark.parametrize("bad", [0, -2, 2.5, "2", True, None])
def test_invalid_grad_accum_steps(bad):
    with pytest.raises(ConfigError, match="grad_accum_steps"):
        plan_batches(dict(batch_size=8, grad_accum_steps=bad), 1)


def test_split_events_gives_the_collated_consecutive_parts():
    gen = torch.Generator().manual_seed(0)
    events = [
        {"coord": torch.rand(n, 3, generator=gen), "feat": torch.rand(n, 4, generator=gen),
         "segment": torch.randint(0, 5, (n,), generator=gen), "event_id": 10 + i}
        for i, n in enumerate((3, 1, 4, 2, 5, 2))
    ]
    parts = split_events(collate_events(events), 3)
    assert len(parts) == 3
    for k, part in enumerate(parts):
        expected = collate_events(events[2 * k : 2 * k + 2])
        assert part.keys() == expected.keys()
        for key in expected:
            assert torch.equal(part[key], expected[key]), (k, key)
    with pytest.raises(ValueError, match="6 events cannot be split into 4"):
        split_events(collate_events(events), 4)


@pytest.fixture(scope="module")
def topology_runs(tmp_path_factory, tiny_data):
    """The tiny config (2 epochs = 12 steps of 8 events) at each (ranks, grad_accum_steps)."""
    exp = tmp_path_factory.mktemp("accum")
    runs = {}
    for topology, (nproc, accum, extra) in TOPOLOGIES.items():
        res, run_dir = launch(exp, tiny_data, nproc, f"batch_size={BATCH}", f"grad_accum_steps={accum}", *extra,
                              name=topology.replace(" ", "_"))
        assert res.returncode == 0, res.stderr[-3000:]
        assert f"= {BATCH // nproc} events/rank ({accum} micro-batch(es) of 2)" in (
            run_dir / "logs/rank0.log").read_text()
        runs[topology] = run_dir
    return runs


def test_ranks_times_accumulation_gives_the_same_steps(topology_runs):
    ref = topology_runs["1x4"]
    ref_losses, ref_steps, ref_weights = losses(ref), steps(ref), weights(ref)
    assert len(ref_losses) == 12 and list(ref_steps) == list(range(1, 13))
    assert all(len(ids) == BATCH for ids in ref_steps.values())
    for topology, run_dir in topology_runs.items():
        assert steps(run_dir) == ref_steps, topology  # the same events at every step: the same cursor
        other = losses(run_dir)
        assert other.keys() == ref_losses.keys()
        for step, a in ref_losses.items():
            assert abs(other[step] - a) <= RTOL * abs(a), f"{topology} step {step}: {other[step]} vs {a}"
        for key, value in weights(run_dir).items():
            assert torch.allclose(value, ref_weights[key], rtol=1e-4, atol=1e-5), (topology, key)


def test_dry_run_shows_the_micro_batches(tmp_path, tiny_data):
    res = pimm_in_process(["launch", "--train.config", TINY, "--resources.nproc-per-node", "2", "--dry-run",
                           "--paths.exp-root", str(tmp_path), "--", f"data.train.path={tiny_data['train']}",
                           f"data.val.path={tiny_data['val']}", "batch_size=8", "grad_accum_steps=2"])
    assert res.returncode == 0, res.stderr
    assert "per rank: batch_size 4 events (global 8) = 2 micro-batch(es) of 2 (grad_accum_steps 2)" in res.stdout


def test_non_divisible_accumulation_fails_before_start(tmp_path, tiny_data):
    res = pimm_in_process(launch_args(tmp_path, tiny_data, 2, "batch_size=8", "grad_accum_steps=3"))
    run_dir = tmp_path / "tests" / "run"
    assert res.returncode == 2
    assert "world size 2 x grad_accum_steps 3 = 6" in res.stderr and "6, 12" in res.stderr
    assert not run_dir.exists()
