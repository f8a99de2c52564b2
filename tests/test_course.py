"""The course in examples/course: every step runs on CPU with 2-4 processes for a few steps.

Each script runs as a user would start it (python or torchrun), in a session of its own that is
killed whole afterwards. The checks are the course's claims: all_reduce sums, step 3's processes end
identical, manual DDP and PyTorch's DDP end with the same weights, the streaming loader reads every
sample once per epoch, FSDP holds 1/world_size of the model state, and multinode_setup_and_run.sh
runs a 2-node job on the local Slurm cluster.
"""

from __future__ import annotations

import contextlib
import gzip
import importlib.util
import json
import os
import signal
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import require_slurm_cluster, wait_for_slurm_jobs
from torch.utils.data import DataLoader

REPO = Path(__file__).resolve().parents[1]
COURSE = REPO / "examples" / "course"
sys.path.insert(0, str(COURSE))
import course_common  # noqa: E402

SAME_WEIGHTS_ATOL = 1e-6  # manual all_reduce vs DDP: same sums in the same order on CPU, so equal to rounding


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: list[str], timeout: float = 180, env: dict | None = None, cwd: Path = COURSE):
    """Run ARGS in its own session; kill the whole session however it ends. Returns the CompletedProcess."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    proc = subprocess.Popen(args, cwd=cwd, env=full_env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{' '.join(args)} timed out after {timeout} s\nstdout:\n{out}\nstderr:\n{err}") from None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def python(script: str, *args: str, **kw):
    res = run([sys.executable, script, *args], **kw)
    assert res.returncode == 0, f"{script} failed:\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
    return res


def torchrun(script: str, nproc: int, *args: str, **kw):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    res = run([*launcher, script, *args], **kw)
    assert res.returncode == 0, f"torchrun {script} failed:\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
    return res


def load_script(name: str):
    """Import a course script by file name (they start with a digit, so `import` cannot name them)."""
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py").replace(".", "_"), COURSE / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- day 1 ----------------------------------------------------------------------------------------------------


def test_0_all_reduce_sums_over_4_processes():
    out = python("0_torch_dist.py", "--nproc", "4").stdout
    assert out.count("after all_reduce: 6 (expected 6)") == 4
    assert "all 4 processes agreed on the sum" in out


def test_1_gpu_all_reduce_or_a_plain_exit_without_gpu():
    out = python("1_torch_dist_gpu.py", "--nproc", "2" if torch.cuda.device_count() >= 2 else "1").stdout
    if torch.cuda.is_available():
        assert "GPUs agreed on the sum" in out
    else:
        assert "no CUDA GPU on this machine" in out


def test_forcing_cuda_without_gpu_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    res = run([sys.executable, "2_mnist_training.py", "--device", "cuda", "--max-steps", "1"])
    assert res.returncode != 0
    assert "torch.cuda.is_available() is False" in res.stderr and "--device cpu" in res.stderr
    assert "Traceback" not in res.stderr


def test_2_single_process_training_prints_loss_timing_accuracy_and_writes_a_trace(tmp_path):
    out = python("2_mnist_training.py", "--device", "cpu", "--max-steps", "8", "--log-every", "2",
                 "--profile-dir", str(tmp_path / "trace"), "--metrics", str(tmp_path / "m.jsonl")).stdout
    assert "using scikit-learn's bundled handwritten digits" in out  # no MNIST on this machine
    assert "step 8: loss" in out and "ms per step" in out and "test accuracy:" in out
    traces = list((tmp_path / "trace").glob("*.pt.trace.json"))
    assert len(traces) == 1 and "traceEvents" in json.loads(traces[0].read_text())
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4, 6, 8]
    assert records[-1]["samples_seen"] == 8 * 32


def test_3_independent_processes_end_identical():
    out = python("3_mnist_distributed.py", "--nproc", "3", "--max-steps", "4", "--log-every", "2").stdout
    assert "all 3 models identical: True (largest weight difference 0)" in out
    assert "3x the work, no gain" in out
    assert len({line.split(": loss ")[1] for line in out.splitlines() if "step 4: loss" in line}) == 1


def test_4_manual_ddp_and_5_pytorch_ddp_end_with_the_same_weights(tmp_path):
    common = ["--nproc", "2", "--max-steps", "10", "--log-every", "5", "--lr-scaling", "linear", "--no-eval"]
    manual = python("4_mnist_manual_ddp.py", *common, "--save", str(tmp_path / "manual.pt"),
                    "--metrics", str(tmp_path / "manual.jsonl")).stdout
    ddp = python("5_mnist_ddp_pt.py", *common, "--save", str(tmp_path / "ddp.pt"),
                 "--metrics", str(tmp_path / "ddp.jsonl")).stdout
    for out in (manual, ddp):
        assert "749 of 1497 images per rank" in out and "global batch 64, lr 0.02" in out
    a = torch.load(tmp_path / "manual.pt", weights_only=True)
    b = torch.load(tmp_path / "ddp.pt", weights_only=True)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=SAME_WEIGHTS_ATOL, rtol=0, msg=key)
    torch.manual_seed(0)
    initial = course_common.Net().state_dict()
    assert any((a[k] - initial[k]).abs().max() > 1e-3 for k in a), "the weights did not move: no training happened"

    table = python("compare_loss_curves.py", str(tmp_path / "manual.jsonl"), str(tmp_path / "ddp.jsonl")).stdout
    rows = [line.split() for line in table.splitlines()[1:] if line.split()[0].isdigit()]
    assert rows and all(row[1] == row[2] for row in rows)  # the same loss curve, to the printed digit
    assert "manual: lr 0.02" in table


def test_mnist_idx_files_are_read_gzipped_or_not(tmp_path):
    images = torch.randint(0, 256, (5, 28, 28), dtype=torch.uint8)
    labels = torch.tensor([3, 1, 4, 1, 5], dtype=torch.uint8)
    image_bytes = struct.pack(">IIII", 2051, 5, 28, 28) + images.numpy().tobytes()
    label_bytes = struct.pack(">II", 2049, 5) + labels.numpy().tobytes()
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(image_bytes))
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(label_bytes)
    got_images, got_labels, source = course_common.load_mnist_raw(tmp_path, "train")
    assert source == f"MNIST from {tmp_path}"
    assert torch.equal(got_images, images) and torch.equal(got_labels, labels)


# -- day 2 ----------------------------------------------------------------------------------------------------


def test_6_torchrun_all_reduce():
    out = torchrun("6_torch_dist_multi_node.py", 2, "--device", "cpu").stdout
    assert "all_reduce over 2 ranks: 1 (expected 1)" in out
    assert "rank 1/2: node 0, local rank 1" in out


def test_7_ddp_under_torchrun_trains_and_saves(tmp_path):
    out = torchrun("7_mnist_ddp_pt_multinode.py", 2, "--max-steps", "4", "--log-every", "2",
                   "--save", str(tmp_path / "w.pt")).stdout
    assert "2 ranks on 1 node(s)" in out and "step 4: loss" in out and "test accuracy:" in out
    assert (tmp_path / "w.pt").is_file()


def test_scripts_started_without_torchrun_say_how_to_start_them():
    res = run([sys.executable, "7_mnist_ddp_pt_multinode.py"])
    assert res.returncode != 0 and "torchrun --standalone --nproc-per-node 4" in res.stderr


@pytest.fixture(scope="module")
def mnist_h5(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("h5") / "mnist.h5"
    out = python("create_mnist_h5.py", "--out", str(path), "--chunk-size", "100").stdout
    assert "train: 1497 images from sklearn digits, 15 chunks of 100" in out
    return path


@pytest.mark.parametrize("num_samples,chunk_size", [(1497, 100), (1000, 250), (7, 3), (2, 5)])
def test_chunks_cover_every_sample_once_per_epoch(num_samples, chunk_size):
    streaming = load_script("8_mnist_ddp_pt_multinode_streaming.py")
    orders = []
    for epoch in (0, 1):
        for world_size in (1, 2, 3, 4):
            for num_workers in (1, 2, 3):
                seen = [i for rank in range(world_size) for worker in range(num_workers)
                        for start, stop in streaming.chunks_for(num_samples, chunk_size, epoch, 0, rank, world_size,
                                                                worker, num_workers)
                        for i in range(start, stop)]
                assert sorted(seen) == list(range(num_samples)), (epoch, world_size, num_workers)
        orders.append(streaming.chunks_for(num_samples, chunk_size, epoch, 0, 0, 1))
    if num_samples // chunk_size > 3:
        assert orders[0] != orders[1], "every epoch should visit the chunks in a new order"


def test_h5_stream_through_dataloader_workers_yields_each_sample_once(mnist_h5):
    import h5py

    streaming = load_script("8_mnist_ddp_pt_multinode_streaming.py")
    with h5py.File(mnist_h5) as f:
        file_labels = torch.from_numpy(f["train/labels"][:]).long()
    world_size, seen = 3, []
    for rank in range(world_size):
        stream = streaming.H5ChunkStream(mnist_h5, "train", rank, world_size, seed=0)
        stream.set_epoch(1)
        for images, labels, indices in DataLoader(stream, batch_size=50, num_workers=2):
            assert images.shape[1:] == (1, 28, 28)
            assert torch.equal(labels, file_labels[indices])  # each image arrives with its own label
            seen += indices.tolist()
    assert sorted(seen) == list(range(len(file_labels)))


def test_8_streaming_script_trains_on_every_sample_once_per_epoch(mnist_h5, tmp_path):
    out = torchrun("8_mnist_ddp_pt_multinode_streaming.py", 2, "--h5", str(mnist_h5), "--epochs", "2",
                   "--batch-size", "64", "--workers", "1", "--log-every", "5",
                   "--record-indices", str(tmp_path)).stdout
    assert "test accuracy:" in out
    for epoch in (0, 1):
        seen = [i for rank in (0, 1) for i in json.loads((tmp_path / f"rank{rank}_epoch{epoch}.json").read_text())]
        assert sorted(seen) == list(range(1497)), f"epoch {epoch}"


def test_9_fsdp_holds_a_world_size_share_of_what_ddp_holds(tmp_path):
    size = ["--width", "512", "--depth", "2", "--max-steps", "3", "--no-eval"]
    for strategy in ("ddp", "fsdp"):
        out = torchrun("9_fsdp_bench.py", 2, "--strategy", strategy, *size,
                       "--json", str(tmp_path / f"{strategy}.json"))
        assert f"{strategy}: each rank holds" in out.stdout and "peak RSS" in out.stdout
    ddp, fsdp = (json.loads((tmp_path / f"{s}.json").read_text()) for s in ("ddp", "fsdp"))
    assert ddp["parameters"] == fsdp["parameters"] == 784 * 512 + 512 + 2 * (512 * 512 + 512) + 512 * 10 + 10
    full_mb = ddp["parameters"] * 4 / 1e6
    for d, f in zip(ddp["ranks"], fsdp["ranks"]):
        assert d["params_mb"] == pytest.approx(full_mb) and d["grads_mb"] == pytest.approx(full_mb)
        assert d["optim_mb"] == pytest.approx(2 * full_mb)
        for key in ("params_mb", "grads_mb", "optim_mb"):
            assert f[key] == pytest.approx(d[key] / 2, rel=0.01), key  # sharded two ways, up to padding
        assert f["ms_per_step"] > 0 and f["peak_mb"] > 0


# -- Slurm ----------------------------------------------------------------------------------------------------


def test_multinode_script_outside_slurm_says_so():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    res = subprocess.run(["bash", "multinode_setup_and_run.sh", "6_torch_dist_multi_node.py"], cwd=COURSE, env=env,
                         check=False, capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and "not inside a Slurm allocation" in res.stderr


def test_multinode_setup_and_run_on_a_2_node_slurm_job(tmp_path):
    require_slurm_cluster()
    log = tmp_path / "job.out"
    (tmp_path / "job.sh").write_text(
        "#!/bin/bash\nset -e\n"
        "./multinode_setup_and_run.sh 6_torch_dist_multi_node.py --device cpu\n"
        f"./multinode_setup_and_run.sh 7_mnist_ddp_pt_multinode.py --device cpu --max-steps 4 --log-every 2 "
        f"--save {tmp_path / 'w.pt'}\n"
    )
    env = {"PYTHON": sys.executable, "NPROC_PER_NODE": "1"}
    res = run(["sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=2", "--time=5",
               "--job-name=pimm-course", f"--output={log}", f"--chdir={COURSE}", str(tmp_path / "job.sh")],
              timeout=60, env=env)
    assert res.returncode == 0, f"sbatch: {res.stdout}{res.stderr}"
    job = int(res.stdout.strip().split(";")[0])
    try:
        (state,) = wait_for_slurm_jobs([job], timeout=240)
    finally:
        subprocess.run(["scancel", str(job)], check=False, capture_output=True, timeout=30)  # this job only
    out = log.read_text() if log.exists() else "(no job output)"
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", f"job {job}: {state}\njob output:\n{out}"
    assert "head node n1 (127.0.0.1)" in out
    assert "2 node(s): node 0 = " in out and "node 1 = " in out
    assert "all_reduce over 2 ranks: 1 (expected 1)" in out
    assert "2 ranks on 2 node(s)" in out and "step 4: loss" in out
    assert (tmp_path / "w.pt").is_file()
