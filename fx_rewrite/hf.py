"""Hugging Face `transformers` models as users bring them: caches on, `return_dict`, masks.

transformers' decoders return key/value cache objects by default, and torch.export refuses types it
cannot flatten. `fold_module` registers them as pytree nodes before its export with transformers' own
registration (global to the process, as when transformers exports), so that the folded module takes
and returns the same cache objects; a type still unknown gets one line that says what to change.
"""
from __future__ import annotations

import re
import sys
from typing import Optional

import torch
# torch's private names are imported here only (tests/test_structure.py): the rest of lnfold imports them from here
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes as disable_dispatch_modes

from ..passes import LnfoldError


def register_caches(module: torch.nn.Module) -> None:
    """Let torch.export flatten the cache objects of the transformers models inside `module`."""
    if "transformers" not in sys.modules:
        return  # a module of transformers' would have imported it
    models = {type(m).__module__: m for m in module.modules() if type(m).__module__.startswith("transformers.")}
    if not models:
        return
    try:  # transformers >= 5: every Cache subclass, and the model files' own cache classes
        from transformers.exporters.exporter_dynamo import register_cache_pytrees_for_model
    except ImportError:
        pass
    else:
        for m in models.values():
            register_cache_pytrees_for_model(m)
        return
    try:  # transformers 4.5x: DynamicCache only
        from transformers.integrations.executorch import register_dynamic_cache_export_support
    except ImportError:
        return
    register_dynamic_cache_export_support()


def fresh(tree):
    """A copy of an input tree whose tensors are new copies and whose containers (caches
    included, once registered) are new objects: transformers' caches grow in place when the
    model runs, so every run (the original, a float64 copy, the folded module) gets its own,
    and the caller's inputs are never touched."""
    return pytree.tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, tree)


# torch.export's words for an output, or an input, of a type it cannot flatten
_UNKNOWN_OUTPUT = re.compile(r"Found <class '([\w.]+)'> in output, which is not a known type")
_UNKNOWN_INPUT = re.compile(r"Unsupported input type <class '([\w.]+)'>")


def export_error(e: Exception) -> Optional[LnfoldError]:
    """One line in place of torch.export's traceback, for a type it cannot flatten; else None."""
    m = _UNKNOWN_OUTPUT.search(str(e)) or _UNKNOWN_INPUT.search(str(e))
    if m is None:
        return None
    cls = m.group(1)
    where = "returns" if m.re is _UNKNOWN_OUTPUT else "takes"
    if cls.rpartition(".")[2].endswith("Cache"):
        return LnfoldError(
            f"the module {where} a {cls}, a key/value cache that torch.export cannot flatten with this version of "
            "transformers: fold it with the cache off, fold_module(model, args, {'use_cache': False}) "
            "(or model.config.use_cache = False), or upgrade transformers")
    return LnfoldError(f"the module {where} a {cls}, which torch.export cannot flatten: register it with "
                       "torch.utils._pytree.register_pytree_node (or torch.export.register_dataclass), or "
                       f"{'return' if where == 'returns' else 'pass'} plain tensors, tuples and dicts")
