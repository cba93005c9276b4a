"""Feedback on long work: the ``pyro_smc`` logger and the progress bars of the engines.

Every long-running call (``SMC.run``, ``SMC.smooth``, ``EPSmoother.smooth``, ``fit_evidence``,
``OnlineVariationalFilter.run``) takes ``progress_bar``:

- ``None`` (the default): a bar in interactive use only, i.e. when standard error is a terminal,
  or in a Jupyter kernel that has ``ipywidgets`` (a text bar there would be saved into the
  notebook's output as stderr). Never under pytest or when the ``CI`` environment variable is
  set, so test logs and executed notebooks stay clean. The environment variable
  ``PYRO_SMC_PROGRESS_BAR=0`` (or ``1``) turns the default off (or on) for a whole process, e.g.
  a batch job's or a notebook executed for its saved outputs.
- ``True`` / ``False``: always / never.

A bar appears only once the call has run for half a second, so quick calls print nothing.

The library logs to the ``pyro_smc`` logger (with a ``NullHandler``, as libraries should): EP's
iterations and ``fit_evidence``'s steps at ``DEBUG``; a compiled step that falls back to Pyro's
handlers at ``INFO``. Turn it on with ``logging.basicConfig()`` and
``logging.getLogger("pyro_smc").setLevel(logging.DEBUG)``.

Example:
    >>> from pyro_smc.progress import progress, progress_enabled
    >>> progress_enabled(False), progress_enabled(True)
    (False, True)
    >>> sum(progress(range(4), desc="demo", enabled=False))
    6
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Iterable

from tqdm import tqdm as text_tqdm

__all__ = ["logger", "progress", "progress_enabled"]

logger = logging.getLogger("pyro_smc")
logger.addHandler(logging.NullHandler())

# Seconds a call runs before its bar is drawn: short calls stay silent.
DELAY = 0.5


def _in_kernel() -> bool:
    """Whether this process is a Jupyter (IPython) kernel."""
    shell = sys.modules.get("IPython")
    if shell is None:
        return False
    try:
        ip = shell.get_ipython()
    except AttributeError:
        return False
    return ip is not None and "IPKernelApp" in getattr(ip, "config", {})


def _has_widgets() -> bool:
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


def _interactive() -> bool:
    switch = os.environ.get("PYRO_SMC_PROGRESS_BAR")
    if switch in ("0", "1"):
        return switch == "1"
    if os.environ.get("CI") or os.environ.get("PYTEST_CURRENT_TEST"):
        return False
    if _in_kernel():
        return _has_widgets()
    stream = sys.stderr
    return stream is not None and hasattr(stream, "isatty") and stream.isatty()


def progress_enabled(progress_bar: bool | None) -> bool:
    """Whether a call given ``progress_bar`` draws a bar (``None``: in interactive use only).

    Raises:
        TypeError: ``progress_bar`` is not ``None``, ``True`` or ``False``.
    """
    if progress_bar is None:
        return _interactive()
    if not isinstance(progress_bar, bool):
        raise TypeError(f"progress_bar must be None (interactive use only), True or False, got {progress_bar!r}")
    return progress_bar


def progress(iterable: Iterable | None = None, *, desc: str, enabled: bool, total: int | None = None):
    """A tqdm bar over ``iterable`` (or a manual one of ``total`` steps), or a silent one.

    The notebook flavour (``tqdm.auto``) is used in a Jupyter kernel with ``ipywidgets``; the text
    bar elsewhere. Bars are left out of the final output (``leave=False``).
    """
    kind = text_tqdm
    if enabled and _in_kernel() and _has_widgets():
        from tqdm.auto import tqdm as kind
    return kind(iterable, desc=desc, total=total, disable=not enabled, leave=False, delay=DELAY, dynamic_ncols=True)
