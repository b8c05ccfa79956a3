"""Running an ONNX model for verification and measurement: onnxruntime sessions built once, quiet
(failures raise; its logs would only repeat them), and onnx's reference evaluator with the ops it
lacks (onnxruntime's RMSNorm ops, tf2onnx's Erfc) where onnxruntime refuses a model."""
from __future__ import annotations

import functools
import math
import os
import re
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional, Union

import numpy as np
import onnx
import onnxruntime as ort
from onnx.external_data_helper import load_external_data_for_model, uses_external_data

ModelLike = Union[onnx.ModelProto, str, os.PathLike]

QUIET = ort.RunOptions()
QUIET.log_severity_level = 4


class Source:
    """A model as given, a ModelProto or a path, read at most once: its graph without external
    weights (`skeleton`) first, the weights (`proto`) only if something needs them. `parsed`: the
    caller's copy of the file, never written here."""

    def __init__(self, model: ModelLike, parsed: Optional[onnx.ModelProto] = None) -> None:
        self.path = None if isinstance(model, onnx.ModelProto) else str(model)
        self._proto = model if isinstance(model, onnx.ModelProto) else None
        self._skeleton: Optional[onnx.ModelProto] = parsed
        self._borrowed = parsed is not None

    @staticmethod
    def of(model: Union[ModelLike, "Source"]) -> "Source":
        return model if isinstance(model, Source) else Source(model)

    @property
    def skeleton(self) -> onnx.ModelProto:
        if self._proto is not None:
            return self._proto
        if self._skeleton is None:
            self._skeleton = onnx.load(self.path, load_external_data=False)
        return self._skeleton

    @property
    def proto(self) -> onnx.ModelProto:
        if self._proto is None:
            if self._borrowed and any(uses_external_data(t) for t in self.skeleton.graph.initializer):
                self._proto = onnx.load(self.path)  # the caller's copy is not ours to load weights into
            else:  # the skeleton, its external weights read in
                load_external_data_for_model(self.skeleton, os.path.dirname(os.path.abspath(self.path)))
                self._proto = self.skeleton
        return self._proto


def in_background(name: str, fn: Callable, *args, **kwargs) -> Future:
    """`fn(*args, **kwargs)` in a thread of its own (onnxruntime and numpy release the GIL)."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"lnfold-{name}")
    future = pool.submit(fn, *args, **kwargs)
    pool.shutdown(wait=False)
    return future


_PROVIDERS = ["CPUExecutionProvider"]


def session(model: Union[ModelLike, Source], outputs=()) -> ort.InferenceSession:
    """An onnxruntime session of `model`; `outputs`: tensors it also outputs (those it does not
    output already)."""
    so = ort.SessionOptions()
    so.log_severity_level = 4  # failures raise; ERROR logs would only repeat them on stderr
    # a run or two per session: threads spinning between ops would only take the CPU from the
    # fold's other work, which the original's runs overlap
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    model = Source.of(model)
    if model.path is not None and not outputs:
        return ort.InferenceSession(model.path, so, providers=_PROVIDERS)
    return _from_file(model.proto, outputs, so)


def _from_file(model: onnx.ModelProto, outputs, so: ort.SessionOptions) -> ort.InferenceSession:
    """`model`'s session (with `outputs`), read from a temporary file: bytes handed to onnxruntime
    would be copied into a C++ string, parsed beside it and kept for the session's life. Errors say
    what they would of the bytes; where no temporary file can be written, the bytes all the same."""
    try:
        with tempfile.TemporaryDirectory(prefix="lnfold-") as folder:
            path = os.path.join(folder, "model.onnx")
            with open(path, "wb") as f:
                f.write(model.SerializeToString())
                f.write(_more_outputs(model, outputs))
            try:
                return ort.InferenceSession(path, so, providers=_PROVIDERS)
            except Exception as e:
                said = f"Load model from {path} failed:"
                if said not in str(e):
                    raise
                raise type(e)(str(e).replace(said, "")) from None
    except OSError:  # (no temporary file: onnxruntime's errors are not OSErrors)
        sess = ort.InferenceSession(model.SerializeToString() + _more_outputs(model, outputs), so,
                                    providers=_PROVIDERS)
        sess._model_bytes = None  # (read only to re-create the session, which nothing here does)
        return sess


def _more_outputs(model: onnx.ModelProto, names) -> bytes:
    """A serialized ModelProto holding only `names` as graph outputs (those `model` lacks): appended
    to `model`'s bytes, protobuf's parser merges it in, with no second copy of the weights."""
    have = {o.name for o in model.graph.output}
    extra = [onnx.ValueInfoProto(name=n) for n in dict.fromkeys(names) if n not in have]
    return onnx.ModelProto(graph=onnx.GraphProto(output=extra)).SerializeToString() if extra else b""


def with_outputs(model: onnx.ModelProto, names) -> onnx.ModelProto:
    """A copy of `model` that also outputs the tensors `names` (those it does not output already)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    m.MergeFromString(_more_outputs(model, names))
    return m


def subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The graphs a node holds (If's branches, Loop's and Scan's bodies)."""
    return [g for a in node.attribute
            for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else
                      list(a.graphs) if a.type == onnx.AttributeProto.GRAPHS else [])]


def graph_reads(graph: onnx.GraphProto) -> set[str]:
    """Every name a (sub)graph's nodes read, its own subgraphs' included (what a subgraph reads from
    outside is not its node's inputs)."""
    out = set()
    for n in graph.node:
        out.update(n.input)
        for sub in subgraphs(n):
            out |= graph_reads(sub)
    return out


def pruned(model: onnx.ModelProto, names) -> onnx.ModelProto:
    """A model that computes the tensors `names` (its only outputs) and nothing else: the nodes they
    need and the constants those read (a node's subgraphs' outer reads too). onnxruntime runs every
    node of a graph, wanted or not: capturing an LM's stream tensors need not run its head."""
    graph = model.graph
    need, keep = set(names), []
    for node in reversed(graph.node):
        if any(o in need for o in node.output):
            keep.append(node)
            need.update(i for i in node.input if i)
            for sub in subgraphs(node):
                need |= graph_reads(sub)
    out = onnx.ModelProto(ir_version=model.ir_version, opset_import=model.opset_import, functions=model.functions)
    out.graph.name = graph.name
    out.graph.input.extend(graph.input)  # (every input: the feeds are the model's)
    out.graph.node.extend(reversed(keep))
    out.graph.initializer.extend(t for t in graph.initializer if t.name in need)
    out.graph.sparse_initializer.extend(t for t in graph.sparse_initializer if t.values.name in need)
    out.graph.value_info.extend(v for v in graph.value_info if v.name in need)
    out.graph.output.extend(onnx.ValueInfoProto(name=n) for n in dict.fromkeys(names))
    return out


def proto_of(model: Union[ModelLike, Source]) -> onnx.ModelProto:
    return Source.of(model).proto


def skeleton_of(model: Union[ModelLike, Source]) -> onnx.ModelProto:
    return Source.of(model).skeleton


# --- runners -------------------------------------------------------------------------------------

class Runner:
    """Runs one model: in onnxruntime, or with onnx's reference evaluator where onnxruntime
    refuses to load it. `outputs`: tensors it also outputs (`session`)."""

    def __init__(self, model: ModelLike, *, allow_reference: bool = False, outputs=()) -> None:
        self.load_error, self.refusal = None, None
        try:
            self.sess = session(model, outputs)
            self.names = [o.name for o in self.sess.get_outputs()]
        except Exception as e:
            if not allow_reference:
                raise
            self.sess, self.load_error, self.refusal = None, first_line(e), refusal_kind(e)
            proto = proto_of(model)
            self.ref = reference(with_outputs(proto, outputs) if outputs else proto)
            self.names = list(self.ref.output_names)

    def run(self, feeds: dict) -> list[np.ndarray]:
        if self.sess is not None:
            return self.sess.run(None, feeds, QUIET)
        return [np.asarray(x) for x in self.ref.run(None, feeds)]

    def release(self) -> None:
        """Drop the onnxruntime session and its copy of the weights; `sess` then tells it ran there."""
        if self.sess is not None:
            self.sess = RELEASED


class _Released:
    def run(self, *args, **kwargs):
        raise RuntimeError("this model's onnxruntime session was released after its runs")


RELEASED = _Released()


def reference(model: onnx.ModelProto):
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(_named_outputs(model), new_ops=contrib_ops())


