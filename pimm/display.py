"""Event displays for checking a model by eye: one event of a prediction file (truth, prediction
and the misclassified points side by side) or of a data file (truth), drawn as a PNG with
matplotlib (3D and xy/xz/yz projections) or as an interactive 3D HTML page with plotly.

Points are coloured by class, by instance (a panoptic model's predicted instances, or a PILArNet-M
file's true particles or interactions), by particle type, or by error (wrong class, wrong
instance); see COLOR_BY. Every panel costs one scatter call per colour group, never one per point:
~100k-point events draw in seconds."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from pimm.data.pilarnet_file import PID_NAMES, detect_revision, is_pilarnet
from pimm.data.predictions import is_predictions, open_predictions
from pimm.errors import DataError, PimmError
from pimm.panoptic_metrics import instance_overlap, match_instances

PIP_DISPLAY = "pip install -e '.[display]'"  # plotly, for --html
# class colours: no pure red or grey, which mark wrong and ignored points
CLASS_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22",
                 "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d", "#31a354")
IGNORED_COLOUR, CORRECT_COLOUR, WRONG_COLOUR = "#d0d0d0", "#b0b0b0", "#e4002b"
WRONG_INSTANCE_COLOUR = "#0000ff"  # a point in the wrong instance (its class right): pure blue, in no palette
# instance colours, qualitative and repeating after 20: tab20's dark then light halves without its
# reds and greys (marks), filled up from tab20b
INSTANCE_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf",
                    "#393b79", "#637939", "#8c6d31", "#7b4173", "#aec7e8", "#ffbb78", "#98df8a", "#c5b0d5",
                    "#c49c94", "#f7b6d2", "#dbdb8d", "#9edae5")
# what `pimm show --color-by` takes: class (the default), instance (predicted, or a data file's true
# particles), interaction and pid (a PILArNet-M data file's truth), error (wrong class or instance)
COLOR_BY = ("class", "instance", "interaction", "pid", "error")
MATCH_IOU = 0.5  # a predicted instance is its true instance's match at IoU >= 0.5 (the detection metrics' threshold)
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


class Group(NamedTuple):
    """Points drawn alike: a legend name, a colour, which points, a marker size factor."""

    name: str
    colour: str
    mask: np.ndarray
    size: float = 1.0


class Panel(NamedTuple):
    """One column of a display: its header, its groups in drawing order, and whether it colours
    by class (the legend then lists every class of the data set)."""

    header: str
    groups: list[Group]
    classes: bool = False


@dataclass
class EventView:
    """What a display draws: coord (N, 3), truth and/or pred (N,) class per point (-1: ignored),
    true_instance and/or pred_instance (N,) instance ids (-1: none), the data set's class names,
    a title, what colours the points (`color_by`: "class", "instance" or "error"; a data file's
    pid and interaction truth come as class and instance views) and `side_by_side` (truth and
    prediction panels). `instance_name` names an instance in the legend (instance, particle,
    interaction)."""

    coord: np.ndarray
    class_names: list[str]
    title: str
    truth: np.ndarray | None = None
    pred: np.ndarray | None = None
    unit: str = COORD_UNIT
    true_instance: np.ndarray | None = None
    pred_instance: np.ndarray | None = None
    instance_name: str = "instance"
    color_by: str = "class"
    side_by_side: bool = False

    def axis_title(self, axis: int) -> str:
        """'x (voxel)': the axis and the coordinates' unit."""
        return f"{AXES[axis]} ({self.unit})"

    def labelled(self) -> np.ndarray:
        """Points with a truth class (not ignored)."""
        return (self.truth >= 0) & (self.truth < len(self.class_names))

    def wrong(self) -> np.ndarray:
        """Labelled points whose prediction differs from the truth."""
        return self.labelled() & (self.pred != self.truth)

    def instance_slots(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(true, predicted) per-point colour slots of the instances (-1 none): a true instance's
        slot is its id; a predicted instance matched to a true one (IoU >= MATCH_IOU) takes that
        one's slot, so a pair looks alike side by side; the others follow the true ones in id order."""
        true, pred = self.true_instance, self.pred_instance
        if true is None or pred is None:
            return true, pred
        overlap, matches = _matched_instances(true, pred)
        slot_of_pred = np.full(len(overlap.pred_ids), -1, np.int64)
        slot_of_pred[overlap.pred_index[matches]] = overlap.true_ids[overlap.true_index[matches]]
        unmatched = slot_of_pred < 0
        first_free = int(overlap.true_ids.max()) + 1 if len(overlap.true_ids) else 0
        slot_of_pred[unmatched] = first_free + np.arange(int(unmatched.sum()))
        # code -1 (no instance) reads the appended -1: also when nothing was predicted
        return true, np.append(slot_of_pred, -1)[overlap.pred_code]

    def instance_wrong(self) -> np.ndarray:
        """Labelled points whose predicted instance is not the match of their true instance (a
        true stuff point must be in no predicted instance)."""
        true, pred = self.instance_slots()
        in_match = np.where(true >= 0, pred == true, pred < 0)  # matched pairs share a slot
        return self.labelled() & ~in_match

    def error_key(self) -> np.ndarray:
        """Per point: -1 ignored, -2 correct, -4 wrong class, -5 wrong instance (class right)."""
        key = np.where(self.labelled(), -2, -1)
        if self.pred_instance is not None:
            key[self.instance_wrong()] = -5
        key[self.wrong()] = -4
        return key

    def columns(self) -> list[Panel]:
        """The panels to draw, left to right (see `EventView`)."""
        has_both = self.truth is not None and self.pred is not None
        if self.color_by == "error":
            shown = self._instance_panels() if self.pred_instance is not None else self._class_panels()
            return [*(shown if self.side_by_side else []), Panel("errors", _mark_groups(self.error_key()))]
        if self.color_by == "instance":
            return self._instance_panels()
        panels = self._class_panels()
        if has_both and not self.side_by_side:
            key = np.where(self.labelled(), -2, -1)
            key[self.wrong()] = -3
            panels.append(Panel("correct / wrong", _mark_groups(key)))
        return panels

    def _class_panels(self) -> list[Panel]:
        return [Panel(header, _class_groups(labels, self.class_names), classes=True)
                for header, labels in (("truth", self.truth), ("prediction", self.pred)) if labels is not None]

    def _instance_panels(self) -> list[Panel]:
        """Truth and prediction side by side, else the prediction (a data file: the truth)."""
        true, pred = self.instance_slots()
        if pred is not None and not self.side_by_side:
            true = None
        return [Panel(header, _instance_groups(slots, self.instance_name))
                for header, slots in (("truth", true), ("prediction", pred)) if slots is not None]


def accuracy_text(view: EventView) -> str:
    """'accuracy 93.1% (12 of 174 labelled points wrong)', or '' without truth and prediction."""
    if view.truth is None or view.pred is None:
        return ""
    labelled, wrong = int(view.labelled().sum()), int(view.wrong().sum())
    if not labelled:
        return "no labelled points"
    return f"accuracy {1 - wrong / labelled:.1%} ({wrong} of {labelled} labelled points wrong)"


def instance_text(view: EventView) -> str:
    """'5 predicted instances, 4 true, 3 matched (IoU >= 0.5)', '7 true particles', or '' without instances."""
    true, pred = view.true_instance, view.pred_instance
    count = {name: len(np.unique(ids[ids >= 0])) for name, ids in (("true", true), ("pred", pred)) if ids is not None}
    if pred is None:
        return f"{count['true']} true {view.instance_name}s" if true is not None else ""
    if true is None:
        return f"{count['pred']} predicted {view.instance_name}s"
    matched = len(_matched_instances(true, pred)[1])
    return (f"{count['pred']} predicted {view.instance_name}s, {count['true']} true, "
            f"{matched} matched (IoU >= {MATCH_IOU})")


def error_text(view: EventView) -> str:
    """'12 wrong class, 30 wrong instance of 174 labelled points' for an error view, else ''."""
    if view.color_by != "error":
        return ""
    key = view.error_key()
    wrong_instance = f", {int((key == -5).sum())} wrong instance" if view.pred_instance is not None else ""
    return f"{int((key == -4).sum())} wrong class{wrong_instance} of {int((key != -1).sum())} labelled points"


def _matched_instances(true_instance: np.ndarray, pred_instance: np.ndarray) -> tuple[Any, np.ndarray]:
    """(InstanceOverlap, matched cells at IoU >= MATCH_IOU) of one event, as the panoptic metrics match."""
    overlap = instance_overlap(true_instance, pred_instance)
    return overlap, match_instances(overlap, MATCH_IOU)


def _class_groups(labels: np.ndarray, class_names: list[str]) -> list[Group]:
    """Ignored points (a label outside 0..C-1) first, then one group per class present."""
    groups = [Group("ignored", IGNORED_COLOUR, (labels < 0) | (labels >= len(class_names)))]
    groups += [Group(name, CLASS_COLOURS[k % len(CLASS_COLOURS)], labels == k) for k, name in enumerate(class_names)]
    return [g for g in groups if g.mask.any()]


def _instance_groups(slots: np.ndarray, name: str) -> list[Group]:
    """Points of no instance first (grey), then one group per instance slot present."""
    groups = [Group(f"no {name}", IGNORED_COLOUR, slots < 0)]
    groups += [Group(f"{name} {k}", INSTANCE_COLOURS[k % len(INSTANCE_COLOURS)], slots == k)
               for k in np.unique(slots[slots >= 0]).tolist()]
    return [g for g in groups if g.mask.any()]


_MARKS = {-1: ("ignored", IGNORED_COLOUR, 1.0), -2: ("correct", CORRECT_COLOUR, 1.0), -3: ("wrong", WRONG_COLOUR, 2.0),
          -5: ("wrong instance", WRONG_INSTANCE_COLOUR, 2.0), -4: ("wrong class", WRONG_COLOUR, 2.0)}


def _mark_groups(key: np.ndarray) -> list[Group]:
    """One group per mark of `key` present (ignored, correct, wrong...), wrong ones last: on top, larger."""
    return [Group(name, colour, key == value, size) for value, (name, colour, size) in _MARKS.items()
            if (key == value).any()]


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


def default_output(path: str | Path, event_id: int, split: str, html: bool, color_by: str = "class",
                   side_by_side: bool = False) -> Path:
    """Where `pimm show` writes without --out: `display/<file stem>-event_<ID>.png` (or .html) in the
    folder of the file it draws (a prediction file's evaluation folder, say), or
    `display/<split>-event_<ID>.png` inside a directory of PILArNet-M shards; another colouring than
    class adds `-<color_by>`, --side-by-side `-side_by_side`, so each view keeps its own file."""
    path = Path(path)
    view = (f"-{color_by}" if color_by != "class" else "") + ("-side_by_side" if side_by_side else "")
    name = f"{split if path.is_dir() else path.stem}-event_{event_id}{view}.{'html' if html else 'png'}"
    return (path if path.is_dir() else path.parent) / DISPLAY_DIR / name


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
    legend: dict[str, str] = {}  # legend name -> colour, in order: a class panel's every class, then its groups
    for col, (header, groups, classes) in enumerate(columns):
        if classes:
            for k, name in enumerate(view.class_names):
                legend.setdefault(name, CLASS_COLOURS[k % len(CLASS_COLOURS)])
        for group in groups:
            legend.setdefault(group.name, group.colour)
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
    handles = [Line2D([], [], marker="o", linestyle="", markersize=8, color=colour, label=name)
               for name, colour in legend.items()]
    # as many legend columns as fit the figure's width (~1.35 inch an entry), at most 8
    ncol = min(len(handles), 8, int(fig.get_figwidth() / 1.35))
    fig.legend(handles=handles, loc="outside lower center", ncol=ncol, frameon=False)
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
                        subplot_titles=[panel.header for panel in columns], horizontal_spacing=HTML_SPACING)
    size = float(np.clip(_marker_size(len(coord)) ** 0.5, 1.0, 4.0))
    shown: set[str] = set()
    for col, panel in enumerate(columns):
        for name, colour, mask, factor in panel.groups:
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


