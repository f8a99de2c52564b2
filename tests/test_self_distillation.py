"""Self-distillation pieces that must not depend on the process count: Sinkhorn targets over the global
batch (1 rank, 2 ranks and 1 rank x 2 micro-batches alike), the EMA update, the published schedules."""

from __future__ import annotations

import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pimm.tasks.self_distillation import cosine_schedule, ema_update, sinkhorn_knopp

TEMPERATURE = 0.05


def published_sinkhorn(feat: torch.Tensor, temp: float, num_iter: int = 3) -> torch.Tensor:
    """The published single-process algorithm (sonata_v1m1_base.py, sinkhorn_knopp at world size 1)."""
    q = torch.exp(feat.float() / temp).t()
    k, n = q.shape
    q = q / q.sum()
    for _ in range(num_iter):
        q = q / q.sum(dim=1, keepdim=True) / k
        q = q / q.sum(dim=0, keepdim=True) / n
    return (q * n).t()


def scores(seed: int = 0) -> list[torch.Tensor]:
    """Four micro-batches of cosine-like teacher logits over 16 prototypes, of unequal sizes."""
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.functional.normalize(torch.randn(n, 16, generator=g), dim=1) for n in (30, 17, 41, 25)]


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        mine = scores()[2 * rank: 2 * rank + 2]  # rank 0: micro-batches 0, 1; rank 1: 2, 3
        torch.save(sinkhorn_knopp(mine, TEMPERATURE), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_targets_are_the_same_at_one_rank_two_ranks_and_two_micro_batches(tmp_path, free_port):
    batches = scores()
    whole = published_sinkhorn(torch.cat(batches), TEMPERATURE)  # one process, one batch: the published result
    at_once = torch.cat(sinkhorn_knopp(batches, TEMPERATURE))
    torch.testing.assert_close(at_once, whole, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(at_once.sum(1), torch.ones(len(at_once)), rtol=1e-5, atol=1e-6)

    out = str(tmp_path / "targets")
    mp.start_processes(_rank, args=(free_port, out), nprocs=2, join=True, start_method="spawn")
    two_ranks = torch.cat([*torch.load(f"{out}.0"), *torch.load(f"{out}.1")])
    torch.testing.assert_close(two_ranks, at_once, rtol=1e-5, atol=1e-7)

    # what accumulation does to the published code: each micro-batch normalised on its own
    alone = torch.cat([published_sinkhorn(b, TEMPERATURE) for b in batches])
    assert (alone - whole).abs().max() > 1e-3


def test_low_temperatures_stay_finite():
    hot = [s * 8.0 for s in scores()]  # logits past 88.7: exp overflows float32 without the max subtracted
    assert not bool(torch.isfinite(published_sinkhorn(torch.cat(hot), TEMPERATURE)).all())
    targets = torch.cat(sinkhorn_knopp(hot, TEMPERATURE))
    assert bool(torch.isfinite(targets).all())


def test_ema_update_against_a_hand_computation():
    teacher = [torch.tensor([1.0, 2.0]), torch.tensor([[4.0]])]
    student = [torch.tensor([3.0, 0.0]), torch.tensor([[0.0]])]
    ema_update(teacher, student, 0.9)
    torch.testing.assert_close(teacher[0], torch.tensor([0.9 * 1 + 0.1 * 3, 0.9 * 2]))
    assert math.isclose(teacher[1].item(), 0.9 * 4, rel_tol=1e-6)


def published_schedule(base, final, total, start=0.0, warmup=0) -> np.ndarray:
    """The published CosineScheduler's table (pimm/utils/scheduler.py), freeze_iters=0."""
    iters = np.arange(total - warmup)
    return np.concatenate((np.linspace(start, base, warmup),
                           final + 0.5 * (base - final) * (1 + np.cos(np.pi * iters / len(iters)))))


def test_schedules_are_the_published_ones_as_functions_of_the_step():
    cases = [  # the published pretraining recipe's: momentum 0.994 -> 1, teacher temperature 0.04 -> 0.07 warm-up
        dict(base=0.994, final=1.0, total=1000),
        dict(base=0.07, final=0.07, total=1000, start=0.04, warmup=50),
        dict(base=0.5, final=0.1, total=37, start=0.0, warmup=5),
    ]
    for case in cases:
        table = published_schedule(**case)
        ours = [cosine_schedule(step, **case) for step in range(case["total"] + 3)]
        np.testing.assert_allclose(ours[: case["total"]], table, rtol=0, atol=1e-12)
        assert ours[case["total"]:] == [case["final"]] * 3
