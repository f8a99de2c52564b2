"""`pimm bench memory`: FSDP2 holds about 1/N of DDP's parameters, gradients and optimizer state,
the results come as JSON, markdown and PNG, and bad input is refused before any process starts."""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, run_pimm

from pimm.cli import main

TINY = "tests/tiny_semseg"


def test_fsdp2_holds_half_of_ddp_at_two_ranks(tmp_path):
    out = tmp_path / "bench"
    res = run_pimm(["bench", "memory", "--train.config", TINY, "--ranks", "1,2", "--strategies", "ddp,fsdp2",
                    "--steps", "2", "--warmup", "1", "--points-per-event", "64", "--out", str(out),
                    "--", "model.channels=32"], cwd=REPO, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "| ranks | strategy |" in res.stdout and "PASS" in res.stdout

    result = json.loads((out / "memory.json").read_text())
    assert result["overrides"] == ["model.channels=32"] and result["steps"] == 2
    rows = {(r["world_size"], r["strategy"]): r for r in result["rows"]}
    assert set(rows) == {(1, "single"), (2, "ddp"), (2, "fsdp2")}
    single, ddp, fsdp2 = rows[1, "single"], rows[2, "ddp"], rows[2, "fsdp2"]

    # DDP: every rank a full replica, the same bytes as one process
    assert ddp["held_bytes"] == single["held_bytes"] == ddp["full_replica_bytes"] > 0
    assert all(r["strategy"] == "ddp" for r in ddp["per_rank"])
    # FSDP2: the two ranks' parameter and gradient shards partition the model exactly
    shards = fsdp2["per_rank"]
    assert [r["strategy"] for r in shards] == ["fsdp2", "fsdp2"]
    for kind in ("param_bytes", "grad_bytes"):
        assert sum(r[f"all_{kind}"] for r in shards) == ddp["per_rank"][0][f"all_{kind}"]
    # ... and each holds about half of DDP's state, within what is left outside the Blocks
    assert 0 < fsdp2["unwrapped_full_bytes"] < ddp["held_bytes"] / 4
    assert abs(fsdp2["held_bytes"] - ddp["held_bytes"] / 2) <= fsdp2["unwrapped_full_bytes"]
    assert fsdp2["ideal_bytes"] == ddp["held_bytes"] / 2 and fsdp2["meets_target"] is True
    assert ddp["x_ideal"] == pytest.approx(2.0) and ddp["meets_target"] is None

    for row in result["rows"]:
        assert row["peak_steps_bytes"] > row["held_bytes"] and row["peak_run_bytes"] >= row["peak_steps_bytes"]
        assert row["runtime_bytes"] > 0 and row["step_seconds_median"] > 0 and len(row["step_seconds"]) == 2
    assert (out / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| 2 | fsdp2 |" in (out / "memory.md").read_text()


@pytest.mark.parametrize("args, message", [
    (["--ranks", "0,2"], "--ranks must be comma-separated positive integers"),
    (["--ranks", "1,two"], "--ranks must be comma-separated positive integers"),
    (["--strategies", "ddp,zero"], "not implemented in pimm"),
    (["--strategies", "fsdp3"], "unknown strategy 'fsdp3'; valid strategies: ddp, fsdp2"),
    (["--steps", "0"], "--steps must be an integer >= 1"),
    (["--train.config", "tests/no_such_config"], "config 'tests/no_such_config' not found"),
    (["--ranks", "1,3"], "batch_size=4 is not divisible by the world size 3"),
    (["--", "parallel.wrap_classes=[Blok]"], "parallel.wrap_classes names ['Blok']"),
])
def test_bad_input_is_refused_before_any_run(tmp_path, capsys, args, message):
    cut = args.index("--") if "--" in args else len(args)
    flags, overrides = args[:cut], args[cut:]
    if "--train.config" not in flags:
        flags = ["--train.config", TINY, *flags]
    code = main(["bench", "memory", *flags, "--out", str(tmp_path / "out"), *overrides])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("pimm: error: ") and message in err, err
    assert not (tmp_path / "out").exists()


_FREE_AND_MEASURE = """
import torch
from pimm.distributed.env import return_freed_memory_to_os
def rss_mib():
    return next(int(l.split()[1]) // 1024 for l in open("/proc/self/status") if l.startswith("VmRSS:"))
said = return_freed_memory_to_os()
warm = torch.ones(1 << 19); del warm  # a freed 2 MiB block: glibc's own threshold rises above 2 MiB
blocks = [torch.ones(1 << 19) for _ in range(100)]  # 200 MiB in 2 MiB tensors, as gathered parameters
keep = torch.ones(1 << 19)  # a block above them: the heap cannot be trimmed from its top
before = rss_mib()
del blocks
print(said, "|", before - rss_mib())
"""


@pytest.mark.parametrize("setting, returned", [(None, True), ("glibc", False)])
def test_ranks_on_cpu_give_freed_tensors_back_to_the_os(setting, returned):
    """FSDP2's CPU ranks set glibc's mmap threshold (what keeps its resident peak below DDP's);
    PIMM_HOST_ALLOCATOR=glibc keeps glibc's defaults, which keep 200 freed MiB resident."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "PIMM_HOST_ALLOCATOR"))}
    env.update(OMP_NUM_THREADS="1", **({"PIMM_HOST_ALLOCATOR": setting} if setting else {}))
    res = subprocess.run([sys.executable, "-c", _FREE_AND_MEASURE], env=env, capture_output=True, text=True,
                         check=False, timeout=120, cwd=REPO)
    assert res.returncode == 0, res.stderr
    said, released = res.stdout.strip().split(" | ")
    assert ("mmap threshold 1048576" in said) is returned
    assert (int(released) > 150) is returned, res.stdout
