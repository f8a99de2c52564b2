"""Exact metric aggregation: splitting the same predictions over ranks gives the same numbers."""

import math

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pimm.tasks import event_mean_loss
from pimm.tasks.metrics import SegmentationMeter, metrics_from_confusion


def test_iou_from_known_confusion():
    confusion = torch.tensor([[3, 1, 0], [0, 2, 0], [0, 0, 0]], dtype=torch.float64)
    m = metrics_from_confusion(confusion, 6.0, 3)
    assert m["iou"][0] == 3 / 4 and m["iou"][1] == 2 / 3 and math.isnan(m["iou"][2])
    assert m["miou"] == (3 / 4 + 2 / 3) / 2  # the class absent everywhere is left out
    assert m["loss"] == 2.0 and m["accuracy"] == 5 / 6


def test_event_mean_loss_weights_events_equally():
    logits = torch.randn(7, 5)
    target = torch.randint(0, 5, (7,))
    offset = torch.tensor([2, 7])
    loss, per_event = event_mean_loss(logits, target, offset)
    point = torch.nn.functional.cross_entropy(logits, target, reduction="none")
    assert torch.allclose(per_event, torch.stack([point[:2].mean(), point[2:].mean()]))
    assert torch.allclose(loss, per_event.mean())


def _shard_worker(rank, world, port, data, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    meter = SegmentationMeter(5, torch.device("cpu"))
    for i, (logits, target, losses) in enumerate(data):
        if i % world == rank:
            meter.add(logits, target, losses)
    result = meter.compute()
    if rank == 0:
        out.put(result)
    dist.destroy_process_group()


def test_two_ranks_equal_one_rank(free_port):
    torch.manual_seed(0)
    data = [(torch.randn(n, 5), torch.randint(0, 5, (n,)), torch.rand(3)) for n in (11, 5, 30, 2, 17)]
    single = SegmentationMeter(5, torch.device("cpu"))
    for logits, target, losses in data:
        single.add(logits, target, losses)
    expected = single.compute()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_shard_worker, args=(r, 2, free_port, data, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = out.get(timeout=60)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert got["miou"] == expected["miou"] and got["iou"] == expected["iou"]
    assert got["points"] == expected["points"] and got["events"] == expected["events"]
    assert math.isclose(got["loss"], expected["loss"], rel_tol=1e-12)
