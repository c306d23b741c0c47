"""How many Triton kernel variants this process holds: the warm-up's measure of "nothing compiles
while serving".

Triton keeps, per kernel and device, one compiled variant per distinct specialisation (the
constexpr values, the dtypes, and for plain int and pointer arguments not marked
`do_not_specialize` their class: 1, a multiple of 16, or other; 16-byte alignment). A variant is
built on its first launch, or loaded from the on-disk cache when an earlier process built it; either
way it appears here. Zero where Triton is absent, interpreted, or nothing ran on a GPU.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator


def _jit_functions() -> Iterator[tuple[str, object]]:
    """(qualified name, JITFunction) of every Triton kernel in the loaded m3lm modules."""
    jit = sys.modules.get("triton.runtime.jit")
    kind = getattr(jit, "JITFunction", None)
    if kind is None:
        return
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "m3lm" or name.startswith("m3lm.")):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, kind) and getattr(value, "module", name) == name:
                yield f"{name}.{attr}", value


def _variants(fn) -> int:
    # device_caches: device -> (kernel cache, key cache, target, backend, binder); a defaultdict,
    # so it is only read, never indexed.
    return sum(len(entry[0]) for entry in list(getattr(fn, "device_caches", {}).values()))


def variants_by_kernel() -> dict[str, int]:
    """Compiled variants of each m3lm kernel that has any."""
    counts = {name: _variants(fn) for name, fn in _jit_functions()}
    return {name: n for name, n in sorted(counts.items()) if n}


def compiled_variants() -> int:
    """Compiled variants summed over every m3lm Triton kernel and device (0 on the CPU)."""
    return sum(_variants(fn) for _, fn in _jit_functions())


class CompileCount:
    """Variants compiled (or loaded from the disk cache) inside a `with` block:

    >>> with CompileCount() as c:
    ...     run_a_burst()
    >>> c.new, c.kernels  # how many, and which kernels gained them
    """

    def __init__(self) -> None:
        self.new = 0
        self.kernels: dict[str, int] = {}

    def __enter__(self) -> CompileCount:
        self._before = variants_by_kernel()
        return self

    def __exit__(self, *exc) -> None:
        after = variants_by_kernel()
        self.kernels = {k: n - self._before.get(k, 0) for k, n in after.items() if n > self._before.get(k, 0)}
        self.new = sum(self.kernels.values())
