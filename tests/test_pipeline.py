"""The plan is final: `make_plan` decides everything (deferral included), nothing changes it after,
and every entry point runs on such a plan."""
from __future__ import annotations

import dataclasses

import pytest

from lnfold.passes import make_plan
from lnfold.passes.edits import Scale
from lnfold.passes.request import Capabilities, PlanRequest

from .test_passes import pre_ln


def _assert_final(plan) -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.swaps = []
    with pytest.raises(TypeError, match="a plan is final"):
        plan.const_edits.append(plan.const_edits[0])
    with pytest.raises(TypeError, match="a plan is final"):
        plan.const_edits[0].users.pop()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.const_edits[0].ops = ()
    with pytest.raises(TypeError):
        plan.betas["x"] = None


def test_plan_is_frozen_and_carries_its_deferral():
    plan = make_plan(pre_ln(), PlanRequest(defer="on"))
    _assert_final(plan)
    assert [d.norm for d in plan.deferral.deferred] == ["ln1"]  # fc1 reads ln1 only: deferred
    assert plan.report.norms[0].deferred and plan.plain_rms == ["ln_f"]
    # γ into fc1's weight is one of the plan's own edits, β goes after the row scale
    assert [(e.value, e.ops) for e in plan.const_edits if e.value.startswith("fc1")] == \
        [("fc1.W", (Scale("ln1.g", 0, 1),))]
    assert "fc1.bias" in {e.value for e in make_plan(pre_ln()).const_edits}  # β folded when not deferred


def test_training_request_defers_nothing():
    """A fold whose edited constants are trained computes its edits in the graph: no deferral."""
    plan = make_plan(pre_ln(), PlanRequest(defer="on", trainable=lambda name: True))
    assert plan.training and not plan.deferral.deferred
    assert not make_plan(pre_ln(), PlanRequest(defer="on")).training


def test_target_that_cannot_compress_says_so():
    plan = make_plan(pre_ln(), PlanRequest(mode="crms", target=Capabilities(name="this target", compresses=False)))
    assert plan.mode == "rms" and not plan.compressions
    assert plan.report.notes == ["this target does not compress (CRMSNorm); folded norms are RMSNorms, "
                                 "which compute the same values"]


def test_every_entry_point_runs_on_a_final_plan(monkeypatch):
    """The frontends' own code paths (ONNX, torch.export, the backend, the training fold) run on
    the plan make_plan returned, each checked final when it is handed over."""
    torch = pytest.importorskip("torch")
    import lnfold
    from lnfold.fx_rewrite import api as fx_api, backend as fx_backend, train as fx_train
    from lnfold.onnx_rewrite import api as onnx_api

    from . import onnx_graphs as G
    from .test_options import IDS, _PreLN

    seen = []

    def checked(make):
        def plan_fn(view, *a, **kw):
            plan = make(view, *a, **kw)
            _assert_final(plan)
            seen.append(plan)
            return plan
        return plan_fn

    for mod in (onnx_api, fx_api, fx_backend, fx_train):
        monkeypatch.setattr(mod, "make_plan", checked(mod.make_plan))
    lnfold.fold_onnx(G.pre_ln(), defer="on")
    lnfold.fold_module(_PreLN(), IDS, defer="on")
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(_PreLN(), backend=lnfold.lnfold_backend_with(inner=lambda gm, _: gm.forward, verify=True))(*IDS)
    torch._dynamo.reset()
    lnfold.fold_for_training(_PreLN(), IDS)
    assert len(seen) == 4 and all(p.swaps for p in seen)


def test_backend_failure_is_told_in_a_copy_of_the_report(monkeypatch):
    """A fold that fails while editing Dynamo's graph compiles the graph unfolded and says so in the
    report it tells (`on_report`), a copy: the plan's own report stays as make_plan wrote it."""
    torch = pytest.importorskip("torch")
    import lnfold
    from lnfold.fx_rewrite import backend as fx_backend

    from .test_options import IDS, _PreLN

    plans, told = [], []

    def planned(view, *a, **kw):
        plans.append(make_plan(view, *a, **kw))
        return plans[-1]

    def broken(self, plan):
        raise RuntimeError("planted")

    monkeypatch.setattr(fx_backend, "make_plan", planned)
    monkeypatch.setattr(fx_backend.Applier, "apply", broken)
    module = _PreLN()
    torch._dynamo.reset()
    with torch.no_grad():
        want = module(*IDS)
        got = torch.compile(module, backend=lnfold.lnfold_backend_with(inner=lambda gm, _: gm.forward,
                                                                       on_report=told.append))(*IDS)
    torch._dynamo.reset()
    assert torch.equal(want, got)  # compiled unfolded
    assert len(told) == 1 and told[0].notes == ["the fold failed (planted); this graph was compiled unfolded"]
    assert plans and plans[-1].report.notes == [] and told[0] is not plans[-1].report


# --- targets: one place each ----------------------------------------------------------------------

