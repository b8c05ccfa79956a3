"""Random PyTorch models with known LayerNorm verdicts, and the fuzz properties lnfold must keep.

In the spirit of NNSmith: the generator builds valid models from the op families of THEORY §1 and
knows, *by construction*, which LayerNorms an exact fold may fold. Each model is a straight-line
`forward` (printable Python source) over modules named `ln3`, `fc7`, ...; while it writes each
line, the generator updates a union-find of stream components:

- a stream start adds centerable sources (embedding, linear, conv, ConvTranspose, constant tables)
  or one opaque start (a nonlinearity, a norm's output, a graph input used directly, a matmul by
  a weight that is a graph input, a depthwise conv);
- a pre-LN block adds its LayerNorm to the component; its branch ends in a centerable source
  (a linear, LayerScale folded in) or adds an opaque start (a nonlinearity, a norm's output,
  token mixing over a non-constant input);
- transparent ops (scalar and per-token scales, dropout, layout ops on token axes: reshape,
  transpose, slice, select, concat of tokens, split, roll, flip, pad, expand, pooling) change
  nothing; adding or concatenating two streams merges their components;
- a trap blocks its component: a linear reading the stream, the stream as a graph output, a
  concat along the feature axis, a per-channel scale of a shared sum, a LayerNorm over two axes,
  an RMSNorm, a reduction or a softmax over the wrong axis, a post-LN block;
- shared and tied weights (tied embedding heads, heads reusing a block's linear, ALBERT-style
  reused blocks) change no verdict but must be cloned, never edited in place.

Ground truth, per LayerNorm call: fold iff its component has no blocker and
`#norms >= 2 * #opaque starts` (the recenter cost model, passes/analysis.py RECENTER_PAYOFF), and
never for a LayerNorm over two axes.

Weights are adversarial (DESIGN §5): γ/β randomized, a large per-row mean in every embedding,
bias, weight and constant table, so that any missed centering breaks equivalence.

Choices go through a `Chooser`: a seeded RNG (reproduce with the seed), a replayed list of draws
(shrinking: `shrink()` lowers draws towards 0, which means "simpler" everywhere), or a hypothesis
`data` object (tests/test_fuzz.py).

The package, one job per module: choices.py (the draws), truth.py (the ground truth and the
`Case`), gen.py (the generator and adversarial weights), export.py (to ONNX, quietly),
properties.py (soundness, completeness, agreement), shrink.py, __main__.py (the command).

    python -m tests.fuzz --count 200 --seed 0          # properties over 200 models
    python -m tests.fuzz --long                       # 10,000 models (ONNX path)
    python -m tests.fuzz --show 17                    # print model 17 and its ground truth
    python -m tests.fuzz --seed 17 --count 1 --shrink # shrink a failing model
"""
