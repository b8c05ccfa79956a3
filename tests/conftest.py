"""Shared fixtures: real architectures from `transformers` config classes, exported once per session."""
from __future__ import annotations

import contextlib
import io
import sys

import pytest

from lnfold import zoo


def export_quiet(module, args, names, **kw):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return zoo.export_onnx(module, args, names, **kw)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from a clean Dynamo: after a recompile of one code object (a transformers
    forward), Dynamo marks its sizes dynamic for every later compile, so a test's outcome would
    depend on which tests ran before it."""
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()
    yield


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


def missing_one_centering(make_plan, index=None):
    """`make_plan` with a planted bug: one centering edit (the middle one, or `index`) is dropped
    from every plan, so the tests can prove that verification catches a skipped centering."""
    from dataclasses import replace

    from lnfold.passes.plan import Center

    def sabotaged(view, mode="rms", **kw):
        plan = make_plan(view, mode, **kw)
        centers = [e for e in plan.const_edits if isinstance(e.ops[-1], Center)]
        dropped = centers[len(centers) // 2 if index is None else index]
        return replace(plan, const_edits=[e for e in plan.const_edits if e is not dropped])

    return sabotaged
