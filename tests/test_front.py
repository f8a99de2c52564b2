"""What a new user meets first: `make venv`'s torch source (TORCH=...), `pimm show`'s default output
place, units, one scale on every axis and a camera that sees the whole event, and the benchmarks'
--wait-quiet and --repeats (benchmarks/_timing.py)."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO

from pimm import cli
from pimm.data.predictions import PredictionWriter, read_event
from pimm.data.synth import write_dataset, write_pilarnet

sys.path.insert(0, str(REPO / "benchmarks"))  # the benchmark scripts import _timing as a sibling
import _timing  # noqa: E402

CLASSES = ["shower", "track", "michel", "delta", "low_energy"]
TORCH_PIN = next(d for d in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
                 if d.startswith("torch=="))

# ----------------------------------------------------------------------------- make venv TORCH=...

needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def make(venv: Path, *args: str, dry_run: bool = True) -> subprocess.CompletedProcess:
    """`make ARGS VENV=venv` in the checkout: with -n, the commands it would run, run nothing."""
    argv = ["make", "--no-print-directory", "-C", str(REPO), *(["-n"] if dry_run else []), *args, f"VENV={venv}"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)


def _line(out: str, needle: str) -> int:
    (index,) = [i for i, line in enumerate(out.splitlines()) if needle in line]
    return index


@needs_make
@pytest.mark.parametrize("source", ["cpu", "cu126"])
def test_make_venv_from_pytorchs_index_installs_torch_first(tmp_path, source) -> None:
    res = make(tmp_path / ".venv", "venv", f"TORCH={source}")
    assert res.returncode == 0, res.stderr
    torch_line = _line(res.stdout, f"--index-url https://download.pytorch.org/whl/{source}")
    assert f"'{TORCH_PIN}'" in res.stdout.splitlines()[torch_line]
    assert torch_line < _line(res.stdout, "-e '.[test]'")  # pip then finds the pin satisfied
    assert res.stdout.splitlines()[-1] == f"echo {source} > {tmp_path / '.venv'}/.installed"


@needs_make
def test_make_venv_by_default_is_the_plain_pinned_install(tmp_path) -> None:
    res = make(tmp_path / ".venv", "venv")
    assert res.returncode == 0, res.stderr
    assert "download.pytorch.org" not in res.stdout and "system-site-packages" not in res.stdout
    assert "-m pip install --quiet --disable-pip-version-check -e '.[test]'" in res.stdout


@needs_make
def test_make_venv_refuses_an_unknown_torch_source(tmp_path) -> None:
    res = make(tmp_path / ".venv", "venv", "TORCH=cuda")
    assert res.returncode == 2 and res.stdout == ""
    assert "TORCH=cuda is not a torch source; use pinned" in res.stderr
    for choice in ("cpu", "cu126", "system"):
        assert choice in res.stderr


@needs_make
def test_an_existing_venv_keeps_its_torch_source(tmp_path) -> None:
    venv = tmp_path / ".venv"
    venv.mkdir()
    (venv / ".installed").write_text("cpu\n")
    res = make(venv, "-B", "venv")  # a reinstall (pyproject.toml changed) uses the venv's own source again
    assert res.returncode == 0, res.stderr
    assert "--index-url https://download.pytorch.org/whl/cpu" in res.stdout
    res = make(venv, "venv", "TORCH=pinned")
    assert res.returncode == 2
    assert f"{venv} was installed with TORCH=cpu; TORCH=pinned applies only when {venv} is created" in res.stderr
    assert f"rm -rf {venv}" in res.stderr


@needs_make
def test_make_venv_torch_system_needs_a_torch_it_can_see(tmp_path) -> None:
    """TORCH=system creates the venv with --system-site-packages, then stops with one line when the
    interpreter has no torch (the python3.11 this suite runs beside has none)."""
    base = shutil.which("python3.11")
    if base is None or subprocess.run([base, "-c", "import torch"], capture_output=True, check=False).returncode == 0:
        pytest.skip("needs a python3.11 without torch")
    plan = make(tmp_path / ".venv", "venv", "TORCH=system")
    assert "-m venv --system-site-packages" in plan.stdout and "--no-deps -e ." in plan.stdout
    # the venv made beforehand, without pip (seconds instead of a pip bootstrap): make reuses it
    subprocess.run([base, "-m", "venv", "--without-pip", "--system-site-packages", tmp_path / ".venv"], check=True)
    res = make(tmp_path / ".venv", "venv", "TORCH=system", dry_run=False)
    assert res.returncode == 2
    assert "TORCH=system, but" in res.stderr and "finds no torch: load the site's PyTorch module" in res.stderr
    assert not (tmp_path / ".venv" / ".installed").exists()


# ----------------------------------------------------------------------------- pimm show


@pytest.fixture(scope="module")
def long_track(tmp_path_factory) -> Path:
    """A prediction file of one event: a straight track 300 voxels long and about 10 across, at an
    angle, plus a few blips (the shape that a camera fitted to a cube cuts off)."""
    root = tmp_path_factory.mktemp("track")
    rng = np.random.default_rng(1)
    t = rng.uniform(0, 300, 400)
    coord = np.stack([100 + t, 200 + 0.05 * t + rng.normal(0, 3, t.size), 50 + rng.normal(0, 3, t.size)], axis=1)
    coord = np.concatenate([coord, rng.uniform([100, 190, 40], [400, 230, 60], (20, 3))]).astype(np.float32)
    truth = np.concatenate([np.full(400, 1), np.full(20, 4)]).astype(np.int16)
    pred = np.where(rng.random(truth.size) < 0.1, 0, truth)
    with PredictionWriter(root / "pred.h5", num_classes=5, class_names=CLASSES, split="val",
                          sources=["track.h5"]) as writer:
        writer.add(0, 0, 0, pred, np.arange(truth.size), coord, segment=truth)
    return root / "pred.h5"


def show(*args) -> tuple[int, str, str]:
    """`pimm show ARGS` in this process: (exit status, stdout, stderr)."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["show", *map(str, args)])
    return code, out.getvalue(), err.getvalue()