def _named_outputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model`, or a copy whose unnamed outputs before a named one get names: onnx's evaluator stores
    every output under its name, so an unnamed one (SkipSimplifiedLayerNormalization's mean) became
    the value of '', which every absent optional input of a later node then read."""
    def gapped(n: onnx.NodeProto) -> bool:
        return any(not o for o in n.output[:-1])

    if not any(map(gapped, model.graph.node)):
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for k, n in enumerate(copy.graph.node):
        if gapped(n):
            for i, o in enumerate(n.output):
                n.output[i] = o or f"lnfold_unread_{k}_{i}"
    return copy


def contrib_ops() -> list:
    """Ops onnx's reference evaluator lacks (onnxruntime's RMSNorm ops and GroupQueryAttention,
    tf2onnx's Erfc), or rounds to float32 (Erf, Gelu: a float32 error in every GELU of a float64 copy)."""
    from onnx.reference.op_run import OpRun

    def root_mean_square(x, axis, eps):
        """√(mean(x²) + ε) over the axes from `axis` on, in float64."""
        axes = tuple(range(axis % x.ndim, x.ndim))
        return np.sqrt(np.mean(np.square(x.astype(np.float64)), axis=axes, keepdims=True) + eps)

    def rms(x, gamma, root):
        return (x / root * gamma).astype(x.dtype)

    class SimplifiedLayerNormalization(OpRun):
        op_domain = ""

        def _run(self, x, gamma, axis=-1, epsilon=1e-5, stash_type=1):
            return (rms(x, gamma, root_mean_square(x, axis, epsilon)),)

    class SkipSimplifiedLayerNormalization(OpRun):
        op_domain = "com.microsoft"

        def _run(self, x, skip, gamma, bias=None, epsilon=1e-5):
            s = x + skip + (bias if bias is not None else 0)
            # every output (onnx's evaluator refuses a None, even for an unnamed output): mean 0, 1/rms
            root = root_mean_square(s, -1, epsilon)
            zero_mean, inv_rms = np.zeros(root.shape, np.float32), (1 / root).astype(np.float32)
            return (rms(s, gamma, root), zero_mean, inv_rms, s)

    class Erfc(OpRun):
        """tf2onnx's GELU, 0.5 x erfc(-x/√2): computed as erfc, exact where 1 - erf(x) would cancel."""
        op_domain = ""

        def _run(self, x):
            return (_erf_pair()[1](x).astype(x.dtype),)

    class Erf(OpRun):
        op_domain = ""

        def _run(self, x):
            return (_erf_pair()[0](x).astype(x.dtype),)

    class Gelu(OpRun):
        """Opset 20's Gelu: onnx would run its function body, whose Erf is onnx's float32 one."""
        op_domain = ""

        def _run(self, x, approximate="none"):
            if approximate == "tanh":
                return ((0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))).astype(x.dtype),)
            return ((0.5 * x * (1 + _erf_pair()[0](x / np.sqrt(2)))).astype(x.dtype),)

    from .contrib_attention import ops as attention_ops  # GroupQueryAttention (onnxruntime-genai's builder)

    return [SimplifiedLayerNormalization, SkipSimplifiedLayerNormalization, Erfc, Erf, Gelu] + attention_ops()


def _elementwise(f):
    return lambda x: np.fromiter(map(f, np.asarray(x, np.float64).ravel().tolist()), np.float64,
                                 np.size(x)).reshape(np.shape(x))


@functools.cache
def _erf_pair():
    """(erf, erfc) over arrays: scipy's Cephes where scipy is installed (not a dependency), within 3
    ulp of libm's (a ViT-B's float64 copy spent 1.3 s in 12 GELUs' Erf element by element), else
    libm's element by element. Imported at the first Erf: scipy.special costs every command 0.3 s."""
    try:
        from scipy.special import erf, erfc
    except ImportError:
        return _elementwise(math.erf), _elementwise(math.erfc)
    return erf, erfc


def first_line(e: BaseException) -> str:
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


def refusal_kind(e: BaseException) -> str:
    """The kind of onnxruntime's reason for refusing to load a model, without the file and the node
    and tensor names it stopped at (a fold that moves nodes makes it stop at another of the same)."""
    text = re.sub(r"^(\[ONNXRuntimeError\] : \d+ : \w+ : )?Load model (from .*? )?failed:\s*", "",
                  " ".join(str(e).split()))
    return re.sub(r"\b(arg|node|Node) \([^()]*\)", r"\1 (…)", text)
