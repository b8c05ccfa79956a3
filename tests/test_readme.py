"""The README and the guide (docs/guide/*.md) as a new user reads them in a clone: they point only at
files the clone has, every relative link of README.md and docs/ resolves (file and heading), every
"DESIGN §N" the code cites is a section of docs/DESIGN.md, every `lnfold ...` line they show parses,
and their Python examples run as written."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from itertools import product
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DESIGN = ROOT / "docs" / "DESIGN.md"
GUIDE = sorted((ROOT / "docs" / "guide").glob("*.md"))
# What a user reads to run lnfold: its commands and Python blocks are tested below.
USER_DOCS = [ROOT / "README.md", *GUIDE]


def _tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / n for n in names if n.endswith((".py", ".md", ".toml", ".txt", ".cfg")) and (ROOT / n).is_file()]


def _fenced(text: str) -> list[tuple[str, str]]:
    """Each fenced block of a markdown text as (language, body); an unlabelled block's language is ""."""
    blocks, language, body = [], None, []
    for line in text.splitlines():
        if line.startswith("```"):
            if language is None:
                language, body = line[3:].strip(), []
            else:
                blocks.append((language, "\n".join(body) + "\n"))
                language = None
        elif language is not None:
            body.append(line)
    return blocks


def _blocks(language: str) -> list[str]:
    """The fenced blocks of one language ("" for unlabelled ones) in the README and the guide."""
    return [body for doc in USER_DOCS for lang, body in _fenced(doc.read_text()) if lang == language]


def _outside_code(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but hyphens dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(doc: Path) -> Iterator[str]:
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+)$", _outside_code(doc.read_text()), flags=re.M):
        a = _anchor(heading)
        seen[a] = seen.get(a, -1) + 1
        yield a if seen[a] == 0 else f"{a}-{seen[a]}"


def test_every_relative_link_in_the_docs_resolves():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    bad = []
    for doc in docs:
        for target in re.findall(r"\]\(([^)\s]+)\)", _outside_code(doc.read_text())):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists():
                bad.append(f"{doc.relative_to(ROOT)}: {target}: no such file")
            elif anchor and file.suffix == ".md" and anchor not in set(_anchors(file)):
                bad.append(f"{doc.relative_to(ROOT)}: {target}: no such heading")
    assert not bad, bad


def test_nothing_points_outside_the_repository():
    outside = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in _tracked_text_files()
               for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
               if re.search(r"\.\./shared|shared/(DESIGN|seeds)", line)]
    assert not outside, outside


def test_every_design_and_theory_citation_is_a_section():
    text = DESIGN.read_text()
    sections = set(re.findall(r"^## (\d+)\. ", text, flags=re.M))
    titles = [t.lower() for t in re.findall(r"^## (?:\d+\. )?(.+)$", text, flags=re.M)]
    papers = set(re.findall(r"^- \*\*(\d{3})\*\*", text, flags=re.M))
    theory = set(re.findall(r"^## (\d+)\. ", (DESIGN.parent / "THEORY.md").read_text(), flags=re.M))
    bad = []
    for p in _tracked_text_files():
        body = p.read_text(errors="replace")
        for n in re.findall(r"DESIGN(?:\.md)? §(\d+)", body):
            if n not in sections:
                bad.append(f"{p.relative_to(ROOT)}: DESIGN §{n}")
        for name in re.findall(r'DESIGN(?:\.md)? "([^"]+)"', body):
            if not any(name.lower() in t for t in titles):
                bad.append(f'{p.relative_to(ROOT)}: DESIGN section "{name}"')
        for n in re.findall(r"\bseed (\d{3})\b", body):
            if n not in papers:
                bad.append(f"{p.relative_to(ROOT)}: seed {n}")
        for n in re.findall(r"THEORY(?:\.md)? §(\d+)", body):
            if n not in theory:
                bad.append(f"{p.relative_to(ROOT)}: THEORY §{n}")
    assert not bad, bad
    assert {"1", "4", "5"} <= sections and "001" in papers and "1" in theory


def test_readme_names_the_papers_and_its_paths_exist():
    for title in ("Pre-RMSNorm and Pre-CRMSNorm Transformers: Equivalent", "Enjoy Your Layer Normalization",
                  "LayerNorm vs RMSNorm: A Geometric Perspective"):
        assert title in README.replace("\n", " "), title
    # paths named in the text are the repository's (markdown links: test_every_relative_link_in_the_docs_resolves)
    missing = []
    for doc in USER_DOCS:
        text = doc.read_text()
        paths = set(re.findall(r"`((?:[\w.-]+/)+[\w.-]+\.(?:py|md))`", text))  # `dir/file.py`
        paths |= {m.split(",")[0] for m in re.findall(r"(?<![\w/.])((?:benchmarks|tests|docs|passes)/[\w./-]+\.(?:py|md))", text)}
        missing += [f"{doc.relative_to(ROOT)}: {p}" for p in sorted(paths) if not (ROOT / p).exists()]
    assert GUIDE and not missing, missing


