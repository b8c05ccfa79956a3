"""Outlier channels in the trained models' residual streams (LLM.int8(); "massive activations").

    python -m benchmarks.trained.outliers

Per layer, on the held-out inputs: each channel's max |activation| over all tokens, and the ratio
of the largest channel's to the median channel's (LLM.int8() calls a feature an outlier at
|x| >= 6 in models whose typical |x| is ~1; "massive activations" are ~1000x the median). Also
the stream's mean along the features relative to its RMS (what the fold's centering removes)
and, per LayerNorm, max |γ| / median |γ|. Measured in float32 on the committed checkpoints.
"""
from __future__ import annotations

import numpy as np
import torch

from . import harness

BLOCKS = ("GPT2Block", "BertLayer", "ViTLayer")


def stream_stats(name: str, limit: int = 32) -> list[dict]:
    """One dict per residual-stream point: the embeddings' output, then each block's output."""
    model = harness.load_model(name)
    blocks = [m for m in model.modules() if type(m).__name__ in BLOCKS]
    seen = []
    hooks = [b.register_forward_hook(lambda mod, args, out: seen.append(out[0] if isinstance(out, tuple) else out))
             for b in blocks]
    x = torch.from_numpy(harness.heldout(name, limit)[harness.INPUT[name]])
    with torch.no_grad():
        out = model(x, output_hidden_states=True)
    for h in hooks:
        h.remove()
    stats = []
    for label, a in [("embeddings", out.hidden_states[0])] + [(f"block {i + 1}", a) for i, a in enumerate(seen)]:
        a = a.double().reshape(-1, a.shape[-1])
        per_channel = a.abs().max(dim=0).values
        top = torch.topk(per_channel, 3)
        stats.append({
            "point": label,
            "max_over_median": (per_channel.max() / per_channel.median()).item(),
            "top_channels": top.indices.tolist(),
            "top_max_abs": [round(v, 2) for v in top.values.tolist()],
            "median_max_abs": per_channel.median().item(),
            "mean_over_rms": (a.mean(-1).abs() / a.pow(2).mean(-1).sqrt()).mean().item(),
        })
    return stats


def gamma_stats(name: str) -> list[tuple[str, float, float]]:
    """(LayerNorm, max |γ| / median |γ|, max |β|) for each LayerNorm of the model."""
    model = harness.load_model(name)
    return [(n, (m.weight.abs().max() / m.weight.abs().median()).item(), m.bias.abs().max().item())
            for n, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm)]


def outlier_table(name: str) -> list[str]:
    lines = [f"**{name}** (residual stream, float32, the first 32 held-out rows)",
             "", "| point | max / median channel max-abs | top channels (max-abs) | median channel max-abs | "
             "mean |token mean| / RMS |", "| --- | --- | --- | --- | --- |"]
    for s in stream_stats(name):
        tops = ", ".join(f"{c} ({v:g})" for c, v in zip(s["top_channels"], s["top_max_abs"]))
        lines.append(f"| {s['point']} | {s['max_over_median']:.1f} | {tops} | {s['median_max_abs']:.2f} | "
                     f"{s['mean_over_rms']:.3f} |")
    gammas = gamma_stats(name)
    worst = max(gammas, key=lambda g: g[1])
    lines += ["", f"γ: max |γ| / median |γ| per LayerNorm: {', '.join(f'{g[1]:.1f}' for g in gammas)} "
              f"(largest: `{worst[0]}`); max |β|: {max(g[2] for g in gammas):.2f}", ""]
    return lines


if __name__ == "__main__":
    for model_name in harness.MODELS:
        print("\n".join(outlier_table(model_name)))
