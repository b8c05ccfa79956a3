"""The float64 run of a torch module, as onnx_rewrite/verify.py's float64 copy of a graph: every
float tensor of the computation in float64. `.double()` alone converts parameters and buffers only;
the tensors made at run time keep float32 (a cast, `torch.full((), finfo(float64).min)` with the
default dtype: transformers' eager attention overflows there)."""
from __future__ import annotations

import torch
from .hf import disable_dispatch_modes, pytree
from torch.utils._python_dispatch import TorchDispatchMode


class Float64Everywhere(TorchDispatchMode):
    """Every op runs in float64: float tensor operands are upcast and a float dtype asked for
    (casts, factories) becomes float64; the default dtype is float64 meanwhile."""

    def __enter__(self):
        self._default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.set_default_dtype(self._default)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.is_mutable and any(isinstance(x, torch.Tensor) and x.is_floating_point()
                                           and x.dtype != torch.float64 for x in pytree.tree_leaves((args, kwargs))):
            # an upcast copy would take the write, not the tensor the module keeps: no float64 run
            raise RuntimeError(f"{func} writes to a tensor that is not float64")

        def up(x):
            if isinstance(x, torch.dtype) and x.is_floating_point:
                return torch.float64
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64:
                return x.double()
            return x

        if func is torch.ops.aten.embedding.default:
            # a lookup picks rows, and rounds nothing: the rows picked, then upcast, are the rows of
            # the upcast table, without a float64 copy of the whole table (a checkpoint's 50k x 2k
            # embedding streamed in bounded memory: fx_rewrite/checkpoint_verify.py)
            return up(func(*args, **(kwargs or {})))
        args, kwargs = pytree.tree_map(up, (args, kwargs or {}))
        return func(*args, **kwargs)


# `with suspended():` no dispatch mode runs (Float64Everywhere included): checkpoint_verify.py reads a
# checkpoint's tensors there, in their stored dtype, while a float64 run is under way.
suspended = disable_dispatch_modes
