"""A refactor changes nothing users see (issue 31): every corpus file's and zoo architecture's
`--json` report under four option sets (rms, crms, γ into readers, a Hadamard rotation), and a
hash of each folded artifact (the serialized ONNX model; the torch module's state_dict and code),
unverified, dumped from the checkout it runs in; run it in two checkouts and compare the files.

    cd OLD && python benchmarks/plan_identity.py /tmp/old.json --corpus --zoo
    cd NEW && python benchmarks/plan_identity.py /tmp/new.json --corpus --zoo
    python -c "import json; a, b = (json.load(open(f)) for f in ('/tmp/old.json', '/tmp/new.json')); \
print([k for k in a if a[k] != b.get(k)])"

Each run takes ~9 min alone on the 2-core machine (107 corpus files, 46 architectures, 4 configurations:
612 keys). It imports lnfold from the checkout it runs in (`_this_checkout`), not from the editable install.
"""
import glob
import hashlib
import json
import os
import sys
import warnings


def _this_checkout() -> None:
    """Import lnfold from the checkout this runs in. Its `lnfold/` holds only __init__.py: unless
    the checkout's root is on the package's path before __init__ runs, the subpackages (passes,
    fx_rewrite, ...) come from wherever `pip install -e` pointed, and two checkouts compare one."""
    import importlib.util
    root = os.getcwd()
    spec = importlib.util.spec_from_file_location("lnfold", os.path.join(root, "lnfold", "__init__.py"),
                                                  submodule_search_locations=[os.path.join(root, "lnfold"), root])
    sys.modules["lnfold"] = module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    import lnfold.passes
    if not lnfold.passes.__file__.startswith(root + os.sep):
        sys.exit(f"plan_identity: lnfold.passes comes from {lnfold.passes.__file__}, not from {root}")


sys.path.insert(0, os.getcwd())  # tests/ of the checkout this runs in
_this_checkout()
warnings.simplefilter("ignore")
CONFIGS = {"rms": dict(mode="rms"), "crms": dict(mode="crms"),
           "gamma": dict(mode="rms", gamma_into_readers=True), "rot": dict(mode="rms", rotate="hadamard", seed=3)}

def corpus(out):
    import onnx
    from lnfold.onnx_rewrite import fold_model
    from lnfold.onnx_rewrite.api import OnnxFrontend
    from lnfold.onnx_rewrite import targets
    from lnfold.passes import make_plan, pipeline
    from lnfold.passes.options import FoldOptions
    for f in sorted(glob.glob("tests/corpus/*.onnx")):
        m = onnx.load(f)
        for c, kw in CONFIGS.items():
            key = f"corpus/{os.path.basename(f)}/{c}"
            try:
                fe = OnnxFrontend(m, FoldOptions(**kw), targets.resolve("ort", "cpu"))
                _, plan = pipeline.plan(fe, make_plan)
                rep = plan.report.to_json()
            except Exception as e:
                rep = f"ERR {type(e).__name__}: {str(e)[:200]}"
            try:
                res = fold_model(m, verify=False, **kw)
                h = hashlib.sha256(res.model.SerializeToString()).hexdigest()
                rj = res.report.to_json()
            except Exception as e:
                h = rj = f"ERR {type(e).__name__}: {str(e)[:200]}"
            out[key] = {"report": rep, "fold": h, "fold_report": rj}
            print(key, h[:12], flush=True)

def zoo(out, only=None):
    from lnfold import zoo as Z
    from lnfold.fx_rewrite import fold_module
    for name in sorted(Z.MODELS):
        if only and name not in only: continue
        try:
            module, args = Z.MODELS[name]()
        except Exception as e:
            out[f"zoo/{name}"] = f"ERR build {e}"; continue
        for c, kw in CONFIGS.items():
            key = f"zoo/{name}/{c}"
            try:
                res = fold_module(module, args, verify=False, dynamic=name != "swin", **kw)
                sd = res.module.state_dict()
                h = hashlib.sha256()
                for k in sorted(sd):
                    h.update(k.encode()); h.update(sd[k].detach().contiguous().numpy().tobytes())
                h.update(res.module.code.encode())
                out[key] = {"fold": h.hexdigest(), "fold_report": res.report.to_json()}
            except Exception as e:
                out[key] = {"fold": f"ERR {type(e).__name__}: {str(e)[:200]}"}
            print(key, out[key]["fold"][:12], flush=True)

if __name__ == "__main__":
    res = {}
    if "--corpus" in sys.argv: corpus(res)
    if "--zoo" in sys.argv:
        only = os.environ.get("ONLY"); zoo(res, only.split(",") if only else None)
    json.dump(res, open(sys.argv[1], "w"), indent=0, sort_keys=True)
