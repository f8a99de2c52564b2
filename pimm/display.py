"""Event displays for checking a model by eye: one event of a prediction file (truth, prediction
and the misclassified points side by side) or of a data file (truth), drawn as a PNG with
matplotlib (3D and xy/xz/yz projections) or as an interactive 3D HTML page with plotly.

Every panel costs one scatter call per class, never one per point: ~100k-point events draw in
seconds."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pimm.data.pilarnet_file import detect_revision, is_pilarnet
from pimm.data.predictions import is_predictions, open_predictions
from pimm.errors import DataError, PimmError

PIP_DISPLAY = "pip install -e '.[display]'"  # plotly, for --html
# class colours: no pure red or grey, which mark wrong and ignored points
CLASS_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22",
                 "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d", "#31a354")
IGNORED_COLOUR, CORRECT_COLOUR, WRONG_COLOUR = "#d0d0d0", "#b0b0b0", "#e4002b"
PROJECTIONS = ((0, 1), (0, 2), (1, 2))  # xy, xz, yz
AXES = "xyz"
HTML_DECIMALS = 2  # coordinates in the HTML page: 1/100 of a voxel is below any detector's resolution
# coordinates as stored: integer voxel indices in PILArNet-M (3 mm voxels in the PILArNet publications),
# ~3 mm units in pimm's synthetic event files; the readers and the models keep them in these units
COORD_UNIT = "voxel"
DISPLAY_DIR = "display"  # pimm show's default folder, beside the file it draws
# each 3D scene of the HTML page is a square of this many pixels (html_scene's camera assumes a square),
# at most HTML_PAGE_PX wide together: 640 for a data file's truth, 440 each for truth | prediction | wrong
HTML_SCENE_PX, HTML_PAGE_PX = 640, 1320
HTML_SPACING = 0.01  # between the scenes, as a fraction of the page's width
HTML_FOVY = np.pi / 4  # plotly's 3D field of view (vertical; as wide as that in a square scene)


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
    unit: str = COORD_UNIT

    def axis_title(self, axis: int) -> str:
        """'x (voxel)': the axis and the coordinates' unit."""
        return f"{AXES[axis]} ({self.unit})"

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


