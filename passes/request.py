"""What a fold asks of the planner: everything `make_plan` decides from, in one object. A new
decision is a new field here and a new step in make_plan: every entry point then makes it, none is
rewired (DESIGN §2).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from .analysis import Component
from .defer import EAGER, Costs
from .errors import LnfoldError
from .options import APPROX_MODE, PLAN_MODES, FoldOptions, check_choice

# the user's options (FoldOptions' fields) that a request carries as they are
_OPTIONS = ("defer", "gamma_into_readers", "rotate", "seed", "gamma_in_float", "spare_channels", "online_hadamard")


@dataclass(frozen=True)
class Capabilities:
    """What an emission target can do: declared by the frontend that owns the target, asked by
    the planner. The defaults are a target that emits every fold of the plan one op at a time."""

    name: str = "the target"
    costs: Costs = EAGER  # the deferral cost model (a measured property of the target)
    # The target runs a residual Add of two equal-shaped tensors and the norm after it as one op
    # (onnxruntime's SkipSimplifiedLayerNormalization on CUDA) for sums of this shape; None: it
    # fuses none. A fused norm's own Add (SkipLayerNormalization's) is always fusable.
    fuses_residual: Optional[Callable[[tuple], bool]] = None
    folds_beta: bool = True  # β may move into the readers' biases (False: each norm keeps its β)
    # A linear reader without a bias may be given one for β (W β; the eager RMSNorm hand-off)
    new_biases: bool = False
    # Its RMSNorm can add β (False: a folded norm whose β cannot move into its readers is not
    # swapped: it stays a LayerNorm on its centered stream, exact, and is reported kept)
    norm_beta: bool = True
    # It can follow a rotated stream's norm by a constant MatMul that un-rotates its output
    # (a rotated stream's readouts, passes/rotate.py; False: such a stream stays unrotated, with the reason)
    readout_matmul: bool = True
    compresses: bool = True  # it can emit CRMSNorm (False: mode "crms" folds into RMSNorms, with a note)
    # Why the target cannot swap folded norm `name` given every folded norm (None: it can): the
    # stream stays centered, the norm stays as it is (exact on a zero-mean input), and is reported kept.
    swap_refusal: Optional[Callable[[str, frozenset], Optional[str]]] = None
    # Why the target cannot emit norm `name` over a sliced (narrower) stream (None: it can): the
    # stream is then not sliced, with the reason, instead of a failure in the emitter.
    resize_refusal: Optional[Callable[[str], Optional[str]]] = None


@dataclass(frozen=True)
class PlanRequest:
    """One fold's question. `zero(value)`: the constant is all zeros where its values are fixed
    (a β of zeros needs neither an Add nor a fold). `refuse(component)`: why the frontend cannot
    apply a foldable component's edits (reported for each of its norms). `trainable(value)`: the
    constant is trained (requires grad with grad mode on): a fold that edits a trained constant
    computes its edits in the graph and defers no norm."""

    mode: str = "rms"
    defer: str = "off"
    target: Capabilities = Capabilities()
    zero: Optional[Callable[[str], bool]] = None
    refuse: Optional[Callable[[Component], Optional[str]]] = None
    trainable: Optional[Callable[[str], bool]] = None
    gamma_into_readers: bool = False  # γ (and β) into the readers' weights (passes/gamma.py)
    rotate: Optional[str] = None  # a stream rotation (passes/rotate.py); implies gamma_into_readers
    seed: int = 0
    gamma_in_float: bool = False  # with `rotate`: γ as a float Qᵀ·diag γ·Q after each rotated norm
    spare_channels: Optional[tuple] = None  # with `rotate`: channels each rotated stream leaves as they are
    online_hadamard: bool = False  # an online H on each stream writer's input, Hᵀ in its weight (passes/online.py)
    # mode "rms-approx" (passes/approx.py): kept norms to swap for RMSNorm although they cannot be
    # folded exactly (NOT exact; chosen under a measured error budget). Empty: exact folds only.
    approx: frozenset = frozenset()
    # a basis per stream, by the stream's first norm: (edits.Basis, entries kept) — a calibrated
    # slice (passes/slicing.py; NOT exact where fewer than all are kept). Streams not named stay as
    # they are; implies gamma_into_readers, excludes `rotate`.
    bases: Optional[Mapping[str, tuple]] = None
    # with `bases`: each sliced stream of RMSNorms as given has its embedding tables centered first
    # (SliceGPT's choice, passes/options.SLICE_OPTIONS; NOT exact: an RMSNorm reads the mean)
    center_embeddings: bool = False
    # with `bases`: a fold made only to capture tensors (passes/slicer.full_width_inputs keeps a
    # segment d wide there): no model of it is kept, so a slice may add parameters
    capture: bool = False

    def __post_init__(self) -> None:
        check_choice("mode", self.mode, PLAN_MODES)  # (rms-approx asks for `approx` norms in mode rms)
        FoldOptions(mode=self.mode, **{f: getattr(self, f) for f in _OPTIONS})  # the options' own checks
        if self.bases is not None and self.rotate is not None:
            raise LnfoldError("a stream is rotated by a seeded Q or projected on a given basis, not both")
        if self.rotate is not None or self.bases is not None:
            object.__setattr__(self, "gamma_into_readers", True)


def request_from(options: FoldOptions, target: Capabilities = Capabilities(), **fields) -> PlanRequest:
    """The one way a frontend asks (the user's options were checked once, in FoldOptions), the
    frontend's own fields of PlanRequest as keywords: every entry point builds its request here, so
    a new option reaches all of them."""
    mode = "rms" if options.mode == APPROX_MODE else options.mode  # (its swaps come as `approx`)
    return PlanRequest(mode, target=target, **{f: getattr(options, f) for f in _OPTIONS}, **fields)
