"""Warnings raised inside an operation on a proxied device, shown where a run without the proxy
shows them: a C++ warning lands on the innermost Python frame, which is the torch-function
mode's (mode.py), and a Python warning's stack level counts the mode's frames too."""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

_PACKAGE = __name__.rsplit(".", 1)[0]
_DIRECTORY = os.path.dirname(os.path.abspath(__file__))


def _program_frame(frame: Any) -> Any:
    """The frame that a warning attributed to `frame` (of this package) lands on without the mode:
    the first outside this package, and past torch's hand-over of a Python torch function to the
    mode (`handle_torch_function` and the function that called it, which runs again inside)."""
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_PACKAGE):
        frame = frame.f_back
    if frame is not None and frame.f_globals.get("__name__") == "torch.overrides":
        frame = frame.f_back
        frame = frame.f_back if frame is not None else None
    return frame


def locate_warnings() -> None:
    """Show a warning raised inside an operation where a run without the proxy shows it, not in
    this package. Warnings shown and recorded pass through `warnings._showwarnmsg` (which the
    interpreter's C side looks up on each warning)."""
    show = getattr(warnings, "_showwarnmsg", None)
    if show is None:
        return

    def show_located(message: warnings.WarningMessage) -> None:
        if message.filename.startswith(_DIRECTORY):
            frame: Any = sys._getframe(1)
            where = (message.filename, message.lineno)
            while frame is not None and (frame.f_code.co_filename, frame.f_lineno) != where:
                frame = frame.f_back
            frame = _program_frame(frame)
            if frame is not None:
                message.filename, message.lineno, message.line = (
                    frame.f_code.co_filename,
                    frame.f_lineno,
                    None,
                )
        show(message)

    warnings._showwarnmsg = show_located  # type: ignore[attr-defined]
