"""Training metrics on the Dask dashboard: rounds published as scheduler events, and the
``/training`` Bokeh page that plots them as they arrive."""
from __future__ import annotations

import contextlib
import logging
import math
import uuid
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path

from pipeline.cluster import bokeh_validation
from pipeline.core import files
from pipeline.core.errors import OutputError
from pipeline.outputs.live import split_series
from pipeline.outputs.metrics import COLUMNS, INTEGERS
from pipeline.outputs.progress import (  # noqa: F401  (re-exported: the page's words)
    add_stages, duration, progress_of, status_html)

logger = logging.getLogger(__name__)

TOPIC = "training"  # scheduler event topic of the rounds
ACTION = "training-round"  # the "action" of a round on the dashboard's /events page
PAGE = "training"  # dashboard page path, under the dashboard's prefix
REFRESH_MS = 500  # how often the /training page reads the event log
# An event's numbers: a line's, the run's round count, the round's workers (its count).
_SCALARS = (*COLUMNS, "rounds", "workers")
_INTS = (*INTEGERS, "rounds", "workers")
MAX_RUN_LABEL = 80  # characters of a run label shown or published
MAX_STAGES = 32  # stage_seconds entries kept from an event
MAX_POINTS = 1000  # points a /training curve holds; past it every other one is dropped


# ---------------------------------------------------------------------------------------------
# Pure helpers


def event_of(line: dict, run: str, rounds: int | None = None) -> dict:
    """A round's metrics dict -> the scheduler event: msgpack-safe scalars, the run label and
    ``action`` (what the /events page groups by); ``stage_seconds`` kept as a flat dict;
    ``rounds``, the run's number of rounds, when known; ``workers``, the count of the line's.

    >>> event_of({"round": 2, "train_acc": 0.5, "stage_seconds": {"train": 1.5},
    ...           "workers": {"count": 3, "names": ["0", "1", "2"], "joined": ["2"]}}, "ipm")
    {'action': 'training-round', 'run': 'ipm', 'round': 2, 'train_acc': 0.5, 'workers': 3,
     'stage_seconds': {'train': 1.5}}
    """
    if rounds is not None:
        line = {**line, "rounds": int(rounds)}
    if isinstance(line.get("workers"), dict):  # names stay in metrics.jsonl
        line = {**line, "workers": line["workers"].get("count", 0)}
    event = {"action": ACTION, "run": str(run)[:MAX_RUN_LABEL]}
    for key in _SCALARS:
        if key in line:
            value = line[key]
            event[key] = int(value) if isinstance(value, int) else float(value)
    if "stage_seconds" in line:
        event["stage_seconds"] = {str(k): float(v) for k, v in line["stage_seconds"].items()}
    return event


def clean_event(msg) -> dict | None:
    """A published event as the page may use it, or None if it is not a well-formed round.

    Any client or task can publish on the topic, so nothing is trusted: the run label becomes
    a string of at most ``MAX_RUN_LABEL`` characters, the metrics finite numbers (ints where
    they count), ``stage_seconds`` a small dict of names to finite seconds; everything else is
    dropped. The page escapes what it shows as well.

    >>> clean_event({"run": "<b>x</b>", "round": 2, "epoch_float": 0.5, "train_loss": 2.3,
    ...              "train_acc": 0.1, "note": "<script>"})
    {'run': '<b>x</b>', 'round': 2, 'epoch_float': 0.5, 'train_loss': 2.3, 'train_acc': 0.1}
    >>> clean_event({"run": "r", "round": "2"}) is None
    True
    """
    if not isinstance(msg, dict):
        return None
    out = {"run": str(msg.get("run"))[:MAX_RUN_LABEL]}
    for key in _SCALARS:
        if key not in msg:
            continue
        value = msg[key]
        if not _finite_number(value):
            return None
        out[key] = int(value) if key in _INTS and float(value).is_integer() else float(value)
    if not all(k in out for k in ("round", "epoch_float", "train_loss", "train_acc")):
        return None
    if ("test_acc" in out) != ("test_loss" in out) or not isinstance(out["round"], int) \
            or not isinstance(out.get("rounds", 0), int):
        return None
    stages = msg.get("stage_seconds")
    if stages is not None:
        if not isinstance(stages, dict) or len(stages) > MAX_STAGES or \
                not all(_finite_number(v) for v in stages.values()):
            return None
        out["stage_seconds"] = {str(k)[:40]: float(v) for k, v in stages.items()}
    return out


