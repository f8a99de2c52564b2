"""pimm's submanifold sparse convolution: forward parity with spconv 2.3.8's SubMConv3d on CPU,
gradients against a dense conv3d restricted to the active sites, spconv's weight layout loading
both ways, the reusable neighbour map, and the benchmark's smoke run."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO

from pimm.models.sparse_conv import (
    SubMConv3d,
    VoxelSites,
    apply_backends,
    build_neighbour_map,
    select_sparse_conv_backend,
    submanifold_conv3d,
)


def import_spconv():
    """spconv.pytorch (the test extra's spconv==2.3.8). Missing: skip here, fail under CI, where the
    reference must run."""
    try:
        import spconv.pytorch as spconv
    except ImportError as exc:
        message = f"spconv cannot be imported ({exc}); install the test extra: pip install -e '.[test]'"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI is set: the spconv parity tests must run)")
        pytest.skip(message)
    return spconv


@contextlib.contextmanager
def one_thread():
    """spconv's CPU path is only trusted single-threaded (its backward varies run to run otherwise)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def random_sites(events: int, per_event: int, extent: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct random voxels in [0, extent)^3 for each event (about `per_event` each; events of
    different density), rows of all events shuffled together."""
    gen = torch.Generator().manual_seed(seed)
    coords, batches = [], []
    for e in range(events):
        size = per_event * (e + 1) // events + 1
        coord = torch.unique(torch.randint(0, extent, (size, 3), generator=gen), dim=0)
        coords.append(coord)
        batches.append(torch.full((len(coord),), e))
    coord, batch = torch.cat(coords), torch.cat(batches)
    shuffle = torch.randperm(len(coord), generator=gen)
    return coord[shuffle], batch[shuffle]


def spconv_forward(spconv, module, features, coord, batch):
    """spconv's SubMConv3d `module` at the sites. Its indices are [N, 4] int32 in the order
    (event, then the coordinate columns as pimm takes them): Pointcept passes (batch, x, y, z), and
    spconv's weight[:, a, b, c, :] acts along the index columns 1, 2, 3 in that order."""
    indices = torch.cat([batch.unsqueeze(1), coord], 1).int()
    shape = (coord.max(0).values + 1).tolist()
    with one_thread(), torch.no_grad():
        return module(spconv.SparseConvTensor(features, indices, shape, int(batch.max()) + 1)).features


# ----------------------------------------------------------------------------- parity with spconv


@pytest.mark.parametrize("kernel_size", [3, 5])
@pytest.mark.parametrize(("in_channels", "out_channels"), [(1, 4), (16, 16), (32, 24)])
def test_forward_matches_spconv_on_random_multi_event_sites(kernel_size, in_channels, out_channels):
    spconv = import_spconv()
    torch.manual_seed(kernel_size * 100 + in_channels)
    coord, batch = random_sites(events=3, per_event=600, extent=14, seed=in_channels + kernel_size)
    features = torch.randn(len(coord), in_channels)
    ours = SubMConv3d(in_channels, out_channels, kernel_size, bias=True)
    # spconv refuses a bias in eval mode on CPU: its module has none, the bias is added after its call
    reference = spconv.SubMConv3d(in_channels, out_channels, kernel_size, bias=False).eval()
    reference.weight.data.copy_(ours.weight.data)
    expected = spconv_forward(spconv, reference, features, coord, batch) + ours.bias.detach()
    with torch.no_grad():
        got = ours(features, VoxelSites(coord, batch))
    assert got.shape == (len(coord), out_channels)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # the sites are dense enough that most offsets have pairs: a wrong axis order would show
    counts = VoxelSites(coord, batch).neighbour_map(kernel_size).pair_counts()
    assert sum(c > 0 for c in counts) == kernel_size**3


