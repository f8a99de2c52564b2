"""Event displays for checking a model by eye: one event of a prediction file (truth, prediction
and the misclassified points side by side) or of a data file (truth), drawn as a PNG with
matplotlib (3D and xy/xz/yz projections) or as an interactive 3D HTML page with plotly.

Every panel costs one scatter call per class, never one per point: ~100k-point events draw in
seconds."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pimm.errors import DataError, PimmError

PIP_DISPLAY = "pip install -e '.[display]'"  # plotly, for --html
# class colours: no pure red or grey, which mark wrong and ignored points
CLASS_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22",
                 "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d", "#31a354")
IGNORED_COLOUR, CORRECT_COLOUR, WRONG_COLOUR = "#d0d0d0", "#b0b0b0", "#e4002b"
PROJECTIONS = ((0, 1), (0, 2), (1, 2))  # xy, xz, yz
AXES = "xyz"
HTML_DECIMALS = 2  # coordinates in the HTML page: 1/100 of a voxel is below any detector's resolution


class DisplayError(PimmError):
    """An event display cannot be drawn (a missing optional package, an unwritable output path)."""


@dataclass
class EventView:
    """What a display draws: coord (N, 3), truth and/or pred (N,) class per point (-1: ignored),
    the data set's class names and a title."""

    coord: np.ndarray
    class_names: list[str]
    title: str
    truth: np.ndarray | None = None
    pred: np.ndarray | None = None

    def labelled(self) -> np.ndarray:
        """Points with a truth class (not ignored)."""
        return (self.truth >= 0) & (self.truth < len(self.class_names))

    def wrong(self) -> np.ndarray:
        """Labelled points whose prediction differs from the truth."""
        return self.labelled() & (self.pred != self.truth)

    def columns(self) -> list[tuple[str, np.ndarray]]:
        """(header, per-point colour key) of each column: classes 0.., -1 ignored; in the last
        column of a view with truth and prediction, -2 correct and -3 wrong."""
        cols = [(name, labels) for name, labels in (("truth", self.truth), ("prediction", self.pred))
                if labels is not None]
        if self.truth is not None and self.pred is not None:
            key = np.where(self.labelled(), -2, -1)
            key[self.wrong()] = -3
            cols.append(("correct / wrong", key))
        return cols


def accuracy_text(view: EventView) -> str:
    """'accuracy 93.1% (12 of 174 labelled points wrong)', or '' without truth and prediction."""
    if view.truth is None or view.pred is None:
        return ""
    labelled, wrong = int(view.labelled().sum()), int(view.wrong().sum())
    if not labelled:
        return "no labelled points"
    return f"accuracy {1 - wrong / labelled:.1%} ({wrong} of {labelled} labelled points wrong)"


def _groups(key: np.ndarray, class_names: list[str]) -> list[tuple[str, str, np.ndarray, float]]:
    """(legend name, colour, point mask, size factor) per group of `key` present, drawn in this order:
    ignored and correct first, then the classes, wrong last (on top, larger)."""
    out = []
    special = {-1: ("ignored", IGNORED_COLOUR, 1.0), -2: ("correct", CORRECT_COLOUR, 1.0),
               -3: ("wrong", WRONG_COLOUR, 2.0)}
    for value in (-1, -2, *range(len(class_names)), -3):
        mask = key == value if value != -1 else (key == -1) | (key >= len(class_names)) | (key < -3)
        if not mask.any():
            continue
        if value >= 0:
            out.append((class_names[value], CLASS_COLOURS[value % len(CLASS_COLOURS)], mask, 1.0))
        else:
            out.append((*special[value][:2], mask, special[value][2]))
    return out


def _marker_size(n: int) -> float:
    """Scatter marker area (points^2): readable for a few hundred points, not a blob at 100k."""
    return float(np.clip(6000.0 / max(n, 1), 0.3, 8.0))


# ----------------------------------------------------------------------------- PNG