def _finite_number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and \
        math.isfinite(value)


# ---------------------------------------------------------------------------------------------
# Dask dashboard

# Loggers of the dashboard's web server. Its pages fail now and then on keys they do not expect
# (the Groups page: KeyError on our stage groups) and when a browser tab closes (Bokeh: "error
# handling message", AssertionError): errors of a web page, not of the run.
DASHBOARD_LOGGERS = ("distributed.dashboard", "bokeh", "tornado", "tornado.application")


class _FileHandlerMakingDirs(logging.FileHandler):
    """A FileHandler that creates the file (and its directory) at its first record only, and
    opens it as every file a run appends to (``files.open_append``: never through a link)."""

    def __init__(self, path: str | Path):
        super().__init__(str(path), delay=True)

    def _open(self):
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        return files.open_append(self.baseFilename, OutputError)

    def handleError(self, record) -> None:
        """A record that cannot be written is dropped: never a "Logging error" traceback on
        the terminal the file exists to keep clean."""


@contextlib.contextmanager
def dashboard_log(path: str | Path) -> Iterator[Path]:
    """For the block, the dashboard web server's own reports (:data:`DASHBOARD_LOGGERS`) go to
    the file ``path`` (made at the first one) instead of the terminal, so a browser on the
    dashboard never scrolls tracebacks into the training output. Matters where the scheduler
    runs in this process (the embedded cluster). A ``path`` that is a symbolic link is refused
    (OutputError) before anything runs: nothing a run writes leaves its directory."""
    files.refuse_link(path, OutputError)
    import distributed  # noqa: F401  its import (re)configures these loggers: ours must come after
    handler = _FileHandlerMakingDirs(path)
    handler.setFormatter(logging.Formatter("%(asctime)s - %(name)s - %(levelname)s - %(message)s"))
    saved = []
    for name in DASHBOARD_LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, logger.handlers[:], logger.propagate))
        logger.handlers = [handler]
        logger.propagate = False
    try:
        yield Path(path)
    finally:
        for logger, handlers, propagate in saved:
            logger.handlers, logger.propagate = handlers, propagate
        handler.close()


class DashboardEvents:
    """``on_round`` callback: publish each round to the scheduler (topic ``"training"`` and
    ``"all"``) and add the ``/training`` dashboard page (see :func:`add_dashboard_page`).

    ``client``: the run's client; None means the default client at the first round (the one
    ``train`` starts when given no client). ``run``: the label that groups this run's rounds
    (default: ``run-<8 hex>``); the page plots the run that published last. ``page_url`` is the
    page's link once added, else None.
    """

    def __init__(self, client=None, run: str | None = None, page: bool = True,
                 rounds: int | None = None):
        self.run = run or f"run-{uuid.uuid4().hex[:8]}"
        self.client, self.page, self.page_url, self.rounds = None, page, None, rounds
        if client is not None:
            self._attach(client)

    def start(self, info) -> None:
        """As a run-output hook (:mod:`pipeline.outputs.hooks`): the run's client and number of
        rounds, so the page is there, and says "N of M rounds done", from the first round on."""
        self.rounds = len(info.rounds)
        if self.client is None:
            self._attach(info.client)

    def _attach(self, client) -> None:
        self.client = client
        if self.page:
            self.page_url = add_dashboard_page(client)

    def __call__(self, line: dict) -> None:
        if self.client is None:
            import distributed
            self._attach(distributed.default_client())
        self.client.log_event([TOPIC, "all"], event_of(line, self.run, self.rounds))


def dashboard_events(client=None, run: str | None = None, page: bool = True) -> DashboardEvents:
    """``DashboardEvents(client, run, page)``: the ``on_round`` that shows a run on the dashboard.

    Give the client before the run starts to have the page there from the first round.
    """
    return DashboardEvents(client, run, page)


def training_events(client, run: str | None = None) -> list[dict]:
    """The rounds published on ``client``'s scheduler (oldest first), of ``run`` if given.

    The scheduler keeps the last ``distributed.admin.low-level-log-length`` events per topic.
    """
    events = [msg for _, msg in client.get_events(TOPIC)]
    return [e for e in events if run is None or e.get("run") == run]


