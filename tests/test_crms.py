"""CRMSNorm (mode="crms"): real architectures through both frontends and the CLI, a planted bug,
and a fallback the cost rule must choose. Weights are adversarial (lnfold.zoo): large-mean sources,
random γ/β, so a missed centering, drop or decompression shows in the outputs."""
from __future__ import annotations

import copy
import subprocess
from dataclasses import replace
import sys

import numpy as np
import onnx
import pytest
import torch

from lnfold import zoo
from lnfold.fx_rewrite import fold_module
from lnfold.onnx_rewrite import VerificationError, fold_model
from lnfold.passes.plan import FoldDecompression, Identity, Project

D = 64  # the zoo models' width


def _widths(model: onnx.ModelProto) -> set:
    """Last-axis sizes of every inner tensor, as onnx's shape inference sees the folded graph."""
    inf = onnx.shape_inference.infer_shapes(model)
    out = set()
    for v in list(inf.graph.value_info) + list(inf.graph.output):
        dims = v.type.tensor_type.shape.dim
        if dims and dims[-1].HasField("dim_value"):
            out.add(dims[-1].dim_value)
    return out


def _fx_widths(module, args) -> set:
    """Last-axis sizes of every tensor the folded module computes (run under FX's interpreter)."""
    seen = set()

    class Probe(torch.fx.Interpreter):
        def run_node(self, n):
            r = super().run_node(n)
            if isinstance(r, torch.Tensor) and r.ndim:
                seen.add(r.shape[-1])
            return r

    Probe(module).run(*args)
    return seen


# name -> (norms, compressed, decompressions in the ONNX fold)
EXPECTED = {"gpt2": (5, 5, 0), "vit": (5, 5, 1), "gpt_neox": (5, 5, 0)}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_onnx_pre_ln_models_compress(zoo_onnx, name):
    _, _, model = zoo_onnx(name)
    res = fold_model(model, mode="crms")
    norms, compressed, dec = EXPECTED[name]
    assert (res.report.folded, res.report.compressed) == (norms, compressed)
    [c] = res.report.compression
    assert c.verdict == "compressed" and c.width == D and c.decompressions == dec
    assert D - 1 in _widths(res.model)  # the stream is d-1 wide
    assert "LayerNormalization" not in [n.op_type for n in res.model.graph.node]
    assert res.max_rel_err < 1e-5  # verified against the original in onnxruntime
    assert res.report.to_dict()["compression"][0]["verdict"] == "compressed"


def test_onnx_gpt2_tied_head_is_untied_and_sources_shrink(zoo_onnx):
    """The tied wte feeds the embedding Gather (centered, last column dropped) and the lm_head
    (γ and the decompression folded in): two different clones, the original left unread."""
    _, _, model = zoo_onnx("gpt2")
    res = fold_model(model, mode="crms", target="portable")
    inits = {i.name: tuple(i.dims) for i in res.model.graph.initializer}
    vocab = 101
    assert (vocab, D - 1) in inits.values()  # the embedding table, one column fewer
    assert (D - 1, vocab) in inits.values() or (vocab, D - 1) in inits.values()
    assert "model.lm_head.weight" not in inits


def test_onnx_bert_only_the_embedding_component_compresses(zoo_onnx):
    _, _, model = zoo_onnx("bert")
    res = fold_model(model, mode="crms", target="onnx")
    assert (res.report.folded, res.report.kept, res.report.compressed) == (1, 4, 1)
    [c] = res.report.compression
    # its output feeds q/k/v (absorbed) and the first block's residual Add (decompressed)
    assert c.decompressions == 1
    assert D - 1 in _widths(res.model)
    assert res.max_rel_err < 1e-5


@pytest.mark.parametrize("name", ["gpt2", "vit", "gpt_neox"])
def test_fx_pre_ln_models_compress(name, zoo_program):
    module, args, program = zoo_program(name)
    res = fold_module(program, args, mode="crms")
    assert res.report.compressed == 5 and res.report.kept == 0
    assert D - 1 in _fx_widths(res.module, args)
    assert res.max_rel_err < 1e-5
    ref = copy.deepcopy(module).double()(*args)  # exactness against float64 directly
    got = res.module(*args)
    assert (got.double() - ref).abs().max() / ref.abs().max() < 1e-5