def _alternatives(line: str) -> list[list[str]]:
    """A synopsis line `lnfold fold m.onnx [--target ort|onnx] [--json]` as argv lists: without the
    optional groups, and with each group in each of its alternatives."""
    groups = re.findall(r"\[([^\]]+)\]", line)
    base = re.sub(r"\s*\[[^\]]+\]", "", line)
    argvs = [shlex.split(base)[1:]]
    for g in groups:
        words = g.split()
        choices = [w.split("|") for w in words]
        for pick in product(*choices):
            argvs.append(shlex.split(base)[1:] + list(pick))
    return argvs


def _lnfold_lines() -> list[str]:
    """The `lnfold ...` lines of every bash block, and of every other block the lines shown as typed (`$ lnfold ...`)."""
    shown = [line for lang in ("", "text", "console") for b in _blocks(lang) for line in b.splitlines()]
    typed = [line[2:] for line in shown if line.startswith("$ lnfold ")]
    lines = []
    for block in _blocks("bash") + ["\n".join(typed)]:
        for line in block.splitlines():
            line = line.split("  #")[0]  # trailing comments
            for part in re.split(r"&&|;|\s\|\s", line):  # a pipe between commands has spaces around it
                part = part.strip()
                if part.startswith("lnfold"):
                    lines.append(part)
    return lines


def test_every_lnfold_command_line_in_the_readme_and_guide_parses(capsys):
    from lnfold.onnx_rewrite.cli import parse_args

    lines = _lnfold_lines()
    assert any(ln.startswith("lnfold fold") for ln in lines) and "lnfold demo" in lines, lines
    for line in lines:
        for argv in _alternatives(line):
            try:
                args = parse_args(argv)
            except SystemExit as e:  # --help / --version print and exit 0; a usage error exits 2
                assert e.code == 0, (line, argv, capsys.readouterr().err)
                continue
            assert args.cmd in ("fold", "report", "quantize", "bench", "check", "slice", "demo"), (line, argv)


# --- the Python blocks, run as written ------------------------------------------------------------
# Each README or guide ```python block is matched to one test below by a phrase it contains; a new block
# without a test fails test_every_python_block_has_a_test.
ONNX_BLOCK = 'lnfold.load_onnx("model.onnx")'
TORCH_BLOCK = "lnfold.fold_module(model, args)"
TRAINING_BLOCK = "lnfold.fold_for_training(model, args)"
HANDOFF_BLOCK = "lnfold.fold_to_rmsnorm(model, args"
CHECKPOINT_BLOCK = 'lnfold.fold_checkpoint("opt-1.3b/"'
QUANTIZE_BLOCK = "lnfold.quantize_module(model, args"


def _block(phrase: str) -> str:
    (block,) = [b for b in _blocks("python") if phrase in b]
    return block


def test_every_python_block_has_a_test():
    for block in _blocks("python"):
        assert sum(p in block for p in (ONNX_BLOCK, TORCH_BLOCK, TRAINING_BLOCK, HANDOFF_BLOCK, CHECKPOINT_BLOCK,
                                    QUANTIZE_BLOCK)) == 1, block


def _run(script: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=cwd, timeout=900)


def test_readme_onnx_example_runs(tmp_path, zoo_onnx):
    import onnx

    _, _, model = zoo_onnx("gpt2")
    onnx.save(model, tmp_path / "model.onnx")  # the file the example reads
    run = _run(_block(ONNX_BLOCK), tmp_path)
    assert run.returncode == 0, run.stderr
    assert "fold" in run.stdout and (tmp_path / "model.folded.onnx").is_file()
    assert run.stderr == "", run.stderr
    ops = [n.op_type for n in onnx.load(tmp_path / "model.folded.onnx").graph.node]
    assert ops.count("SimplifiedLayerNormalization") == 5 and "LayerNormalization" not in ops, sorted(set(ops))


SECOND_SHAPE = """
longer = (torch.randint(0, 50257, (2, 13)),)
torch.testing.assert_close(compiled(*longer).logits, model(*longer).logits, rtol=1e-5, atol=1e-4)
print("second shape: same outputs")
"""


@pytest.mark.slow
def test_readme_pytorch_example_runs(tmp_path):
    # Then a second input shape, as a user's next call would be: Dynamo recompiles with dynamic
    # sizes, and "lnfold.verify" runs again (issue 16 item 1; tests/test_hf_defaults.py).
    run = _run(_block(TORCH_BLOCK) + SECOND_SHAPE, tmp_path)
    assert run.returncode == 0, run.stderr
    assert "fold" in run.stdout and "second shape: same outputs" in run.stdout
    assert run.stderr == "", run.stderr  # no warnings of our own making


# What torchrun and the user's code give the training example: a process group (one rank here),
# a CPU mesh for fully_shard (its default mesh is on the GPU), a transformers model and inputs.
TRAINING_PRELUDE = """
import functools, os, socket
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
import torch.distributed.fsdp
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
dist.init_process_group("gloo", rank=0, world_size=1)
torch.distributed.fsdp.fully_shard = functools.partial(torch.distributed.fsdp.fully_shard,
                                                       mesh=init_device_mesh("cpu", (1,)))
from lnfold import zoo
wrapped, args = zoo.gpt2()
model = wrapped.model
model.config.use_cache = False
"""

