"""Issue 43 item 4: sizes are checked before the work and memory they would cost.

Verification makes up inputs from the model's input shapes (onnx_rewrite/inputs.py): a fixed
shape of a billion rows, or `--dim batch=100000000`, was allocated as asked and ended in a
MemoryError (exit 3) after gigabytes. A transformers config.json claiming 10,000 layers built and
planned all of them (minutes) before the fold found the files hold three. Each is now one line,
exit 2, before anything is allocated or built. The CLI runs as a subprocess under an address-space
limit (RLIMIT_AS), so that an allocation of the claimed size fails the test instead of the machine.

The fold's passes being linear in the graph's size is measured, not tested here
(benchmarks/foldscale.py); what is tested is the behaviour of the helpers made linear for it.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

from tests import onnx_graphs as G

REPO = Path(__file__).parents[1]
LIMIT = 3 << 30  # address space of the CLI's process: imports and a small fold fit, gigabytes of inputs do not


def _limited():
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))


def lnfold(*args, cwd) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("LNFOLD_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "lnfold", *map(str, args)], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=120, preexec_fn=_limited)


def one_line(r: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == code and len(lines) == 1, (r.returncode, r.stderr)
    assert lines[0].startswith("lnfold: error: ") and "internal error" not in lines[0], lines[0]
    for n in needles:
        assert n in lines[0], f"{n!r} not in {lines[0]!r}"
    return lines[0]


def huge_fixed_batch() -> onnx.ModelProto:
    """pre_ln with its ids input fixed at [1000000000, 5] (int64: 37 GiB of made-up inputs)."""
    m = G.pre_ln()
    m.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 10**9
    return m


def test_a_fixed_input_shape_too_big_to_make_up_is_refused_before_allocating(tmp_path):
    onnx.save(huge_fixed_batch(), tmp_path / "m.onnx")
    r = lnfold("fold", "m.onnx", "-o", "out.onnx", cwd=tmp_path)
    line = one_line(r, 2, "ids", "1000000000", "--inputs", "--no-verify")
    assert "37.3 GiB" in line  # the size it would take
    assert not (tmp_path / "out.onnx").exists() and not list(tmp_path.glob(".lnfold-*"))
    # unverified, the model folds: the size is verification's, not the fold's
    from lnfold.onnx_rewrite import fold_model

    assert fold_model(huge_fixed_batch(), verify=False).report.folded == 3


def test_a_dim_too_big_to_make_up_is_refused_before_allocating(tmp_path):
    onnx.save(G.float_input_pre_ln(dynamic=True), tmp_path / "m.onnx")
    r = lnfold("fold", "m.onnx", "-o", "out.onnx", "--dim", "batch=100000000", cwd=tmp_path)
    one_line(r, 2, "100000000", "--dim NAME=SIZE", "--inputs")
    assert not (tmp_path / "out.onnx").exists()


def test_the_api_refuses_the_same_sizes_and_names_the_budget(monkeypatch):
    """Made-up inputs over inputs.MAX_INPUT_BYTES (all inputs of one run) are refused where they
    are made (inputs.candidates) and before the fold (check_verify_args); the budget is lowered
    here so that the refusal is seen on a small model without allocating anything big."""
    from lnfold.onnx_rewrite import LnfoldError, fold_model
    from lnfold.onnx_rewrite import inputs as synth
    from lnfold.onnx_rewrite.api import check_verify_args

    model = G.float_input_pre_ln(dynamic=True)
    monkeypatch.setattr(synth, "MAX_INPUT_BYTES", 4096)
    with pytest.raises(LnfoldError, match="more than the 4 KiB") as e:
        check_verify_args(model, None, {"batch": 100})  # 100 x 5 x 8 float32: 16,000 bytes
    assert len(str(e.value).splitlines()) == 1
    with pytest.raises(LnfoldError, match=r"15\.6 KiB \(x \[100, 5, 8\] float32\)"):
        next(synth.candidates(model, {"batch": 100}))
    with pytest.raises(LnfoldError, match="more than the 4 KiB"):
        fold_model(model, dims={"batch": 100})
    # a plan that fits is made up; a later, bigger try is skipped rather than refused
    tries = list(synth.candidates(model, {"batch": 20}))  # 20 x 5 x 8 x 4 = 3,200 bytes
    assert tries and all(sum(a.nbytes for a in feeds.values()) <= 4096 for _, feeds in tries)
    assert fold_model(model, dims={"batch": 20}).report.folded


# --- a checkpoint whose config.json claims more layers than its files hold ------------------------

transformers = pytest.importorskip("transformers")


def gpt2_checkpoint(folder: Path, layers: int = 2) -> Path:
    import torch

    from lnfold.zoo import adversarial

    cfg = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=layers, n_head=2,
                               bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    adversarial(transformers.GPT2LMHeadModel(cfg)).save_pretrained(folder)
    return folder


def test_a_config_claiming_layers_the_files_do_not_hold_is_refused_quickly(tmp_path, capsys):
    from lnfold.onnx_rewrite.cli import main

    src = gpt2_checkpoint(tmp_path / "ck")
    config = json.loads((src / "config.json").read_text())
    config["n_layer"] = 10_000
    (src / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    t0 = time.perf_counter()
    rc = main(["fold", str(src), "-o", str(tmp_path / "out")])
    took = time.perf_counter() - t0
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, (rc, err)
    assert "10000 layers" in lines[0] and "hold 2" in lines[0], lines[0]
    assert took < 5, f"refused after {took:.1f} s"
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".lnfold-*"))


def test_a_config_claiming_one_layer_more_than_the_files_is_refused(tmp_path):
    """Not only absurd claims: 7 layers claimed, 6 stored (blocks 0 … 5) is as wrong."""
    import lnfold
    from lnfold.passes import LnfoldError

    src = gpt2_checkpoint(tmp_path / "ck", layers=6)
    config = json.loads((src / "config.json").read_text())
    config["n_layer"] = 7
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(LnfoldError, match=r"claims 7 layers .* hold 6 \(") as e:
        lnfold.fold_checkpoint(src, tmp_path / "out", verify=False)
    assert len(str(e.value).splitlines()) == 1


# --- helpers made linear in the graph's size (benchmarks/foldscale.py measures the fold) ----------

def test_float_dtype_shares_one_walk_between_norms_and_finds_what_it_finds_alone(monkeypatch):
    """norms.float_dtype with a memo shared by the norms of a fold (the emission's): each tensor is
    entered once for all of them (without one, each norm of a stream without value_info walked
    back to the stream's start: quadratic in depth), and each norm's dtype is the one a walk of
    its own finds."""
    import onnx_graphsurgeon as gs

    from lnfold.onnx_rewrite import norms

    for dtype in (np.float32, np.float16):
        graph = gs.import_onnx(G.pre_ln(layers=30, dtype=dtype))
        xs = [n.inputs[0] for n in graph.nodes if n.op == "LayerNormalization"]
        assert len(xs) == 31 and all(x.dtype is None for x in xs[1:])  # (no value_info: found by walking)
        alone = [norms.float_dtype(x) for x in xs]
        entered = []
        real = norms.is_constant
        monkeypatch.setattr(norms, "is_constant", lambda t: entered.append(t.name) or real(t))
        memo: dict = {}
        shared = [norms.float_dtype(x, memo) for x in xs]
        monkeypatch.setattr(norms, "is_constant", real)
        assert shared == alone and all(d == np.dtype(dtype) for d in shared)
        assert len(entered) == len(set(entered)) <= len(graph.tensors())  # each tensor once, all norms together
        # a Cast says its own dtype; a tensor met again on its own walk (a cycle) finds nothing there
        assert norms.float_dtype(xs[5], {xs[5].name: np.dtype(np.float64)}) == np.float64


def test_float_dtype_walks_inputs_in_order_and_stops_at_a_non_float_type():
    """The first float dtype in depth-first order, as the walk without a memo found it: a declared
    integer tensor ends its branch, LayerNormalization and Gather are walked through their data
    input only."""
    import onnx_graphsurgeon as gs

    from lnfold.onnx_rewrite import norms

    ids = gs.Variable("ids", np.int64, [2, 3])
    table = gs.Constant("table", np.zeros((4, 8), np.float16))
    scale = gs.Constant("scale", np.ones(8, np.float32))
    x = gs.Variable("x")
    gs.Node("Gather", inputs=[table, ids], outputs=[x])
    n = gs.Variable("n")
    gs.Node("LayerNormalization", inputs=[x, scale], outputs=[n])
    s = gs.Variable("s")
    gs.Node("Add", inputs=[ids, n], outputs=[s])
    memo: dict = {}
    assert norms.float_dtype(s, memo) == np.float16 and memo["ids"] is None
    assert norms.float_dtype(n, memo) == np.float16 and norms.float_dtype(n) == np.float16
