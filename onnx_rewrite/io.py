"""Loading and saving ONNX models: clear errors for bad files, atomic writes, external data."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import onnx
from google.protobuf.message import DecodeError

from passes import LnfoldError

# Protobuf cannot serialize a message over 2 GiB: such models keep their weights beside them.
_PROTO_LIMIT = 2**31 - 2**20
MIN_OPSET = 9


def default_opset(model: onnx.ModelProto) -> int:
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return int(o.version)
    raise LnfoldError("the model imports no standard ONNX opset")


def check_opset(model: onnx.ModelProto) -> int:
    opset = default_opset(model)
    newest = onnx.defs.onnx_opset_version()
    if not MIN_OPSET <= opset <= newest:
        raise LnfoldError(f"unsupported opset {opset} (lnfold supports opsets {MIN_OPSET} to {newest})")
    return opset


def load(path: str | os.PathLike, *, data_files: set | None = None) -> onnx.ModelProto:
    """Read an ONNX model (and its external data), or raise LnfoldError saying what is wrong.

    `data_files`, when given, receives the resolved paths of the external-data files read.
    """
    p = Path(path)
    if not p.exists():
        raise LnfoldError(f"{p}: no such file")
    if p.is_dir():
        raise LnfoldError(f"{p}: is a directory, not an ONNX file")
    if not p.is_file():
        raise LnfoldError(f"{p}: not a regular file")
    if not os.access(p, os.R_OK):
        raise LnfoldError(f"{p}: permission denied")
    if p.stat().st_size == 0:
        raise LnfoldError(f"{p}: empty file, not an ONNX model")
    try:
        model = onnx.load(str(p), load_external_data=False)
    except PermissionError:
        raise LnfoldError(f"{p}: permission denied") from None
    except (DecodeError, ValueError, RuntimeError, OSError) as e:
        raise LnfoldError(f"{p}: not a readable ONNX model (truncated or corrupt?): {_first_line(e)}") from None
    if not model.graph.node or not model.opset_import:
        raise LnfoldError(f"{p}: not an ONNX model (no graph or no opset)")
    if data_files is not None:
        data_files |= external_files(p, model)
    try:
        onnx.external_data_helper.load_external_data_for_model(model, str(p.parent))
    except (OSError, ValueError, onnx.checker.ValidationError) as e:
        # onnx raises ValidationError for a missing data file or a location outside the folder
        raise LnfoldError(f"{p}: cannot read its external data: {_first_line(e)}") from None
    return model


def external_files(path: str | os.PathLike, model: onnx.ModelProto) -> set[Path]:
    """The external-data files that `model`, read from `path` without its data, refers to."""
    p = Path(path)
    files = set()
    for t in list(model.graph.initializer) + [s.values for s in model.graph.sparse_initializer]:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            loc = next((e.value for e in t.external_data if e.key == "location"), None)
            if loc:
                files.add((p.parent / loc).resolve())
    return files


# Bytes per element of the types whose raw data can be checked against their dims.
_ITEM_BYTES = {1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 9: 1, 10: 2, 11: 8, 12: 4, 13: 8, 16: 2,
               17: 1, 18: 1, 19: 1, 20: 1, 24: 1}


def check_tensors(model: onnx.ModelProto) -> None:
    """Every initializer holds as many elements as its dims say (a truncated weight file or a
    corrupt proto otherwise fails much later, deep inside numpy)."""
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            continue  # not loaded (load_external_data=False): checked where it is read
        n = 1
        for d in t.dims:
            if d < 0:
                raise LnfoldError(f"initializer `{t.name}` has a negative dimension {list(t.dims)}")
            n *= d
        if t.HasField("raw_data"):
            size = _ITEM_BYTES.get(t.data_type)
            if size is not None and len(t.raw_data) != n * size:
                raise LnfoldError(f"initializer `{t.name}` holds {len(t.raw_data)} bytes, but its shape "
                                  f"{list(t.dims)} needs {n * size} (truncated or corrupt weights)")
        elif t.data_type in _ITEM_BYTES:
            have = len(t.float_data) + len(t.int32_data) + len(t.int64_data) + len(t.double_data) + len(t.uint64_data)
            if have != n:
                raise LnfoldError(f"initializer `{t.name}` holds {have} values, but its shape {list(t.dims)} "
                                  f"needs {n} (truncated or corrupt weights)")


def check_graph(model: onnx.ModelProto) -> None:
    """The main graph is a DAG whose every input is provided, or raise LnfoldError naming why.

    Checked up front because a cycle or a dangling input otherwise surfaces as an unrelated
    failure (unknown shapes, a toposort error, onnxruntime refusing the folded model).
    """
    g = model.graph
    provided = {i.name for i in g.input} | {t.name for t in g.initializer}
    provided |= {t.values.name for t in g.sparse_initializer}
    producer: dict[str, int] = {}
    for k, n in enumerate(g.node):
        for o in n.output:
            if not o:
                continue
            if o in producer or o in provided:
                raise LnfoldError(f"tensor `{o}` is produced twice (node `{n.name or n.op_type}`): not a valid ONNX graph")
            producer[o] = k
    for n in g.node:
        for i in n.input:
            if i and i not in provided and i not in producer:
                raise LnfoldError(f"node `{n.name or n.op_type}` reads `{i}`, which no node, graph input or "
                                  "initializer provides (dangling input)")
    for o in g.output:
        if o.name not in provided and o.name not in producer:
            raise LnfoldError(f"graph output `{o.name}` is produced by no node")
    # Kahn's algorithm: whatever is left unplaced lies on (or after) a cycle.
    waiting = [sum(1 for i in n.input if i in producer) for n in g.node]
    readers: dict[str, list[int]] = {}
    for k, n in enumerate(g.node):
        for i in n.input:
            if i in producer:
                readers.setdefault(i, []).append(k)
    ready = [k for k, w in enumerate(waiting) if w == 0]
    placed = 0
    while ready:
        k = ready.pop()
        placed += 1
        for o in g.node[k].output:
            for r in readers.get(o, ()):
                waiting[r] -= 1
                if waiting[r] == 0:
                    ready.append(r)
    if placed != len(g.node):
        stuck = next(n for k, n in enumerate(g.node) if waiting[k] > 0)
        raise LnfoldError(f"the graph has a cycle (through node `{stuck.name or stuck.op_type}`): not a valid ONNX graph")


def no_norm_message(model: onnx.ModelProto) -> str:
    inner = subgraph_norms(model)
    if inner:
        return (f"no LayerNorm found in the main graph ({inner} inside If/Loop/Scan subgraphs, "
                "which lnfold does not fold): nothing to fold")
    return "no LayerNorm found in the model: nothing to fold"


def subgraph_norms(model: onnx.ModelProto) -> int:
    """LayerNorms inside If/Loop/Scan bodies, which lnfold leaves alone."""
    def count(graph, top: bool) -> int:
        k = 0
        for n in graph.node:
            if not top and n.op_type in ("LayerNormalization", "SkipLayerNormalization"):
                k += 1
            for a in n.attribute:
                for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                    k += count(sub, False)
        return k

    return count(model.graph, True)


def is_large(model: onnx.ModelProto) -> bool:
    return model.ByteSize() > _PROTO_LIMIT if _cheap_size_ok(model) else True


def _cheap_size_ok(model: onnx.ModelProto) -> bool:
    # ByteSize() on a >2 GiB message works, but summing raw data first avoids the walk when huge.
    total = sum(len(t.raw_data) for t in model.graph.initializer)
    return total < _PROTO_LIMIT


def save(model: onnx.ModelProto, path: str | os.PathLike, *, external: bool | None = None,
         check: Callable[[Path], None] | None = None) -> None:
    """Write `model` to `path` atomically; weights go to `<name>.data` beside it when large.

    Everything is written into a temporary folder beside the target, handed to `check` (which
    may raise to refuse it) and only then renamed into place, so an error, a failed check or an
    interrupt never leaves a half-written model. Saving with external data empties `model`'s
    in-memory weights (onnx moves them out).
    """
    p = Path(path)
    out_dir = p.parent if str(p.parent) else Path(".")
    if not out_dir.is_dir():
        raise LnfoldError(f"{out_dir}: output directory does not exist")
    if external is None:
        external = is_large(model)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=".lnfold-", dir=out_dir))
    except OSError as e:
        raise LnfoldError(f"{p}: cannot write into {out_dir}: {_first_line(e)}") from None
    try:
        target = tmp / p.name
        if external:
            location = p.name + ".data"
            onnx.save_model(model, str(target), save_as_external_data=True, all_tensors_to_one_file=True,
                            location=location, size_threshold=1024)
        else:
            onnx.save_model(model, str(target))
        if check is not None:
            check(target)
        # (below onnx's size threshold every tensor stays inside the model: no weights file)
        _publish(tmp, target, p, out_dir / location if external and (tmp / location).exists() else None)
    except OSError as e:
        raise LnfoldError(f"{p}: cannot write: {_first_line(e)}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _publish(tmp: Path, model_file: Path, dst: Path, data_dst: Path | None) -> None:
    """Rename the checked files into place: the weights first, the model last.

    Until the model's rename, a failure or an interrupt puts back whatever weights file was
    at `data_dst` before (an earlier output's), so the target is either the old pair or the new.
    """
    if data_dst is None:
        os.replace(model_file, dst)
        return
    backup = tmp / (data_dst.name + ".old")
    had_old = data_dst.exists()
    if had_old:
        os.replace(data_dst, backup)
    try:
        os.replace(tmp / data_dst.name, data_dst)
        os.replace(model_file, dst)
    except BaseException:
        if had_old:
            os.replace(backup, data_dst)
        else:
            try:
                data_dst.unlink()
            except FileNotFoundError:
                pass
        raise


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:200]