def test_spconv_state_dict_loads_into_pimm_and_back():
    spconv = import_spconv()
    torch.manual_seed(1)
    coord, batch = random_sites(events=2, per_event=400, extent=10, seed=7)
    features = torch.randn(len(coord), 8)
    reference = spconv.SubMConv3d(8, 12, 3, bias=True)  # train mode: spconv's CPU path adds the bias itself
    torch.nn.init.normal_(reference.bias)
    ours = SubMConv3d(8, 12, 3)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in reference.state_dict().items()}
    ours.load_state_dict(reference.state_dict())
    with torch.no_grad():
        got = ours(features, VoxelSites(coord, batch))
    torch.testing.assert_close(got, spconv_forward(spconv, reference, features, coord, batch), rtol=1e-5, atol=1e-5)

    # and pimm's weights load into spconv, which then computes what pimm computes
    ours = SubMConv3d(8, 12, 3)
    reference.load_state_dict(ours.state_dict())
    with torch.no_grad():
        got = ours(features, VoxelSites(coord, batch))
    torch.testing.assert_close(got, spconv_forward(spconv, reference, features, coord, batch), rtol=1e-5, atol=1e-5)


def test_published_kernel_orientation_one_weight_at_a_time():
    """Each of the 27 kernel taps of spconv's weight, alone, reads the same neighbour in pimm."""
    spconv = import_spconv()
    coord = torch.tensor([[x, y, z] for x in range(3, 6) for y in range(3, 6) for z in range(3, 6)])
    batch = torch.zeros(len(coord), dtype=torch.long)
    features = torch.arange(1.0, len(coord) + 1).unsqueeze(1)  # every site its own value
    reference = spconv.SubMConv3d(1, 1, 3, bias=False).eval()
    ours = SubMConv3d(1, 1, 3, bias=False)
    for tap in range(27):
        weight = torch.zeros(1, 27, 1)
        weight[0, tap, 0] = 1.0
        reference.weight.data.copy_(weight.view(1, 3, 3, 3, 1))
        ours.weight.data.copy_(weight.view(1, 3, 3, 3, 1))
        with torch.no_grad():
            got = ours(features, VoxelSites(coord, batch))
        torch.testing.assert_close(got, spconv_forward(spconv, reference, features, coord, batch), msg=f"tap {tap}")


# ----------------------------------------------------------------------------- gradients


