"""What a notebook shows for the value of `train(...)` and `predict(...)`: one summary line, never
every weight or probability."""
from __future__ import annotations

import numpy as np

from pipeline import Config
from pipeline.training.loop import TrainOutput
from pipeline.training.predict import Prediction


class _Link:
    def __repr__(self):  # a Link's repr is as long as its layers
        return "Link(" + "layer, " * 1000 + ")"


def test_train_output_is_one_summary_line():
    params = {"conv1/W": np.ones((64, 3, 3, 3), np.float32), "bn1/N": np.array(3),
              "fc/b": np.zeros(10, np.float32)}
    history = [{"round": r, "train_acc": 0.1 * r, "seconds": r} for r in range(5)]
    history[2]["test_acc"] = 0.4321
    out = TrainOutput(history, _Link(), params, "runs/ipm", Config())
    assert repr(out) == ("TrainOutput(status='done', rounds=5, train_acc=0.400, test_acc=0.432, "
                         "out='runs/ipm', parameters=1,739)")
    assert repr(out._replace(history=[], out=None, status="complete")) == (
        "TrainOutput(status='complete', rounds=0, out=None, parameters=1,739)")
    assert out.params is params and out[0] is history  # still the tuple it was


def test_prediction_is_one_summary_line():
    p = Prediction(np.full((500, 10), 0.1, np.float32), [f"c{i}" for i in range(10)],
                   [f"img{i}.png" for i in range(500)])
    assert repr(p) == "Prediction(500 images x 10 classes)"
    assert p.top(1)[0][0][0] == "c0"  # still the value it was
