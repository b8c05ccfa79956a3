"""lnfold as a pass of Microsoft Olive's engine (`pip install 'lnfold[olive]'`): ONNX in, ONNX out.

Olive finds a pass by its `type` in a *package config* (olive_config.json: type -> module_path and
what it supports); the default one lists only Olive's own passes, and a dotted module path as a
workflow's `type` is looked up there by its last name too. So a workflow that uses `LnfoldPass` is
run with a package config that names it: `olive run --config workflow.json --package-config
olive_config.json`, where olive_config.json is Olive's own plus PACKAGE_ENTRY (`python -m
lnfold.onnx_rewrite.olive_pass olive_config.json` writes it), or only the passes a workflow uses
(docs/guide/olive/). docs/guide/olive.md shows the workflow.

The pass calls lnfold's Python API and nothing else: `fold_onnx` (exact, verified against float64),
`slice_onnx` (with `slice_fraction`, NOT exact), `quantize_onnx` (with `quantize`, NOT exact). Its
options are Olive PassConfigParams; `rotate` and `slice_fraction` carry a search space, so that
Olive's search can tune them.
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from olive.hardware.accelerator import AcceleratorSpec
from olive.model import ONNXModelHandler
from olive.model.utils import resolve_onnx_path
from olive.passes import Pass
from olive.passes.onnx.common import get_external_data_config, model_proto_to_olive_model
from olive.passes.pass_config import BasePassConfig, PassConfigParam
from olive.search.search_parameter import Categorical

from ..passes.options import OPTIONS, SLICE_OPTIONS, Option
from .targets import TARGET

logger = logging.getLogger(__name__)

# This pass's row of an Olive package config: it runs on the host's CPU, whatever the target runs.
PACKAGE_ENTRY = {"LnfoldPass": {"module_path": "lnfold.onnx_rewrite.olive_pass.LnfoldPass",
                                "supported_providers": ["*"], "supported_accelerators": ["*"],
                                "supported_precisions": ["*"]}}
ROTATIONS = ["none", *OPTIONS["rotate"].choices]  # ("none": Olive's search space holds no None)
SLICE_FRACTIONS = [0.1, 0.2, 0.3]


def _param(option: Option, **overrides) -> PassConfigParam:
    """An lnfold option (passes/options.OPTIONS, onnx_rewrite/targets: one declaration) as Olive
    declares a pass's config: its type, default, description and search space."""
    kw = dict(type_=option.type, default_value=option.default, description=option.help)
    if option.search:
        kw["search_defaults"] = Categorical(list(option.search))
    return PassConfigParam(**{**kw, **overrides})


