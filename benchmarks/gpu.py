"""`python -m benchmarks gpu`: the GPU rows of issue 35 in one script, start to finish within a budget.

    python -m benchmarks gpu [--out benchmarks/gpu.jsonl] [--rounds 3] [--budget-s 450] [--only kernels,infer,train]
    python -m benchmarks gpu --smoke        # the same code on CPU, tiny shapes (the suite runs it)

Groups (each row a JSON line written and flushed as soon as it is measured: a row that fails, or a
run cut short, loses nothing measured before it):
  kernels  compiled residual Add + LayerNorm against Add + RMSNorm + β on a zero-mean sum (what a
           folded model computes), d 768 / 1024 / 4096, forward and forward + backward
  infer    GPT-2-small b8x512, OPT d4096 x4 layers b4x512, ViT-B b64: the original compiled by
           Inductor, `torch.compile(backend="lnfold")` with lnfold.defer off / on / auto,
           `lnfold.fold_to_rmsnorm` then Inductor, and the LN->RMS swap without the fold (not exact)
  train    GPT-2-small training step (AdamW, autocast): original, `fold_for_training`, swap; compiled
Every group has an A/A copy (a second compiled copy of the original): the spread of a ratio of 1.
Every group runs in float16 and bfloat16; every row carries the error of its output (logits, or the
loss for training) against an fp32 reference, beside the original's own error in that dtype.
Timing: triton's do_bench on CUDA (else perf_counter medians), `--rounds` interleaved rounds whose
order rotates; ratios are medians against the original compiled by Inductor.

Dynamo traps: compiling several copies of one `transformers` forward exceeds Dynamo's recompile
limit and silently runs the rest eagerly, so the limit is raised and Dynamo is reset between groups.
The budget: rows that would start after `--budget-s` are written as skipped, with the reason.
`--smoke` runs on CPU with tiny shapes, one round, and compiles with Dynamo's "eager" backend
(lnfold's backend runs its folded graph eagerly): it checks the script, not the speed.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

from .common import HERE, log, now, quiet, versions

DTYPES = ("float16", "bfloat16")
SMOKE_DTYPES = ("bfloat16",)  # (the smoke checks the code; one dtype runs every line of it)


class Run:
    """What every row needs: device, compiler, budget, and the JSON-lines file it appends to."""

    def __init__(self, out: Path, smoke: bool, rounds: int, budget_s: float) -> None:
        import torch

        self.torch = torch
        self.smoke, self.rounds, self.budget_s = smoke, rounds, budget_s
        self.device = "cpu" if smoke or not torch.cuda.is_available() else "cuda"
        self.dtypes = SMOKE_DTYPES if smoke else DTYPES
        self.start = time.perf_counter()
        self.out = out
        out.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(out, "a")
        torch._dynamo.config.recompile_limit = 64  # (the trap: copies of one forward past the limit run eagerly)
        torch._dynamo.config.accumulated_recompile_limit = 4096

    def write(self, row: dict) -> None:
        row = {"date": now(), "device": self.device, "smoke": self.smoke, **row}
        self.file.write(json.dumps(row, default=str) + "\n")
        self.file.flush()
        log(json.dumps(row, default=str)[:300])

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.start)

    def compile(self, module, backend: str = "inductor", **lnfold_options):
        """torch.compile of `module` by Inductor ("inductor") or lnfold's backend ("lnfold");
        in smoke mode the compiled graphs run eagerly (Dynamo's "eager", lnfold's inner)."""
        torch = self.torch
        if backend == "lnfold":
            from lnfold.fx_rewrite import lnfold_backend_with

            inner = (lambda gm, _: gm.forward) if self.smoke else None
            return torch.compile(module, backend=lnfold_backend_with(inner=inner, **lnfold_options), dynamic=False)
        return torch.compile(module, backend="eager" if self.smoke else "inductor", dynamic=False)

    def sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def bench(self, fn) -> float:
        """Seconds per call of `fn`."""
        if self.device == "cuda":
            try:
                from triton.testing import do_bench

                return do_bench(fn, warmup=25, rep=100) / 1e3
            except ImportError:
                pass
        times = []
        for _ in range(1 if self.smoke else 5):
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)


def rel_err(got, ref) -> float:
    """max |got - ref| / max |ref|, in float64."""
    got, ref = got.double(), ref.double()
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def group(run: Run, name: str, dtype: str, variants: dict, reference, meta: dict) -> None:
    """Make each variant (`make() -> (call, output)`: its first call compiles), judge its output
    against the fp32 `reference`, time the variants in interleaved rounds, write a row each.
    A variant that fails is a row with its error; the others go on."""
    if run.left() <= 0:
        run.write({"group": name, "dtype": dtype, **meta, "skipped": f"budget of {run.budget_s:.0f} s spent"})
        return
    calls, rows = {}, {}
    for variant, make in variants.items():
        row = {"group": name, "variant": variant, "dtype": dtype, **meta}
        try:
            t0 = time.perf_counter()
            with quiet():
                call, out = make()
            run.sync()
            row["compile_s"] = round(time.perf_counter() - t0, 2)
            row["err_vs_fp32"] = rel_err(out, reference)
            calls[variant] = call
        except Exception as e:  # one variant that fails must not lose the others
            row["error"] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
            traceback.print_exc()
            run.write(row)
            continue
        rows[variant] = row
    times: dict = {v: [] for v in calls}
    order = list(calls)
    for r in range(run.rounds):
        for variant in order[r % len(order):] + order[:r % len(order)] if order else []:
            times[variant].append(run.bench(calls[variant]))
    base = statistics.median(times["original"]) if times.get("original") else None
    original_err = rows.get("original", {}).get("err_vs_fp32")
    for variant, row in rows.items():
        median = statistics.median(times[variant])
        row.update(ms=median * 1e3, times_ms=[t * 1e3 for t in times[variant]], rounds=run.rounds,
                   ratio=None if base is None else median / base, original_err_vs_fp32=original_err)
        run.write(row)
    run.torch._dynamo.reset()


# --- kernels: residual Add + LN against Add + RMSNorm + β ---------------------------------------

def kernels(run: Run) -> None:
    torch = run.torch
    from torch import nn

    tokens, dims = (64, (32,)) if run.smoke else (16384, (768, 1024, 4096))

    class AddLN(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.norm = nn.LayerNorm(d)

        def forward(self, x, r):
            return self.norm(x + r)

    class AddRMSBeta(nn.Module):
        def __init__(self, ln: nn.LayerNorm):
            super().__init__()
            self.norm = nn.RMSNorm(ln.normalized_shape, eps=ln.eps)
            self.beta = nn.Parameter(ln.bias.detach().clone())
            with torch.no_grad():
                self.norm.weight.copy_(ln.weight)

        def forward(self, x, r):
            return self.norm(x + r) + self.beta

    for d in dims:
        g = torch.Generator().manual_seed(d)
        ln32 = AddLN(d)
        with torch.no_grad():
            ln32.norm.weight.copy_(1 + 0.5 * torch.randn(d, generator=g))
            ln32.norm.bias.copy_(torch.randn(d, generator=g))
        # a zero-mean sum: what a folded model's norm reads (its sources centered)
        x32 = torch.randn(tokens, d, generator=g) * 3
        r32 = torch.randn(tokens, d, generator=g)
        x32, r32 = x32 - x32.mean(-1, keepdim=True), r32 - r32.mean(-1, keepdim=True)
        for dtype_name in run.dtypes:
            dtype = getattr(torch, dtype_name)
            x, r = x32.to(run.device, dtype), r32.to(run.device, dtype)
            with torch.no_grad():  # the fp32 reference: the stored low-precision inputs, computed in fp32
                reference = ln32.to(run.device)(x.float(), r.float())
            for pass_ in ("forward", "forward+backward"):
                def variant(module, pass_=pass_, x=x, r=r):
                    def make():
                        m = module.to(run.device, dtype)
                        fn = run.compile(m)
                        grad = torch.ones_like(x)
                        xs, rs = (x.clone().requires_grad_(), r.clone().requires_grad_()) \
                            if pass_ != "forward" else (x, r)

                        def call():
                            if pass_ == "forward":
                                with torch.no_grad():
                                    return fn(xs, rs)
                            out = fn(xs, rs)
                            out.backward(grad)
                            return out.detach()
                        return call, call()
                    return make
                group(run, "kernels", dtype_name, {
                    "original": variant(copy.deepcopy(ln32)),
                    "original (A/A)": variant(copy.deepcopy(ln32)),
                    "Add+RMSNorm+β": variant(AddRMSBeta(ln32.norm)),
                }, reference, {"case": f"residual Add + norm, {tokens} tokens, d {d}", "pass": pass_})


# --- inference: GPT-2-small, OPT d4096 x4, ViT-B ------------------------------------------------

def _models(smoke: bool) -> dict:
    """name -> (build() -> fp32 module, inputs(device) -> args)."""
    import torch
    import transformers

    from lnfold import zoo

    def lm(cfg, model_cls, batch, seq):
        def build():
            torch.manual_seed(0)
            return zoo.Logits(model_cls(cfg).eval(), "logits").eval()
        return build, lambda dev: (torch.randint(0, cfg.vocab_size, (batch, seq),
                                                 generator=torch.Generator().manual_seed(0)).to(dev),)

    if smoke:
        gpt2 = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=101, n_positions=64,
                                       attn_implementation="eager")
        opt = transformers.OPTConfig(hidden_size=64, ffn_dim=256, num_hidden_layers=2, num_attention_heads=4,
                                     vocab_size=101, max_position_embeddings=64, word_embed_proj_dim=64)
        vit = transformers.ViTConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=256,
                                     image_size=32, patch_size=8, attn_implementation="eager")
        shapes = {"gpt2": (2, 16), "opt": (2, 16), "vit": 2}
    else:
        gpt2 = transformers.GPT2Config(attn_implementation="eager")
        opt = transformers.OPTConfig(hidden_size=4096, ffn_dim=16384, num_hidden_layers=4, num_attention_heads=32,
                                     vocab_size=50272, max_position_embeddings=2048, word_embed_proj_dim=4096)
        vit = transformers.ViTConfig(attn_implementation="eager")
        shapes = {"gpt2": (8, 512), "opt": (4, 512), "vit": 64}

    def vit_build():
        torch.manual_seed(0)
        return zoo.Logits(transformers.ViTModel(vit, add_pooling_layer=False).eval(), "last_hidden_state").eval()

    side = vit.image_size
    return {
        f"GPT-2-small b{shapes['gpt2'][0]}x{shapes['gpt2'][1]}": lm(gpt2, transformers.GPT2LMHeadModel, *shapes["gpt2"]),
        f"OPT d{opt.hidden_size} x{opt.num_hidden_layers} b{shapes['opt'][0]}x{shapes['opt'][1]}":
            lm(opt, transformers.OPTForCausalLM, *shapes["opt"]),
        f"ViT-B b{shapes['vit']}": (vit_build, lambda dev: (torch.randn(
            shapes["vit"], 3, side, side, generator=torch.Generator().manual_seed(0)).to(dev),)),
    }


def infer(run: Run) -> None:
    torch = run.torch
    import lnfold

    from .torch_bench import swap_norms

    for case, (build, inputs) in _models(run.smoke).items():
        if run.left() <= 0:
            run.write({"group": "infer", "case": case, "skipped": f"budget of {run.budget_s:.0f} s spent"})
            continue
        try:
            fp32 = build().to(run.device)
            args32 = inputs(run.device)
            with torch.no_grad():
                reference = fp32(*args32)
            handoff = copy.deepcopy(fp32)  # folded once in fp32 (verified against float64), then cast
            lnfold.fold_to_rmsnorm(handoff, args32)
            swapped = swap_norms(fp32, "rms")
        except Exception as e:
            run.write({"group": "infer", "case": case, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            traceback.print_exc()
            continue
        for dtype_name in run.dtypes:
            dtype = getattr(torch, dtype_name)
            args = tuple(a.to(dtype) if a.is_floating_point() else a for a in args32)

            def variant(module, backend="inductor", **options):
                def make():
                    fn = run.compile(copy.deepcopy(module).to(dtype), backend, **options)

                    def call():
                        with torch.no_grad():
                            return fn(*args)
                    return call, call()
                return make
            group(run, "infer", dtype_name, {
                "original": variant(fp32),
                "original (A/A)": variant(fp32),
                "backend lnfold": variant(fp32, "lnfold"),
                "backend lnfold, defer on": variant(fp32, "lnfold", defer="on"),
                "backend lnfold, defer auto": variant(fp32, "lnfold", defer="auto"),
                "fold_to_rmsnorm": variant(handoff),
                "LN->RMS swap (not exact)": variant(swapped),
            }, reference, {"case": case})
        del fp32, handoff, swapped


# --- training: GPT-2-small step ------------------------------------------------------------------

def train(run: Run) -> None:
    torch = run.torch
    import torch.nn.functional as F
    import lnfold

    from .torch_bench import swap_norms

    (case, (build, inputs)), = [(k, v) for k, v in _models(run.smoke).items() if k.startswith("GPT-2")]
    fp32 = build().to(run.device)
    for m in fp32.modules():  # dropout off: a dropped residual stream keeps every norm, correctly
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    fp32.train()
    (ids,) = inputs(run.device)

    def loss_of(model):
        logits = model(ids)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))

    reference = loss_of(fp32).detach()
    folded = copy.deepcopy(fp32)
    lnfold.fold_for_training(folded, (ids,))
    swapped = swap_norms(fp32, "rms").train()
    for dtype_name in run.dtypes:
        dtype = getattr(torch, dtype_name)

        def variant(module):
            def make():
                model = copy.deepcopy(module)
                fn = run.compile(model)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

                def call():
                    with torch.autocast(run.device, dtype=dtype):
                        loss = loss_of(fn)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    return loss.detach()
                return call, call()
            return make
        group(run, "train", dtype_name, {
            "original": variant(fp32),
            "original (A/A)": variant(fp32),
            "fold_for_training": variant(folded),
            "LN->RMS swap (not exact)": variant(swapped),
        }, reference, {"case": f"{case} training step (AdamW, autocast {dtype_name})"})


GROUPS = {"kernels": kernels, "infer": infer, "train": train}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks gpu")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, one round, compiled graphs run eagerly")
    p.add_argument("--out", default=str(HERE / "gpu.jsonl"), help="the JSON-lines file the rows are appended to")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3; --smoke: 1)")
    p.add_argument("--budget-s", type=float, default=450.0,
                   help="rows that would start after this many seconds are written as skipped (default 450)")
    p.add_argument("--only", default=",".join(GROUPS), help="comma-separated groups: " + ", ".join(GROUPS))
    a = p.parse_args(argv)
    groups = [g for g in a.only.split(",") if g]
    bad = [g for g in groups if g not in GROUPS]
    if bad:
        p.error(f"unknown group(s) {', '.join(bad)}; choose from {', '.join(GROUPS)}")
    run = Run(Path(a.out), a.smoke, 1 if a.smoke else a.rounds, a.budget_s)
    if run.device != "cuda" and not a.smoke:
        print("benchmarks gpu: torch sees no CUDA device (use --smoke to check the script on CPU)", file=sys.stderr)
        return 2
    import torch

    run.write({"group": "meta", "versions": versions(), "gpu": torch.cuda.get_device_name(0) if run.device == "cuda"
               else None, "command": "python -m benchmarks gpu " + " ".join(argv if argv is not None else sys.argv[1:])})
    failed = 0
    for g in groups:
        try:
            GROUPS[g](run)
        except Exception as e:  # a group that fails outside its rows: said, and the next group runs
            failed += 1
            run.write({"group": g, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            traceback.print_exc()
    run.write({"group": "meta", "finished_s": round(time.perf_counter() - run.start, 1), "failed_groups": failed})
    run.file.close()
    return 1 if failed else 0
