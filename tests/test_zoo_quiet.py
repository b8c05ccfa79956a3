"""No warnings of our own making: the zoo's models (what the demo, the README's examples and the
tests build) configure `transformers` so that it has nothing to warn about, and `lnfold demo`
writes nothing on stderr. Each check runs in a fresh process: transformers warns once per process."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

BUILD_ALL = r"""
import json, logging, sys, warnings
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(f"{record.name}: {record.getMessage()}")
import transformers
logging.getLogger("transformers").addHandler(Keep(logging.WARNING))
from lnfold import zoo
caught = {}
for name, build in zoo.MODELS.items():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        build()
    caught[name] = [f"{x.category.__name__}: {x.message}" for x in w]
print(json.dumps({"warnings": {k: v for k, v in caught.items() if v}, "logged": records}))
"""


def test_zoo_models_build_without_warnings():
    run = subprocess.run([sys.executable, "-c", BUILD_ALL], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    assert got == {"warnings": {}, "logged": []}, got
    assert run.stderr == "", run.stderr  # transformers' own handler prints to stderr


def test_special_tokens_keep_their_place_at_the_end_of_the_vocabulary():
    import transformers

    from lnfold.zoo import special_tokens_in_vocab

    cfg = special_tokens_in_vocab(transformers.GPT2Config, vocab_size=101)
    assert cfg["bos_token_id"] == cfg["eos_token_id"] == 100  # 50256 of 50257: the last id
    cfg = special_tokens_in_vocab(transformers.CLIPTextConfig, vocab_size=101)
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (99, 100)  # 49406, 49407 of 49408
    assert special_tokens_in_vocab(transformers.GPT2Config, vocab_size=101, eos_token_id=7)["eos_token_id"] == 7


@pytest.mark.slow
def test_demo_writes_nothing_on_stderr_leaves_no_folder_and_leads_with_float64(tmp_path):
    """`lnfold demo` as a user runs it: quiet on stderr, its temporary models removed (TMPDIR is
    where mkdtemp writes), and its verification line judged against float64."""
    import os
    import re

    work = tmp_path / "tmp"
    work.mkdir()
    run = subprocess.run([sys.executable, "-m", "lnfold", "demo", "--layers", "1", "--hidden", "64", "--seconds", "0.3"],
                         capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "TMPDIR": str(work)})
    assert run.returncode == 0, run.stderr
    assert run.stderr == "", run.stderr
    left = [p.name for p in work.iterdir() if p.name.startswith("lnfold")]  # (torch keeps its own caches)
    assert left == [], left
    line = next(ln for ln in run.stdout.splitlines() if "verified in onnxruntime" in ln)
    assert re.search(r"error against a float64 run of the original: folded [\d.e+-]+, original [\d.e+-]+", line), line
    assert "max relative output difference" not in run.stdout
    assert "original again" in run.stdout
