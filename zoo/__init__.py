"""The models the tests and the benchmarks build, in one package.

The repository root puts it on ``sys.path``: pyproject's pytest ``pythonpath`` for the tests
(and the gloo ranks they start, which inherit their parent's path), and ``python -m bench.<name>``
run from the root for the benchmarks. It is not part of the installed package; the models a
user reaches (``tpcompile demo``, ``tpcompile explain mlp``) are ``tpcompile.tools.models``.

- :mod:`zoo.idioms`: one small transformer per way real projects write one step of a block,
  with the Megatron-style plan each should get.
- :mod:`zoo.catalogue_models`: bad or unusual inputs, one model per entry of docs/guarantees.md.
- :mod:`zoo.random_models`: random transformer-like models from plain-data specs (property tests).
- :mod:`zoo.cache_models`: decoders that own a static KV cache, as gpt-fast writes them.
- :mod:`zoo.lit_cache_models`: a decoder owning its KV cache as litgpt does.
- :mod:`zoo.lora_models`: LoRA adapters, hand-written and peft's.
- :mod:`zoo.hf_models`: tiny random-init Hugging Face transformers models.
"""
