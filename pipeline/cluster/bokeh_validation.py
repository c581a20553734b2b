"""Bokeh's property-validation switch made per thread, so that two threads of one process that
run Bokeh (two schedulers' dashboards, or a dashboard and the user's own plots) cannot break
each other's pages.

Bokeh keeps the switch in one class attribute, ``Property._should_validate``, for the whole
process; ``validate(False)`` saves it, sets it and puts the saved value back on exit, and
distributed wraps every dashboard update in it (``without_property_validation``). Bokeh turns a
``str`` given where a model is expected into the model (``figure(title="...")`` -> a ``Title``)
only while validation is on (``Property.prepare_value`` of the Bokeh 3.9 we install). So:

- while one thread's update runs, a figure built on another thread keeps its title as a
  ``str``; on the dashboard's /status page that is ``ClusterMemory``, whose ``update`` then
  fails with "'str' object has no attribute 'text'", and the page is an HTTP 500;
- two updates on two threads that overlap (A saves True, B saves False, A restores True, B
  restores False) leave validation off for the rest of the process: every later /status fails.

Two event loops in one process are enough: our embedded cluster's scheduler beside a user's own
``LocalCluster``, or the tests' in-process cluster. Bokeh's sources keep the switch global up to
their newest, so no version pin helps. :func:`per_thread` makes ``validate`` and ``validation_on`` read and
write a thread-local value instead; a thread that never set one follows the class attribute, as
Bokeh's own default does.
"""
from __future__ import annotations

import threading

_LOCAL = threading.local()


def per_thread() -> bool:
    """Install the per-thread switch in this process (idempotent); False without Bokeh.

    Called where a scheduler's dashboard starts in this process (the embedded cluster) and where
    our /training page is added to a scheduler.
    """
    try:
        from bokeh.core.property import bases, validation
    except ImportError:  # no dashboard without Bokeh: nothing to guard
        return False
    if getattr(validation.validate, "per_thread", False):
        return True

    def validation_on() -> bool:
        value = getattr(_LOCAL, "value", None)
        return bases.Property._should_validate if value is None else value

    validation_on.__doc__ = bases.validation_on.__doc__
    validate.__doc__ = validation.validate.__doc__
    # Both are looked up as module globals when called (``prepare_value``, the wrapper of
    # ``without_property_validation``), so the functions distributed decorated use these too.
    bases.validation_on = validation_on
    validation.validate = validate
    return True


class validate:  # noqa: N801  Bokeh's name, as ``with validate(False):`` spells it
    """Bokeh's ``validate(value)`` for the calling thread only: set on creation, the thread's
    previous value back on exit (None: the thread follows the process-wide default again)."""

    per_thread = True

    def __init__(self, value: bool) -> None:
        self.old = getattr(_LOCAL, "value", None)
        _LOCAL.value = bool(value)

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc) -> None:
        _LOCAL.value = self.old
