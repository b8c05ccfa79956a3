#!/usr/bin/env python
"""Regenerate the corpus's RMSNorm LLM files (issue 47): a tiny Llama/Qwen2 through the tools LLM
users run, each file's entry appended to manifest.json (replacing an entry of the same name).

    python tests/corpus/build_llm.py OUTDIR [--only SUBSTR ...]

NEVER run in CI. Self-contained (no import of lnfold). The tools live in their own venvs, made with
`python -m venv DIR --system-site-packages` over the project's python (torch 2.13.0+cpu,
transformers 5.24.0, onnx 1.23.2, onnxruntime 1.32.0):

    LNFOLD_GENAI_PYTHON    a venv with `pip install onnxruntime-genai==0.18.0` (adds nothing else)
    LNFOLD_OPTIMUM_PYTHON  a venv with `pip install optimum-onnx==0.1.0` (pins transformers 4.57.6)

Models: `transformers` LlamaForCausalLM / Qwen2ForCausalLM / Phi3ForCausalLM (packed qkv_proj and
gate_up_proj; original_max_position_embeddings = max_position_embeddings, no LongRoPE), 2 layers, hidden 64, 4 heads, 2 kv heads
(head size 16: onnxruntime's GroupQueryAttention CPU kernel needs a multiple of 16), MLP 96, vocab
128, tied embeddings, random weights and biases, every RMSNorm weight uniform in ±[0.5, 2] with random signs (a
γ left in a norm of a rotated stream, or a reader left unrotated, then moves the outputs far beyond
the gate), and a large mean on the embedding rows (+3). MLP 96 and vocab 128 (not 128 and 256) keep
each file near 300 KB. save_pretrained with a tiny WordLevel tokenizer (the genai builder saves one).
Weights are inlined in every file (the builder writes model.onnx.data beside its model.onnx).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
GENAI = os.environ.get("LNFOLD_GENAI_PYTHON", sys.executable)
OPTIMUM = os.environ.get("LNFOLD_OPTIMUM_PYTHON", sys.executable)
ENV = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", CUDA_VISIBLE_DEVICES="")

HF_SRC = r'''
import sys, torch, transformers
from tokenizers import Tokenizer, models, pre_tokenizers
arch, out = sys.argv[1], sys.argv[2]
kw = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
          vocab_size=128, max_position_embeddings=128, tie_word_embeddings=True, bos_token_id=126, eos_token_id=127)
cfg, cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
            "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM)}[arch]
if arch == "phi3":  # no LongRoPE (the genai builder's Phi3MiniModel, not its 128K variant)
    kw.update(original_max_position_embeddings=128, pad_token_id=0)
torch.manual_seed(0)
m = cls(cfg(**kw)).eval()
with torch.no_grad():
    for name, p in m.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(torch.empty_like(p).uniform_(0.5, 2.0) * torch.randint(0, 2, p.shape).mul(2).sub(1))
        elif name.endswith(".bias"):  # Qwen2's q/k/v biases (zeros at init: the genai builder drops zero biases)
            p.copy_(torch.randn_like(p))
    m.model.embed_tokens.weight.add_(3.0)
m.save_pretrained(out)
vocab = {f"t{i}": i for i in range(125)} | {"<unk>": 125, "<s>": 126, "</s>": 127}
tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                     eos_token="</s>").save_pretrained(out)
'''

# Optimum's legacy pair (no past in, present out; past in) merged into one If, as build.py's do_merged
MERGED_SRC = r'''
import sys, contextlib, io, tempfile
from pathlib import Path
import transformers
from optimum.exporters.onnx import export
from optimum.exporters.tasks import TasksManager
from optimum.onnx import merge_decoders
src, out = sys.argv[1], sys.argv[2]
m = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
tmp = Path(tempfile.mkdtemp())
ctor = TasksManager.get_exporter_config_constructor("onnx", model=m, task="text-generation", library_name="transformers")
for past_in, f in [(False, "decoder_model.onnx"), (True, "decoder_with_past_model.onnx")]:
    with contextlib.redirect_stdout(io.StringIO()):
        export(m, ctor(m.config, use_past=True, use_past_in_inputs=past_in), tmp / f)
merge_decoders(decoder=tmp / "decoder_model.onnx", decoder_with_past=tmp / "decoder_with_past_model.onnx",
               save_path=out, strict=False)
'''

DYNAMO_SRC = r'''
import sys, torch, transformers
src, out = sys.argv[1], sys.argv[2]
from lnfold import zoo
m = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
ids = torch.randint(0, 128, (1, 8))
torch.onnx.export(zoo.Logits(m, "logits"), (ids,), out, dynamo=True, input_names=["input_ids"], output_names=["logits"])
'''

ORTOPT_SRC = r'''
import sys
from onnxruntime.transformers.optimizer import optimize_model
src, out, kind = sys.argv[1], sys.argv[2], sys.argv[3]
opt = optimize_model(src, model_type=kind, num_heads=4, hidden_size=64, opt_level=0)
for n in opt.model.graph.node:  # torch's dynamo exporter's stack traces: a third of the file
    del n.metadata_props[:]
opt.save_model_to_file(out)
'''


def run(python: str, src: str, *args: str) -> None:
    subprocess.run([python, "-c", src, *map(str, args)], check=True, env=ENV)


def version(python: str, dist: str) -> str:
    return subprocess.run([python, "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
                          check=True, capture_output=True, text=True, env=ENV).stdout.strip()


def inline(src: Path, dst: Path) -> None:
    """One self-contained file: external data read in, saved inline."""
    import onnx

    onnx.save(onnx.load(str(src)), str(dst))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--only", nargs="*", default=[])
    args = ap.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="corpus_llm_"))
    entries = []
    tf = version(sys.executable, "transformers")

    def want(name: str) -> bool:
        return not args.only or any(s in name for s in args.only)

    def record(fname: str, producer: str, arch: str, rms: int, why: str, needs=()) -> None:
        import onnx

        m = onnx.load(str(out / fname), load_external_data=False)
        ops = sorted({n.op_type for n in m.graph.node} | {n.op_type for n in m.graph.node for a in n.attribute
                                                         if a.type == onnx.AttributeProto.GRAPH
                                                         for n in a.g.node})
        entries.append({"file": fname, "producer": producer, "model": f"{arch} (tiny {arch}ForCausalLM, tied head)",
                        "dtype": "fp32", "layernorms": 0, "expected_folded": 0, "expected_recentered": 0,
                        "rms_norms": rms, "expected_rotated": 1 if rms else 0, "why": why, "needs": list(needs),
                        "graph_count": {"ops": ops}, "size": (out / fname).stat().st_size})
        print("  +", fname, (out / fname).stat().st_size, flush=True)

    for arch, cls in (("llama", "Llama"), ("qwen2", "Qwen2"), ("phi3", "Phi3")):
        hf = tmp / f"hf_{arch}"
        run(sys.executable, HF_SRC, arch, hf)
        name = f"genai_fp32_cpu_{arch}.onnx"
        if want(name):
            built = tmp / f"genai_{arch}"
            subprocess.run([GENAI, "-m", "onnxruntime_genai.models.builder", "-i", hf, "-o", built, "-p", "fp32",
                            "-e", "cpu", "-c", tmp / "cache"], check=True, env=ENV, stdout=subprocess.DEVNULL)
            inline(built / "model.onnx", out / name)
            record(name, f"onnxruntime-genai {version(GENAI, 'onnxruntime-genai')} `python -m "
                   "onnxruntime_genai.models.builder -i HF_DIR -o OUT -p fp32 -e cpu` (transformers "
                   f"{version(GENAI, 'transformers')}), external data inlined", cls, 5,
                   "SimplifiedLayerNormalization of the embedding, then SkipSimplifiedLayerNormalization per norm "
                   "(output 3 the residual sum); packed QKV MatMul into GroupQueryAttention (rotary inside, "
                   "past/present KV in head space); embedding = Gather of Transpose(lm_head weight): 1 stream, "
                   "all 5 norms RMS: rotates",
                   needs=["no --dim: verification's made-up total_sequence_length equals the sequence "
                          "(a first prompt; the past is not read)"])
        for task, suffix in (("text-generation", "nopast"), ("text-generation-with-past", "past")):
            name = f"optimum_{arch}_{suffix}_model.onnx"
            if want(name):
                d = tmp / f"optimum_{arch}_{suffix}"
                subprocess.run([Path(OPTIMUM).parent / "optimum-cli", "export", "onnx", "-m", hf, "--task", task, d],
                               check=True, env=ENV, stdout=subprocess.DEVNULL)
                inline(d / "model.onnx", out / name)
                record(name, f"optimum-onnx {version(OPTIMUM, 'optimum-onnx')} `optimum-cli export onnx "
                       f"--task {task}` (transformers {version(OPTIMUM, 'transformers')})", cls, 5,
                       "decomposed RMSNorms (Pow, ReduceMean, Add, Sqrt, Div, Mul γ); tied head cloned; rotary "
                       "as Slice/Neg/Concat in head space: 1 stream, 5 RMS norms: rotates")
        name = f"optimum_{arch}_decoder_model_merged.onnx"
        if want(name):
            run(OPTIMUM, MERGED_SRC, hf, out / name)
            record(name, f"optimum-onnx {version(OPTIMUM, 'optimum-onnx')}: optimum.exporters.onnx.export "
                   "OnnxConfig(use_past=True, use_past_in_inputs=False / True) + optimum.onnx.merge_decoders"
                   "(strict=False)", cls, 10,
                   "If(use_cache_branch) holds the no-past and the with-past decoder: 2 × 5 decomposed RMSNorms",
                   needs=["use_cache_branch is a bool input selecting the If branch"])
        dyn = tmp / f"dynamo_{arch}.onnx"
        if want(f"ortopt_gpt2_dynamo_{arch}.onnx"):
            run(sys.executable, DYNAMO_SRC, hf, dyn)
        for kind in ("gpt2",):  # (model_type "qwen3" writes the same file here)
            name = f"ortopt_{kind}_dynamo_{arch}.onnx"
            if want(name):
                run(sys.executable, ORTOPT_SRC, dyn, out / name, kind)
                record(name, f"onnxruntime {version(sys.executable, 'onnxruntime')} onnxruntime.transformers."
                       f"optimizer.optimize_model(model_type={kind!r}, opt_level=0) on torch "
                       f"{version(sys.executable, 'torch')} torch.onnx.export(dynamo=True) (transformers {tf}); the "
                       "nodes' metadata_props (the exporter's stack traces) dropped", cls, 5,
                       "the residual Adds fused into SkipSimplifiedLayerNormalization: 1 stream, 5 RMS norms")

    # the committed manifest when building into tests/corpus, else a copy of it beside the files
    manifest = HERE / "manifest.json"
    if out.resolve() != HERE.resolve():
        (out / "manifest.json").write_text(manifest.read_text())
        manifest = out / "manifest.json"
    doc = json.loads(manifest.read_text())
    made = {e["file"] for e in entries}
    doc["files"] = [e for e in doc["files"] if e["file"] not in made] + entries
    manifest.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
