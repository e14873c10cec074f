"""ONNX Runtime's own log, routed through ours: every session ort_offload creates logs at the
severity the ``onnxruntime`` Python logger's level asks for.

ONNX Runtime writes its log to stderr itself (its Python API takes no log callback), so its
verbosity follows ours instead: by default (WARNING) it is silent and a failure reaches the user
once, as the one-line error made from the exception ONNX Runtime raises; at INFO (``-v``) its
warnings and errors show, at DEBUG (``-vv``) its info lines too. Like :mod:`ort_offload.errors`
this module sits at the bottom (standard library only), so the graph passes use it as well.
"""

from __future__ import annotations

import logging
import re

ORT_LOGGER_NAME = "onnxruntime"
# ONNX Runtime's severities: 0 verbose, 1 info, 2 warning, 3 error, 4 fatal.
_SEVERITY_INFO, _SEVERITY_WARNING, _SEVERITY_FATAL = 1, 2, 4


def ort_log_severity() -> int:
    """The ``log_severity_level`` for a new ONNX Runtime session (or its default logger)."""
    level = logging.getLogger(ORT_LOGGER_NAME).getEffectiveLevel()
    if level <= logging.DEBUG:
        return _SEVERITY_INFO
    if level <= logging.INFO:
        return _SEVERITY_WARNING
    return _SEVERITY_FATAL


_PREFIXES = re.compile(r"^(?:\[ONNXRuntimeError\]\s*:\s*\d+\s*:\s*\w+\s*:\s*)?(?:Error in execution:\s*)?")
# "/onnxruntime_src/.../reshape_helper.h:91 onnxruntime::ReshapeHelper::ReshapeHelper(const ...&, bool) "
_SOURCE_LOCATION = re.compile(r"/onnxruntime_src/\S+:\d+ [\w:~<>, ]+\([^()]*\)(?: const)? ")


def ort_error_summary(error: BaseException) -> str:
    """The first line of an ONNX Runtime exception without its status prefix and C++ source
    locations: what went wrong, short enough for a one-line error."""
    text = str(error).strip()
    first = text.splitlines()[0] if text else type(error).__name__
    return _SOURCE_LOCATION.sub("", _PREFIXES.sub("", first)).strip() or first
