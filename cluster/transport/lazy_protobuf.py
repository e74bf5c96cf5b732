"""Deferring protobuf's pure-Python message implementation
(`google.protobuf.internal.python_message`); `cluster/__init__.py` calls
`defer_pure_python_messages` before anything imports protobuf. protobuf's descriptor pool and
builder import that module whatever the backend, and with it `text_format`, the pure-Python
decoders and containers, `pickle` and more: about a sixth of what a worker process pays to start
(issue 26), for code that the upb backend (the default) never runs. The module is registered with
the standard library's `importlib.util.LazyLoader`, so it is executed on its first attribute
access: at once with the `python` backend, which uses it, never with upb."""

from __future__ import annotations

import importlib.util
import sys

PURE_PYTHON_MESSAGES = "google.protobuf.internal.python_message"


def defer_pure_python_messages() -> bool:
    """Register the pure-Python message module to load on first use; True when it was deferred,
    False when it is already imported or protobuf is not installed."""
    if PURE_PYTHON_MESSAGES in sys.modules:
        return False
    try:
        spec = importlib.util.find_spec(PURE_PYTHON_MESSAGES)
    except ModuleNotFoundError:
        return False
    if spec is None or spec.loader is None:
        return False
    loader = importlib.util.LazyLoader(spec.loader)
    spec.loader = loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[PURE_PYTHON_MESSAGES] = module
    loader.exec_module(module)
    package, _, name = PURE_PYTHON_MESSAGES.rpartition(".")
    setattr(sys.modules[package], name, module)
    return True
