"""Edges of the torch frontend no other test reaches: the op builders that must leave an op opaque
(fx_rewrite/classify.py), the refusals of the module-level folds (holders.py, handoff.py, train.py),
the gate on non-tensor outputs (verify.py), and the one-line errors for bad files and options
(safetensors_io.py, checkpoint.py, checkpoint_fold.py, handoff.restore_rmsnorm).

Tiny modules through the real torch.export; the sources that write the stream have a large mean
(bias +5) and γ/β are random, so a fold that skips a centering is far off in float64."""
from __future__ import annotations

import copy
import hashlib
import json
import struct

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lnfold.fx_rewrite import (LnfoldError, NothingToFold, VerificationError, analyze_module, check_equivalent,
                               fold_checkpoint, fold_for_training, fold_module, fold_to_rmsnorm, restore_rmsnorm,
                               slice_module)
from lnfold.fx_rewrite.checkpoint import read_checkpoint
from lnfold.fx_rewrite.safetensors_io import read_header
from lnfold.fx_rewrite.verify import judge_outputs

D = 16


def _randomized(m: nn.Module) -> nn.Module:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
        m.emb.bias.add_(5.0)  # a large mean in the stream: a missed centering shows
    return m.eval()


class Between(nn.Module):
    """Linear -> `mid` -> LayerNorm -> Linear: `mid` stands between the stream's writer and its norm."""

    def __init__(self, mid) -> None:
        super().__init__()
        self.emb, self.ln, self.out, self.mid = nn.Linear(8, D), nn.LayerNorm(D), nn.Linear(D, 4), mid

    def forward(self, x):
        return self.out(self.ln(self.mid(self.emb(x))))


ARGS = (torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1)),)


def _verdict(mid) -> tuple[str, str]:
    (norm,) = analyze_module(_randomized(Between(mid)), ARGS).norms
    return norm.verdict, norm.reason