TRAINING_EPILOGUE = """
import lnfold.fx_rewrite.train as train
assert not any(train.RECORD in m.__dict__ for m in model.modules()), "still folded"
dist.destroy_process_group()
print("trained and unfolded")
"""


@pytest.mark.slow
def test_readme_training_example_runs(tmp_path):
    run = _run(TRAINING_PRELUDE + _block(TRAINING_BLOCK) + textwrap.dedent(TRAINING_EPILOGUE), tmp_path)
    assert run.returncode == 0, run.stderr
    assert "trained and unfolded" in run.stdout and (tmp_path / "ckpt.pt").is_file()
    assert run.stderr == "", run.stderr


@pytest.mark.slow
def test_readme_handoff_example_runs(tmp_path):
    run = _run(_block(HANDOFF_BLOCK) + "\nprint('handed off')", tmp_path)
    assert run.returncode == 0, run.stderr
    assert "torch.nn.RMSNorm modules" in run.stdout and "handed off" in run.stdout


@pytest.mark.slow
def test_guide_quantize_module_example_runs(tmp_path):
    run = _run(_block(QUANTIZE_BLOCK) + "\nprint('quantized', tuple(logits.logits.shape))", tmp_path)
    assert run.returncode == 0, run.stderr
    assert "NOT exact" in run.stdout and "quantized (2, 9, 101)" in run.stdout, run.stdout


@pytest.mark.slow  # as the README's other torch examples; fold_checkpoint itself is the fast tier's (test_checkpoint.py)
def test_readme_checkpoint_example_runs(tmp_path):
    """Issue 25's block, on a tiny sharded OPT saved under the name the README uses."""
    import torch
    import transformers

    from lnfold.zoo import adversarial

    cfg = transformers.OPTConfig(vocab_size=101, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=2,
                                 max_position_embeddings=32, word_embed_proj_dim=32)
    torch.manual_seed(0)
    adversarial(transformers.OPTForCausalLM(cfg)).save_pretrained(tmp_path / "opt-1.3b", max_shard_size="20KB")
    r = _run(_block(CHECKPOINT_BLOCK) + "\nassert result.report.folded == 5 and result.criterion == 'float64'\n",
             tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "opt-1.3b.folded" / "model.safetensors.index.json").is_file()


# --- the README's own examples, run as shown ------------------------------------------------------
def _shown_examples() -> list[tuple[str, list[str]]]:
    """The README's `$ lnfold ...` lines with the output lines shown under each ("..." marks a cut)."""
    examples = []
    for language, body in _fenced(README):
        if language == "":
            for line in body.splitlines():
                if line.startswith("$ lnfold "):
                    examples.append((line[2:], []))
                elif examples and line.strip() != "...":
                    examples[-1][1].append(line)
    return examples


def _masked(text: str) -> str:
    """Figures vary by model and machine; the words and the layout of a line do not."""
    return re.sub(r"\d[\d,]*(\.\d+)?(e[-+]\d+)?", "#", text)


@pytest.mark.slow  # six commands, bench's default 8 s budget among them: ~20 s
def test_readme_examples_run_and_print_what_the_readme_shows(tmp_path, zoo_onnx, monkeypatch, capsys):
    """Each command the README shows as typed runs (the console script's own `main`, in this process)
    on a GPT-2 (the zoo's: smaller than the demo's, so figures and names differ; they are masked) and
    prints each line shown under it. The fold line of its bash block runs first, as a reader would,
    to make gpt2.folded.onnx."""
    import numpy as np
    import onnx

    from lnfold.onnx_rewrite.cli import main

    model = zoo_onnx("gpt2")[2]
    onnx.save(model, tmp_path / "gpt2.onnx")
    rows = min(t.dims[0] for t in model.graph.initializer if len(t.dims) == 2)  # ids inside every table
    np.savez(tmp_path / "cal.npz", input_ids=np.random.default_rng(0).integers(0, rows, (16, 32)))
    (fold_line,) = [ln for ln in _lnfold_lines() if ln.startswith("lnfold fold gpt2.onnx")]
    examples = [(fold_line, []), *_shown_examples()]
    assert {line.split()[1] for line, _ in examples} >= {"fold", "check", "quantize", "slice", "bench"}, examples
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    for line, shown in examples:
        code = main(shlex.split(re.sub(r"\s*\[[^\]]+\]", "", line))[1:])
        out = capsys.readouterr()
        assert code == 0, (line, out.err[-2000:])
        printed = _masked(out.out + out.err)
        if line.startswith("lnfold bench"):  # its verdict ("within noise", "faster") is the machine's
            shown = [s for s in shown if "within noise" not in s]
        missing = [s for s in shown if _masked(s) not in printed]
        assert not missing, (line, missing, out.out + out.err)
