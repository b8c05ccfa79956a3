"""Fold time against graph size (issue 43 item 4): the fold's passes must stay linear in the node count.

A pre-LN stream of N blocks (tests/onnx_graphs.pre_ln: 7 nodes per block, every LayerNorm
foldable, no value_info, d = 8 so that the weights cost nothing and the time is the passes'),
folded by `lnfold.onnx_rewrite.fold_model` in a fresh process per size (fixed seed 0), the
result's `timings` (analysis, editing, verification) reported with the wall and CPU time of the
fold call and the process's peak RSS. One JSON object per size on stdout, then a summary with the
time per 1,000 nodes (flat when linear) and the exponent between consecutive sizes.

    python -m benchmarks.foldscale [--nodes 10000,50000,100000] [--no-verify] [--timeout 1800]
    git archive OLD | tar -x -C /tmp/old && python -m benchmarks.foldscale --lnfold /tmp/old   (an older commit)

`--lnfold DIR` runs the children against the lnfold checkout in DIR (a `git archive` of an older
commit, say): a folder of links DIR/.foldscale/lnfold/{passes,onnx_rewrite,...} mirrors the
installed package layout and goes first on the children's sys.path.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NODES_PER_BLOCK = 7  # pre_ln's block: LayerNorm, MatMul, Add, Relu, MatMul, Add, residual Add

_CHILD = r"""
import json, os, resource, sys, time
sys.path.append(sys.argv[1])  # tests.onnx_graphs (lnfold: the one in the cwd, first on the path)
from tests import onnx_graphs as G
from lnfold.onnx_rewrite import fold_model
import lnfold.onnx_rewrite.api, lnfold.onnx_rewrite.verify  # (imports outside the timing)
layers, verify = int(sys.argv[2]), sys.argv[3] == "1"
model = G.pre_ln(layers=layers, seed=0)
nodes = len(model.graph.node)
w0, c0 = time.perf_counter(), time.process_time()
result = fold_model(model, verify=verify)
wall, cpu = time.perf_counter() - w0, time.process_time() - c0
print(json.dumps(dict(nodes=nodes, layers=layers, verify=verify, wall_s=round(wall, 3), cpu_s=round(cpu, 3),
                      timings={k: round(v, 3) for k, v in result.timings.items()},
                      folded=result.report.folded, out_nodes=len(result.model.graph.node),
                      peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                      lnfold=os.path.dirname(os.path.dirname(lnfold.onnx_rewrite.api.__file__)))))
"""

_PACKAGES = {"lnfold": "lnfold", "passes": "passes", "fx_rewrite": "fx_rewrite", "onnx_rewrite": "onnx_rewrite",
             "zoo": "zoo", "demo": "demo"}


def _layout(tree: Path) -> Path:
    """DIR/.foldscale: `lnfold` as installed (its subpackages linked in) for the checkout in DIR."""
    root = tree / ".foldscale"
    pkg = root / "lnfold"
    pkg.mkdir(parents=True, exist_ok=True)
    for f in (tree / "lnfold").iterdir():
        if not (pkg / f.name).exists():
            (pkg / f.name).symlink_to(f.resolve())
    for sub, folder in _PACKAGES.items():
        if sub != "lnfold" and (tree / folder).is_dir() and not (pkg / sub).exists():
            (pkg / sub).symlink_to((tree / folder).resolve())
    return root


def run(layers: int, verify: bool, timeout: float, tree: Path | None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env.pop("LNFOLD_DEBUG", None)
    cwd = ROOT  # (a child's sys.path starts with its folder: the lnfold it imports is found there)
    if tree is not None:
        cwd = _layout(tree)
        env["PYTHONPATH"] = str(cwd) + os.pathsep + env.get("PYTHONPATH", "")
    tests_root = str(tree if tree is not None else ROOT)
    try:
        r = subprocess.run([sys.executable, "-c", _CHILD, tests_root, str(layers), "1" if verify else "0"],
                           capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    except subprocess.TimeoutExpired:
        return dict(nodes=NODES_PER_BLOCK * layers + 4, layers=layers, verify=verify, wall_s=None,
                    error=f"timed out after {timeout:.0f} s")
    if r.returncode != 0:
        return dict(layers=layers, verify=verify, error=(r.stderr.strip().splitlines() or ["?"])[-1])
    return json.loads(r.stdout.strip().splitlines()[-1])


def summary(rows: list[dict]) -> list[dict]:
    out, prev = [], None
    for row in rows:
        if row.get("wall_s") is None:
            continue
        s = dict(nodes=row["nodes"], wall_s=row["wall_s"], s_per_1k_nodes=round(row["wall_s"] / row["nodes"] * 1e3, 4))
        if prev is not None:  # t ~ n^k between consecutive sizes: 1 linear, 2 quadratic
            s["exponent"] = round(math.log(row["wall_s"] / prev["wall_s"]) / math.log(row["nodes"] / prev["nodes"]), 2)
        out.append(s)
        prev = row
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="10000,50000,100000", help="graph sizes, comma-separated (default: %(default)s)")
    ap.add_argument("--no-verify", action="store_true", help="fold without verification")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per size (default: %(default)s)")
    ap.add_argument("--lnfold", type=Path, default=None, help="another checkout of lnfold to measure")
    a = ap.parse_args(argv)
    rows = []
    for n in (int(x) for x in a.nodes.split(",")):
        row = run(max(1, round(n / NODES_PER_BLOCK)), not a.no_verify, a.timeout, a.lnfold)
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(json.dumps({"summary": summary(rows), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                      "command": "python -m benchmarks.foldscale " + " ".join(sys.argv[1:] if argv is None else argv)}))


if __name__ == "__main__":
    main()
