"""The metric harness: the trained models' held-out metric, for any way of running them.

    from benchmarks.trained import harness
    module = harness.logits_module("gpt2_stdlib")                  # eager, returns logits
    harness.evaluate("gpt2_stdlib", harness.torch_runner(module))  # Metric(perplexity=..., loss=...)
    harness.evaluate("gpt2_stdlib", harness.onnx_runner(onnx_model_or_path))

A *runner* is any callable from one batch of the held-out inputs (a numpy array: token ids, or
pixels) to the model's logits: the eager module, a `fold_module` / `torch.compile` /
`fold_for_training` result (`torch_runner`), an ONNX model in onnxruntime (`onnx_runner`). The
metric is computed from the logits in float64, so two runners differ only by what they compute:
held-out perplexity for the decoder, masked-LM accuracy (and loss) for the encoder, accuracy for
the ViT classifier. Checkpoints and held-out inputs are the committed ones beside this file.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np

CHECKPOINTS = Path(__file__).resolve().parent
MODELS = ("gpt2_stdlib", "bert_stdlib", "vit_digits")  # committed
CACHED = ("opt_stdlib",)  # trained on demand into the same folder (benchmarks/trained/slicegpt_side.py)
DECODERS = ("gpt2_stdlib", "opt_stdlib")
INPUT = {"gpt2_stdlib": "input_ids", "bert_stdlib": "input_ids", "vit_digits": "pixel_values", "opt_stdlib": "input_ids"}
METRIC = {"gpt2_stdlib": "perplexity", "bert_stdlib": "mlm_accuracy", "vit_digits": "accuracy",
          "opt_stdlib": "perplexity"}

Runner = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class Metric:
    name: str  # perplexity | mlm_accuracy | accuracy
    value: float
    loss: float  # mean cross-entropy, nats, over the scored positions / images
    count: int  # positions / images scored

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.name} {self.value:.6g} (loss {self.loss:.6g} over {self.count})"


def folder(name: str, root: Optional[Path] = None) -> Path:
    if name not in MODELS + CACHED:
        raise ValueError(f"unknown trained model {name!r}; one of {', '.join(MODELS + CACHED)}")
    return (root or CHECKPOINTS) / name


def manifest(name: str, root: Optional[Path] = None) -> dict:
    return json.loads((folder(name, root) / "manifest.json").read_text())


def heldout(name: str, limit: Optional[int] = None, root: Optional[Path] = None) -> dict[str, np.ndarray]:
    """The committed held-out split: the model's input array (and labels), the first `limit` rows."""
    with np.load(folder(name, root) / "heldout.npz") as data:
        return {k: data[k][:limit] for k in data.files}


def load_model(name: str, dtype=None, root: Optional[Path] = None):
    """The trained transformers model (eval mode, eager attention), optionally cast to `dtype`."""
    import transformers

    model = transformers.AutoConfig.from_pretrained(folder(name, root))
    cls = {"gpt2_stdlib": transformers.AutoModelForCausalLM, "opt_stdlib": transformers.AutoModelForCausalLM,
           "bert_stdlib": transformers.AutoModelForMaskedLM,
           "vit_digits": transformers.AutoModelForImageClassification}[name]
    model = cls.from_pretrained(folder(name, root), attn_implementation="eager")
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


def logits_module(name: str, dtype=None, root: Optional[Path] = None):
    """The trained model as a module from the input tensor to the logits tensor (what exporters,
    `fold_module` and `torch.compile` take)."""
    from lnfold import zoo

    return zoo.Logits(load_model(name, dtype, root), "logits").eval()


def example_args(name: str, rows: int = 2, root: Optional[Path] = None) -> tuple:
    """(input tensor,) of `rows` held-out rows: example inputs for export and fold_module."""
    import torch

    return (torch.from_numpy(heldout(name, rows, root)[INPUT[name]]),)


# ---------------------------------------------------------------- runners

def torch_runner(module, dtype=None) -> Runner:
    """Run a torch module (returning logits, or an output with .logits) without grad. Float inputs
    are cast to `dtype` (default: the module's first floating parameter's dtype)."""
    import torch

    if dtype is None:
        dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)

    def run(x: np.ndarray) -> np.ndarray:
        t = torch.from_numpy(x)
        if t.is_floating_point():
            t = t.to(dtype)
        with torch.no_grad():
            out = module(t)
        out = getattr(out, "logits", out)
        return out.detach().to(torch.float64).numpy()

    return run


def onnx_runner(model: Union[str, Path, "object"]) -> Runner:
    """Run an ONNX model (a ModelProto or a path) in onnxruntime on the CPU; float inputs are
    cast to the graph's input type."""
    import onnxruntime as ort

    payload = str(model) if isinstance(model, (str, Path)) else model.SerializeToString()
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 3
    session = ort.InferenceSession(payload, opts, providers=["CPUExecutionProvider"])
    first = session.get_inputs()[0]
    float_type = {"tensor(float16)": np.float16, "tensor(double)": np.float64}.get(first.type, np.float32)

    def run(x: np.ndarray) -> np.ndarray:
        if np.issubdtype(x.dtype, np.floating):
            x = x.astype(float_type)
        return session.run(None, {first.name: x})[0].astype(np.float64)

    return run


# ---------------------------------------------------------------- metrics

def logits(name: str, runner: Runner, limit: Optional[int] = None, batch: int = 16,
           root: Optional[Path] = None) -> np.ndarray:
    """The runner's logits on the held-out inputs (float64), in batches of `batch` rows."""
    x = heldout(name, limit, root)[INPUT[name]]
    return np.concatenate([runner(x[i:i + batch]) for i in range(0, len(x), batch)])


def score(name: str, out: np.ndarray, limit: Optional[int] = None, root: Optional[Path] = None) -> Metric:
    """The metric of held-out logits `out` (as `logits` returns them)."""
    data = heldout(name, limit, root)
    if name in DECODERS:  # next-byte prediction inside each window
        ids = data["input_ids"]
        pred, target = out[:, :-1], ids[:, 1:]
    elif name == "bert_stdlib":  # the masked positions only
        scored = data["labels"] != -100
        pred, target = out[scored], data["labels"][scored]
    else:
        pred, target = out, data["labels"]
    pred = pred.reshape(-1, pred.shape[-1]).astype(np.float64)
    target = target.reshape(-1)
    shifted = pred - pred.max(axis=-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    loss = float(-logp[np.arange(len(target)), target].mean())
    if name in DECODERS:
        value = float(np.exp(loss))
    else:
        value = float((pred.argmax(axis=-1) == target).mean())
    return Metric(METRIC[name], value, loss, int(len(target)))


def evaluate(name: str, runner: Runner, limit: Optional[int] = None, root: Optional[Path] = None) -> Metric:
    """The held-out metric of `runner` (on the first `limit` held-out rows)."""
    return score(name, logits(name, runner, limit, root=root), limit, root)


def evaluate_module(name: str, module, root: Optional[Path] = None, limit: Optional[int] = None) -> Metric:
    return evaluate(name, torch_runner(module), limit, root)


def max_rel_err(out: np.ndarray, reference: np.ndarray) -> float:
    """max |out − reference| / max |reference|: the error of a run against a float64 one."""
    return float(np.abs(out - reference).max() / np.abs(reference).max())