def test_fx_bert_falls_back_by_the_cost_rule(zoo_program):
    """torch.export keeps BERT's eval-mode dropout: the embedding norm's output reaches q/k/v and
    the residual Add through one node, so it must be decompressed, and for one block that costs
    more than compression saves: RMSNorm, with the reason."""
    _, args, program = zoo_program("bert")
    res = fold_module(program, args, mode="crms")
    [c] = res.report.compression
    assert c.verdict == "rms" and "decompressing the output of `layer_norm`" in c.reason
    assert res.report.folded == 1 and res.max_rel_err < 1e-5


def test_lone_norm_read_by_a_graph_output_falls_back():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(50, 32)
            self.ln = torch.nn.LayerNorm(32)

        def forward(self, ids):
            return self.ln(self.emb(ids))

    res = fold_module(zoo.adversarial(Net()), (torch.randint(0, 50, (2, 5)),), mode="crms")
    [c] = res.report.compression
    assert c.verdict == "rms" and "would cost more than compression saves" in c.reason


def _sabotaged(kind):
    """make_plan with one CRMS edit broken: a reader reads z as if it were the first d-1 entries
    (decompression skipped), or a source keeps its last row and loses its first instead."""
    from lnfold.passes import make_plan

    def plan_fn(view, mode="rms", **kw):
        plan = make_plan(view, mode, **kw)
        d = next(cc.width for cc in plan.compressions if cc.compressed)
        for k, e in enumerate(plan.const_edits):
            if kind == "decompression" and any(isinstance(op, FoldDecompression) for op in e.ops):
                e = replace(e, ops=tuple(Project(op.axis, Identity(d), d - 1) if isinstance(op, FoldDecompression) else op
                                         for op in e.ops))
                return replace(plan, const_edits=[*plan.const_edits[:k], e, *plan.const_edits[k + 1:]])
        raise AssertionError("no edit to sabotage")

    return plan_fn


def test_planted_bug_skipped_decompression_fails_verification(zoo_onnx, zoo_program, monkeypatch):
    import lnfold.onnx_rewrite.api as onnx_api
    import lnfold.fx_rewrite.api as fx_api

    _, _, model = zoo_onnx("gpt2")
    fold_model(model, mode="crms")  # sound as planned
    monkeypatch.setattr(onnx_api, "make_plan", _sabotaged("decompression"))
    with pytest.raises(VerificationError):
        fold_model(model, mode="crms")
    monkeypatch.setattr(fx_api, "make_plan", _sabotaged("decompression"))
    _, args, program = zoo_program("gpt2")
    with pytest.raises(VerificationError):
        fold_module(program, args, mode="crms")


