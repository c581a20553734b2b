"""Where a run published on the dashboard stands, in words for the ``/training`` page: rounds done
of how many (counted as every message counts them), time so far, ETA, seconds per stage."""
from __future__ import annotations

import html
from collections.abc import Sequence

from pipeline.outputs.live import format_line


def duration(seconds: float) -> str:
    """Seconds as a short human duration.

    >>> duration(42.4), duration(185), duration(7384)
    ('42 s', '3 min 05 s', '2 h 03 min')
    """
    seconds = int(round(max(0.0, seconds)))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds // 60 % 60:02d} min"


def progress_of(rows: Sequence[dict], stages: dict | None = None) -> dict:
    """Where a run stands from its published rounds (oldest first): rounds done, of how many,
    seconds so far, the estimated seconds left, and the seconds per stage summed over the rounds
    (``stages``, when the caller summed them already: then only the first and last row count).

    The estimate is the mean time per round between the first and the last row given (or, with one
    row, since the run started) times the rounds left. Rounds count from 0, so "done" is the last
    round + 1.

    >>> p = progress_of([{"round": 0, "rounds": 4, "seconds": 3.0, "stage_seconds": {"train": 2}},
    ...                  {"round": 1, "rounds": 4, "seconds": 5.0, "stage_seconds": {"train": 1}}])
    >>> p["done"], p["rounds"], p["eta"], p["stages"]
    (2, 4, 4.0, {'train': 3.0})
    """
    last = rows[-1]
    done, total = int(last["round"]) + 1, last.get("rounds")
    first = rows[0]
    if len(rows) > 1 and last["round"] > first["round"]:
        per_round = ((last.get("seconds", 0.0) - first.get("seconds", 0.0))  # optional fields
                     / (last["round"] - first["round"]))
    else:
        per_round = last.get("seconds", 0.0) / done
    eta = per_round * (total - done) if total is not None else None
    if stages is None:
        stages = add_stages({}, rows)
    return {"done": done, "rounds": total, "seconds": last.get("seconds", 0.0), "eta": eta,
            "stages": stages}


def add_stages(stages: dict, rows: Sequence[dict]) -> dict:
    """``stages`` ({stage: seconds}) with the rows' ``stage_seconds`` added, in place.

    >>> add_stages({"train": 1.0}, [{"stage_seconds": {"train": 2, "augment": 0.5}}, {}])
    {'train': 3.0, 'augment': 0.5}
    """
    for row in rows:
        for stage, seconds in (row.get("stage_seconds") or {}).items():
            stages[stage] = stages.get(stage, 0.0) + float(seconds)
    return stages


def status_html(run: str, rows: Sequence[dict], stages: dict | None = None) -> str:
    """The /training page's heading: run name, "N of M rounds done", time so far and ETA, the
    latest line (its "round R" counts from 0, as metrics.jsonl, the progress bar and every
    message do: after round 1, 2 rounds are done), and a table of seconds per stage (every value
    escaped: events come from any client). ``stages``: as :func:`progress_of`.

    >>> text = status_html("ipm-1", [{"round": 1, "rounds": 4, "epoch_float": 0.5,
    ...                               "train_loss": 2.0, "train_acc": 0.3, "seconds": 10.0}])
    >>> "<b>ipm-1</b>: 2 of 4 rounds done" in text, "ETA 10 s" in text, "round 1 epoch" in text
    (True, True, True)
    >>> rows = [{"round": 0, "epoch_float": .25, "train_loss": 2, "train_acc": .1, "workers": 1},
    ...         {"round": 1, "epoch_float": .5, "train_loss": 2, "train_acc": .1, "workers": 3}]
    >>> status_html("r", rows).split("<br>")[0]
    '<b>r</b>: 2 rounds done (0 s so far; round 1 on 3 workers, 2 joined)'
    """
    p = progress_of(rows, stages)
    of = f" of {p['rounds']}" if p["rounds"] is not None else ""
    eta = (f", ETA {duration(p['eta'])}" if p["eta"] is not None and p["done"] < (p["rounds"] or 0)
           else "")
    plural = "s" if p["rounds"] is not None or p["done"] != 1 else ""
    head = (f"<b>{html.escape(str(run))}</b>: {p['done']}{of} round{plural} done "
            f"({duration(p['seconds'])} so far{eta}{workers_note(rows)})")
    total = sum(p["stages"].values()) or 1.0
    cells = "".join(f"<td style='padding:0 8px'>{html.escape(str(stage))}<br>{sec:.1f} s "
                    f"({100 * sec / total:.0f}%)</td>"
                    for stage, sec in sorted(p["stages"].items(), key=lambda kv: -kv[1]))
    table = f"<table><tr><td>time per stage:</td>{cells}</tr></table>" if cells else ""
    return f"{head}<br>{html.escape(format_line(rows[-1]))}{table}"


def workers_note(rows: Sequence[dict]) -> str:
    """``; round R on N workers`` and the change from the round before (``, 2 joined``,
    ``, 1 left``), for rows that record their workers (an elastic run's); else ``""``.

    >>> workers_note([{"round": 4, "workers": 3}, {"round": 5, "workers": 2}])
    '; round 5 on 2 workers, 1 left'
    >>> workers_note([{"round": 0}])
    ''
    """
    last = rows[-1]
    if not isinstance(last.get("workers"), int):
        return ""
    n, before = last["workers"], rows[-2].get("workers") if len(rows) > 1 else None
    change = "" if not isinstance(before, int) or before == n else \
        f", {abs(n - before)} {'joined' if n > before else 'left'}"
    return f"; round {last['round']} on {n} worker{'s' if n != 1 else ''}{change}"