def add_dashboard_page(client) -> str | None:
    """Add the ``/training`` page to the dashboard of ``client``'s scheduler; return its link.

    Runs :func:`install_page` on the scheduler, so the scheduler must import this module (true
    for a LocalCluster, whose scheduler runs in this process, and for a ``dask scheduler`` in an
    environment with this package). Returns None, logging why, when it cannot (no dashboard, or
    the scheduler lacks the package); the events are published either way. Idempotent.
    """
    try:
        added = client.run_on_scheduler(install_page)
        link = client.dashboard_link
    except Exception as exc:  # ModuleNotFoundError on the scheduler, no bokeh, no dashboard
        logger.info("no /%s dashboard page: %s: %s", PAGE, type(exc).__name__, exc)
        return None
    if not added:
        return None
    return link.rsplit("/", 1)[0] + "/" + PAGE  # link is <dashboard>/<prefix>/status


_INSTALLED: weakref.WeakSet = weakref.WeakSet()  # schedulers (in this process) with the page


def install_page(dask_scheduler) -> bool:
    """Add the ``/training`` Bokeh page to this scheduler's dashboard; False without one.

    Runs on the scheduler (``client.run_on_scheduler``), in its event loop: a second Bokeh
    application beside distributed's own, with the same prefix, template and theme, and an
    entry in the dashboard's "More..." menu.
    """
    from bokeh.server.server import BokehTornado
    from distributed.dashboard.core import BokehApplication
    from distributed.dashboard.scheduler import template_variables
    from tornado.ioloop import IOLoop

    if dask_scheduler in _INSTALLED:
        return True
    bokeh_validation.per_thread()  # a scheduler in the user's process: Bokeh beside theirs
    http = getattr(dask_scheduler, "http_application", None)
    apps = [a for a in getattr(http, "applications", ()) if isinstance(a, BokehTornado)]
    if not apps:
        return False
    variables = template_variables(dask_scheduler)
    app = BokehApplication({"/" + PAGE: _training_doc}, dask_scheduler, prefix=apps[0].prefix,
                           template_variables=variables)
    http.add_application(app)
    app.initialize(IOLoop.current())
    app.start()
    # The menu is a list in distributed's memoized template variables, shared by every page it
    # renders: appending links the page from all of them (best effort; only a menu entry).
    plots = variables.get("plots")
    if isinstance(plots, list) and not any(p.get("url") == PAGE for p in plots):
        plots.append({"url": PAGE, "name": "Training"})
    _INSTALLED.add(dask_scheduler)
    return True


def _training_doc(scheduler, extra, doc) -> None:
    from distributed.dashboard.components import add_periodic_callback
    from distributed.dashboard.components.scheduler import BOKEH_THEME, env

    page = TrainingPage(scheduler)
    page.update()
    add_periodic_callback(doc, page, REFRESH_MS)
    doc.title = "Dask: Training"
    doc.add_root(page.root)
    doc.template = env.get_template("simple.html")
    doc.template_variables.update(extra)
    doc.theme = BOKEH_THEME


