"""lnfold: fold the LayerNorms of Pre-LN models into RMSNorms, without changing what they compute.

ONNX (the plain install; torch is not needed and not imported)::

    import lnfold
    model = lnfold.load_onnx("model.onnx")
    print(lnfold.analyze_onnx(model).table())            # every LayerNorm, its verdict, why
    result = lnfold.fold_onnx(model)                     # folds, verifies, never edits `model`
    print("\n".join(lnfold.check_onnx("model.onnx", "other.onnx").lines()))  # anyone's transform, judged
    lnfold.save_onnx(result.model, "model.folded.onnx")
    quantized = lnfold.quantize_onnx(model, weights="int8", rotate="hadamard")  # NOT exact:
    print(quantized.report.table())                      # onnxruntime's quantizer after the fold; its error

PyTorch (``pip install 'lnfold[torch]'``)::

    result = lnfold.fold_module(module, args)            # torch.export, fold, verify
    compiled = torch.compile(module, backend="lnfold")
    lnfold.fold_for_training(module, args)               # training at scale: folds the eager module
                                                         # in place, then DDP / fully_shard / compile
    lnfold.fold_checkpoint("opt-1.3b/", "opt-1.3b.folded/")  # a sharded transformers checkpoint, shard
                                                         # by shard, in bounded memory
    quantized = lnfold.quantize_module(module, args, weights="int8", rotate="hadamard")  # NOT exact:
    print(quantized.report.table())                      # torchao's (or torch.ao's) quantizer after the fold

Both frontends return the same `FoldResult` and `Report`; user errors are `LnfoldError`s
(`NothingToFold`, `VerificationError`) with a one-line message.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .passes import FoldResult, LnfoldError, NormVerdict, NothingToFold, Report, VerificationError

# Both frontends are imported on first use: `import lnfold.passes` loads neither onnx nor torch.
_ONNX_NAMES = {"analyze_onnx": "analyze_model", "check_onnx": "check_onnx", "fold_onnx": "fold_model",
               "load_onnx": "load", "save_onnx": "save", "quantize_onnx": "quantize_model", "slice_onnx": "slice_model"}

if TYPE_CHECKING:
    from .onnx_rewrite import analyze_model as analyze_onnx
    from .onnx_rewrite import fold_model as fold_onnx
    from .onnx_rewrite import check_onnx
    from .onnx_rewrite import load as load_onnx
    from .onnx_rewrite import save as save_onnx
    from .onnx_rewrite import quantize_model as quantize_onnx
    from .onnx_rewrite import slice_model as slice_onnx
    from .fx_rewrite import (analyze_module, fold_checkpoint, fold_for_training, fold_module, lnfold_backend,
                             lnfold_backend_with, unfold_for_training)
    from .fx_rewrite import fold_to_rmsnorm, quantize_module, restore_rmsnorm, slice_module



def _installed_version() -> str:
    """The installed distribution's version (pyproject.toml's, through the package metadata)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lnfold")
    except PackageNotFoundError:  # imported from a source tree that was never installed
        return "0+unknown"

_TORCH_NAMES = ("analyze_module", "fold_checkpoint", "fold_for_training", "fold_module", "lnfold_backend",
                "lnfold_backend_with", "unfold_for_training", "fold_to_rmsnorm", "restore_rmsnorm", "slice_module",
                "quantize_module")

__all__ = [
    "FoldResult", "LnfoldError", "NormVerdict", "NothingToFold", "Report", "VerificationError",
    "analyze_module", "analyze_onnx", "check_onnx", "fold_checkpoint", "fold_for_training", "fold_module",
    "fold_onnx",
    "lnfold_backend", "lnfold_backend_with", "load_onnx", "quantize_onnx", "save_onnx", "slice_onnx", "unfold_for_training",
    "fold_to_rmsnorm", "quantize_module", "restore_rmsnorm", "slice_module",
]


def __getattr__(name: str) -> Any:
    if name == "__version__":  # read on first use: the metadata lookup costs ~25 ms at import
        globals()["__version__"] = v = _installed_version()
        return v
    if name in _ONNX_NAMES:
        from . import onnx_rewrite

        return getattr(onnx_rewrite, _ONNX_NAMES[name])
    if name in _TORCH_NAMES:
        try:
            from . import fx_rewrite
        except ImportError as e:
            raise ImportError(f"lnfold.{name} needs the torch frontend: pip install 'lnfold[torch]' ({e})") from e
        return getattr(fx_rewrite, name)
    raise AttributeError(f"module 'lnfold' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | {"__version__"})