def test_show_writes_beside_the_data_not_into_the_current_directory(tmp_path, monkeypatch) -> None:
    data = write_dataset(tmp_path / "data" / "val.h5", 3, seed=3)
    write_pilarnet(tmp_path / "pil", 2, seed=4, shards=1, split="val")
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    expected = [tmp_path / "data" / "display" / "val-event_1.png", tmp_path / "pil" / "display" / "val-event_0.png"]
    assert show(data, "--event", 1) == (0, f"{expected[0]}\n", "")
    assert show(tmp_path / "pil", "--split", "val", "--event", 0) == (0, f"{expected[1]}\n", "")
    assert all(p.stat().st_size > 10_000 for p in expected)
    assert show(data, "--event", 1) == (0, f"{expected[0]}\n", "")  # drawn again from the same file: replaced
    assert list(here.iterdir()) == []


def test_show_refused_input_leaves_no_display_folder(tmp_path) -> None:
    data = write_dataset(tmp_path / "val.h5", 2, seed=3)
    code, out, err = show(data, "--event", 7)
    assert (code, out) == (2, "") and "event 7 is not in" in err
    assert not (tmp_path / "display").exists()
    (tmp_path / "display").write_text("a file where the folder would go\n")
    code, out, err = show(data, "--event", 1)
    assert (code, out) == (2, "")
    assert err.startswith(f"pimm: error: cannot create {tmp_path / 'display'} for the picture: ")
    assert err.endswith("give --out PATH where you can write\n") and err.count("\n") == 1


def test_show_png_has_units_and_one_scale_on_every_axis(long_track, tmp_path, monkeypatch) -> None:
    from matplotlib.figure import Figure

    drawn: list[Figure] = []
    savefig = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (drawn.append(fig), savefig(fig, *a, **k))[1])
    out = tmp_path / "e.png"
    assert show(long_track, "--event", 0, "--out", out) == (0, f"{out}\n", "")
    (fig,) = drawn
    views = [ax for ax in fig.axes if ax.name == "3d"]
    assert len(views) == 3  # truth, prediction, correct / wrong
    for ax in views:
        spans = np.array([np.ptp(ax.get_xlim()), np.ptp(ax.get_ylim()), np.ptp(ax.get_zlim())])
        np.testing.assert_allclose(spans / np.asarray(ax.get_box_aspect()), spans[0] / ax.get_box_aspect()[0],
                                   rtol=1e-6)  # data units per box length: the same on x, y and z
        assert spans[0] > 5 * spans[2]  # the track's length is not squeezed into a cube
        assert (ax.get_xlabel(), ax.get_ylabel(), ax.get_zlabel()) == ("x (voxel)", "y (voxel)", "z (voxel)")
    for ax in (ax for ax in fig.axes if ax.name != "3d"):
        assert ax.get_xlabel().endswith(" (voxel)") and ax.get_ylabel().endswith(" (voxel)")


def _plotly_layout(html: str) -> dict:
    """The layout argument of the page's Plotly.newPlot(id, data, layout, config)."""
    decoder = json.JSONDecoder()
    rest = html[html.index("Plotly.newPlot(") :]
    rest = rest[rest.index(",") + 1 :].lstrip()
    _, end = decoder.raw_decode(rest)  # the traces
    layout, _ = decoder.raw_decode(rest[end:].lstrip()[1:].lstrip())
    return layout