class LnfoldPass(Pass):
    """Fold a model's LayerNorms into RMSNorms exactly (lnfold), optionally rotating the stream, then
    optionally slice it (SliceGPT-style, NOT exact) or quantize it (onnxruntime's quantizer after the
    fold, NOT exact). The fold is verified against a float64 run of the input; a model with nothing
    to fold, or a fold that fails verification, fails the pass with lnfold's one-line reason."""

    @classmethod
    def _default_config(cls, accelerator_spec: AcceleratorSpec) -> dict[str, PassConfigParam]:
        config = {
            "mode": _param(OPTIONS["mode"], description='"rms" (exact) or "crms" (exact, one feature fewer per '
                           'stream)'),
            "target": _param(TARGET),
            "rotate": _param(OPTIONS["rotate"], default_value="none", search_defaults=Categorical(ROTATIONS),
                             description=OPTIONS["rotate"].help + f"; one of {ROTATIONS}; with `quantize` also "
                             '"auto" (lnfold measures each candidate and keeps the best)'),
            "seed": _param(OPTIONS["seed"]),
            "gamma_into_readers": _param(OPTIONS["gamma_into_readers"]),
            "gamma_in_float": _param(OPTIONS["gamma_in_float"]),
            "spare_channels": _param(OPTIONS["spare_channels"]),
            "online_hadamard": _param(OPTIONS["online_hadamard"]),
            "slice_fraction": PassConfigParam(type_=float, default_value=None,
                                              search_defaults=Categorical(SLICE_FRACTIONS),
                                              description="delete this share of each stream's width, its least-"
                                              "used principal directions on `calibration` (NOT exact; "
                                              "needs `calibration`)"),
            **{name: _param(option) for name, option in SLICE_OPTIONS.items()},
            "quantize": PassConfigParam(type_=str, default_value=None,
                                        description='"int8" (quantize_dynamic), "int4" (MatMulNBits, weight-only) '
                                        'or "w8a8" (quantize_static, needs `calibration`) after the fold (NOT exact)'),
            "calibration": PassConfigParam(type_=str, default_value=None,
                                           description="an .npz of input rows (one array per model input, rows "
                                           "along the first axis): slicing's basis and quantization's "
                                           "calibration and error measurement"),
            "verify": _param(OPTIONS["verify"], description="verify the fold against a float64 run of the input "
                             "model"),
        }
        config.update(get_external_data_config())
        return config

    def _run_for_config(self, model: ONNXModelHandler, config: type[BasePassConfig],
                        output_model_path: str) -> ONNXModelHandler:
        import lnfold

        rotate = None if config.rotate in (None, "none") else config.rotate
        source = lnfold.load_onnx(model.model_path)
        if config.slice_fraction is not None:
            if config.calibration is None:
                raise ValueError("LnfoldPass: slice_fraction needs calibration (an .npz of input rows)")
            sliced = lnfold.slice_onnx(source, config.calibration, fraction=config.slice_fraction,
                                       target=config.target,
                                       **{name: getattr(config, name) for name in SLICE_OPTIONS})
            logger.info("lnfold slice: %s", sliced.report.table())
            result = sliced.model
            if config.quantize:  # slice first, then quantize the sliced model (guide: slicing)
                result = self._quantize(lnfold, result, config, rotate=None)
        elif config.quantize:  # quantize_onnx folds (verified) and rotates itself
            result = self._quantize(lnfold, source, config, rotate=rotate)
        else:
            folded = lnfold.fold_onnx(source, mode=config.mode, target=config.target, verify=config.verify,
                                      rotate=rotate, seed=config.seed, gamma_into_readers=config.gamma_into_readers,
                                      gamma_in_float=config.gamma_in_float, spare_channels=config.spare_channels,
                                      online_hadamard=config.online_hadamard)
            logger.info("lnfold fold: %s", folded.report.table())
            result = folded.model
        output_model_path = resolve_onnx_path(output_model_path, Path(model.model_path).name)
        return model_proto_to_olive_model(result, output_model_path, config)

    @staticmethod
    def _quantize(lnfold, source, config, *, rotate):
        weights, activations = ("int8", "int8") if config.quantize == "w8a8" else (config.quantize, None)
        quantized = lnfold.quantize_onnx(source, weights=weights, activations=activations, rotate=rotate,
                                         seed=config.seed, gamma_in_float=bool(rotate) and config.gamma_in_float,
                                         spare_channels=config.spare_channels if rotate else None,
                                         online_hadamard=config.online_hadamard,
                                         calibrate=config.calibration, verify=config.verify)
        logger.info("lnfold quantize: %s", quantized.report.table())
        return quantized.model


def package_config() -> dict:
    """Olive's own package config with this pass added: what `olive run --package-config` takes."""
    from olive.package_config import OlivePackageConfig

    config = json.loads(Path(OlivePackageConfig.get_default_config_path()).read_text())
    config["passes"].update(PACKAGE_ENTRY)
    return config


if __name__ == "__main__":  # python -m lnfold.onnx_rewrite.olive_pass OUT.json
    if len(sys.argv) != 2:
        sys.exit("usage: python -m lnfold.onnx_rewrite.olive_pass OLIVE_CONFIG.json")
    Path(sys.argv[1]).write_text(json.dumps(package_config(), indent=2) + "\n")
