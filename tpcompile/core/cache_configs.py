"""KV caches off for capture: every config a model's modules read ``use_cache`` from, restored.

Hugging Face models return a KV cache object (``DynamicCache``, ``EncoderDecoderCache``) when
``use_cache`` is set; it is not a pytree export can return, and a tensor-parallel step has no
use for it. The root config is not the only one read: an encoder-decoder's stacks keep their
own copies (T5's ``model.decoder.config`` is another object than ``model.config``), and
multimodal configs nest theirs (``text_config``, ``encoder``, ``decoder``). So capture switches
the flag off on every config reachable from any module's ``config`` attribute, through nested
sub-configs, and puts each value back afterwards.

A cache that is returned anyway (a module that ignores its config) fails export with the
cache's class in the message; :func:`cache_hint` turns that into the fix.
"""

from __future__ import annotations

import contextlib
import re
import sys

from torch import nn

__all__ = ["caches_off", "cache_hint", "reachable_configs", "NOTE"]

NOTE = "captured with config.use_cache=False: the module returns no KV cache"


def _config_base():
    """transformers' config base class, if transformers is loaded (a model built from it is)."""
    tf = sys.modules.get("transformers")
    return getattr(tf, "PreTrainedConfig", None) or getattr(tf, "PretrainedConfig", None)


def _nested(config, base) -> list:
    """``config``'s sub-configs (``text_config``, ``encoder``, ...): attributes that are configs."""
    if base is None or not hasattr(config, "__dict__"):
        return []
    return [v for v in vars(config).values() if isinstance(v, base)]


def reachable_configs(model: nn.Module) -> list:
    """Every distinct config object the model's modules hold, and their sub-configs, in order."""
    base, seen, out = _config_base(), set(), []
    todo = [m.config for m in model.modules() if getattr(m, "config", None) is not None]
    while todo:
        config = todo.pop(0)
        if id(config) in seen:
            continue
        seen.add(id(config))
        out.append(config)
        todo += _nested(config, base)
    return out


@contextlib.contextmanager
def caches_off(model: nn.Module, notes: list[str]):
    """``use_cache=False`` on every reachable config that sets it, each restored on exit."""
    switched = [(c, c.use_cache) for c in reachable_configs(model) if getattr(c, "use_cache", None)]
    for config, _ in switched:
        config.use_cache = False
    if switched:
        notes.append(NOTE)
    try:
        yield
    finally:
        for config, value in switched:
            config.use_cache = value


_OUTPUT_TYPE = re.compile(r"Found <class '([\w.]+)'> in output")


def _is_cache(qualified: str) -> bool:
    """A class named like a cache, or a subclass of transformers' ``Cache``."""
    module, _, name = qualified.rpartition(".")
    cls = getattr(sys.modules.get(module), name, None)
    base = getattr(sys.modules.get("transformers"), "Cache", None)
    return name.endswith("Cache") or (isinstance(cls, type) and isinstance(base, type)
                                      and issubclass(cls, base))


def cache_hint(err: BaseException) -> str | None:
    """The fix for an export error about a KV cache in the model's output, else None."""
    found = _OUTPUT_TYPE.search(str(err))
    if found is None or not _is_cache(found.group(1)):
        return None
    name = found.group(1).rsplit(".", 1)[-1]
    return (f"the model returns a KV cache ({name}), which a captured step cannot return; turn "
            "use_cache off: set use_cache=False on the config of the module that returns it, or "
            "pass use_cache=False in example_kwargs")