class TrainingPage:
    """The /training page: loss and accuracy against epoch of the run that published last.

    Bokeh sources (what a browser test reads): ``train`` with columns epoch, train_loss,
    train_acc, round; ``test`` with epoch, test_loss, test_acc, round; a Div with the last line.
    ``scheduler`` needs only ``get_events(topic)`` -> ((time, msg), ...).
    """

    def __init__(self, scheduler):
        from bokeh.layouts import column, row
        from bokeh.models import ColumnDataSource, Div
        from bokeh.plotting import figure

        self.scheduler = scheduler
        self.mark = None  # the newest event read, and its time (after_mark)
        self.run: str | None = None  # the run plotted
        self.first = self.last = None  # its first and newest rows
        self.stages: dict = {}  # its seconds per stage, summed over its rows
        self.count, self.stride = 0, 1  # its rows read; a point plotted every stride rows
        self.train = ColumnDataSource(self._empty("train"))
        self.test = ColumnDataSource(self._empty("test"))
        self.div = Div(text="<b>training</b>: no rounds published yet")
        plots = []
        # Legends where the curves are not: loss falls to the right, accuracy rises.
        for name, label, corner in (("loss", "loss", "top_right"),
                                    ("acc", "accuracy", "bottom_right")):
            fig = figure(title=label, height=300, sizing_mode="stretch_width", tools="hover,reset",
                         tooltips=[("round", "@round"), ("epoch", "@epoch{0.00}"),
                                   (label, f"@{{train_{name}}}{{0.000}}")])
            fig.line("epoch", f"train_{name}", source=self.train, legend_label="train",
                     line_width=2)
            fig.scatter("epoch", f"train_{name}", source=self.train, size=4)
            fig.line("epoch", f"test_{name}", source=self.test, legend_label="test",
                     color="#d62728", line_width=2)
            fig.scatter("epoch", f"test_{name}", source=self.test, size=8, color="#d62728")
            fig.xaxis.axis_label = "epoch"
            fig.legend.location = corner
            plots.append(fig)
        self.root = column(self.div, row(*plots, sizing_mode="stretch_width"),
                           sizing_mode="stretch_width")

    @staticmethod
    def _empty(kind: str) -> dict:
        return {"epoch": [], f"{kind}_loss": [], f"{kind}_acc": [], "round": []}

    def update(self) -> None:
        """Read the events published since the last update and stream their points: O(new
        rounds) per update, never the whole run again (a 900-round run redrawn from scratch
        every 500 ms sent 900 points a series each time). A new run label starts afresh."""
        events = self.scheduler.get_events(TOPIC)
        fresh, self.mark = after_mark(events, self.mark)
        rows = [row for row in (clean_event(msg) for _, msg in _pairs(fresh)) if row]
        if not rows:
            return
        run = rows[-1]["run"]
        if run != self.run:  # read once per run: its rounds from the whole log
            rows = [r for r in (clean_event(msg) for _, msg in _pairs(events)) if r]
            self._restart(run)
        rows = [row for row in rows if row["run"] == run]
        add_stages(self.stages, rows)
        self.first, self.last = self.first or rows[0], rows[-1]
        kept = [r for i, r in enumerate(rows, self.count) if i % self.stride == 0]
        self.count += len(rows)
        train, test = split_series(kept)
        tested = [r for r in kept if "test_acc" in r]
        self.train.stream({"epoch": train["epoch"], "train_loss": train["loss"],
                           "train_acc": train["acc"], "round": [r["round"] for r in kept]})
        if tested:
            self.test.stream({"epoch": test["epoch"], "test_loss": test["loss"],
                              "test_acc": test["acc"], "round": [r["round"] for r in tested]})
        if max(len(self.train.data["round"]), len(self.test.data["round"])) > MAX_POINTS:
            self.stride *= 2  # every other point: the whole run still spanned, at half the detail
            for source in (self.train, self.test):
                source.data = {k: list(v)[::2] for k, v in source.data.items()}
        self.div.text = status_html(run, [self.first, self.last], self.stages)  # escaped

    def _restart(self, run: str) -> None:
        self.run, self.first, self.last, self.stages, self.count, self.stride = \
            run, None, None, {}, 0, 1
        self.train.data, self.test.data = self._empty("train"), self._empty("test")


def after_mark(events: Sequence, mark) -> tuple[list, object]:
    """(the events after ``mark``, oldest first; the new mark): a walk back from the newest that
    stops at the event read last (or, once the scheduler's bounded log dropped it, at one
    published before it), so an update costs what is new, not the whole log.
    ``mark``: ``(event, time)`` of the newest event read, None before the first read.

    >>> events = [(1.0, "a"), (2.0, "b")]
    >>> fresh, mark = after_mark(events, None); fresh
    [(1.0, 'a'), (2.0, 'b')]
    >>> after_mark(events + [(3.0, "c")], mark)[0], after_mark(events[1:], mark)[0]
    ([(3.0, 'c')], [])
    """
    if not events:
        return [], mark
    fresh = []
    last, when = mark if mark is not None else (None, None)
    for event in reversed(events):
        if mark is not None and (event is last or event == last or
                                 (when is not None and _time(event) < when)):
            break
        fresh.append(event)
    times = [t for t in map(_time, reversed(fresh)) if t != -math.inf]
    return fresh[::-1], (events[-1], max(times) if times else when)


def _time(event) -> float:
    """An event's publication time; -inf for anything not a (time, msg) pair."""
    ok = isinstance(event, (tuple, list)) and len(event) == 2 and _finite_number(event[0])
    return float(event[0]) if ok else -math.inf


def _pairs(events) -> list:
    """The (time, msg) pairs of an event log, skipping anything not shaped so."""
    return [e for e in events if isinstance(e, (tuple, list)) and len(e) == 2]
