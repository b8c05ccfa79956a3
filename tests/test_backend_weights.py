"""The torch.compile backend sees every change of the model's weights (issue 43, item 2).

The backend used to cache centered copies keyed on `(id, data_ptr, _version)`: a write through
`p.data` bumps no version of `p`, an inference-mode tensor has none, and a new tensor may reuse a
freed one's id and address, so a compiled model kept computing with the old weights (0.03-1.74
relative away from eager, no warning). The edits are now computed in the graph at every call. Each
test below changes the weights in one way users do, after the first compiled call, and compares
the compiled model with eager: it fails with any cache that misses that way. The models have
randomized γ/β and large-mean sources (zoo.adversarial), so a stale or missing centering shows.

`_eager` runs the folded graph as the backend hands it to Inductor; the slow test runs Inductor
itself, with and without its `freezing` option, against Inductor alone on the original.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from lnfold.fx_rewrite import lnfold_backend_with

from tests import test_fx

D = test_fx.D
RTOL = 1e-5


def PreLN(layers=2, tied=False) -> nn.Module:
    """tests/test_fx.py's embedding -> pre-LN blocks -> final LN -> head, with LayerScale: every kind of
    edit the backend makes (a centered table, centered writers and biases, a scaled LayerScale source)."""
    return test_fx.PreLN(layers, layerscale=True, tied=tied)


IDS = torch.randint(0, 11, (2, 5))


def _eager(gm, example_inputs):
    return gm.forward


def _rel(ref: torch.Tensor, got: torch.Tensor) -> float:
    return ((ref.double() - got.double()).abs().max() / ref.double().abs().max()).item()


def _compiled(m: nn.Module, **options):
    """`m` compiled by the backend, the folded graph run as it would be handed to Inductor; and the
    reports. A fold that fails in the backend compiles the graph unfolded (exact, so the outputs
    would still match): `_folded` checks that it did not."""
    torch._dynamo.reset()
    reports = []
    c = torch.compile(m, backend=lnfold_backend_with(inner=_eager, on_report=reports.append, **options))
    return c, reports


def _folded(reports) -> None:
    assert reports and reports[-1].folded == 3 and not any("compiled unfolded" in n for n in reports[-1].notes), \
        reports[-1].notes if reports else "no report"


def _same_after(m: nn.Module, change, *, grad: bool = False) -> None:
    """Compile `m`, call it once, `change(m)`, and compare the compiled model with eager again."""
    c, reports = _compiled(m)
    with torch.set_grad_enabled(grad):
        assert _rel(m(IDS), c(IDS)) < RTOL
    _folded(reports)  # (the test is not of an unfolded graph)
    before = m(IDS).detach()
    change(m)
    with torch.set_grad_enabled(grad):
        ref = m(IDS)
        assert _rel(before, ref) > 1e-2  # the change changes what the model computes
        assert _rel(ref, c(IDS)) < RTOL


def _each_weight(m: nn.Module):
    """The weights the fold edits: the table, the writers and their biases, the LayerScale."""
    return [m.emb.weight, m.blocks[0]["fc"].weight, m.blocks[1]["fc"].bias, m.scale[1]]


@pytest.mark.parametrize("how", ["data_mul_", "data_copy_", "data_add_", "data_assign"])
def test_writes_through_data(how):
    """`p.data.mul_()` and friends (EMA updates, weight surgery, some loaders) bump no version of `p`."""
    def change(m):
        for p in _each_weight(m):
            if how == "data_mul_":
                p.data.mul_(1.5)
            elif how == "data_copy_":
                p.data.copy_(torch.randn_like(p) + 3.0)
            elif how == "data_add_":
                p.data.add_(torch.randn_like(p))
            else:
                p.data = torch.randn_like(p) * 2 + 1.0  # a new tensor behind the same Parameter

    with torch.no_grad():
        _same_after(PreLN(), change)


def test_copy_under_no_grad_and_load_state_dict():
    other = PreLN().state_dict()
    with torch.no_grad():
        _same_after(PreLN(), lambda m: m.blocks[0]["fc"].weight.copy_(torch.randn(D, D) + 2.0))
        _same_after(PreLN(), lambda m: m.load_state_dict(other))


def test_inference_mode_tensors():
    """Tensors made under inference_mode keep no version counter at all."""
    with torch.inference_mode():
        m = PreLN()
        m.load_state_dict({k: v.clone() for k, v in m.state_dict().items()})  # inference tensors now
        assert m.emb.weight.is_inference()

        def change(m):
            for p in _each_weight(m):
                p.mul_(1.5).add_(0.5)

        _same_after(m, change)


def test_a_new_tensor_at_a_freed_tensors_address():
    """Swapping in new tensors (a loader, `nn.utils.parametrize`): the allocator reuses the freed
    storage, so a new tensor may carry a freed one's id, address and version 0."""
    m = PreLN()
    c, reports = _compiled(m)
    with torch.no_grad():
        c(IDS)
        _folded(reports)
        for k in range(5):
            w = m.blocks[0]["fc"].weight
            m.blocks[0]["fc"].weight = nn.Parameter(torch.randn(D, D) + k)
            del w
            assert _rel(m(IDS), c(IDS)) < RTOL


