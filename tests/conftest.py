"""Fail fast when tpcompile is not installed (``passes/`` only exists as tpcompile.passes), and,
where the test dependencies are required (CI sets TPCOMPILE_REQUIRE_TEST_DEPS=1), when one is
missing: a test that guards a guarantee (OpInfo soundness needs expecttest, the Hugging Face
rows transformers, LoRA peft, torchao's quantized weights) would otherwise skip and the guarantee would go unchecked."""

import importlib
import os

import pytest

try:
    import tpcompile.passes  # noqa: F401
except ModuleNotFoundError as e:  # pragma: no cover
    raise SystemExit("tpcompile is not installed: run `pip install -e '.[test]'` first") from e

from tpcompile.tools.launch import preload  # noqa: E402

# gloo ranks fork from a server that imported these once (a missing one is skipped there): a
# rank of a Hugging Face test no longer spends a second and a half importing transformers
preload("transformers", "peft")

# what the test extra installs that some test would skip without
REQUIRED = ("hypothesis", "expecttest", "transformers", "peft", "safetensors", "torchao",
            "diffusers", "torch.testing._internal.common_methods_invocations")


def pytest_configure(config):
    if os.environ.get("TPCOMPILE_REQUIRE_TEST_DEPS") != "1":
        return
    missing = []
    for name in REQUIRED:
        try:
            importlib.import_module(name)
        except ImportError as e:
            missing.append(f"{name} ({type(e).__name__}: {e})")
    if missing:
        raise pytest.UsageError(
            "TPCOMPILE_REQUIRE_TEST_DEPS=1 but these test dependencies cannot be imported, and "
            f"the tests that need them would skip: {'; '.join(missing)}\n"
            "  hint: pip install -e '.[test]'")
