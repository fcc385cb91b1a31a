"""A module whose import fails (on purpose): a recipe naming `fuzz_raises_on_import:factory` must be
refused with ValueError like any other import path that cannot be imported."""

raise RuntimeError("fuzz_raises_on_import fails at import time on purpose (tests/fuzz)")