def test_a_new_onnx_target_is_one_entry(monkeypatch):
    """A target registered in onnx_rewrite/targets.py alone is a choice of fold_onnx, the planner
    asks its capabilities (here: fuse every rank-3 residual Add, on onnxruntime's CPU), and the
    folded model passes onnxruntime verification; an unknown name stays a one-line error."""
    from lnfold.onnx_rewrite import fold_model, targets
    from lnfold.passes import LnfoldError

    from . import onnx_graphs as G

    fused_cpu = targets.Target("fused-cpu", norm_op="SimplifiedLayerNormalization",
                               fuses_residual=lambda shape: len(shape) == 3)
    with pytest.raises(LnfoldError, match="unknown target 'fused-cpu'"):
        fold_model(G.pre_ln(), target="fused-cpu")
    monkeypatch.setitem(targets._TARGETS, ("fused-cpu", None), fused_cpu)
    res = fold_model(G.pre_ln(), target="fused-cpu")
    ops = [n.op_type for n in res.model.graph.node]
    assert "SkipSimplifiedLayerNormalization" in ops and res.criterion is not None
    assert any(s.fused for s in res.report.streams)
    plain = [n.op_type for n in fold_model(G.pre_ln()).model.graph.node]
    assert "SkipSimplifiedLayerNormalization" not in plain


def test_fusing_is_the_targets_call_not_the_planners():
    """The IR-neutral planner fuses a residual Add only where the target says it fuses its shape."""
    from lnfold.passes.view import View

    v = pre_ln()
    assert isinstance(v, View)
    seen = []

    def fuses(shape):
        seen.append(shape)
        return False

    plan = make_plan(v, target=Capabilities(fuses_residual=fuses))
    assert seen and not plan.fuse_residual
    plan = make_plan(pre_ln(), target=Capabilities(fuses_residual=lambda shape: True))
    assert plan.fuse_residual and not make_plan(pre_ln()).fuse_residual


def test_the_one_heldout_rule_in_both_frontends():
    """passes/calibration.split, reached through each frontend's own batch form (ONNX: one dict of
    arrays; torch: args tuples): half the rows (rounded up) decide, the rest report; with several
    batches, half the batches; a single row holds nothing out; given held-out inputs are used as given."""
    import numpy as np
    import torch

    from lnfold.fx_rewrite import calibration as fx_calibration
    from lnfold.onnx_rewrite.calibration import calibration_data
    from tests.geometry_models import ids, onnx_model

    model, x = onnx_model(), ids(5)
    data = calibration_data(model, {"ids": x.numpy()})
    (decide,), (held,) = data.deciding, data.held
    torch_split = fx_calibration.split([(x,)], None)
    assert len(decide["ids"]) == len(torch_split.deciding[0][0]) == 3
    assert len(held["ids"]) == len(torch_split.held[0][0]) == 2
    np.testing.assert_array_equal(held["ids"], torch_split.held[0][0].numpy())
    assert calibration_data(model, {"ids": x[:1].numpy()}).held is None
    assert fx_calibration.split([(x[:1],)], None).held is None
    three = fx_calibration.split([(x[:1],), (x[1:2],), (x[2:],)], None)
    assert len(three.deciding) == 2 and len(three.held) == 1 and torch.equal(three.held[0][0], x[2:])
    given = calibration_data(model, {"ids": x.numpy()}, {"ids": x[:1].numpy()})
    assert len(given.deciding[0]["ids"]) == 5 and len(given.held[0]["ids"]) == 1
    assert fx_calibration.split([(x,)], [(x[:1],)]).deciding == [(x,)]


def test_capture_and_run_agree_across_frontends():
    """Frontend.capture / Frontend.run (passes/calibration.py), once per IR: on the same rows (more than
    one ONNX run's worth: its pieces are joined back), each norm's input and the outputs agree between
    onnxruntime and torch, in the original and in the exact fold, where the folded norm's input is
    zero-mean."""
    import numpy as np

    from lnfold.fx_rewrite.api import ExportFolds
    from lnfold.onnx_rewrite import targets
    from lnfold.onnx_rewrite.api import OnnxFolds
    from lnfold.passes import FoldOptions, calibration
    from lnfold.passes.geometry import norm_inputs
    from tests.geometry_models import PostLN, ids, onnx_model

    x = ids(40)
    frontends = {"onnx": (OnnxFolds(onnx_model(), FoldOptions(), targets.resolve("ort", "cpu")), [{"ids": x.numpy()}]),
                 "torch": (ExportFolds(PostLN(0.0), (x[:2],), {}, FoldOptions()), [(x,)])}
    seen = {}
    for ir, (folds, batches) in frontends.items():
        view, plan = folds.plan(make_plan)
        values = [ni.value for ni in norm_inputs(view)]
        folded = folds.fold(make_plan, FoldOptions(verify=False))
        seen[ir] = [[np.concatenate(calibration.capture(folds, r, values, batches)[v]).astype(np.float64)
                     for v in values] + calibration.run(folds, r, batches) for r in (None, folded)]
    for before_after in zip(seen["onnx"], seen["torch"]):
        for a, b in zip(*before_after):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * np.abs(b).max())
    ln0_after = seen["torch"][1][0]  # the embedding norm folds: its input is centered
    assert np.abs(ln0_after.mean(-1)).max() < 1e-4 * np.abs(ln0_after).max()
    assert np.abs(seen["torch"][0][0].mean(-1)).min() > 1.0  # (it was not: the embedding's planted mean)
