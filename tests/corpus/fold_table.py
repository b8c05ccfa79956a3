"""Fold every corpus file with the CLI and print the markdown table of tests/corpus/README.md.

    python tests/corpus/fold_table.py    (from the repository root)
"""
import json, subprocess, sys, tempfile, os
from pathlib import Path
root = Path("tests/corpus"); man = json.load(open(root / "manifest.json"))
rows = []
for e in man["files"]:
    f = root / e["file"]
    if not f.exists():
        continue
    with tempfile.TemporaryDirectory() as d:
        r = subprocess.run([sys.executable, "-m", "lnfold", "fold", str(f), "-o", f"{d}/o.onnx", "--json"], capture_output=True, text=True)
    if r.returncode == 0:
        j = json.loads(r.stdout)
        rows.append((e["file"], e["producer"].split()[0], e["model"], f"{e['expected_folded']}/{e['layernorms']}", f"{j['report']['folded']}/{len(j['report']['norms'])}", j.get("exact_err"), j.get("original_exact_err"), (j.get("criterion") or "")[:40]))
    else:
        rows.append((e["file"], e["producer"].split()[0], e["model"], f"{e['expected_folded']}/{e['layernorms']}", f"exit {r.returncode}", None, None, r.stderr.strip()[:80]))
fmt = lambda x: "–" if x is None else f"{x:.1e}"
print("| file | producer | model | expected | folded | folded vs f64 | original vs f64 | criterion |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {fmt(r[5])} | {fmt(r[6])} | {r[7]} |")
