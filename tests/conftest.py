"""Shared fixtures: real architectures from `transformers` config classes, exported once per session."""
from __future__ import annotations

import contextlib
import functools
import io
import sys

import pytest

# Bytecode is written even where the environment says not to (PYTHONDONTWRITEBYTECODE=1 on the CI
# machine): otherwise each worker rewrites and compiles every test module again (~6 s), and each of
# the suite's command-line runs compiles lnfold again (~0.25 s of its ~1 s start).
sys.dont_write_bytecode = False


def _one_core_per_worker() -> None:
    """Under pytest-xdist each worker gets its share of the cores for torch's intra-op threads:
    two workers of two threads each on two cores only contend."""
    import os

    import torch

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def _fewer_collections() -> None:
    """torch.export and the ONNX exporter allocate millions of small objects; with Python's default
    thresholds the cyclic collector took 6-10 % of a zoo architecture's export, rescanning the
    imported modules each time (2026-11-27: 0.5 -> 0.15 s per architecture). The objects alive
    after the imports are frozen out of the collector, and it runs less often; memory is ample."""
    import gc

    gc.freeze()
    gc.set_threshold(100_000, 50, 50)


def _one_torchlib_table_per_opset() -> None:
    """torch.onnx.export (dynamo) builds its torchlib table again for every export (0.8 s each on the
    CI machine, 2026-12-03): from a process's first export on, not only after its first fuzz export,
    every export shares one per opset. Patched at that first export: importing the table's module
    costs 1.8 s, which a run that exports nothing need not pay."""
    import torch.onnx

    from tests.fuzz.export import cache_torchlib_registry

    export = torch.onnx.export

    @functools.wraps(export)
    def export_sharing_the_table(*args, **kwargs):
        cache_torchlib_registry()
        return export(*args, **kwargs)

    torch.onnx.export = export_sharing_the_table


def pytest_configure(config):
    """The process's setup for running tests, and torch imported for them, except in pytest-xdist's
    controller: it hands the tests to its workers and runs none, and the workers start only once it
    has configured (torch's import there delayed every run by ~3 s)."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return
    from lnfold import zoo  # noqa: F401  (torch and lnfold before the collector's freeze)

    _one_core_per_worker()
    _fewer_collections()
    _one_torchlib_table_per_opset()


def export_quiet(module, args, names, **kw):
    from lnfold import zoo

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return zoo.export_onnx(module, args, names, **kw)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from a clean Dynamo: after a recompile of one code object (a transformers
    forward), Dynamo marks its sizes dynamic for every later compile, so a test's outcome would
    depend on which tests ran before it."""
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()
    yield


def _shared_exports(tmp_path_factory):
    """key -> ONNX ModelProto, each made once per run by `make()`: under pytest-xdist the first
    worker to need it saves it in the run's folder, the others load it."""
    import os

    import onnx
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # (the run's folder, not older runs')
    cache = {}

    def get(key: str, make):
        if key not in cache:
            path = shared / f"{key}.onnx"
            with FileLock(f"{path}.lock"):
                if not path.exists():
                    onnx.save(make(), f"{path}.tmp")
                    os.replace(f"{path}.tmp", path)
                cache[key] = onnx.load(path)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def zoo_module():
    """name -> (torch module, example args), each zoo model built once per worker (the zoo's modules
    are seeded: every worker builds the same). The folds never modify it (test_fx.py checks)."""
    from lnfold import zoo

    return functools.cache(lambda name: zoo.MODELS[name]())


@pytest.fixture(scope="session")
def zoo_program(zoo_module):
    """name -> (module, args, ExportedProgram): lnfold's own export of the zoo module, what
    fold_module makes of it first (fx_rewrite.api.export, dynamic sizes), once per worker. A
    program is read as it is and every tensor a fold edits is copied first
    (test_fx.py::test_an_exported_program_is_folded_as_it_is), so the tests of what comes after
    the export share one (a zoo GPT-2's export is most of a fold_module of it: ~2.5 s of ~3 s).
    `dynamic=False`: the static export, as fold_module(..., dynamic=False) makes it."""
    from lnfold.fx_rewrite.api import export

    @functools.cache
    def get(name: str, dynamic: bool = True):
        module, args = zoo_module(name)
        return module, args, export(module, args, dynamic=dynamic)

    return get


@pytest.fixture(scope="session")
def zoo_onnx(tmp_path_factory, zoo_module):
    """name -> (torch module, example args, ONNX ModelProto), built lazily and exported once per run."""
    from lnfold import zoo

    exports = _shared_exports(tmp_path_factory)

    @functools.cache
    def get(name: str, opset: int = 18):
        module, args = zoo_module(name)
        return module, args, exports(
            f"zoo-{name}-opset{opset}", lambda: export_quiet(module, args, zoo.INPUT_NAMES[name], opset=opset))

    return get


@pytest.fixture(scope="session")
def trained_onnx(tmp_path_factory):
    """name -> the committed trained model's logits (benchmarks/trained/harness.py) as a dynamo ONNX
    export, made once per run."""
    from benchmarks.trained import harness

    exports = _shared_exports(tmp_path_factory)
    return lambda name: exports(f"trained-{name}", lambda: export_quiet(
        harness.logits_module(name), harness.example_args(name), [harness.INPUT[name]]))


def missing_one_centering(make_plan, index=None):
    """`make_plan` with a planted bug: one centering edit (the middle one, or `index`) is dropped
    from every plan, so the tests can prove that verification catches a skipped centering."""
    from dataclasses import replace

    from lnfold.passes.plan import Center

    def sabotaged(view, mode="rms", **kw):
        plan = make_plan(view, mode, **kw)
        centers = [e for e in plan.const_edits if isinstance(e.ops[-1], Center)]
        dropped = centers[len(centers) // 2 if index is None else index]
        return replace(plan, const_edits=[e for e in plan.const_edits if e is not dropped])

    return sabotaged


def pytest_collection_modifyitems(config, items):
    """tests/tiers.py: the tests only the full run (CI) takes."""
    from tests.tiers import FULL_RUN_ONLY, full_run_only

    listed = {item.nodeid for item in items} | {item.nodeid.split("[")[0] for item in items}
    picked = {a.split("::")[0] for a in config.args if "::" in a}  # files only part of which was asked for
    files = {item.nodeid.split("::")[0] for item in items} - picked
    for item in items:
        if full_run_only(item.nodeid):
            item.add_marker(pytest.mark.slow)
    stale = [key for key in FULL_RUN_ONLY if key.split("::")[0] in files and key not in listed]
    if stale:  # (a test renamed or removed must leave the list too, or it would silently join the fast run)
        raise pytest.UsageError(f"tests/tiers.py lists tests that do not exist: {', '.join(stale[:3])}")
    # The slow tier first: pytest-xdist hands the two workers tests in this order, so the long ones
    # start early and the many short ones even the workers out at the end (a long test last kept
    # one worker busy alone: the full run's wall time varied by minutes between runs).
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_collection_finish(session):
    """The test modules and all they imported live as long as the run: frozen out of the collector
    too (as torch and lnfold are in pytest_configure above), or each full collection, a fold_checkpoint's among them,
    rescans them (~0.2 s each)."""
    import gc

    gc.freeze()


def pytest_sessionfinish(session):
    """pytest's cleanup then collects five times over (for unraisable exceptions in finalizers),
    each pass rescanning everything the run's caches still hold (~1 s each in a worker at the end
    of the fast run): one full collection here, while the hook that reports them is still in
    place, then what is left frozen; what its finalizers leave behind is still collected there."""
    import gc

    gc.collect()
    gc.freeze()
