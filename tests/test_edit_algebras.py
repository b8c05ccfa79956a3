"""One interpreter of edit ops (passes/edits.apply_ops), three algebras: numpy in float64 (every
fold that computes a constant once), torch tensors (the module-level training fold, in forward)
and FX graph nodes (the backend under autograd). The same ops give the same tensor in all three."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import fx

from lnfold.fx_rewrite.apply import ATEN
from lnfold.fx_rewrite.edits import TENSOR, graph_algebra
from lnfold.passes.edits import (NUMPY, AddWeightTimes, Center, DataBasis, FoldDecompression, Identity, Ones, Project, Scale,
                                 Seeded, apply_ops)

RNG = np.random.default_rng(0)
CONSTS = {
    "w": RNG.normal(3.0, 1.0, (6, 8)),  # a large mean: a missed centering shows
    "ls": np.tile(RNG.normal(1.0, 0.5, (1, 8)), (3, 1)),  # a LayerScale vector along axis 1
    "v": RNG.normal(size=8),
    "r": RNG.normal(size=(5, 8)),  # a reader's weight, input features on axis 1
}
CASES = {
    "center": (Center(1),),
    "center-uniform": (Center(None),),
    "center-blocks": (Center(0, block=2, lo=2, hi=6),),
    "scale-then-center": (Scale("ls", 1, 1), Center(1)),
    "ones": (Ones(),),
    "drop": (Center(1), Project(1, Identity(8), 7)),
    "fold-decompression": (FoldDecompression(1),),
    "add-weight-times": (Project(1, Identity(8), 7), AddWeightTimes("r", 1, "v")),
}
# changes of basis with arithmetic: the eager tensor algebra multiplies, the training graph refuses
ROTATIONS = {
    "rotate": (Center(1), Project(1, Seeded("orthogonal", 8, 3), 8)),
    "slice": (Center(1), Project(1, DataBasis("pca", np.linalg.qr(RNG.normal(size=(8, 8)))[0]), 5)),
}


def _graph(ops, a):
    """`ops` built into an FX graph by graph_algebra, then run."""
    g = fx.Graph()
    ins = {n: g.placeholder(n) for n in CONSTS}
    out = apply_ops(ins["w"], ops, ins.__getitem__, graph_algebra(g, ATEN, a.shape))
    g.output(out)
    return fx.GraphModule(torch.nn.Module(), g)(**{n: torch.from_numpy(v) for n, v in CONSTS.items()})


@pytest.mark.parametrize("case", CASES)
def test_three_algebras_agree(case):
    ops = CASES[case]
    if case == "add-weight-times":  # W v has the reader's output features: edit a bias of that size
        CONSTS["w"], w = RNG.normal(size=(5, 1)), CONSTS["w"]
        ops = (AddWeightTimes("r", 1, "v"),)
    try:
        a = CONSTS["w"]
        want = apply_ops(a, ops, CONSTS.__getitem__, NUMPY)
        t = {n: torch.from_numpy(v) for n, v in CONSTS.items()}
        eager = apply_ops(t["w"], ops, t.__getitem__, TENSOR)
        graph = _graph(ops, a)
    finally:
        if case == "add-weight-times":
            CONSTS["w"] = w
    np.testing.assert_allclose(eager.numpy(), want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(graph.numpy(), want, rtol=1e-12, atol=1e-12)
    if any(isinstance(op, Center) for op in ops) and not isinstance(ops[-1], Project):
        assert not np.allclose(want, apply_ops(a, ops[:-1], CONSTS.__getitem__, NUMPY))  # the case edits


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_centering_is_judged_against_float64(dtype):
    """The tensor algebra takes a float16/bfloat16 mean in float32: the centered weight is within
    two roundings (of the mean, of the difference) of the float64 centering of the same weight."""
    w = torch.from_numpy(RNG.normal(30.0, 1.0, (4, 4096))).to(dtype)
    want = apply_ops(w.double().numpy(), (Center(1),), CONSTS.__getitem__, NUMPY)
    got = apply_ops(w, (Center(1),), CONSTS.__getitem__, TENSOR)
    bound = 2 * torch.finfo(dtype).eps * w.double().abs().max().item()
    assert np.abs(got.double().numpy() - want).max() <= bound


@pytest.mark.parametrize("case", ROTATIONS)
def test_projections_agree_and_keep_the_subspace(case):
    """`Project` by an orthogonal basis: numpy (float64) and eager torch agree; the kept columns are
    the first `keep` of a ×_axis B (so a slice of a rotation is the rotation's first entries); the
    training graph, which edits trained constants in the forward, refuses to multiply."""
    ops = ROTATIONS[case]
    a = CONSTS["w"]
    want = apply_ops(a, ops, CONSTS.__getitem__, NUMPY)
    q = ops[-1].basis.matrix()
    full = apply_ops(a, ops[:-1], CONSTS.__getitem__, NUMPY) @ q
    np.testing.assert_allclose(want, full[:, :ops[-1].keep], rtol=1e-12, atol=1e-12)
    t = {n: torch.from_numpy(v) for n, v in CONSTS.items()}
    np.testing.assert_allclose(apply_ops(t["w"], ops, t.__getitem__, TENSOR).numpy(), want, rtol=1e-12, atol=1e-12)
    with pytest.raises(TypeError, match="basis"):
        _graph(ops, a)


def test_op_answers_for_the_walkers():
    """What the checkpoint path, β into a new bias and the row-block editor ask of an op."""
    from lnfold.passes.edits import chunk_axis

    assert Scale("g", 0, 2).without_axis(1) == Scale("g", 0, 1)
    assert Center(None).without_axis(0) == Center(None)
    assert AddWeightTimes("w", 1, "b").without_axis(0) == AddWeightTimes("w", 1, "b")
    assert AddWeightTimes("w", 1, "b").renamed({"w": "W", "b": "B"}) == AddWeightTimes("W", 1, "B")
    assert Scale("g", 0, 1).constants() == ("g",) and Center(1).constants() == ()
    assert chunk_axis((Center(1), Scale("g", 0, 1)), 2) == 0  # each row on its own: streamed by rows
    assert chunk_axis((Center(0),), 2) is None  # a mean over the rows: whole
    assert chunk_axis((Center(1), Project(1, Identity(8), 7)), 2) is None  # the shape changes: whole


@pytest.mark.parametrize("shape, ops", [
    ((3000, 256), (Center(1),)),  # a token table centered along its features (3 MB: 6 blocks of rows)
    ((1200, 8, 64), (Scale("g", 0, 2), Center(2))),  # a LayerScale fold, then its centering, per row
    ((8000, 96), (Center(1, block=32),)),  # per-head runs
])
def test_a_big_constant_is_edited_by_blocks_of_rows_to_the_same_bytes(shape, ops):
    """compute_constants edits a tensor whose ops treat rows alone a block of rows at a time (the
    float64 temporaries stay in cache): every byte as the whole-tensor edit gives."""
    from lnfold.passes.edits import CACHE_BLOCK_BYTES, edited

    a = RNG.normal(3.0, 1.0, shape).astype(np.float32)
    assert a.nbytes > 2 * CACHE_BLOCK_BYTES  # (else it is edited whole)
    gamma = RNG.normal(1.0, 0.5, (shape[-1],))
    source = {"g": gamma}.__getitem__
    whole = apply_ops(a.astype(np.float64), ops, source, NUMPY).astype(np.float32)
    got = edited(a, ops, source)
    assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), whole.view(np.uint32))
    assert abs(float(got.astype(np.float64).mean(axis=-1).max())) < 1e-5  # centered (the mean was 3)
