"""Numerical verification: run original and folded model in onnxruntime on the same random inputs."""
from __future__ import annotations

import os
import re
from typing import Union

import numpy as np
import onnx
import onnxruntime as ort

from ..passes import LnfoldError, VerificationError
from ..passes.weights import max_rel_err

ModelLike = Union[onnx.ModelProto, str, os.PathLike]

# Made-up sizes for dynamic dims: batch-like names get 2, everything else 7.
_BATCH_NAMES = ("batch", "n", "b")
_DEFAULT_DIM = 7
_INDEX_PASSTHROUGH = {"Cast", "Unsqueeze", "Squeeze", "Reshape", "Flatten", "Identity", "Expand"}

# Worst relative output difference accepted, by the narrowest float type among the outputs.
TOLERANCE = {"tensor(float)": 1e-4, "tensor(double)": 1e-9, "tensor(float16)": 2e-2, "tensor(bfloat16)": 1e-1}

_NP = {
    "tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_,
    "tensor(uint8)": np.uint8, "tensor(int8)": np.int8,
}


_QUIET = ort.RunOptions()
_QUIET.log_severity_level = 4


def session(model: ModelLike) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 4  # failures raise; ERROR logs would only repeat them on stderr
    src = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])


def index_bounds(model: onnx.ModelProto) -> dict[str, int]:
    """For integer inputs used as Gather indices of constant tables: the smallest table size."""
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in model.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    sizes = {t.name: list(t.dims) for t in model.graph.initializer}
    bounds: dict[str, int] = {}
    for inp in model.graph.input:
        frontier, seen, best = [inp.name], set(), None
        while frontier:
            name = frontier.pop()
            if name in seen:
                continue
            seen.add(name)
            for n in consumers.get(name, []):
                if n.op_type == "Gather" and len(n.input) > 1 and n.input[1] == name and n.input[0] in sizes:
                    axis = next((a.i for a in n.attribute if a.name == "axis"), 0)
                    dim = sizes[n.input[0]][axis]
                    best = dim if best is None else min(best, dim)
                elif n.op_type in _INDEX_PASSTHROUGH and n.input[0] == name:
                    frontier.extend(n.output)
        if best is not None:
            bounds[inp.name] = best
    return bounds


def random_inputs(sess: ort.InferenceSession, bounds: dict[str, int], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for i in sess.get_inputs():
        shape = [
            d if isinstance(d, int) and d >= 0
            else 2 if isinstance(d, str) and d.lower().startswith(_BATCH_NAMES) else _DEFAULT_DIM
            for d in i.shape
        ]
        dt = _NP.get(i.type)
        if dt is None:
            raise ValueError(f"input {i.name!r} has type {i.type}, which verification cannot make up")
        if np.issubdtype(dt, np.floating):
            feeds[i.name] = rng.standard_normal(shape).astype(dt)
        elif dt is np.bool_:
            feeds[i.name] = rng.random(shape) < 0.8
        else:
            feeds[i.name] = rng.integers(0, bounds.get(i.name, 2), size=shape).astype(dt)
    return feeds


def compare(original: ModelLike, folded: ModelLike, *, seed: int = 0, bounds: dict[str, int] | None = None) -> tuple[float, float]:
    """(worst relative difference over all outputs, the tolerance for the outputs' dtypes).

    Raises LnfoldError when onnxruntime cannot run the original model on made-up inputs (there
    is nothing to compare against) and VerificationError when only the folded model fails.
    """
    try:
        a = session(original)
        if bounds is None:
            bounds = index_bounds(original if isinstance(original, onnx.ModelProto) else onnx.load(str(original), load_external_data=False))
        feeds = random_inputs(a, bounds, seed)
        ra = a.run(None, feeds, _QUIET)
    except Exception as e:
        raise LnfoldError(f"cannot verify: onnxruntime cannot run the input model on made-up inputs "
                          f"({_first_line(e)}); use --no-verify (API: verify_outputs=False) to skip it") from None
    try:
        b = session(folded)
        rb = b.run(None, feeds, _QUIET)
    except Exception as e:
        raise VerificationError(f"verification failed: onnxruntime cannot run the folded model ({_first_line(e)})") from None
    tol = min(TOLERANCE.get(o.type, 1e-4) for o in a.get_outputs())
    if len(ra) != len(rb):
        return float("inf"), tol
    return max((max_rel_err(x, y) for x, y in zip(ra, rb)), default=0.0), tol


def _first_line(e: BaseException) -> str:
    """onnxruntime's message on one line, without its source locations and C++ signatures."""
    text = " ".join(str(e).split()) or type(e).__name__
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", text)
    m = re.search(r"/?onnxruntime_src/\S+:\d+ ", text)
    if m:  # "/onnxruntime_src/x.h:46 void ns::f(args...) message": drop the location and signature
        rest, depth, cut = text[m.end():], 0, 0
        for k, ch in enumerate(rest):
            depth += ch == "("
            if ch == ")":
                depth -= 1
                if depth == 0:
                    cut = k + 1
                    break
        text = text[:m.start()] + " " + rest[cut:].strip()
    if len(text) > 240:
        sentences = [x for x in re.split(r"(?<=\.) ", text) if x]
        first, last = sentences[0], sentences[-1]
        text = f"{first} ... {last}" if len(sentences) > 1 and len(first) + len(last) < 300 else text[:240] + "..."
    return text