def load_event(path: str | Path, event_id: int, split: str = "train", color_by: str = "class",
               side_by_side: bool = False) -> EventView:
    """Event `event_id` of a prediction file (truth when labelled, prediction, instances when it has
    them), or of a data file (truth only): a pimm event file, or PILArNet-M shards (a shard or a
    directory; `split` picks <path>/*<split>/*.h5). For a data file the id is the dataset index with
    the reader's default selection (every event with a point). `color_by` (COLOR_BY) and
    `side_by_side` say what is drawn; a combination the file cannot give is a DisplayError naming
    the option and what to do. DataError saying what is wrong with the file otherwise."""
    path = Path(path)
    if color_by not in COLOR_BY:
        raise DisplayError(f"--color-by {color_by!r} is not one of {', '.join(COLOR_BY)}")
    if is_predictions(path):
        with open_predictions(path) as preds:
            _check_prediction_options(path, preds.has_labels, preds.has_instances, color_by, side_by_side)
            event = preds.read_event(event_id)
            class_names = preds.class_names
        view = EventView(coord=event["coord"], class_names=class_names, title="",
                         truth=event["segment"].astype(np.int64) if "segment" in event else None,
                         pred=event["pred"].astype(np.int64), color_by=color_by, side_by_side=side_by_side)
        if "instance" in event:
            view.pred_instance = event["instance"].astype(np.int64)
            view.true_instance = event["true_instance"].astype(np.int64) if "true_instance" in event else None
        origin = f"from {Path(event['source']).name} #{event['source_index']}"
    elif not path.exists():
        raise DataError(f"{path}: no such file or directory; give a prediction file (from `pimm test` or "
                        "`pimm predict`) or a data file")
    else:
        view = _data_view(path, event_id, split, color_by, side_by_side)
        origin = "truth"
    stats = [f"{len(view.coord):,} points", instance_text(view) if color_by != "class" else "",
             error_text(view) or (accuracy_text(view) if color_by == "class" else "")]
    colouring = "" if color_by == "class" else f", by {color_by}"
    view.title = f"{path.name}  event {event_id} ({origin}{colouring})\n{', '.join(s for s in stats if s)}"
    return view