def _digest(m: nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in sorted(m.state_dict().items()):
        h.update(k.encode() + v.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _max_rel_err_f64(module: nn.Module, folded: nn.Module) -> float:
    with torch.no_grad():
        ref = copy.deepcopy(module).double()(ARGS[0].double())
        got = copy.deepcopy(folded).double()(ARGS[0].double())
    return ((ref - got).abs().max() / ref.abs().max()).item()


# --- classify.py: ops whose builder must leave them opaque --------------------------------------

def test_a_floor_division_between_writer_and_norm_keeps_the_norm():
    """x // c is no scaling: a centered stream does not stay centered through it (classify._mul)."""
    verdict, reason = _verdict(lambda h: torch.div(h, 0.5, rounding_mode="floor"))
    assert verdict == "keep"
    assert "started by aten.div.Tensor_mode `div`, which no weight edit can make zero-mean" in reason


def test_a_roll_of_the_flattened_tensor_keeps_the_norm_and_a_roll_along_time_folds_exactly():
    """roll without dims moves features across rows (classify._reorder); along an axis it only moves rows."""
    verdict, reason = _verdict(lambda h: torch.roll(h, 1))
    assert verdict == "keep"
    assert "started by aten.roll.default `roll`, which no weight edit can make zero-mean" in reason
    module = _randomized(Between(lambda h: torch.roll(h, 1, 1)))
    res = fold_module(module, ARGS)
    assert (res.report.folded, res.report.kept) == (1, 0)
    assert _max_rel_err_f64(module, res.module) < 1e-5  # float32 weights, edited in float64


def test_a_one_operand_einsum_reading_the_stream_keeps_the_norm():
    """einsum("btd->bt") sums the feature axis: the vocabulary's einsum rule has two operands (classify._einsum)."""
    verdict, reason = _verdict(lambda h: h + torch.einsum("btd->bt", h)[..., None])
    assert verdict == "keep"
    assert "read by aten.einsum.default `einsum`: no rule for op `aten.einsum.default`" in reason


class MeanReader(nn.Module):
    """The stream's writer is also read by `h.mean()`, a mean over every axis, the feature axis included."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.ln, self.out = nn.Linear(8, D), nn.LayerNorm(D), nn.Linear(D, 4)

    def forward(self, x):
        h = self.emb(x)
        return self.out(self.ln(h)) + h.mean()


def test_a_mean_over_every_axis_that_reads_the_stream_keeps_the_norm_and_says_why():
    """x.mean() with no dim reduces the feature axis too: it sees the mean a centering removes (classify._reduce)."""
    (norm,) = analyze_module(_randomized(MeanReader()), ARGS).norms
    assert norm.verdict == "keep"
    assert norm.reason == ("its input `linear` is also read by aten.mean.default `mean`, whose result depends on "
                           "the mean")


class RenormedTable(nn.Module):
    """nn.Embedding(max_norm=...): torch.export renormalizes the table's rows in place before the lookup."""

    def __init__(self, max_norm) -> None:
        super().__init__()
        self.emb, self.ln1, self.mid = nn.Embedding(10, D, max_norm=max_norm), nn.LayerNorm(D), nn.Linear(D, D)
        self.ln2, self.out = nn.LayerNorm(D), nn.Linear(D, 4)

    def forward(self, ids):
        h = self.emb(ids)
        h = h + self.mid(self.ln1(h))
        return self.out(self.ln2(h))


IDS = (torch.tensor([[1, 2, 3], [4, 5, 6]]),)


def _renormed(max_norm) -> nn.Module:
    torch.manual_seed(0)
    module = RenormedTable(max_norm).eval()
    with torch.no_grad():
        module.emb.weight.add_(5.0)
    return module


def test_a_table_renormalized_in_place_is_not_centered_and_its_stream_is_recentered_exactly():
    """Centering the rows before max_norm's renormalization changes their norms: it was folded (analysis
    said fold; the gate refused it at 2.16 relative error). classify._embedding now sees the in-place write."""
    (plain,) = analyze_module(_renormed(None), IDS).streams
    assert plain.centered[0] == "`emb.weight` (aten.embedding.default `embedding`)"
    module = _renormed(0.01)
    (renormed,) = analyze_module(module, IDS).streams
    assert renormed.recentered == ["aten.embedding.default `embedding`"]
    assert not [c for c in renormed.centered if "emb.weight" in c]
    res = fold_module(module, IDS)
    assert (res.report.folded, res.report.recentered) == (2, 1)
    with torch.no_grad():
        ref = copy.deepcopy(module).double()(*IDS)
        got = copy.deepcopy(res.module).double()(*IDS)
    assert ((ref - got).abs().max() / ref.abs().max()).item() < 1e-5


# --- apply.py: a LayerNorm written out as several ops ---------------------------------------------

class WrittenOut(nn.Module):
    """A pre-norm block whose second norm is written out: mean, centered square, sqrt, divide, γ, β."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.ln, self.mid, self.out = nn.Linear(8, D), nn.LayerNorm(D), nn.Linear(D, D), nn.Linear(D, 4)
        self.gamma, self.beta = nn.Parameter(torch.randn(D)), nn.Parameter(torch.randn(D))

    def forward(self, x):
        h = self.emb(x)
        h = h + self.mid(self.ln(h))
        c = h - h.mean(-1, keepdim=True)
        return self.out(c / torch.sqrt((c * c).mean(-1, keepdim=True) + 1e-5) * self.gamma + self.beta)


@pytest.mark.parametrize("rotate", [None, "hadamard"])
def test_a_written_out_layer_norm_folds_exactly_with_its_gamma_in_its_readers(rotate):
    """gamma_into_readers on a written-out norm: its γ Mul goes (apply.Applier._swap); it used to pick
    the norm's first op (the collapsed view node lists γ among its inputs) and fail to unpack."""
    module = _randomized(WrittenOut())
    res = fold_module(module, ARGS, gamma_into_readers=True, rotate=rotate)
    assert (res.report.folded, res.report.kept) == (2, 0)
    assert not [n for n in res.module.graph.nodes if n.target == torch.ops.aten.mul.Tensor
                and any(a.name == "gamma" for a in n.all_input_nodes)]
    assert _max_rel_err_f64(module, res.module) < 1e-5


def test_slicing_the_stream_of_a_written_out_layer_norm_is_a_one_line_error():
    """The torch target cannot emit a written-out LayerNorm over a narrower stream: the plan leaves
    that stream unsliced with the reason (Capabilities.resize_refusal), not the emitter failing."""
    module = _randomized(WrittenOut())
    before = _digest(module)
    calibration = (torch.randn(32, 3, 8, generator=torch.Generator().manual_seed(2)),)
    with pytest.raises(LnfoldError, match=r"^no stream can be sliced: .*: slicing the stream of a written-out "
                                          r"LayerNorm \(mean\) is not implemented in the torch frontend$"):
        slice_module(module, calibration, fraction=0.25)
    assert _digest(module) == before


# --- the module-level folds: what they cannot edit ----------------------------------------------

class PlainAttribute(nn.Module):
    """A tensor that writes into the stream but is a plain attribute, not a parameter or buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.ln, self.out = nn.Linear(8, D), nn.LayerNorm(D), nn.Linear(D, 4)
        self.shift = torch.randn(D) + 5.0

    def forward(self, x):
        return self.out(self.ln(self.emb(x) + self.shift))


class FunctionalNorm(nn.Module):
    """F.layer_norm: a foldable stream, but no nn.LayerNorm module to swap for an RMSNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.out = nn.Linear(8, D), nn.Linear(D, 4)
        self.gamma = nn.Parameter(torch.randn(D))

    def forward(self, x):
        return self.out(F.layer_norm(self.emb(x), (D,), self.gamma))


@pytest.mark.parametrize("fold, who", [(fold_to_rmsnorm, "the eager RMSNorm hand-off"),
                                       (fold_for_training, "the module-level training fold")])
def test_a_tensor_made_outside_parameters_and_buffers_that_writes_the_stream_is_refused(fold, who):
    module = PlainAttribute().eval()
    before, shift = _digest(module), module.shift.clone()
    with pytest.raises(NothingToFold, match=f"`shift` writes into the stream but is not a parameter or buffer of "
                                            rf"the module \(a tensor made in forward\?\); {who} cannot edit it"):
        fold(module, ARGS)
    assert _digest(module) == before
    assert torch.equal(module.shift, shift)


@pytest.mark.parametrize("fold, message", [
    (fold_to_rmsnorm, "no nn.LayerNorm module can become an RMSNorm; first: "),
    (fold_for_training, "no nn.LayerNorm module can be swapped; first: ")])
def test_a_functional_layer_norm_has_no_module_to_swap(fold, message):
    module = FunctionalNorm().eval()
    before = _digest(module)
    with pytest.raises(NothingToFold) as e:
        fold(module, ARGS)
    assert str(e.value) == (message + "no nn.LayerNorm module to swap (a functional layer_norm in "
                                      "`FunctionalNorm.forward`); its stream is centered")
    assert _digest(module) == before


class SharedLinear(nn.Module):
    """One Linear writes the norm's stream (centered by a fold) and, called again, the output (uncentered)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.ln, self.out = nn.Linear(8, D), nn.LayerNorm(D), nn.Linear(D, D)

    def forward(self, x):
        return self.out(self.ln(self.emb(x))) + self.emb(x * 2)


@pytest.mark.parametrize("fold", [fold_to_rmsnorm, fold_for_training])
def test_a_module_read_centered_and_uncentered_is_refused_in_place_and_folded_in_a_graph(fold):
    """The module-level folds edit `emb.weight` itself, which both calls read (holders.conflict);
    fold_module edits a copy per reader in its graph."""
    module = _randomized(SharedLinear())
    before = _digest(module)
    with pytest.raises(NothingToFold, match="`emb.weight` is read centered and uncentered through one module "
                                            "attribute"):
        fold(module, ARGS)
    assert _digest(module) == before
    res = fold_module(module, ARGS)
    assert res.report.folded == 1
    assert _max_rel_err_f64(module, res.module) < 1e-5


class FloorDivided(nn.Module):
    """Two norms on a stream started by a floor division: centering it takes a recenter after it."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.ln1, self.mid = nn.Linear(8, D), nn.LayerNorm(D), nn.Linear(D, D)
        self.ln2, self.out = nn.LayerNorm(D), nn.Linear(D, 4)

    def forward(self, x):
        h = torch.div(self.emb(x), 0.5, rounding_mode="floor")
        h = h + self.mid(self.ln1(h))
        return self.out(self.ln2(h))


@pytest.mark.parametrize("fold, who", [(fold_to_rmsnorm, "the eager RMSNorm hand-off"),
                                       (fold_for_training, "the module-level training fold")])
def test_a_stream_that_needs_a_recenter_is_refused_by_the_module_level_folds_and_recentered_by_fold_module(fold, who):
    module = _randomized(FloorDivided())
    before = _digest(module)
    with pytest.raises(NothingToFold, match=f"needs a recenter of aten.div.Tensor_mode `div`, which {who} does not "
                                            r"insert \(fold_module or the lnfold backend do\)$"):
        fold(module, ARGS)
    assert _digest(module) == before
    res = fold_module(module, ARGS)
    assert (res.report.folded, res.report.recentered) == (2, 1)
    assert _max_rel_err_f64(module, res.module) < 1e-5


class OneReaderTwoNorms(nn.Module):
    """One Linear reads two norms: β into its bias would be W β1 + b after one and W β2 + b after the other."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.emb2 = nn.Linear(8, D), nn.Linear(8, D)
        self.ln1, self.ln2, self.out = nn.LayerNorm(D), nn.LayerNorm(D), nn.Linear(D, 4)

    def forward(self, x):
        return self.out(self.ln1(self.emb(x))) + self.out(self.ln2(self.emb2(x)))


def test_a_reader_of_two_norms_is_refused_by_the_hand_off_and_folded_by_fold_module():
    """holders.ModuleMap.plan asked the planner again with refusals that stop stream sources only, so
    a conflicted reader's bias came back each time: fold_to_rmsnorm looped forever."""
    module = _randomized(OneReaderTwoNorms())
    before = _digest(module)
    with pytest.raises(LnfoldError, match="^`out.bias` would need different values for its readers .*; the eager "
                                          r"RMSNorm hand-off cannot edit it \(fold_module can\)$"):
        fold_to_rmsnorm(module, ARGS)
    assert _digest(module) == before
    res = fold_module(module, ARGS, gamma_into_readers=True)
    assert res.report.folded == 2
    assert _max_rel_err_f64(module, res.module) < 1e-5


class BareWeight(nn.Module):
    """The norm's reader is F.linear on a bare Parameter: no Linear whose missing bias could take W β."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.ln, self.w = nn.Linear(8, D), nn.LayerNorm(D), nn.Parameter(torch.randn(4, D))

    def forward(self, x):
        return F.linear(self.ln(self.emb(x)), self.w)


def test_the_hand_off_refuses_a_reader_that_cannot_take_a_new_bias_and_restores_what_it_edited():
    """By the time it finds the reader (_new_biases) it has baked the centered `emb` weights: they go back."""
    module = _randomized(BareWeight())
    before = _digest(module)
    with pytest.raises(LnfoldError, match="^`linear_1` reads a folded norm through a layer that cannot take a new "
                                          "bias; the eager RMSNorm hand-off needs a bias there for β$"):
        fold_to_rmsnorm(module, ARGS)
    assert _digest(module) == before
    assert isinstance(module.ln, nn.LayerNorm)


def test_restoring_a_model_that_was_never_folded_is_a_one_line_error():
    module = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(LnfoldError, match="^the model has no config.lnfold: it was not saved from fold_to_rmsnorm's "
                                          "result$"):
        restore_rmsnorm(module)


def _tiny_gpt2(record: dict) -> nn.Module:
    import transformers

    config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=11, n_positions=8)
    model = transformers.GPT2LMHeadModel(config)
    model.config.lnfold = record
    return model


def test_restoring_names_that_are_not_layer_norms_is_a_one_line_error_that_changes_nothing():
    model = _tiny_gpt2({"rmsnorm": ["transformer.h.0.ln_1", "transformer.h.0.attn"], "new_biases": ["lm_head"]})
    with pytest.raises(LnfoldError, match="^`transformer.h.0.attn` is a GPT2Attention, not the LayerNorm config.lnfold "
                                          "names$"):
        restore_rmsnorm(model)
    assert isinstance(model.transformer.h[0].ln_1, nn.LayerNorm)
    assert model.lm_head.bias is None


def test_restoring_from_a_folder_without_the_new_biases_is_a_one_line_error_that_changes_nothing(tmp_path):
    from safetensors.torch import save_file

    save_file({"other": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    model = _tiny_gpt2({"rmsnorm": ["transformer.h.0.ln_1"], "new_biases": ["lm_head"]})
    with pytest.raises(LnfoldError, match=f"^`lm_head.bias` is not in {tmp_path}: not a folder saved from "
                                          "fold_to_rmsnorm's result$"):
        restore_rmsnorm(model, str(tmp_path))
    assert isinstance(model.transformer.h[0].ln_1, nn.LayerNorm)
    assert model.lm_head.bias is None


# --- verify.py: the gate on output leaves --------------------------------------------------------

def test_the_gate_fails_a_different_number_of_outputs_and_a_changed_non_tensor_output():
    t = torch.ones(3)
    assert judge_outputs([t, 2], [t, 2], None).ok
    missing = judge_outputs([t, 2], [t], None)
    assert not missing.ok and missing.failure == "1 outputs instead of 2"
    changed = judge_outputs([t, 2], [t, 3], None)
    assert not changed.ok and changed.failure == "output 2 became 3"


def test_check_equivalent_passes_a_fold_and_fails_a_changed_module():
    module = _randomized(Between(nn.Identity()))
    folded = fold_module(module, ARGS).module
    assert check_equivalent(module, folded, ARGS, {}) < 1e-5
    broken = _randomized(Between(nn.Identity()))
    with torch.no_grad():
        broken.out.bias.add_(1.0)
    with pytest.raises(VerificationError):
        check_equivalent(module, broken, ARGS, {})


# --- bad files and options: one line, nothing written --------------------------------------------

def _safetensors(path, header: dict, data: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_unreadable_safetensors_headers_are_one_line_errors_naming_the_file(tmp_path):
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x01\x02")
    long = tmp_path / "long.safetensors"
    long.write_bytes(struct.pack("<Q", 1000) + b"{}")
    entry = tmp_path / "entry.safetensors"
    _safetensors(entry, {"w": {"dtype": "F32", "shape": [2]}}, b"\0" * 8)  # no data_offsets
    for path, why in [(short, "shorter than a header"), (long, "header longer than the file"),
                      (entry, "tensor w: data_offsets None are not [begin, end]")]:
        with pytest.raises(LnfoldError) as e:
            read_header(path)
        assert str(e.value).startswith(f"{path}: not a readable safetensors file ({why}")
        assert "\n" not in str(e.value)


def test_a_checkpoint_whose_shard_index_is_not_json_is_a_one_line_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(LnfoldError, match=r"model.safetensors.index.json: not a shard index \("):
        read_checkpoint(tmp_path)


@pytest.mark.parametrize("jobs", [0, 1.5, "2"])
def test_fold_checkpoint_refuses_a_bad_jobs_count_before_reading_anything(tmp_path, jobs):
    with pytest.raises(LnfoldError, match=f"^jobs must be a positive integer, not {jobs!r}$"):
        fold_checkpoint(tmp_path / "absent", jobs=jobs)


def test_fold_checkpoint_of_a_folder_that_is_no_checkpoint_writes_nothing(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")  # no weights beside it
    with pytest.raises(LnfoldError, match=r": not a transformers checkpoint folder \(config.json with "):
        fold_checkpoint(src, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
