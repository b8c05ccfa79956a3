#!/usr/bin/env python
"""Run the project's CLI on every corpus file and write the baseline into README.md's table.

    python tests/corpus/baseline.py [CORPUS_DIR] [--lnfold "lnfold"]

For each file of manifest.json: `lnfold report FILE --json` and `lnfold fold FILE -o TMP.onnx`;
records exit code, folded / kept / recentered, and the first line of the error. Writes
baseline.json beside the manifest and regenerates the table between the BASELINE markers of
README.md. Not run in CI (slow: one onnxruntime verification per file).
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import tempfile
import time
from pathlib import Path


def first_error(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    for ln in lines:
        if "Error" in ln or "error" in ln or ln.startswith("lnfold:"):
            return ln[:240]
    return (lines[-1] if lines else "")[:240]


def run(cmd, timeout):
    t = time.time()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return r.returncode, r.stdout, r.stderr, time.time() - t
    except subprocess.TimeoutExpired:
        return 124, "", f"timeout after {timeout}s", time.time() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("corpus", nargs="?", default=str(Path(__file__).parent))
    ap.add_argument("--lnfold", default="lnfold")
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--only", nargs="*")
    a = ap.parse_args()
    d = Path(a.corpus)
    man = json.loads((d / "manifest.json").read_text())
    lnf = shlex.split(a.lnfold)
    bpath = d / "baseline.json"
    base = json.loads(bpath.read_text()) if bpath.exists() else {}
    tmp = Path(tempfile.mkdtemp(prefix="lnfold_baseline_"))
    for e in man["files"]:
        f = d / e["file"]
        if a.only and not any(s in e["file"] for s in a.only):
            continue
        if not f.exists():
            base[e["file"]] = {"missing": True}
            continue
        rc, out, err, dt = run(lnf + ["report", str(f), "--json"], a.timeout)
        rep = {"report_rc": rc}
        if rc == 0:
            try:
                j = json.loads(out)
                rep.update(report_folded=j.get("folded"), report_kept=j.get("kept"),
                           report_recentered=j.get("recentered"),
                           report_kept_reasons=[n.get("reason") for n in j.get("norms", []) if n.get("verdict") != "fold"][:3])
            except Exception as ex:  # noqa: BLE001
                rep["report_error"] = f"unparsable JSON: {ex}"
        else:
            rep["report_error"] = first_error(err + "\n" + out)
        out_path = tmp / "x.onnx"
        out_path.unlink(missing_ok=True)
        rc, out, err, dt = run(lnf + ["fold", str(f), "-o", str(out_path)], a.timeout)
        rep.update(fold_rc=rc, fold_seconds=round(dt, 1))
        if rc != 0:
            rep["fold_error"] = first_error(err + "\n" + out)
        else:
            rep["fold_summary"] = " | ".join(ln.strip() for ln in out.strip().splitlines()[:6])[:400]
        base[e["file"]] = rep
        print(e["file"], rep, flush=True)
    bpath.write_text(json.dumps(base, indent=1, sort_keys=True) + "\n")
    write_table(d, man, base)


def verdict(e, b):
    if b.get("missing"):
        return "not in git"
    if e["layernorms"] == 0:
        return "ok" if b.get("fold_rc") == 2 else "differs"
    if b.get("report_rc") == 0 and b.get("report_folded") is not None:
        got = b["report_folded"]
        ok = got == e["expected_folded"] and (b.get("report_recentered") or 0) == e["expected_recentered"]
        return "ok" if ok and b.get("fold_rc") in (0, 2) else "differs"
    return "error"


def write_table(d: Path, man, base):
    rows = ["| file | producer | model | dtype | LNs | expected folded (recentered) | report: folded (recentered) "
            "| fold rc | first error line | match |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for e in man["files"]:
        b = base.get(e["file"], {})
        prod = e["producer"].split(" on ")[0]
        prod = prod if len(prod) < 70 else prod[:67] + "..."
        got = (f"{b.get('report_folded')} ({b.get('report_recentered')})" if b.get("report_rc") == 0 else
               f"rc {b.get('report_rc')}")
        err = b.get("fold_error") or (b.get("report_error") if b.get("report_rc") else "") or ""
        err = err.replace("|", "\\|")
        rows.append(f"| `{e['file']}` | {prod} | {e['model']} | {e['dtype']} | {e['layernorms']} | "
                    f"{e['expected_folded']} ({e['expected_recentered']}) | {got} | {b.get('fold_rc', '')} | "
                    f"{err} | {verdict(e, b)} |")
    # producer x model summary: expected folded/total (and what lnfold reports today)
    fam = lambda f: f.split("_")[0] + ("_fp16" if f.startswith("ortopt_fp16") else "")
    models = sorted({e["model"] for e in man["files"]})
    fams = sorted({fam(e["file"]) for e in man["files"]})
    cell = {}
    for e in man["files"]:
        b = base.get(e["file"], {})
        got = b.get("report_folded") if b.get("report_rc") == 0 else "err"
        cell.setdefault((e["model"], fam(e["file"])), []).append(
            f"{e['expected_folded']}/{e['layernorms']}" + ("" if got == e["expected_folded"] else f" (now {got})"))
    rows = ["| model \\ producer | " + " | ".join(fams) + " |", "| --- |" + " --- |" * len(fams)] + [
        f"| {m} | " + " | ".join(", ".join(cell.get((m, f), [])) for f in fams) + " |" for m in models] + [
        "", "Per file:", ""] + rows
    readme = d / "README.md"
    text = readme.read_text() if readme.exists() else "<!-- BASELINE -->\n<!-- /BASELINE -->\n"
    head, rest = text.split("<!-- BASELINE -->", 1)
    _, tail = rest.split("<!-- /BASELINE -->", 1)
    readme.write_text(head + "<!-- BASELINE -->\n" + "\n".join(rows) + "\n<!-- /BASELINE -->" + tail)


if __name__ == "__main__":
    main()
