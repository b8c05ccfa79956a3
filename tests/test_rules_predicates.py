"""The questions passes ask of a rule (passes/rules.py's predicates and accessors, issue 44): what
each answers for the rules frontends write, and that no module but rules.py reads a rule's params."""
import pathlib
import re

from lnfold.passes.rules import (branch_op, data_input, difference, is_cast_or_identity, is_product, is_quotient,
                                 is_sum_of_two, kind_of, mean_axes, operands, rule, spelled_sizes, squared_inputs)
from lnfold.passes.view import SizeOf

ROOT = pathlib.Path(__file__).resolve().parents[1]


def branch(r):
    return rule("in_branch", op=r)


def test_mean_axes_only_for_a_mean_that_keeps_its_dims():
    assert mean_axes(rule("reduce", data=0, axes=[2, 1], keepdims=True, op="mean")) == (1, 2)
    assert mean_axes(rule("reduce", data=0, axes=[1], keepdims=False, op="mean")) is None
    assert mean_axes(rule("reduce", data=0, axes=[1], keepdims=True, op="sum")) is None
    assert mean_axes(rule("reduce", data=0, axes=None, keepdims=True, op="mean")) is None
    assert mean_axes(rule("elementwise", data=0, op="identity")) is None
    assert mean_axes(None) is None


def test_data_input():
    assert data_input(rule("reduce", data=1, axes=[1], keepdims=True, op="mean")) == 1
    assert data_input(rule("pow", exponent=2)) == 0  # the default: input 0
    assert data_input(branch(rule("elementwise", data=2, op="cast"))) == 2


def test_casts_and_identities_but_no_other_elementwise_op():
    assert is_cast_or_identity(rule("elementwise", data=0, op="cast"))
    assert is_cast_or_identity(rule("elementwise", data=0, op="identity"))
    assert not is_cast_or_identity(rule("elementwise", data=0, op="dropout"))
    assert not is_cast_or_identity(rule("elementwise", data=0, op="neg"))
    assert not is_cast_or_identity(rule("clamp", data=0))
    assert not is_cast_or_identity(None)


def test_products_and_quotients():
    mul, div = rule("scale", operands=[0, 1]), rule("scale", operands=[0, 1], divide=True)
    assert is_product(mul) and not is_quotient(mul)
    assert is_quotient(div) and not is_product(div)
    assert not is_quotient(rule("broadcast", data=[0, 1])) and not is_quotient(None)
    assert operands(div) == (0, 1) and operands(rule("scale", operands=[1, None])) == (1, None)


def test_operands_of_two_operand_rules_only():
    assert operands(rule("broadcast", data=[0, 1], minus=[1])) == (0, 1)
    assert operands(rule("broadcast", data=[0])) is None  # an expand
    assert operands(rule("broadcast", data=[0, 1, 4])) is None  # input + skip + bias
    assert operands(rule("pow", data=0, exponent=2)) is None
    assert operands(None) is None


def test_difference_is_kept_then_subtracted():
    assert difference(rule("broadcast", data=[0, 1], minus=[1])) == (0, 1)
    assert difference(rule("broadcast", data=[0, 1], minus=[0])) == (1, 0)  # rsub
    assert difference(rule("broadcast", data=[0, 1])) is None  # an Add
    assert difference(rule("scale", operands=[0, 1])) is None
    assert not is_sum_of_two(rule("broadcast", data=[0, 1], minus=[1]))


def test_squared_inputs():
    assert squared_inputs(rule("pow", data=0, exponent=2)) == (0,)
    assert squared_inputs(rule("pow", data=0, exponent=3)) is None
    assert squared_inputs(rule("scale", operands=[0, 1])) == (0, 1)  # d * d: a square where both are d
    assert squared_inputs(rule("scale", operands=[0, 1], divide=True)) is None
    assert squared_inputs(rule("scale", operands=[0, None])) is None  # d * 2.0
    assert squared_inputs(None) is None


def test_branch_ops_answer_as_their_op():
    mean = rule("reduce", data=0, axes=[2], keepdims=True, op="mean")
    assert branch_op(branch(mean)) is mean and branch_op(mean) is None and branch_op(None) is None
    assert kind_of(branch(branch(rule("pad", data=0))))[0] == "pad"
    assert mean_axes(branch(mean)) == (2,)
    assert is_product(branch(rule("scale", operands=[0, 1])))


def test_spelled_sizes_are_the_rules_own():
    sizes = [-1, SizeOf("x", 2)]
    assert spelled_sizes(rule("reshape", data=0, sizes=sizes, slot=1)) is sizes
    assert spelled_sizes(rule("reshape", data=0)) is None  # a flatten spells none
    assert spelled_sizes(branch(rule("reshape", data=0, sizes=sizes))) is None  # as sized_off_stream reads it
    assert spelled_sizes(None) is None


def test_only_rules_reads_a_rules_params():
    readers = []
    for folder in ("passes", "fx_rewrite", "onnx_rewrite"):
        for f in sorted((ROOT / folder).rglob("*.py")):
            if f.name != "rules.py" or f.parent.name != "passes":
                readers += [f"{f.relative_to(ROOT)}:{i}" for i, line in enumerate(f.read_text().splitlines(), 1)
                            if re.search(r"\.params\b(?!_)", line)]
    assert readers == [], "ask passes/rules.py (a predicate or accessor there) instead of reading rule.params"
