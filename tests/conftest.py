"""Shared fixtures: real architectures from `transformers` config classes, exported once per session."""
from __future__ import annotations

import contextlib
import io

import pytest

from fx_rewrite import zoo


def export_quiet(module, args, names, **kw):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return zoo.export_onnx(module, args, names, **kw)


@pytest.fixture(scope="session")
def zoo_onnx():
    """name -> (torch module, example args, ONNX ModelProto), built lazily and cached."""
    cache = {}

    def get(name: str, opset: int = 18):
        key = (name, opset)
        if key not in cache:
            module, args = zoo.MODELS[name]()
            cache[key] = (module, args, export_quiet(module, args, zoo.INPUT_NAMES[name], opset=opset))
        return cache[key]

    return get