def test_parametrized_weights():
    from torch.nn.utils import parametrize

    class Doubled(nn.Module):
        def forward(self, w):
            return 2 * w

    m = PreLN()
    parametrize.register_parametrization(m.blocks[0]["fc"], "weight", Doubled())
    with torch.no_grad():
        _same_after(m, lambda m: m.blocks[0]["fc"].parametrizations.weight.original.mul_(-1.0).add_(1.0))


def test_optimizer_steps_between_inference_calls():
    """Train eagerly, run the compiled model under no_grad in between (evaluation during training)."""
    m = PreLN()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    c, reports = _compiled(m)
    for _ in range(3):
        with torch.no_grad():
            assert _rel(m(IDS), c(IDS)) < RTOL
        opt.zero_grad()
        m(IDS).square().mean().backward()
        opt.step()
    with torch.no_grad():
        assert _rel(m(IDS), c(IDS)) < RTOL
    _folded(reports)


def test_training_graph_sees_writes_through_data():
    """Under autograd the edits were in the graph already; a `p.data` write must stay seen there too."""
    def change(m):
        for p in _each_weight(m):
            p.data.mul_(1.5)

    _same_after(PreLN(), change, grad=True)


def test_deferred_norms_see_changed_beta_and_weights():
    """`lnfold.defer`: a deferred reader's bias `W β + b` is computed from β and W too."""
    m = PreLN()
    c, reports = _compiled(m, defer="on")
    with torch.no_grad():
        assert _rel(m(IDS), c(IDS)) < RTOL
        _folded(reports)
        m.ln_f.bias.data.add_(3.0)
        m.head.weight.data.mul_(-2.0)
        m.blocks[1]["ln"].bias.data.add_(1.0)
        assert _rel(m(IDS), c(IDS)) < RTOL


def test_edits_are_float64_exact():
    """At inference the edits are computed in float64 and rounded once: the compiled model is as
    close to a float64 run as the original (not a second fp32 rounding of each mean)."""
    m = PreLN()
    c, reports = _compiled(m)
    m64 = PreLN().double()
    m64.load_state_dict({k: v.double() for k, v in m.state_dict().items()})
    with torch.no_grad():
        ref = m64(IDS)
        assert _rel(ref, c(IDS)) <= 4 * max(_rel(ref, m(IDS)), 1e-7)
    _folded(reports)


def test_a_looked_up_table_is_edited_row_by_row_after_the_lookup():
    """The table stays as it is in the graph (no pass over the whole vocabulary per call): the rows
    looked up are centered, in float64. Tied to the head, the head still reads the original."""
    graphs = []

    def inner(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    m = PreLN(tied=True)
    torch._dynamo.reset()
    c = torch.compile(m, backend=lnfold_backend_with(inner=inner))
    with torch.no_grad():
        assert _rel(m(IDS), c(IDS)) < RTOL
        from lnfold.fx_rewrite.apply import lookup_centered

        lookups = [n for n in graphs[-1].graph.nodes if n.target is lookup_centered]
        assert len(lookups) == 1 and lookups[0].args[1].op == "placeholder"  # the table: its rows are centered
        m.emb.weight.data.mul_(-1.5).add_(2.0)
        assert _rel(m(IDS), c(IDS)) < RTOL


@pytest.mark.slow
@pytest.mark.parametrize("options", [{}, {"freezing": True}], ids=["inductor", "freezing"])
def test_under_inductor_the_backend_keeps_no_weight_inductor_alone_would_not(options):
    """Inductor compiles the folded graph: after `p.data` writes the backend computes what Inductor
    alone computes on the original (with `freezing` too: whatever Inductor's contract for a frozen
    weight, the backend keeps no weight of its own), and, here, what eager computes."""
    state = PreLN().state_dict()
    outputs = {}
    for backend in ("lnfold", "inductor"):  # (one after the other: Dynamo's reset drops compiled code)
        m = PreLN()
        m.load_state_dict(state)
        torch._dynamo.reset()
        c = torch.compile(m, backend=backend, options=dict(options))
        with torch.no_grad():
            c(IDS)
            m.blocks[0]["fc"].weight.data.mul_(1.5)
            m.emb.weight.data.add_(1.0)
            outputs[backend], eager = c(IDS), m(IDS)
    assert _rel(outputs["inductor"], outputs["lnfold"]) < RTOL
    assert _rel(eager, outputs["lnfold"]) < RTOL  # (torch 2.13: Inductor alone sees the writes, freezing or not)