def test_show_html_sees_the_whole_event_at_one_scale(long_track, tmp_path) -> None:
    pytest.importorskip("plotly", reason="--html needs the display extra: pip install -e '.[display]'")
    assert show(long_track, "--event", 0, "--html") == (0, f"{long_track.parent / 'display/pred-event_0.html'}\n", "")
    layout = _plotly_layout((long_track.parent / "display" / "pred-event_0.html").read_text())
    coord = read_event(long_track, 0)["coord"]
    scenes = [key for key in layout if key.startswith("scene")]
    assert len(scenes) == 3
    for key in scenes:
        scene = layout[key]
        # plotly's aspectmode "data" scales the box to a geometric-mean side of 1: this track would
        # reach ~3 times past the default camera's view
        assert scene["aspectmode"] == "manual"
        ranges = np.array([scene[f"{a}axis"]["range"] for a in "xyz"])
        assert (ranges[:, 0] <= coord.min(axis=0)).all() and (ranges[:, 1] >= coord.max(axis=0)).all()
        ratio = np.array([scene["aspectratio"][a] for a in "xyz"])
        np.testing.assert_allclose(np.ptp(ranges, axis=1) / ratio, np.ptp(ranges[0]) / ratio[0], rtol=1e-9)
        assert [scene[f"{a}axis"]["title"]["text"] for a in "xyz"] == ["x (voxel)", "y (voxel)", "z (voxel)"]
        # the box (ratio/2 either side of the centre) fits in plotly's 45-degree field of view
        eye = np.array([scene["camera"]["eye"][a] for a in "xyz"])
        radius = 0.5 * float(np.linalg.norm(ratio))
        assert math.asin(radius / np.linalg.norm(eye)) < math.pi / 8
        assert math.asin(radius / np.linalg.norm(eye)) > 0.8 * math.pi / 8  # and fills most of it
        # a square scene: its field of view is as wide as it is high
        width = (scene["domain"]["x"][1] - scene["domain"]["x"][0]) * layout["width"]
        height = (layout["height"] - layout["margin"]["t"] - layout["margin"]["b"]) * np.ptp(scene["domain"]["y"])
        assert abs(width - height) < 2


# ----------------------------------------------------------------------------- benchmarks/_timing.py


def test_abba_alternates_the_order_of_each_repeat() -> None:
    assert _timing.abba(["a", "b"], 3) == [(0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b")]
    assert _timing.abba(["a", "b", "c"], 2) == [(0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a")]


def test_spread_prints_the_median_with_the_lowest_and_highest() -> None:
    spread = _timing.Spread.of([3.0, 1.0, 9.0, 2.0])
    assert (spread.median, spread.low, spread.high, spread.n) == (2.5, 1.0, 9.0, 4)
    assert spread.format() == "2.5 [1.0..9.0]"
    assert _timing.Spread.of([-0.01, 0.02, 0.03]).format(".1%") == "2.0% [-1.0%..3.0%]"
    assert _timing.Spread.of([194.61]).format() == "194.6"  # one measurement: no spread to show
    with pytest.raises(ValueError, match="no measurements"):
        _timing.Spread.of([])


def test_wait_until_quiet_stops_when_quiet_or_at_its_limit() -> None:
    quiet = _timing.wait_until_quiet(60, threshold=1e9, probe_s=0.05)  # any load is quiet
    assert quiet.quiet and quiet.seconds < 5
    busy = _timing.wait_until_quiet(0.3, threshold=-1, probe_s=0.05)  # no load is quiet: waits out the limit
    assert not busy.quiet and 0.3 <= busy.seconds < 5 and busy.cores is not None and busy.cores >= 0


def test_quiet_gate_says_how_long_it_waited() -> None:
    lines: list[str] = []
    gate = _timing.QuietGate(0.2, threshold=-1, probe_s=0.05, say=lines.append)
    gate.before("run 1")
    assert len(lines) == 1 and lines[0].startswith("  run 1: still busy after ") and "measuring anyway" in lines[0]
    summary = gate.summary()
    assert summary.startswith("waited ") and summary.endswith("(1 waits, 1 of them still busy at the limit)")
    off = _timing.QuietGate(0, say=lines.append)
    assert off.before("run 2") is None and off.summary() == "" and len(lines) == 1  # --wait-quiet 0: no wait


@pytest.mark.parametrize("argv", [["--repeats", "0"], ["--repeats", "two"], ["--wait-quiet", "-1"],
                                  ["--wait-quiet", "nan"]])
def test_benchmark_flags_refuse_bad_values(argv, capsys) -> None:
    parser = argparse.ArgumentParser(prog="bench")
    _timing.add_arguments(parser, repeats=3, what="runs")
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(argv)
    assert exc.value.code == 2 and argv[1] in capsys.readouterr().err


def test_a_benchmark_waits_repeats_and_prints_the_spread(tmp_path) -> None:
    """benchmarks/checkpoint_save.py end to end with both flags (no speed asserted)."""
    argv = [sys.executable, str(REPO / "benchmarks" / "checkpoint_save.py"), "--channels", "8", "--repeats", "2",
            "--wait-quiet", "0.1", "--quiet-cores", "1000"]
    res = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    waits = [line for line in lines if "waited" in line and "for a quiet machine" in line]
    assert [w.split(":")[0].strip() for w in waits[:4]] == ["repeat 1/2 async", "repeat 1/2 sync", "repeat 2/2 sync",
                                                          "repeat 2/2 async"]
    assert "median of 2 [lowest..highest]" in res.stdout
    for mode in ("async", "sync"):
        (row,) = [line for line in lines if line.startswith(mode)]
        assert row.count("[") == 2 and row.count("..") == 2, row
    assert lines[-1].startswith("waited ") and lines[-1].endswith("(4 waits, 0 of them still busy at the limit)")