def scene_box(coord: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(low, high) corners of the box an event is drawn in, one scale on every axis: the points'
    extent padded by 4% of its longest side, and at least 10% of that side along every axis (a flat
    or straight event stays visible). The same box in the PNG and the HTML page."""
    coord = np.asarray(coord, dtype=np.float64).reshape(-1, 3)
    if not len(coord):
        return np.zeros(3), np.ones(3)
    low, high = coord.min(axis=0), coord.max(axis=0)
    longest = max(float((high - low).max()), 1.0)
    half = np.maximum((high - low) / 2, 0.05 * longest) + 0.04 * longest
    centre = (low + high) / 2
    return centre - half, centre + half


def default_output(path: str | Path, event_id: int, split: str, html: bool) -> Path:
    """Where `pimm show` writes without --out: `display/<file stem>-event_<ID>.png` (or .html) in the
    folder of the file it draws (a prediction file's evaluation folder, say), or
    `display/<split>-event_<ID>.png` inside a directory of PILArNet-M shards."""
    path = Path(path)
    suffix = "html" if html else "png"
    if path.is_dir():
        return path / DISPLAY_DIR / f"{split}-event_{event_id}.{suffix}"
    return path.parent / DISPLAY_DIR / f"{path.stem}-event_{event_id}.{suffix}"


def make_output_folder(out: Path) -> None:
    """Create the folder of a default output path, or DisplayError saying why not and what to do."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DisplayError(f"cannot create {out.parent} for the picture: {exc.strerror or exc}; "
                           "give --out PATH where you can write") from exc


def _marker_size(n: int) -> float:
    """Scatter marker area (points^2): readable for a few hundred points, not a blob at 100k."""
    return float(np.clip(6000.0 / max(n, 1), 0.3, 8.0))


# ----------------------------------------------------------------------------- PNG


def draw_png(view: EventView, out: str | Path) -> Path:
    """Draw `view` as a PNG at `out` (written whole or not at all): one column per entry of
    `view.columns()`, rows 3D, xy, xz, yz (a 2x2 grid when there is one column); a legend
    with the data set's class names. Returns the path."""
    import matplotlib  # deferred: matplotlib only for a PNG (not for --html)

    matplotlib.use("Agg")
    # deferred: pyplot only after the backend is chosen
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    out = Path(out)
    columns = view.columns()
    coord = np.asarray(view.coord, dtype=np.float32)
    size = _marker_size(len(coord))
    single = len(columns) == 1
    shape = (2, 2) if single else (4, len(columns))
    fig = plt.figure(figsize=(11, 10.5) if single else (4.6 * len(columns), 17), layout="constrained")
    low, high = scene_box(coord)
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
                # one scale on every axis: limits and box sides both from scene_box
                ax.set(xlim=(low[0], high[0]), ylim=(low[1], high[1]), zlim=(low[2], high[2]))
                ax.set_box_aspect(high - low)
                ax.set(xlabel=view.axis_title(0), ylabel=view.axis_title(1), zlabel=view.axis_title(2))
                ax.set_title(f"{header}: 3D")
            else:
                i, j = PROJECTIONS[row - 1]
                ax = fig.add_subplot(*shape, index)
                for _, colour, mask, factor in groups:
                    ax.scatter(coord[mask, i], coord[mask, j], s=size * factor, c=colour, linewidths=0)
                ax.set_aspect("equal", adjustable="datalim")
                ax.set(xlabel=view.axis_title(i), ylabel=view.axis_title(j))
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
        if tmp.exists():  # not unlink(missing_ok): under a file in the way it raises NotADirectoryError
            tmp.unlink()
        raise DisplayError(f"cannot write {out}: {exc}; choose a writable --out path") from exc
    finally:
        plt.close(fig)
    return out


# ----------------------------------------------------------------------------- HTML


def html_scene(view: EventView) -> dict:
    """The layout of one square 3D scene of the HTML page: scene_box on every axis at one scale (its
    longest side 1), axis titles with the unit, and a camera far enough away to see the whole box.
    (Not aspectmode "data": plotly scales that box to a geometric mean side of 1, so a long track
    reaches far outside the default camera's view.)"""
    low, high = scene_box(view.coord)
    ratio = (high - low) / (high - low).max()
    # plotly draws the box as ratio/2 either side of the scene centre, and the camera looks at the
    # centre: the box's bounding sphere fits the field of view from this distance (8% to spare)
    radius = 0.5 * float(np.linalg.norm(ratio))
    distance = 1.08 * radius / np.sin(HTML_FOVY / 2)
    eye = distance * np.array([1.0, 1.0, 0.8]) / np.linalg.norm([1.0, 1.0, 0.8])
    axis = {f"{AXES[i]}axis": {"range": [float(low[i]), float(high[i])], "autorange": False,
                               "title": {"text": view.axis_title(i)}} for i in range(3)}
    return {"aspectmode": "manual", "aspectratio": dict(zip(AXES, map(float, ratio))),
            "camera": {"eye": dict(zip(AXES, map(float, eye))), "center": {"x": 0.0, "y": 0.0, "z": 0.0}}, **axis}


def require_plotly() -> None:
    """DisplayError naming the pip command when plotly (the `display` extra) is not installed."""
    try:
        import plotly.graph_objects  # noqa: F401  # deferred: an optional package, checked only for --html
    except ImportError as exc:
        raise DisplayError(f"--html needs plotly, which is not installed; install it with `{PIP_DISPLAY}`") from exc


def write_html(view: EventView, out: str | Path) -> Path:
    """An interactive 3D page of `view` at `out`, one scene per column of `view.columns()`,
    self-contained (plotly.js inline: it opens without a network); clicking a legend entry hides
    that class in every scene. Returns the path."""
    require_plotly()
    # deferred: plotly is an optional package (the display extra)
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    out = Path(out)
    columns = view.columns()
    # plain lists, not numpy arrays: plotly would encode arrays in base64, hiding the numbers
    coord = np.round(np.asarray(view.coord, dtype=np.float64), HTML_DECIMALS)
    fig = make_subplots(rows=1, cols=len(columns), specs=[[{"type": "scene"}] * len(columns)],
                        subplot_titles=[header for header, _ in columns], horizontal_spacing=HTML_SPACING)
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
    # a fixed size: every scene a square, which html_scene's camera distance assumes
    margin = {"l": 0, "r": 0, "b": 50, "t": 80}
    side = min(HTML_SCENE_PX, HTML_PAGE_PX // len(columns))
    width = round(side * len(columns) / (1 - HTML_SPACING * (len(columns) - 1)))
    scene = html_scene(view)
    fig.update_layout(title={"text": view.title.replace("\n", "<br>")}, width=width,
                      height=side + margin["t"] + margin["b"], margin=margin,
                      **{f"scene{k + 1 if k else ''}": scene for k in range(len(columns))},
                      legend={"itemsizing": "constant", "orientation": "h", "x": 0.5, "xanchor": "center",
                              "y": 0, "yanchor": "top"})
    tmp = out.with_name(f".{out.name}.tmp.html")
    try:
        fig.write_html(tmp, include_plotlyjs=True, full_html=True)
        tmp.replace(out)
    except OSError as exc:
        if tmp.exists():  # not unlink(missing_ok): under a file in the way it raises NotADirectoryError
            tmp.unlink()
        raise DisplayError(f"cannot write {out}: {exc}; choose a writable --out path") from exc
    return out


# ----------------------------------------------------------------------------- loading one event


def load_event(path: str | Path, event_id: int, split: str = "train") -> EventView:
    """Event `event_id` of a prediction file (truth when labelled, prediction), or of a data file
    (truth only): a pimm event file, or PILArNet-M shards (a shard or a directory; `split` picks
    <path>/*<split>/*.h5). For a data file the id is the dataset index with the reader's
    default selection (every event with a point). DataError saying what is wrong otherwise."""
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
    from pimm.data.dataset import LArTPCDataset, PILArNetDataset  # deferred: torch, only to draw a data file

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
