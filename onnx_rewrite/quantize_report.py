"""What `lnfold quantize` did, and how far the result is from the float model: it is NOT exact."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Optional


def scheme_name(weights: str, activations: Optional[str], block_size: int, per_channel: bool,
                plain: bool = False) -> str:
    """The scheme in words; `plain`: the call plain onnxruntime makes for it, as a user writes it."""
    channel = (", per_channel=True" if plain else ", per channel") if per_channel else ""
    if weights == "int4":
        return (f"MatMulNBitsQuantizer(model, bits=4, block_size={block_size}, is_symmetric=True)" if plain else
                f"int4 weight-only, blocks of {block_size} (onnxruntime MatMulNBitsQuantizer, symmetric)")
    if activations == "int8":
        return (f"quantize_static(model, rows, quant_format=QDQ, activation_type=QInt8, weight_type=QInt8{channel})"
                if plain else
                f"W8A8: int8 weights{channel}, static int8 activations (onnxruntime quantize_static, QDQ)")
    return (f"quantize_dynamic(model, weight_type=QInt8{channel})" if plain else
            f"int8 weights{channel}, dynamic int8 activations (onnxruntime quantize_dynamic)")


@dataclass
class QuantizeReport:
    scheme: str
    weights: str
    activations: Optional[str]
    block_size: Optional[int]
    per_channel: bool
    folded: int  # LayerNorms folded into RMSNorms (exact, verified)
    kept: int
    fold_verified: Optional[str]  # the gate's criterion ("float64", ...); None: no fold
    fold_max_rel_err: Optional[float]
    gamma_into_readers: bool
    rotate: Optional[str]
    seed: Optional[int]
    rotation: Optional[str]  # the fold report's word on each stream's rotation
    rotated_streams: int  # streams the rotation applied to (0 where every one was blocked)
    linear_layers: int  # MatMuls with a constant weight handed to the quantizer
    basis_changes: dict  # the fold's basis-change MatMuls, kept float: node -> parameters
    parameters: int  # the float model handed to the quantizer: its initializers' elements
    ops_before: dict  # op kind -> count, the float model given to the quantizer
    ops_after: dict  # the same, quantized
    bytes_before: int  # the input model
    bytes_after: int  # the quantized model
    errors: dict  # output -> {"max_rel_err", "rel_rms", "top1_agreement"} against the float input model
    error_inputs: str  # what they were measured on
    notes: list = field(default_factory=list)
    timings: dict = field(default_factory=dict)
    # --rotate auto: every candidate tried ({"candidate", "score" (worst output's relative RMS
    # error), "max_rel_err", "ops" (the quantized model's op counts), "bytes"} or {"candidate",
    # "skipped"}) and the one kept, with why; last, plain onnxruntime's quantizer on the model as
    # given ("plain": True), a reference never chosen
    candidates: list = field(default_factory=list)
    chosen: Optional[str] = None
    exact: bool = False  # quantization is not exact: see `errors`

    @property
    def max_rel_err(self) -> float:
        return max((e["max_rel_err"] for e in self.errors.values()), default=0.0)

    @property
    def rel_rms(self) -> float:
        return max((e["rel_rms"] for e in self.errors.values()), default=0.0)

    def changed_ops(self) -> dict:
        """op kind -> (before, after) for the kinds whose count the quantizer changed."""
        kinds = sorted(set(self.ops_before) | set(self.ops_after))
        return {k: (self.ops_before.get(k, 0), self.ops_after.get(k, 0)) for k in kinds
                if self.ops_before.get(k, 0) != self.ops_after.get(k, 0)}

    def fold_line(self) -> str:
        if self.fold_verified is None:
            return "fold: none (the model went to the quantizer as given)"
        extra = ", γ into the readers" if self.gamma_into_readers else ""
        if self.rotate:
            extra += (f", {self.rotated_streams} stream(s) rotated ({self.rotate}, seed {self.seed})"
                      if self.rotated_streams else f", rotation {self.rotate} asked, no stream rotated")
        err = f", max rel. diff {self.fold_max_rel_err:.1e}" if self.fold_max_rel_err is not None else ""
        return (f"fold: {self.folded} LayerNorm(s) folded, {self.kept} kept{extra}: exact, verified "
                f"({self.fold_verified}{err})")

    def basis_change_line(self) -> str:
        n = sum(self.basis_changes.values())
        return (f"kept float: {len(self.basis_changes)} MatMul(s) the fold inserted to change the stream's basis "
                f"({', '.join(self.basis_changes)}; {n} parameters, {n / max(self.parameters, 1):.2%} of the "
                "model's): no layer of the model, and a readout's error would land on the output")

    def error_line(self) -> str:
        parts = []
        for name, e in self.errors.items():
            agree = f", top-1 agreement {e['top1_agreement']:.1%}" if "top1_agreement" in e else ""
            left = (f" ({e['nonfinite_ref']} value(s) where the float model itself is not finite left out)"
                    if e.get("nonfinite_ref") else "")
            parts.append(f"{name}: rel. RMS error {e['rel_rms']:.2e}, max rel. error {e['max_rel_err']:.2e}{agree}{left}")
        return "; ".join(parts) or "no float output to compare"

    def table(self) -> str:
        lines = [f"quantized: {self.scheme}",
                 self.fold_line(),
                 f"linear layers quantized: {self.linear_layers}; ops changed: " + ", ".join(
                     f"{k} {a} -> {b}" for k, (a, b) in self.changed_ops().items()),
                 f"size: {self.bytes_before / 2**20:.2f} MiB -> {self.bytes_after / 2**20:.2f} MiB "
                 f"({self.bytes_after / max(self.bytes_before, 1):.2f}x)"]
        if self.basis_changes:
            lines.append(self.basis_change_line())
        if self.rotation:
            lines.append(f"rotation: {self.rotation}")
        lines += [f"note: {n}" for n in self.notes]
        for t in self.candidates:
            said = (f"skipped: {t['skipped']}" if "skipped" in t else
                    f"rel. RMS error {t['score']:.3e}, max rel. error {t['max_rel_err']:.3e}")
            if "bytes" in t:
                said += f", {t['bytes'] / max(self.bytes_before, 1):.2f}x the size"
            if t.get("plain"):  # quantizes ops lnfold leaves float: what a user of onnxruntime alone gets
                ops = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in t.get("changed_ops", {}).items())
                said += (f" (ops changed: {ops}; " if ops else " (") + \
                    "every op it takes, on the model as given: reference, never chosen)"
            lines.append(f"auto: {t['candidate']}: {said}{'  <- chosen' if t.get('chosen') else ''}")
        if self.chosen:
            lines.append(f"auto chose {self.chosen} (chosen and measured on the same rows)")
        lines.append(f"NOT exact (quantization): against the float model on {self.error_inputs}: {self.error_line()}")
        return "\n".join(lines)

    def metadata(self) -> str:
        """One line for the model's metadata_props."""
        rot = f", {self.rotated_streams} stream(s) rotated {self.rotate} (seed {self.seed})" if self.rotated_streams else ""
        fold = f"{self.folded} LayerNorm(s) folded exactly{rot}; " if self.fold_verified else ""
        return (f"{fold}then quantized: {self.scheme}. NOT exact: rel. RMS error {self.rel_rms:.2e}, max rel. error "
                f"{self.max_rel_err:.2e} against the float model on {self.error_inputs}")

    def as_dict(self) -> dict:
        d = asdict(self)
        d["max_rel_err"] = self.max_rel_err
        d["rel_rms"] = self.rel_rms
        d["changed_ops"] = {k: list(v) for k, v in self.changed_ops().items()}
        return d

    def to_json(self, **kw) -> str:
        return json.dumps(self.as_dict(), **kw)