def draw_png(view: EventView, out: str | Path) -> Path:
    """Draw `view` as a PNG at `out` (written whole or not at all): one column per entry of
    `view.columns()`, rows 3D, xy, xz, yz (a 2x2 grid when there is one column); a legend
    with the data set's class names. Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    out = Path(out)
    columns = view.columns()
    coord = np.asarray(view.coord, dtype=np.float32)
    size = _marker_size(len(coord))
    single = len(columns) == 1
    shape = (2, 2) if single else (4, len(columns))
    fig = plt.figure(figsize=(11, 10.5) if single else (4.6 * len(columns), 17), layout="constrained")
    span = np.ptp(coord, axis=0) if len(coord) else np.ones(3)
    legend: dict[str, str] = {}
    for col, (header, key) in enumerate(columns):
        groups = _groups(key, view.class_names)
        legend.update({name: colour for name, colour, _, _ in groups})
        for row in range(4):
            index = row + 1 if single else row * len(columns) + col + 1
            if row == 0:
                ax = fig.add_subplot(*shape, index, projection="3d")
                for _, colour, mask, factor in groups:
                    c = coord[mask]
                    ax.scatter(c[:, 0], c[:, 1], c[:, 2], s=size * factor, c=colour, linewidths=0,
                               depthshade=False)
                ax.set_box_aspect(np.maximum(span, span.max() / 20 + 1e-6))
                ax.set(xlabel="x", ylabel="y", zlabel="z")
                ax.set_title(f"{header}: 3D")
            else:
                i, j = PROJECTIONS[row - 1]
                ax = fig.add_subplot(*shape, index)
                for _, colour, mask, factor in groups:
                    ax.scatter(coord[mask, i], coord[mask, j], s=size * factor, c=colour, linewidths=0)
                ax.set_aspect("equal", adjustable="datalim")
                ax.set(xlabel=AXES[i], ylabel=AXES[j])
                ax.set_title(f"{header}: {AXES[i]}{AXES[j]}")
    # every class of the data set, in class order, then the marks that are not classes
    names = [*view.class_names, *(n for n in ("ignored", "correct", "wrong") if n in legend)]
    colours = {**{n: CLASS_COLOURS[k % len(CLASS_COLOURS)] for k, n in enumerate(view.class_names)}, **legend}
    handles = [Line2D([], [], marker="o", linestyle="", markersize=8, color=colours[n], label=n) for n in names]
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 8), frameon=False)
    fig.suptitle(view.title)
    tmp = out.with_name(f".{out.name}.tmp.png")
    try:
        fig.savefig(tmp, dpi=100)
        tmp.replace(out)  # never a half-written PNG under the final name
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise DisplayError(f"cannot write {out}: {exc}; choose a writable --out path") from exc
    finally:
        plt.close(fig)
    return out


# ----------------------------------------------------------------------------- HTML


def require_plotly() -> None:
    """DisplayError naming the pip command when plotly (the `display` extra) is not installed."""
    try:
        import plotly.graph_objects  # noqa: F401
    except ImportError as exc:
        raise DisplayError(f"--html needs plotly, which is not installed; install it with `{PIP_DISPLAY}`") from exc


def write_html(view: EventView, out: str | Path) -> Path:
    """An interactive 3D page of `view` at `out`, one scene per column of `view.columns()`,
    self-contained (plotly.js inline: it opens without a network); clicking a legend entry hides
    that class in every scene. Returns the path."""
    require_plotly()
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    out = Path(out)
    columns = view.columns()
    # plain lists, not numpy arrays: plotly would encode arrays in base64, hiding the numbers
    coord = np.round(np.asarray(view.coord, dtype=np.float64), HTML_DECIMALS)
    fig = make_subplots(rows=1, cols=len(columns), specs=[[{"type": "scene"}] * len(columns)],
                        subplot_titles=[header for header, _ in columns], horizontal_spacing=0.01)
    size = float(np.clip(_marker_size(len(coord)) ** 0.5, 1.0, 4.0))
    shown: set[str] = set()
    for col, (_, key) in enumerate(columns):
        for name, colour, mask, factor in _groups(key, view.class_names):
            c = coord[mask]
            fig.add_trace(go.Scatter3d(x=c[:, 0].tolist(), y=c[:, 1].tolist(), z=c[:, 2].tolist(), mode="markers",
                                       name=name, legendgroup=name, showlegend=name not in shown,
                                       marker={"size": size * factor ** 0.5, "color": colour}),
                          row=1, col=col + 1)
            shown.add(name)
    scene = {"aspectmode": "data", "xaxis_title": "x", "yaxis_title": "y", "zaxis_title": "z"}
    fig.update_layout(title=view.title, **{f"scene{k + 1 if k else ''}": scene for k in range(len(columns))},
                      legend={"itemsizing": "constant"}, margin={"l": 0, "r": 0, "b": 0, "t": 60})
    tmp = out.with_name(f".{out.name}.tmp.html")
    try:
        fig.write_html(tmp, include_plotlyjs=True, full_html=True)
        tmp.replace(out)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise DisplayError(f"cannot write {out}: {exc}; choose a writable --out path") from exc
    return out


# ----------------------------------------------------------------------------- loading one event


def load_event(path: str | Path, event_id: int, split: str = "train") -> EventView:
    """Event `event_id` of a prediction file (truth when labelled, prediction), or of a data file
    (truth only): a pimm event file, or PILArNet-M shards (a shard or a directory; `split` picks
    <path>/*<split>/*.h5). For a data file the id is the dataset index with the reader's
    default selection (every event with a point). DataError saying what is wrong otherwise."""
    from pimm.data.predictions import is_predictions, open_predictions

    path = Path(path)
    if is_predictions(path):
        with open_predictions(path) as preds:
            event = preds.read_event(event_id)
            class_names = preds.class_names
        view = EventView(coord=event["coord"], class_names=class_names, title="",
                         truth=event["segment"].astype(np.int64) if "segment" in event else None,
                         pred=event["pred"].astype(np.int64))
        origin = f"from {Path(event['source']).name} #{event['source_index']}"
    elif not path.exists():
        raise DataError(f"{path}: no such file or directory; give a prediction file (from `pimm test` or "
                        "`pimm predict`) or a data file")
    else:
        coord, truth, class_names = _read_data_event(path, event_id, split)
        view = EventView(coord=coord, class_names=class_names, title="", truth=truth)
        origin = "truth"
    stats = ", ".join(s for s in (f"{len(view.coord):,} points", accuracy_text(view)) if s)
    view.title = f"{path.name}  event {event_id} ({origin})\n{stats}"
    return view


def _read_data_event(path: Path, event_id: int, split: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(coord, truth, class names) of one event of a data file, read as pimm's datasets read it."""
    from pimm.data.dataset import LArTPCDataset, PILArNetDataset
    from pimm.data.pilarnet_file import detect_revision, is_pilarnet

    if is_pilarnet(path):
        dataset = PILArNetDataset(path, split=split, revision=detect_revision(path, split))
    else:
        dataset = LArTPCDataset(path)
    try:
        n = len(dataset)
        if not 0 <= event_id < n:
            raise DataError(f"event {event_id} is not in {path} (it holds {n} events, ids 0..{n - 1})")
        raw = dataset.read_raw(event_id)
        return raw["coord"], raw["segment"].astype(np.int64), list(dataset.class_names)
    finally:
        dataset.close()
