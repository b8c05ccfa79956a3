"""The generator: one straight-line model per run of draws, its forward written as Python source,
its ground truth kept as it writes (truth.py), its weights made adversarial."""
from __future__ import annotations

import linecache
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .choices import Chooser, ReplayChooser, SeededChooser
from .truth import Case, NormCall, Truth

B = 2  # batch
ACTS = ["F.gelu", "torch.relu", "torch.tanh", "F.silu", "torch.sigmoid"]
SOURCE_MEAN = 3.0  # large means, in units of a tensor's own scale (DESIGN §5)


class GenModel(nn.Module):
    """Holds the generated modules/parameters; `forward` is compiled from generated source."""

    def finish(self, source: str, tag: str) -> None:
        filename = f"<tests.fuzz {tag}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        ns: dict = {"torch": torch, "F": F}
        exec(compile(source, filename, "exec"), ns)
        self._src = source
        # forward belongs to this model only: a subclass per model
        self.__class__ = type("Generated", (GenModel,), {"forward": ns["forward"]})


@dataclass
class Stream:
    var: str
    cid: int
    read: bool = False  # some tensor of this stream has a reader besides the path to here


class Gen:
    """Builds one model: lines of `forward`, modules, inputs, and the ground truth."""

    def __init__(self, ch: Chooser, small: bool = False, lowp: bool = False) -> None:
        self.ch = ch
        self.small = small  # at most 2 streams of at most 3 steps (the long run)
        # No 2-feature streams: LayerNorm over 2 features is a sign function of x1 - x2
        # (n = ±1), and a row near the tie (mean/std of 950 happens) flips on one ulp, in either
        # model, so "no less accurate than the original" cannot be judged on it. (`lowp` once
        # excluded them in fp16 only; the long run met one in fp32 too.)
        self.lowp = lowp
        self.m = GenModel()
        self.lines: list[str] = []
        self.env: dict[str, torch.Tensor] = {}  # example value of every variable (runs as it writes)
        self.inputs: list[str] = []
        self.outputs: list[str] = []
        self.truth = Truth()
        self.calls: list[NormCall] = []
        self.k = 0
        self.roles: dict[str, str] = {}  # parameter name -> how to make it adversarial
        self.vocab = ch.pick([13, 7, 29])
        self.blocks: list[tuple] = []  # reusable (D, shape, fn) for ALBERT-style shared blocks
        self.d_linears: dict[int, list[str]] = {}  # D -> linears D->D (for shared heads)
        self.embs: dict[int, list[str]] = {}  # D -> embeddings (for tied heads, shared sources)
        self.start_linears: list[str] = []  # input projections (shared between starts)
        self.donated: list[tuple[str, int]] = []  # (var, D): norm outputs given to a later stream
        self.pending: list[Stream] = []  # streams kept open to merge into a later one

    # -- bookkeeping ---------------------------------------------------------------------------
    def name(self, prefix: str) -> str:
        self.k += 1
        return f"{prefix}{self.k}"

    def add(self, prefix: str, mod: nn.Module) -> str:
        n = self.name(prefix)
        setattr(self.m, n, mod)
        return n

    def param(self, shape, role: str) -> str:
        n = self.name("p")
        setattr(self.m, n, nn.Parameter(torch.randn(*shape) * 0.5))
        self.roles[n] = role
        return n

    def emit(self, expr: str) -> str:
        v = self.name("v")
        self.run(f"{v} = {expr}")
        return v

    def run(self, line: str) -> None:
        ns = dict(self.env, self=self.m, torch=torch, F=F)
        with torch.no_grad():
            exec(line, ns)
        for k, val in ns.items():
            if k.startswith("v") and k[1:].isdigit() and k not in self.env:
                self.env[k] = val
        self.lines.append(line)

    def shape(self, v: str) -> tuple:
        return tuple(self.env[v].shape)

    def new_input(self, kind: str, shape) -> str:
        n = f"in{len(self.inputs)}"
        if kind == "ids":
            self.env[n] = torch.randint(0, self.vocab, tuple(shape))
        else:
            self.env[n] = torch.randn(*shape)
            if kind == "mask":
                self.env[n] = torch.rand(*shape) + 0.5
        self.inputs.append(n)
        return n

    def output(self, v: str) -> None:
        if v in self.inputs:  # an input returned as is: the dynamo exporter writes a duplicate name
            v = self.emit(f"-{v}")
        if v not in self.outputs:
            self.outputs.append(v)

    def layernorm(self, v: str, comp: Optional[int], two_axes: bool = False) -> str:
        """A LayerNorm call on `v` (new module), registered with the ground truth."""
        shape = self.shape(v)
        ch = self.ch
        normalized = shape[-2:] if two_axes else shape[-1:]
        affine = not ch.bool(0.2)
        bias = affine and not ch.bool(0.15)
        eps = self.eps(affine)
        mod = self.add("ln", nn.LayerNorm(list(normalized), eps=eps, elementwise_affine=affine, bias=bias))
        return self.norm_call(mod, v, comp)

    def eps(self, affine: bool) -> float:
        """Exporters merge identical calls on one input (CSE): two γ-less LayerNorms of one tensor
        would become one node. A unique eps per γ-less norm keeps every call a node."""
        e = self.ch.pick([1e-5, 1e-6, 1e-12])
        return e if affine else e * (1 + 1e-3 * self.k)

    def norm_call(self, mod: str, v: str, comp: Optional[int]) -> str:
        idx = len(self.calls)
        self.calls.append(NormCall(mod, comp))
        if comp is not None:
            self.truth.add_norm(comp, idx)
        return self.emit(f"self.{mod}({v})")

    def linear(self, din: int, dout: int, bias: Optional[bool] = None) -> str:
        if bias is None:
            bias = not self.ch.bool(0.2)
        n = self.add("fc", nn.Linear(din, dout, bias=bias))
        if din == dout:
            self.d_linears.setdefault(din, []).append(n)
        return n

    def rms_expr(self, z: str, D: int) -> str:
        """An RMSNorm written out (the TorchScript exporter has no aten::rms_norm before opset 23)."""
        g = self.param((D,), "gamma")
        return f"{z} * torch.rsqrt({z}.pow(2).mean(-1, keepdim=True) + 1e-6) * self.{g}"

    def act(self) -> str:
        return self.ch.pick(ACTS)

    # -- stream starts -------------------------------------------------------------------------
    def start(self, T: int, D: int) -> Stream:
        """A new stream: a sum of centerable start terms and at most one opaque term."""
        ch = self.ch
        cid = self.truth.new()
        terms: list[str] = []
        opaque = None
        if self.donated and ch.bool(0.5):
            v, D = self.donated.pop(0)
            terms.append(v)
            opaque = "the output of a LayerNorm of another stream"
            T = self.shape(v)[1] if len(self.shape(v)) >= 3 else T
        else:
            kind = ch.pick(["emb", "linear", "conv2d", "conv1d", "opaque", "convT"])
            if kind == "opaque":
                v, opaque = self.opaque_term(T, D)
            else:
                v = self.centerable_term(kind, T, D)
            terms.append(v)
        shape = self.shape(terms[0])
        # more centerable terms of the same shape, and constant tables
        for _ in range(ch.int(0, 2)):
            kind = ch.pick(["emb", "linear", "conv1d", "pos", "rowconst", "opaque"])
            if (len(shape) != 3 or shape[0] != B) and kind not in ("pos", "rowconst"):
                continue
            if kind == "opaque":
                if opaque is not None:
                    continue
                v, opaque = self.opaque_term(shape[1], shape[2])
            elif kind == "pos":
                v = f"self.{self.param(shape[1:], 'table')}"
            elif kind == "rowconst":  # a constant that is the same along the feature axis
                v = f"self.{self.param(shape[1:-1] + (1,), 'rowconst')}"
            else:
                v = self.centerable_term(kind, shape[1], shape[2])
            terms.append(v)
        h = terms[0] if len(terms) == 1 else self.emit(" + ".join(terms))
        if opaque:
            self.truth.add_opaque(cid, opaque)
        if ch.bool(0.15):  # T5/Gemma-style scalar scale of the embedding
            h = self.emit(f"{h} * {ch.pick([2.0, 0.125, 8.0])}")
        if ch.bool(0.15) and len(self.shape(h)) == 3:  # cls token: a constant concatenated on tokens
            cls = self.param((1, 1, self.shape(h)[-1]), "table")
            h = self.emit(f"torch.cat([self.{cls}.expand({self.shape(h)[0]}, 1, {self.shape(h)[-1]}), {h}], 1)")
        return Stream(h, cid)

    def centerable_term(self, kind: str, T: int, D: int) -> str:
        ch = self.ch
        if kind == "emb":
            have = [i for i in self.inputs if self.env[i].dtype == torch.int64 and self.env[i].shape == (B, T)]
            ids = have[0] if have and not ch.bool(0.3) else self.new_input("ids", (B, T))
            if self.embs.get(D) and ch.bool(0.25):  # an embedding shared with another source
                mod = ch.pick(self.embs[D])
                # new ids: exporters merge identical calls (CSE), which would join the two streams
                ids = self.new_input("ids", (B, T))
            else:
                mod = self.add("emb", nn.Embedding(self.vocab, D))
                self.embs.setdefault(D, []).append(mod)
            v = self.emit(f"self.{mod}({ids})")
        elif kind == "linear":
            shared = [m for m in self.start_linears if getattr(self.m, m).out_features == D]
            if shared and ch.bool(0.25):  # an input projection shared by two starts
                mod = ch.pick(shared)
                din = getattr(self.m, mod).in_features
            else:
                din = ch.pick([3, 5, D])
                mod = self.linear(din, D)
                self.start_linears.append(mod)
            x = self.new_input("x", (B, T, din))
            v = self.emit(f"self.{mod}({x})")
        elif kind == "conv2d":
            hp = next(d for d in (2, 1) if T % d == 0)
            p = ch.pick([2, 1])
            c = ch.pick([3, 1])
            img = self.new_input("x", (B, c, hp * p, (T // hp) * p))
            mod = self.add("conv", nn.Conv2d(c, D, p, stride=p, bias=not ch.bool(0.2)))
            v = self.emit(f"self.{mod}({img}).flatten(2).transpose(1, 2)")
        elif kind == "conv1d":
            cin = ch.pick([3, D])
            x = self.new_input("x", (B, T, cin))
            mod = self.add("conv", nn.Conv1d(cin, D, 3, padding=1, bias=not ch.bool(0.2)))
            v = self.emit(f"self.{mod}({x}.transpose(1, 2)).transpose(1, 2)")
        else:  # convT
            cin = ch.pick([3, D])
            x = self.new_input("x", (B, T, cin))
            mod = self.add("conv", nn.ConvTranspose1d(cin, D, 3, padding=1, bias=not ch.bool(0.2)))
            v = self.emit(f"self.{mod}({x}.transpose(1, 2)).transpose(1, 2)")
        if ch.bool(0.2):  # LayerScale of a single source: folded into it
            v = self.emit(f"{v} * self.{self.param((D,), 'scale')}")
        return v

    def opaque_term(self, T: int, D: int) -> tuple[str, str]:
        ch = self.ch
        kind = ch.pick(["act", "input", "norm", "weight_input", "dwconv"])
        if kind == "act":
            v = self.centerable_term(ch.pick(["emb", "linear"]), T, D)
            return self.emit(f"{self.act()}({v})"), "a nonlinearity"
        if kind == "input":
            return self.new_input("x", (B, T, D)), "a graph input used directly"
        if kind == "norm":  # BLOOM: an embedding LayerNorm starts the stream
            src = self.start_for_norm(T, D)
            return self.layernorm(src.var, src.cid), "the output of a LayerNorm"
        if kind == "weight_input":
            x = self.new_input("x", (B, T, 3))
            w = self.new_input("x", (3, D))
            return self.emit(f"torch.matmul({x}, {w})"), "a matmul by a weight that is a graph input"
        x = self.new_input("x", (B, T, D))
        mod = self.add("conv", nn.Conv1d(D, D, 3, padding=1, groups=D))
        return self.emit(f"self.{mod}({x}.transpose(1, 2)).transpose(1, 2)"), "a depthwise conv"

    def start_for_norm(self, T: int, D: int) -> Stream:
        """A tiny stream read only by one LayerNorm (its own component)."""
        cid = self.truth.new()
        return Stream(self.centerable_term(self.ch.pick(["emb", "linear", "conv1d"]), T, D), cid)

    # -- residual blocks -----------------------------------------------------------------------
    def block(self, st: Stream) -> Stream:
        ch = self.ch
        D = self.shape(st.var)[-1]
        shape = self.shape(st.var)
        reuse = [b for b in self.blocks if b[0] == D and b[1] in (None, shape)]
        if reuse and ch.bool(0.15):  # ALBERT: the same block modules again
            fn = ch.pick(reuse)[2]
        else:
            fn = self.make_block(D, shape)
        h = fn(st)
        st.read = True
        return Stream(h, st.cid, True)

    def make_block(self, D: int, shape: tuple) -> Callable[[Stream], str]:
        ch = self.ch
        parallel = ch.bool(0.2)
        shared_norm = parallel and ch.bool(0.5)
        n_branches = 2 if parallel else 1
        branches = [self.make_branch(D, shape) for _ in range(n_branches)]
        # LayerNorm modules of the block (made now, called at each use)
        ln_mods = []
        for _ in range(1 if shared_norm else n_branches):
            affine = not ch.bool(0.2)
            bias = affine and not ch.bool(0.15)
            eps = self.eps(affine)
            ln_mods.append(self.add("ln", nn.LayerNorm(D, eps=eps, elementwise_affine=affine, bias=bias)))
        combine = ch.pick(["+", "+", "-", "r+", "r-"])
        needs_shape = any(b[1] for b in branches)

        # A branch that adds its LayerNorm's output through transparent ops puts that output in
        # the stream: one opaque start however many such branches, and if the norm is shared
        # with another branch, that branch reads a stream tensor (THEORY §1: a sink) and blocks.
        plain = [b[2] for b in branches]

        def fn(st: Stream) -> str:
            ys = []
            normed = [self.norm_call(m, st.var, st.cid) for m in ln_mods]
            counted = False
            for k, (branch, _, is_plain) in enumerate(branches):
                y, opaque = branch(normed[0 if shared_norm else k])
                if opaque and not (shared_norm and is_plain and counted):
                    self.truth.add_opaque(st.cid, opaque)
                counted = counted or is_plain
                ys.append(y)
            if shared_norm and any(plain) and not all(plain):
                self.truth.block(st.cid, "a LayerNorm output added to the stream is also read by another branch")
            if combine in ("r+", "r-"):  # the stream as the last operand (of a Sub: negated)
                return self.emit(" + ".join(ys) + f" {combine[1]} {st.var}")
            return self.emit(f"{st.var} {combine} " + f" {combine} ".join(ys))

        self.blocks.append((D, shape if needs_shape else None, fn))
        return fn

    def make_branch(self, D: int, shape: tuple):
        """(branch(normed var) -> (y, opaque start or None), needs this exact shape, whether it
        adds its input to the stream through transparent ops only)."""
        ch = self.ch
        kind = ch.pick(["mlp", "linear", "attn", "deep", "opaque_end", "norm_end", "identity",
                        "mixer", "dwconv", "rms_inside"])
        if kind == "mixer" and (len(shape) < 3 or shape[-2] < 2):
            kind = "mlp"
        if kind == "dwconv" and len(shape) != 3:
            kind = "linear"
        H = ch.pick([2 * D, D, 3])
        post: list[str] = []
        if ch.bool(0.3):
            post.append(f"* self.{self.param((D,), 'scale')}")  # LayerScale
        if ch.bool(0.2):
            post.append(f"* {ch.pick([0.5, 2.0, 0.1])}")
        if ch.bool(0.15):
            post.append(f"/ {ch.pick([4.0, 0.25])}")
        if ch.bool(0.2):
            post.append("DROPOUT")
        dropout = self.add("drop", nn.Dropout(0.3)) if "DROPOUT" in post else None
        post = [p for p in post if p != "DROPOUT"]
        opaque = None
        if kind == "mlp":
            f1, f2, a = self.linear(D, H), self.linear(H, D), self.act()
            body = lambda z: self.emit(f"self.{f2}({a}(self.{f1}({z})))")  # noqa: E731
        elif kind == "linear":
            f1 = self.linear(D, D)
            body = lambda z: self.emit(f"self.{f1}({z})")  # noqa: E731
        elif kind == "deep":
            depth = ch.int(2, 4)
            dims = [D] + [H] * (depth - 1) + [D]
            mods = [self.linear(dims[i], dims[i + 1]) for i in range(depth)]
            acts = [self.act() for _ in range(depth - 1)]

            def body(z):
                for i, m in enumerate(mods):
                    z = self.emit(f"self.{m}({z})")
                    if i < len(acts):
                        z = self.emit(f"{acts[i]}({z})")
                return z
        elif kind == "attn":
            q, k, v, o = (self.linear(D, D) for _ in range(4))

            def body(z):
                a = self.emit(f"torch.softmax(self.{q}({z}) @ self.{k}({z}).transpose(-1, -2) * {1 / math.sqrt(D):.6f}, -1)")
                return self.emit(f"self.{o}({a} @ self.{v}({z}))")
        elif kind == "opaque_end":
            f1, a = self.linear(D, D), self.act()
            body = lambda z: self.emit(f"{a}(self.{f1}({z}))")  # noqa: E731
            opaque = "a nonlinearity ending a branch"
        elif kind == "norm_end":  # the branch ends with a LayerNorm of its own
            f1 = self.linear(D, D)
            affine = not ch.bool(0.3)
            inner = self.add("ln", nn.LayerNorm(D, eps=self.eps(affine), elementwise_affine=affine))

            def body(z):
                src = self.emit(f"self.{f1}({z})")
                return self.norm_call(inner, src, self.truth.new())
            opaque = "the output of a LayerNorm ending a branch"
        elif kind == "identity":  # h + LN(h)
            body = lambda z: z  # noqa: E731
            opaque = "the output of the block's LayerNorm"
        elif kind == "mixer":  # MLP-Mixer token mixing: a linear over the token axis
            T = shape[-2]
            f1 = self.linear(T, T)
            body = lambda z: self.emit(f"self.{f1}({z}.transpose(-1, -2)).transpose(-1, -2)")  # noqa: E731
            opaque = "token mixing of a LayerNorm's output"
        elif kind == "dwconv":  # ConvNeXt-ish: depthwise conv over tokens, then a linear
            c = self.add("conv", nn.Conv1d(D, D, 3, padding=1, groups=D))
            f1 = self.linear(D, D)
            body = lambda z: self.emit(f"self.{f1}(self.{c}({z}.transpose(1, 2)).transpose(1, 2))")  # noqa: E731
        else:  # rms_inside: an RMSNorm inside the branch (reads a norm output, not the stream)
            f1 = self.linear(D, D)
            body = lambda z: self.emit(f"self.{f1}({self.rms_expr(z, D)})")  # noqa: E731

        def branch(z: str):
            y = body(z)
            for p in post:
                y = self.emit(f"{y} {p}")
            if dropout:
                y = self.emit(f"self.{dropout}({y})")
            return y, opaque

        plain_identity = kind == "identity" and not any(p.startswith("* self.") for p in post)
        return branch, kind in ("mixer", "dwconv"), plain_identity

    # -- transparent steps ---------------------------------------------------------------------
    def layout(self, st: Stream) -> Stream:
        """A shift-transparent op on non-feature axes (or a scale constant along features)."""
        ch = self.ch
        h = st.var
        s = self.shape(h)
        r = len(s)
        tok = [a for a in range(r - 1) if s[a] >= 2]
        kind = ch.pick(["scale", "transpose", "split", "merge", "slice", "select", "pool", "cat_self",
                        "roll", "flip", "pad", "chunk_add", "expand", "mask", "index", "rowconst", "pos", "neg"])
        if kind in ("transpose",) and r < 3:
            kind = "scale"
        if kind in ("split",) and (r > 3 or not any(s[a] % 2 == 0 and s[a] >= 2 for a in range(1, r - 1))):
            kind = "scale"
        if kind in ("merge",) and r < 3:
            kind = "scale"
        if kind in ("slice", "select", "roll", "flip", "chunk_add", "index") and not tok:
            kind = "scale"
        if kind == "chunk_add" and not any(s[a] % 2 == 0 for a in tok):
            kind = "scale"
        if kind in ("pool", "select") and r < 3:
            kind = "scale"
        if kind == "expand" and r > 3:
            kind = "scale"
        if kind == "scale":
            op = ch.pick(["*", "/"])
            out = self.emit(f"{h} {op} {ch.pick([0.5, 3.0, -1.5])}")
        elif kind == "neg":
            out = self.emit(f"-{h}")
        elif kind == "transpose":
            a, b = ch.pick([(0, 1), (1, r - 2), (0, r - 2)])
            out = self.emit(f"{h}.transpose({a}, {b})")
        elif kind == "split":
            a = next(a for a in range(1, r - 1) if s[a] % 2 == 0)
            new = list(s[:a]) + [s[a] // 2, 2] + list(s[a + 1:])
            out = self.emit(f"{h}.reshape({', '.join(map(str, new))})")
        elif kind == "merge":
            a = ch.int(0, r - 3)
            new = list(s[:a]) + [s[a] * s[a + 1]] + list(s[a + 2:])
            out = self.emit(f"{h}.reshape({', '.join(map(str, new))})" if ch.bool(0.5) else f"{h}.flatten({a}, {a + 1})")
        elif kind == "slice":
            a = ch.pick(tok)
            idx = [":"] * r
            idx[a] = ch.pick(["1:", "::2", ":-1", "1::2"])
            out = self.emit(f"{h}[{', '.join(idx)}]")
        elif kind == "select":
            a = ch.pick(tok) if tok else 0
            idx = [":"] * a + [str(ch.pick([0, -1]))]
            out = self.emit(f"{h}[{', '.join(idx)}]")
        elif kind == "pool":
            a = ch.pick(list(range(1, r - 1)) or [0])
            op = ch.pick(["mean", "sum"])
            out = self.emit(f"{h}.{op}({a}, keepdim={ch.pick([False, True])})")
        elif kind == "cat_self":
            a = ch.pick(list(range(r - 1)))
            out = self.emit(f"torch.cat([{h}, {h}], {a})")
        elif kind == "roll":
            out = self.emit(f"torch.roll({h}, 1, {ch.pick(tok)})")
        elif kind == "flip":
            out = self.emit(f"torch.flip({h}, [{ch.pick(tok)}])")
        elif kind == "pad":
            a = ch.pick(list(range(r - 1)))
            pads = [0, 0] * (r - 1 - a) + [1, ch.int(0, 1)]
            out = self.emit(f"F.pad({h}, ({', '.join(map(str, pads))}))")
        elif kind == "chunk_add":
            a = next(a for a in tok if s[a] % 2 == 0)
            out = self.emit(f"torch.chunk({h}, 2, {a})[0] + torch.chunk({h}, 2, {a})[1]")
        elif kind == "expand":
            a = ch.int(0, r - 1)
            new = list(s[:a]) + [2] + list(s[a:])
            out = self.emit(f"{h}.unsqueeze({a}).expand({', '.join(map(str, new))})")
        elif kind == "mask":  # a per-token (non-constant) scale: constant along the feature axis
            m = self.new_input("mask", s[:-1] + (1,))
            out = self.emit(f"{h} {ch.pick(['*', '/'])} {m}")
        elif kind == "index":
            a = ch.pick(tok)
            n = s[a]
            idx = [ch.int(0, n - 1) for _ in range(ch.int(1, 3))]
            out = self.emit(f"{h}.index_select({a}, torch.tensor({idx}))")
        elif kind == "rowconst":  # a constant that is the same along the feature axis
            out = self.emit(f"{h} + self.{self.param(s[1:-1] + (1,), 'rowconst')}")
        else:  # pos: a constant table added mid-stream
            out = self.emit(f"{h} + self.{self.param(s[1:], 'table')}")
        return Stream(out, st.cid, st.read)

    # -- traps ---------------------------------------------------------------------------------
    def side_trap(self, st: Stream) -> None:
        """Something that reads the stream and is not shift-invariant: blocks the component."""
        ch = self.ch
        h = st.var
        s = self.shape(h)
        D = s[-1]
        kind = ch.pick(["linear", "output", "ln2", "softmax_tok", "reduce_feat", "rms", "featcat", "ln_tok"])
        if kind == "ln2" and len(s) < 2:
            kind = "linear"
        if kind == "ln_tok" and (len(s) < 3 or s[-2] < 2):
            kind = "linear"
        if kind == "softmax_tok" and len(s) < 2:
            kind = "output"
        if kind == "linear":
            self.output(self.emit(f"self.{self.linear(D, 3)}({h})"))
            why = "a linear reads the stream"
        elif kind == "output":
            self.output(h)
            why = "the stream is a graph output"
        elif kind == "ln2":
            self.output(self.emit(f"self.{self.linear(D, 2)}({self.layernorm(h, None, two_axes=True)})"))
            why = "a LayerNorm over two axes reads the stream"
        elif kind == "softmax_tok":
            self.output(self.emit(f"torch.softmax({h}, {ch.int(0, len(s) - 2)})"))
            why = "a softmax over a token axis reads the stream"
        elif kind == "reduce_feat":
            self.output(self.emit(f"{h}.{ch.pick(['mean', 'sum', 'amax'])}(-1)"))
            why = "a reduction over the feature axis reads the stream"
        elif kind == "ln_tok":  # a LayerNorm over a token axis of the stream
            t = self.emit(f"{h}.transpose(-1, -2)")
            self.output(self.emit(f"self.{self.linear(s[-2], 2)}({self.layernorm(t, None)})"))
            why = "a LayerNorm over a token axis reads the stream"
        elif kind == "rms":
            self.output(self.emit(self.rms_expr(h, D)))
            why = "an RMSNorm reads the stream"
        else:
            z = self.new_input("x", s[:-1] + (2,))
            self.output(self.emit(f"self.{self.linear(D + 2, 3)}(torch.cat([{h}, {z}], -1))"))
            why = "a concat along the feature axis reads the stream"
        self.truth.block(st.cid, why)
        st.read = True

    def side_invariant(self, st: Stream) -> None:
        """A shift-invariant reader: a softmax over features, or an extra LayerNorm head."""
        h = st.var
        if self.ch.bool(0.5):
            self.output(self.emit(f"torch.{self.ch.pick(['softmax', 'log_softmax'])}({h}, -1)"))
        else:
            n = self.layernorm(h, st.cid)
            self.output(self.emit(f"self.{self.linear(self.shape(h)[-1], 2)}({n})"))
        st.read = True

    def restart_trap(self, st: Stream) -> Stream:
        """The stream goes on through something not transparent: blocks it, starts a new component."""
        ch = self.ch
        h = st.var
        s = self.shape(h)
        D = s[-1]
        kind = ch.pick(["postln", "scale_sum", "featcat", "ln2"])
        if kind == "scale_sum" and not st.read:
            kind = "postln"  # a scale of an unread sum of sources is LayerScale: foldable
        if kind == "ln2" and len(s) < 2:
            kind = "postln"
        new = self.truth.new()
        if kind == "postln":  # h = LN(h + f(h)): f reads the stream
            f1 = self.linear(D, D)
            t = self.emit(f"{h} + self.{f1}({h})")
            self.truth.block(st.cid, "post-LN block: a linear reads the stream")
            out = self.layernorm(t, st.cid)
            self.truth.add_opaque(new, "a post-LN norm's output")
        elif kind == "scale_sum":
            out = self.emit(f"{h} * self.{self.param((D,), 'scale')}")
            self.truth.block(st.cid, "a per-channel scale of a sum that has other readers")
            self.truth.add_opaque(new, "a per-channel scale of the stream")
        elif kind == "featcat":
            z = self.new_input("x", s[:-1] + (2,))
            out = self.emit(f"torch.cat([{h}, {z}], -1)")
            self.truth.block(st.cid, "a concat along the feature axis reads the stream")
            self.truth.add_opaque(new, "a concat along the feature axis")
        else:
            out = self.layernorm(h, None, two_axes=True)
            self.truth.block(st.cid, "a LayerNorm over two axes reads the stream")
            self.truth.add_opaque(new, "a two-axis LayerNorm's output")
        return Stream(out, new, False)

    def opaque_add(self, st: Stream) -> Stream:
        """h + an opaque term from outside (a conditioning input through a nonlinearity)."""
        s = self.shape(st.var)
        if len(s) != 3 or s[0] != B:
            return self.layout(st)
        v, what = self.opaque_term(s[1], s[2])
        self.truth.add_opaque(st.cid, what)
        return Stream(self.emit(f"{st.var} + {v}"), st.cid, st.read)

    def merge(self, st: Stream, other: Stream) -> Optional[Stream]:
        a, b = self.shape(st.var), self.shape(other.var)
        if a == b:
            out = self.emit(f"{st.var} + {other.var}" if self.ch.bool(0.5) else f"{other.var} + {st.var}")
        elif len(a) == len(b) and a[-1] == b[-1] and sum(x != y for x, y in zip(a, b)) == 1:
            ax = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            out = self.emit(f"torch.cat([{st.var}, {other.var}], {ax})")
        else:
            return None
        return Stream(out, self.truth.union(st.cid, other.cid), st.read or other.read)

    # -- ends ----------------------------------------------------------------------------------
    def end(self, st: Stream, can_donate: bool) -> None:
        ch = self.ch
        h = st.var
        s = self.shape(h)
        D = s[-1]
        kinds = ["ln_head", "ln_out", "ln_tied", "ln_shared", "pool_ln", "softmax", "donate", "pend",
                 "trap_output", "trap_linear", "trap_ln2"]
        kind = ch.pick(kinds)
        if kind == "ln_tied" and not self.embs.get(D):
            kind = "ln_head"
        if kind == "ln_shared" and not self.d_linears.get(D):
            kind = "ln_head"
        if kind == "pool_ln" and len(s) < 3:
            kind = "ln_head"
        if kind == "donate" and (not can_donate or len(s) != 3):
            kind = "ln_out"
        if kind == "pend" and not can_donate:
            kind = "ln_head"
        if kind == "ln_head":
            n = self.layernorm(h, st.cid)
            self.output(self.emit(f"self.{self.linear(D, 3)}({n})"))
        elif kind == "ln_out":
            self.output(self.layernorm(h, st.cid))
        elif kind == "ln_tied":
            emb = ch.pick(self.embs[D])
            n = self.layernorm(h, st.cid)
            self.output(self.emit(f"F.linear({n}, self.{emb}.weight)"))
        elif kind == "ln_shared":  # a head that reuses a linear some stream uses as a source
            fc = ch.pick(self.d_linears[D])
            n = self.layernorm(h, st.cid)
            self.output(self.emit(f"self.{fc}({n})"))
        elif kind == "pool_ln":
            p = self.emit(f"{h}.mean(1)" if ch.bool(0.5) else f"{h}[:, 0]")
            n = self.layernorm(p, st.cid)
            self.output(self.emit(f"self.{self.linear(D, 3)}({n})"))
        elif kind == "softmax":
            self.output(self.emit(f"torch.softmax({h}, -1)"))
        elif kind == "donate":
            self.donated.append((self.layernorm(h, st.cid), D))
        elif kind == "pend":
            self.pending.append(st)
        elif kind == "trap_output":
            self.output(h)
            self.truth.block(st.cid, "the stream is a graph output")
        elif kind == "trap_linear":
            self.output(self.emit(f"self.{self.linear(D, 3)}({h})"))
            self.truth.block(st.cid, "a linear head reads the stream")
        else:
            self.side_trap(st)

    def build(self) -> None:
        ch = self.ch
        T = ch.pick([4, 2, 6, 3, 8])
        D = ch.pick([4, 8, 6, 5])
        n_streams = ch.int(1, 2 if self.small else 3)
        for si in range(n_streams):
            last = si == n_streams - 1
            st = self.start(T, D)
            for _ in range(ch.int(1, 3 if self.small else 5) if not ch.bool(0.1) else 0):
                step = ch.pick(["block", "block", "block", "layout", "layout", "side_trap", "side_inv",
                                "restart", "opaque_add", "merge"])
                if step == "block":
                    st = self.block(st)
                elif step == "layout":
                    st = self.layout(st)
                elif step == "side_trap" and ch.bool(0.5):
                    self.side_trap(st)
                elif step == "side_inv":
                    self.side_invariant(st)
                elif step == "restart" and ch.bool(0.5):
                    st = self.restart_trap(st)
                elif step == "opaque_add":
                    st = self.opaque_add(st)
                elif step == "merge" and self.pending:
                    got = self.merge(st, self.pending[0])
                    if got is not None:
                        self.pending.pop(0)
                        st = got
            for _ in range(1 + ch.int(0, 1)):
                self.end(st, can_donate=not last)
                if st in self.pending:
                    break
        # streams still open, norm outputs nobody took
        for st in self.pending:
            n = self.layernorm(st.var, st.cid)
            self.output(self.emit(f"self.{self.linear(self.shape(st.var)[-1], 3)}({n})"))
        for v, _ in self.donated:
            self.output(v)
        self.pending.clear()
        self.donated.clear()


# ----------------------------------------------------------------------------- adversarial init
@torch.no_grad()
def adversarial(model: GenModel, roles: dict[str, str], seed: int) -> None:
    """γ/β randomized; a large per-row mean in every source (DESIGN §5)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    for name, mod in model.named_children():
        if isinstance(mod, nn.LayerNorm):
            if mod.weight is not None:
                mod.weight.copy_(1 + 0.5 * rnd(*mod.weight.shape))
            if mod.bias is not None:
                mod.bias.copy_(0.5 * rnd(*mod.bias.shape))
        elif isinstance(mod, nn.RMSNorm):
            mod.weight.copy_(1 + 0.5 * rnd(*mod.weight.shape))
        elif isinstance(mod, nn.Embedding):
            w = mod.weight
            w.add_(SOURCE_MEAN * w.std() * rnd(w.shape[0], 1))
        elif isinstance(mod, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.ConvTranspose1d)):
            w = mod.weight
            out_axis = 1 if isinstance(mod, nn.ConvTranspose1d) else 0
            shape = [1] * w.ndim
            for a in range(w.ndim):
                if a != out_axis:
                    shape[a] = w.shape[a]
            w.add_(SOURCE_MEAN * w.std() * rnd(*shape))
            if mod.bias is not None:
                mod.bias.copy_(0.3 * rnd(*mod.bias.shape) + SOURCE_MEAN * 0.3 * rnd(1))
    for name, p in model.named_parameters(recurse=False):
        role = roles.get(name)
        if role == "table":
            p.copy_(0.5 * rnd(*p.shape) + SOURCE_MEAN * 0.5 * rnd(*p.shape[:-1], 1))
        elif role == "rowconst":
            p.copy_(SOURCE_MEAN * rnd(*p.shape))
        elif role == "gamma":
            p.copy_(1 + 0.5 * rnd(*p.shape))
        elif role == "scale":
            p.copy_(rnd(*p.shape).abs() + 0.3)


# --------------------------------------------------------------------------------- generation
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def generate(ch: Chooser, *, seed: Optional[int] = None, dtype: Optional[torch.dtype] = None,
             exporter: Optional[str] = None, opset: Optional[int] = None, target: Optional[str] = None,
             small: bool = False) -> Case:
    """One model from the choices of `ch`. Unforced dtype/exporter/opset are drawn too."""
    wseed = ch.int(0, 2**31 - 1)
    d_draw = ch.pick(["fp32", "fp32", "fp32", "fp32", "fp16"])
    e_draw = ch.pick(["torchscript", "torchscript", "torchscript", "dynamo"])
    o_draw = ch.pick([17, 18, 14])
    t_draw = ch.pick(["ort", "ort", "ort", "portable", "onnx"])
    gen = Gen(ch, small, lowp=(dtype or DTYPES[d_draw]) != torch.float32)
    torch.manual_seed(wseed)
    gen.build()
    adversarial(gen.m, gen.roles, wseed)
    exporter = exporter or e_draw
    opset = opset or (18 if exporter == "dynamo" else o_draw)
    dtype = dtype or DTYPES[d_draw]

    args = ", ".join(gen.inputs)
    body = "\n".join("    " + line for line in gen.lines)
    outs = ", ".join(gen.outputs)
    source = f"def forward(self, {args}):\n{body}\n    return ({outs},)\n"
    tag = f"seed {seed}" if seed is not None else f"{len(ch.trace)} draws"
    gen.m.finish(source, tag)
    model = gen.m.eval()
    inputs = tuple(gen.env[n] for n in gen.inputs)
    expected, why = [], []
    for c in gen.calls:
        v, w = gen.truth.verdict(c.comp)
        expected.append(v)
        why.append(w)
    case = Case(seed, list(ch.trace), torch.float32, exporter, opset, model, inputs, list(gen.inputs),
                source, gen.calls, expected, why, target or t_draw)
    return case.to(dtype) if dtype != torch.float32 else case


def make_case(module: nn.Module, inputs: tuple, expected: dict[str, str], *, dtype=torch.float32,
              exporter: str = "torchscript", opset: int = 17, why: str = "hand-written") -> Case:
    """A Case from a hand-written module (regression tests): `expected` maps the attribute name
    of each nn.LayerNorm to "fold"/"keep"; calls are recorded in forward order."""
    calls: list[NormCall] = []
    hooks = []
    for name, mod in module.named_modules():
        if isinstance(mod, nn.LayerNorm):
            hooks.append(mod.register_forward_pre_hook(lambda m, a, name=name: calls.append(NormCall(name, 0))))
    module.eval()
    try:
        with torch.no_grad():
            module(*inputs)
    finally:
        for h in hooks:
            h.remove()
    names = [f"in{i}" for i in range(len(inputs))]
    try:
        import inspect

        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        source = why
    case = Case(None, [], torch.float32, exporter, opset, module, tuple(inputs), names, source, calls,
                [expected[c.module] for c in calls], [why] * len(calls))
    return case.to(dtype) if dtype != torch.float32 else case


def from_seed(seed: int, **kw) -> Case:
    return generate(SeededChooser(seed), seed=seed, **kw)


def from_draws(draws: list[int], **kw) -> Case:
    return generate(ReplayChooser(draws), **kw)
