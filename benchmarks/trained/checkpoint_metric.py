"""Issue 25 on a trained model: the trained GPT-2 (benchmarks/trained/gpt2_stdlib) saved as a sharded checkpoint
(fp32 and fp16, 2 MB shards) and folded by lnfold.fold_checkpoint (verified); held-out perplexity of original and
folded, each loaded by from_pretrained in the stock class, and their logits against a float64 run of the original.
ViT (pixel inputs) is tried too: the checkpoint path feeds input_ids, so it is refused in one line.

    python -m benchmarks.trained.checkpoint_metric
"""
import shutil
import tempfile
from pathlib import Path

import torch

import lnfold
from benchmarks.trained import harness as H


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    for dtype in (torch.float32, torch.float16):
        name = str(dtype).removeprefix("torch.")
        src, out = tmp / f"src-{name}" / "gpt2_stdlib", tmp / f"out-{name}" / "gpt2_stdlib"
        src.parent.mkdir(); out.parent.mkdir()
        H.load_model("gpt2_stdlib").to(dtype).save_pretrained(src, max_shard_size="2MB")
        for f in ("heldout.npz", "manifest.json"):
            shutil.copy(H.folder("gpt2_stdlib") / f, src / f)
        r = lnfold.fold_checkpoint(src, out)
        ppl = {k: H.evaluate_module("gpt2_stdlib", H.load_model("gpt2_stdlib", root=root), root=root).value
               for k, root in (("original", src.parent), ("folded", out.parent))}
        exact = H.logits("gpt2_stdlib", H.torch_runner(H.load_model("gpt2_stdlib", root=src.parent).double()), root=src.parent)
        errs = {k: H.max_rel_err(H.logits("gpt2_stdlib", H.torch_runner(H.load_model("gpt2_stdlib", root=root)), root=root), exact)
                for k, root in (("original", src.parent), ("folded", out.parent))}
        print(f"{name}: {len(list(src.glob('*.safetensors')))} shards, {r.report.folded} folded / {r.report.kept} kept, "
              f"verified {r.criterion}; held-out perplexity original {ppl['original']:.5f} folded {ppl['folded']:.5f}; "
              f"logits vs float64: original {errs['original']:.2e} folded {errs['folded']:.2e}", flush=True)
    try:
        lnfold.fold_checkpoint(H.folder("vit_digits"), tmp / "vit")
    except lnfold.LnfoldError as e:
        print("vit_digits:", str(e).splitlines()[0][:300])
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