def dense_reference(features, coord, batch, weight, bias, events: int):
    """The submanifold convolution as a dense conv3d on a zero-filled grid, read at the active sites
    (inactive voxels are zero, so the dense sum over the kernel is the sparse one)."""
    local = coord - coord.min(0).values
    x, y, z = local.unbind(1)
    grid = features.new_zeros(events, *(local.max(0).values + 1).tolist(), features.shape[1])  # channels last
    grid = grid.index_put((batch, x, y, z), features)  # differentiable: the features' gradient flows back
    out = F.conv3d(grid.permute(0, 4, 1, 2, 3), weight.permute(0, 4, 1, 2, 3), bias, padding=weight.shape[1] // 2)
    return out.permute(0, 2, 3, 4, 1)[batch, x, y, z]


@pytest.mark.parametrize("kernel_size", [3, 5])
def test_gradients_match_a_dense_conv3d_masked_to_the_active_sites(kernel_size):
    gen = torch.Generator().manual_seed(kernel_size)
    events, shape = 2, (9, 8, 9)
    active = torch.rand(events, *shape, generator=gen) < 0.35
    batch, x, y, z = active.nonzero(as_tuple=True)
    coord = torch.stack([x, y, z], 1) - 3  # negative coordinates: the keys must shift them
    order = torch.randperm(len(coord), generator=gen)
    coord, batch = coord[order], batch[order]
    features = torch.randn(len(coord), 5, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(6, kernel_size, kernel_size, kernel_size, 5, dtype=torch.float64, generator=gen,
                         requires_grad=True)
    bias = torch.randn(6, dtype=torch.float64, generator=gen, requires_grad=True)
    upstream = torch.randn(len(coord), 6, dtype=torch.float64, generator=gen)

    got = submanifold_conv3d(features, VoxelSites(coord, batch), weight, bias)
    grads = torch.autograd.grad((got * upstream).sum(), (features, weight, bias))
    expected = dense_reference(features, coord, batch, weight, bias, events)
    expected_grads = torch.autograd.grad((expected * upstream).sum(), (features, weight, bias))
    torch.testing.assert_close(got, expected)
    for name, g, e in zip(("features", "weight", "bias"), grads, expected_grads):
        torch.testing.assert_close(g, e, msg=f"gradient of {name}")


def test_gradcheck_and_partial_gradients():
    gen = torch.Generator().manual_seed(3)
    coord, batch = random_sites(events=2, per_event=30, extent=4, seed=3)
    sites = VoxelSites(coord, batch)
    features = torch.randn(len(coord), 3, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(2, 3, 3, 3, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    bias = torch.randn(2, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(lambda f, w, b: submanifold_conv3d(f, sites, w, b), (features, weight, bias))
    # an input layer: no gradient for the features, the weight's is still right
    frozen = features.detach()
    (weight_only,) = torch.autograd.grad(submanifold_conv3d(frozen, sites, weight).sum(), weight)
    (both,) = torch.autograd.grad(submanifold_conv3d(features, sites, weight).sum(), weight)
    torch.testing.assert_close(weight_only, both)


# ----------------------------------------------------------------------------- the neighbour map


def brute_force_pairs(coord, batch, kernel_size):
    """{offset index: {(input row, output row)}} by comparing every pair of rows."""
    radius = kernel_size // 2
    where = {(int(b), *map(int, c)): i for i, (b, c) in enumerate(zip(batch, coord))}
    pairs: dict[int, set] = {i: set() for i in range(kernel_size**3)}
    for out_row, (b, c) in enumerate(zip(batch.tolist(), coord.tolist())):
        for i in range(kernel_size**3):
            dx, dy, dz = i // kernel_size**2 - radius, i // kernel_size % kernel_size - radius, i % kernel_size - radius
            in_row = where.get((b, c[0] + dx, c[1] + dy, c[2] + dz))
            if in_row is not None:
                pairs[i].add((in_row, out_row))
    return pairs


@pytest.mark.parametrize("kernel_size", [1, 3, 5])
def test_neighbour_map_holds_every_pair_once(kernel_size):
    coord, batch = random_sites(events=3, per_event=150, extent=7, seed=kernel_size)
    neighbours = build_neighbour_map(coord, batch, kernel_size)
    expected = brute_force_pairs(coord, batch, kernel_size)
    centre = kernel_size**3 // 2
    for i in range(kernel_size**3):
        in_rows, out_rows = neighbours.in_rows[i], neighbours.out_rows[i]
        got = list(zip(in_rows.tolist(), out_rows.tolist()))
        assert len(got) == neighbours.counts[i] == len(set(out_rows.tolist())) == len(set(in_rows.tolist()))
        if i == centre:
            assert got == [] and neighbours.pair_counts()[i] == len(coord)  # handled as one matmul
        else:
            assert set(got) == expected[i], f"offset {i}"


def test_the_map_is_built_once_per_kernel_size_and_shared():
    coord, batch = random_sites(events=2, per_event=200, extent=8, seed=11)
    sites = VoxelSites(coord, batch)
    first, second = SubMConv3d(4, 4), SubMConv3d(4, 8)
    features = torch.randn(len(coord), 4)
    second(first(features, sites), sites)
    assert sites.neighbour_map(3) is sites.neighbour_map(3)
    assert sites.neighbour_map(5) is not sites.neighbour_map(3)


def test_offsets_and_batch_index_give_the_same_sites():
    coord, _ = random_sites(events=1, per_event=300, extent=8, seed=5)
    coord = torch.cat([coord, coord[:100]])  # the second event repeats voxels of the first
    batch = torch.cat([torch.zeros(len(coord) - 100, dtype=torch.long), torch.ones(100, dtype=torch.long)])
    conv, features = SubMConv3d(2, 3), torch.randn(len(coord), 2)
    with torch.no_grad():
        torch.testing.assert_close(conv(features, VoxelSites.from_offset(coord, torch.tensor([len(coord) - 100,
                                                                                              len(coord)]))),
                                   conv(features, VoxelSites(coord, batch)))


def test_empty_and_isolated_sites():
    conv = SubMConv3d(3, 2)
    empty = conv(torch.zeros(0, 3), VoxelSites(torch.zeros(0, 3, dtype=torch.long), torch.zeros(0, dtype=torch.long)))
    assert empty.shape == (0, 2)
    # far-apart voxels have no neighbour: the output is the centre tap and the bias alone
    coord = torch.tensor([[0, 0, 0], [10, 10, 10], [0, 0, 0]])
    batch = torch.tensor([0, 0, 1])
    features = torch.randn(3, 3)
    with torch.no_grad():
        got = conv(features, VoxelSites(coord, batch))
        torch.testing.assert_close(got, features @ conv.weight[:, 1, 1, 1, :].t() + conv.bias)


@pytest.mark.parametrize(("make", "words"), [
    (lambda: VoxelSites(torch.tensor([[0, 0, 0], [0, 0, 0]]), torch.zeros(2, dtype=torch.long)).neighbour_map(3),
     ["appear more than once", "row", "[0, 0, 0]", "grid sampling"]),
    (lambda: VoxelSites(torch.rand(4, 3), torch.zeros(4, dtype=torch.long)), ["integers", "torch.float32", "floor"]),
    (lambda: VoxelSites(torch.zeros(4, 2, dtype=torch.long), torch.zeros(4, dtype=torch.long)), ["[N, 3]", "[4, 2]"]),
    (lambda: VoxelSites(torch.zeros(4, 3, dtype=torch.long), torch.zeros(3, dtype=torch.long)), ["[N] = [4]", "[3]"]),
    (lambda: VoxelSites(torch.zeros(1, 3, dtype=torch.long), torch.tensor([-1])), [">= 0", "-1"]),
    (lambda: SubMConv3d(2, 2, kernel_size=4), ["odd", "4"]),
    (lambda: SubMConv3d(2, 3)(torch.zeros(1, 5), VoxelSites(torch.zeros(1, 3, dtype=torch.long),
                                                             torch.zeros(1, dtype=torch.long))), ["[N, 2]", "[1, 5]"]),
    (lambda: SubMConv3d(2, 3)(torch.zeros(2, 2), VoxelSites(torch.zeros(1, 3, dtype=torch.long),
                                                             torch.zeros(1, dtype=torch.long))), ["2 rows", "1"]),
    (lambda: submanifold_conv3d(torch.zeros(1, 2), VoxelSites(torch.zeros(1, 3, dtype=torch.long),
                                                              torch.zeros(1, dtype=torch.long)), torch.zeros(3, 27, 2)),
     ["[out, k, k, k, in]", "[3, 27, 2]"]),
    (lambda: VoxelSites(torch.tensor([[0, 0, 0], [2**40, 2**40, 2**40]]), torch.zeros(2, dtype=torch.long))
     .neighbour_map(3), ["too large", "coarser grid"]),
    (lambda: VoxelSites.from_offset(torch.zeros(5, 3, dtype=torch.long), torch.tensor([2, 4])), ["number of points (5)",
                                                                                                 "[2, 4]"]),
])
def test_errors_say_what_was_wrong(make, words):
    with pytest.raises(ValueError) as info:
        make()
    for word in words:
        assert word in str(info.value), (word, str(info.value))


# ----------------------------------------------------------------------------- precision and devices


def test_bfloat16_autocast_runs_at_the_autocast_precision():
    coord, batch = random_sites(events=2, per_event=300, extent=8, seed=2)
    sites, conv = VoxelSites(coord, batch), SubMConv3d(16, 16)
    features = torch.randn(len(coord), 16, requires_grad=True)
    with torch.no_grad():
        exact = conv(features, sites)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = conv(features, sites)
    assert mixed.dtype == torch.bfloat16
    assert float((mixed.detach().float() - exact).abs().max() / exact.abs().max()) < 0.02
    mixed.float().sum().backward()
    assert features.grad.dtype == torch.float32 and conv.weight.grad.dtype == torch.float32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu_forward_and_backward():
    coord, batch = random_sites(events=3, per_event=2000, extent=20, seed=9)
    cpu = SubMConv3d(32, 48, 3)
    gpu = SubMConv3d(32, 48, 3).cuda()
    gpu.load_state_dict(cpu.state_dict())
    features = torch.randn(len(coord), 32, requires_grad=True)
    features_gpu = features.detach().cuda().requires_grad_()
    out_cpu = cpu(features, VoxelSites(coord, batch))
    out_gpu = gpu(features_gpu, VoxelSites(coord.cuda(), batch.cuda()))
    torch.testing.assert_close(out_gpu.cpu(), out_cpu, rtol=1e-4, atol=1e-4)
    upstream = torch.randn_like(out_cpu)
    (out_cpu * upstream).sum().backward()
    (out_gpu * upstream.cuda()).sum().backward()
    torch.testing.assert_close(features_gpu.grad.cpu(), features.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gpu.weight.grad.cpu(), cpu.weight.grad, rtol=1e-4, atol=1e-3)


# ----------------------------------------------------------------------------- the benchmark


def test_benchmark_quick_run_reports_both_ratios(tmp_path):
    import_spconv()
    out = tmp_path / "sparse_conv.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "sparse_conv.py"), "--quick", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ratio" in proc.stdout and "pimm ms reused" in proc.stdout
    (row,) = json.loads(out.read_text())["results"]
    assert row["max_abs_difference"] < 1e-4
    assert row["ratio_new"] > 0 and row["ratio_reused"] > 0 and row["sites"] == 600


# ----------------------------------------------------------------------------- the backend switch


def test_the_spconv_backend_runs_spconv_on_the_same_parameters_and_shares_its_pairs():
    """backends.sparse_conv='spconv': the module's own weight and bias through spconv (on CPU in
    evaluation, single-threaded), the pairs built once per VoxelSites; outputs as the torch backend's."""
    import_spconv()
    torch.manual_seed(3)
    coord, batch = random_sites(events=3, per_event=500, extent=12, seed=5)
    model = torch.nn.Sequential(SubMConv3d(6, 8, 3), SubMConv3d(8, 8, 3)).eval()
    features = torch.randn(len(coord), 6)

    def run(backend: str) -> torch.Tensor:
        assert select_sparse_conv_backend(model, backend, torch.device("cpu")) == backend
        sites = VoxelSites(coord, batch)
        with one_thread(), torch.no_grad():
            out = model[1](model[0](features, sites), sites)
        return out, sites

    expected, _ = run("torch")
    got, sites = run("spconv")
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert list(sites._spconv_tensor.indice_dict) == ["pimm_subm3"]  # one set of pairs for both convolutions
    assert "_spconv_module" not in dict(model.named_modules()) and len(model.state_dict()) == 4
    model.train()  # spconv's CPU backward is wrong: training on CPU with it is refused, with what to do
    with pytest.raises(RuntimeError, match=r"trains on CUDA only .*backends.sparse_conv='torch'"):
        model[0](features, VoxelSites(coord, batch))


def test_auto_picks_torch_on_cpu_and_a_model_without_sparse_convolutions_has_no_backend():
    model = torch.nn.Sequential(SubMConv3d(2, 2, 3))
    assert apply_backends(model, {}, torch.device("cpu")) == {"sparse_conv": "torch"}
    assert model[0].backend == "torch"
    assert apply_backends(torch.nn.Linear(2, 2), {"backends": {"sparse_conv": "spconv"}}, torch.device("cpu")) == {}
