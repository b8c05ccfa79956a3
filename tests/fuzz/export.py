"""A generated model as an ONNX ModelProto, with no output from the exporters."""
from __future__ import annotations

import contextlib
import io
import sys
import warnings

import torch

from .truth import Case


@contextlib.contextmanager
def _silenced():
    """No output at all, also from C++ (the TorchScript exporter prints graphs on errors)."""
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved + [null]:
            os.close(fd)


_REGISTRY_CACHED = False


def cache_torchlib_registry() -> None:
    """The dynamo exporter rebuilds its torchlib registry (over a second) on every export; the
    suite exports thousands of models with no custom ops, so build it once per opset (an export only
    reads it: the same bytes). Where torch moved it, every export builds its own as before."""
    global _REGISTRY_CACHED
    if _REGISTRY_CACHED:
        return
    _REGISTRY_CACHED = True
    try:
        from torch.onnx._internal.exporter import _registration
    except Exception:
        return
    reg = _registration.ONNXRegistry
    orig = reg.__dict__.get("from_torchlib")
    if not isinstance(orig, classmethod):
        return
    cache: dict = {}

    def from_torchlib(cls, *a, **k):
        key = (cls, a, tuple(sorted(k.items())))
        if key not in cache:
            cache[key] = orig.__func__(cls, *a, **k)
        return cache[key]

    reg.from_torchlib = classmethod(from_torchlib)


def export(case: Case):
    """The case's model as an ONNX ModelProto (static shapes), quietly."""
    import logging

    import onnx

    if case.exporter == "dynamo":
        cache_torchlib_registry()

    for name in ("torch.onnx", "torch.export", "torch._dynamo", "onnxscript"):
        logging.getLogger(name).setLevel(logging.ERROR)
    buf = io.BytesIO()
    with warnings.catch_warnings(), _silenced():
        warnings.simplefilter("ignore")
        torch.onnx.export(case.module, case.inputs, buf, opset_version=case.opset,
                          dynamo=case.exporter == "dynamo", input_names=case.input_names, verbose=False)
    return onnx.load_from_string(buf.getvalue())