def test_cli_fold_crms(zoo_onnx, tmp_path):
    _, _, model = zoo_onnx("gpt2")
    src, dst = tmp_path / "m.onnx", tmp_path / "f.onnx"
    onnx.save(model, src)
    p = subprocess.run([sys.executable, "-m", "lnfold", "fold", str(src), "-o", str(dst), "--mode", "crms"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "compressed to 63 features" in p.stdout
    assert D - 1 in _widths(onnx.load(dst))
    h = subprocess.run([sys.executable, "-m", "lnfold", "fold", "--help"], capture_output=True, text=True)
    assert "crms" in h.stdout and "d-1" in h.stdout


def test_crms_norm_matches_rmsnorm_of_the_decompressed_vector():
    from lnfold.fx_rewrite.crms import crms_norm, decompress

    z = torch.randn(4, 7, dtype=torch.float64)
    full = torch.cat([z, -z.sum(-1, keepdim=True)], -1)
    want = torch.nn.functional.rms_norm(full, (8,), eps=1e-5)
    got = crms_norm(z, 8, 1e-5)
    assert torch.allclose(got, want[:, :7]) and torch.allclose(decompress(got, None, None), want)
    np.testing.assert_allclose(full.mean(-1).numpy(), 0, atol=1e-12)


@pytest.mark.slow
def test_backend_crms_inference_and_training_gradients():
    """torch.compile(backend=lnfold, mode crms): the inference cache and the training graph
    (compressed weights computed from the optimizer's parameters) give the original's outputs
    and gradients."""
    import copy

    from lnfold.fx_rewrite import lnfold_backend_with

    module, args = zoo.gpt2()
    reports = []
    backend = lnfold_backend_with(mode="crms", on_report=reports.append)
    ref = module(*args)
    with torch.no_grad():
        out = torch.compile(copy.deepcopy(module), backend=backend)(*args)
    assert reports[-1].compressed == 5 and not reports[-1].notes  # no note: the fold was not abandoned
    assert float((out - ref).abs().max() / ref.abs().max()) < 1e-5

    eager, folded = copy.deepcopy(module).train(), copy.deepcopy(module).train()
    for m in (eager, folded):
        for mod in m.modules():
            if isinstance(mod, torch.nn.Dropout):
                mod.p = 0.0
    compiled = torch.compile(folded, backend=backend)
    eager(*args).double().pow(2).mean().backward()
    compiled(*args).double().pow(2).mean().backward()
    assert reports[-1].compressed == 5 and not reports[-1].notes
    for (name, p), q in zip(eager.named_parameters(), folded.parameters()):
        if p.grad is not None:
            assert float((p.grad - q.grad).abs().max() / (p.grad.abs().max() + 1e-12)) < 1e-4, name


class _BiaslessReaderWritesStream(torch.nn.Module):
    """lnA's only reader `fc` has no bias and writes a second stream: CRMS gives fc a new bias
    `W β` that takes fc's own source edits (centered, last row dropped) as well."""

    def __init__(self, d: int = 16, vocab: int = 23) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb, self.emb2 = torch.nn.Embedding(vocab, d), torch.nn.Embedding(vocab, d)
        for e in (self.emb, self.emb2):
            e.weight.data += 3 * torch.randn(vocab, 1, generator=g)
        self.lnA, self.lnB = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        for ln in (self.lnA, self.lnB):
            ln.weight.data, ln.bias.data = 1 + 0.5 * torch.randn(d, generator=g), 0.5 * torch.randn(d, generator=g)
        self.fc = torch.nn.Linear(d, d, bias=False)
        self.fc.weight.data += 2 * torch.randn(d, 1, generator=g)
        self.head = torch.nn.Linear(d, 3)

    def forward(self, ids):
        return self.head(self.lnB(self.fc(self.lnA(self.emb(ids))) + self.emb2(ids)))


def test_backend_new_bias_of_a_reader_that_writes_a_stream():
    """The backend computes that new bias in the graph (the same edit walk as fold_module's
    float64 one): both streams compressed, outputs equal."""
    from lnfold.fx_rewrite import lnfold_backend_with

    m = _BiaslessReaderWritesStream().eval()
    ids = torch.randint(0, 23, (2, 6), generator=torch.Generator().manual_seed(1))
    graphs, reports = [], []

    def inner(gm, _):
        graphs.append(gm)
        return gm.forward

    assert fold_module(m, (ids,), mode="crms").report.compressed == 2
    c = torch.compile(m, backend=lnfold_backend_with(mode="crms", inner=inner, on_report=reports.append))
    with torch.no_grad():
        ref, got = m(ids), c(ids)
    assert reports[-1].compressed == 2
    assert sum("crms_norm" in str(n.target) for n in graphs[-1].graph.nodes) == 2  # folded, not the fallback
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_written_out_norm_becomes_crms_in_fold_module_and_the_backend():
    """A LayerNorm written out (mean, x - mean, variance, γ, β) read by a Linear head: CRMSNorm
    reads the stream and replaces its last op (it took the first mean for an aten layer_norm: a
    width mismatch in fold_module and the backend)."""
    from lnfold.fx_rewrite import backend as fx_backend, lnfold_backend_with

    from .test_defer import HandNormHead

    m = zoo.adversarial(HandNormHead())
    ids = torch.randint(0, 11, (2, 6), generator=torch.Generator().manual_seed(1))
    res = fold_module(m, (ids,), mode="crms", dynamic=False)  # verified against float64
    assert [c.verdict for c in res.report.compression] == ["compressed"]
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(m, backend=lnfold_backend_with(mode="crms", verify=True, inner=lambda gm, _: gm.forward))(ids)
        want = m(ids)
    assert [c.verdict for c in fx_backend.reports[-1].compression] == ["compressed"]
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5