def _check_prediction_options(path: Path, has_labels: bool, has_instances: bool, color_by: str,
                              side_by_side: bool) -> None:
    """DisplayError for what a prediction file with these contents cannot show."""
    if color_by in ("interaction", "pid"):
        raise DisplayError(f"--color-by {color_by} colours the truth of PILArNet-M data; {path} is a prediction file: "
                           "use --color-by instance for its instances, or class")
    if color_by == "instance" and not has_instances:
        raise DisplayError(f"--color-by instance: {path} holds no instance predictions (a semantic segmentation "
                           "model's); use --color-by class or error, or the predictions of a Panoptic model")
    unlabelled = (f"{path} has no truth (predictions of unlabelled data, from `pimm predict`); use the predictions "
                  "of `pimm test --save-predictions`")
    if color_by == "error" and not has_labels:
        raise DisplayError(f"--color-by error compares the prediction with the truth, and {unlabelled}, or "
                           "--color-by class or instance")
    if side_by_side and not has_labels:
        raise DisplayError(f"--side-by-side puts the truth beside the prediction, and {unlabelled}, or leave "
                           "--side-by-side out")


def _data_view(path: Path, event_id: int, split: str, color_by: str, side_by_side: bool) -> EventView:
    """The truth of one event of a data file, read as pimm's datasets read it, for `color_by`."""
    from pimm.data.dataset import LArTPCDataset, PILArNetDataset  # deferred: torch, only to draw a data file

    if color_by == "error":
        raise DisplayError(f"--color-by error compares a prediction with the truth; {path} is a data file (truth "
                           "only): give a prediction file from `pimm test --save-predictions`")
    if side_by_side:
        raise DisplayError(f"--side-by-side puts the truth beside a prediction; {path} is a data file (truth "
                           "only): leave --side-by-side out, or give a prediction file")
    instances = color_by != "class"
    if is_pilarnet(path):
        dataset = PILArNetDataset(path, split=split, revision=detect_revision(path, split), instances=instances)
    elif instances:
        raise DisplayError(f"--color-by {color_by} shows instance labels, which a pimm event file ({path}) does not "
                           "have; use PILArNet-M data (a shard or a directory), or --color-by class")
    else:
        dataset = LArTPCDataset(path)
    try:
        n = len(dataset)
        if not 0 <= event_id < n:
            raise DataError(f"event {event_id} is not in {path} (it holds {n} events, ids 0..{n - 1})")
        raw = dataset.read_raw(event_id)
        if color_by == "pid" and "pid" not in raw:
            raise DisplayError(f"--color-by pid: {path} (PILArNet-M revision {dataset.revision}) has no particle "
                               "types; use --color-by class, instance or interaction")
        view = EventView(coord=raw["coord"], class_names=list(dataset.class_names), title="",
                         truth=raw["segment"].astype(np.int64))
        if color_by == "pid":
            view.class_names, view.truth = list(PID_NAMES), raw["pid"].astype(np.int64)
        elif instances:  # instance: the true particles; interaction: the true interactions
            view.color_by = "instance"
            view.instance_name = "interaction" if color_by == "interaction" else "particle"
            view.true_instance = raw[view.instance_name].astype(np.int64)
        return view
    finally:
        dataset.close()
