"""Each kernel check is written once and runs on two targets: the GPU (`cuda`) and Triton's
interpreter on the CPU (`interpreter`), each with cases of its own (the interpreter runs a
launch's programs one by one, so its cases are small).

Triton chooses between compiling and interpreting when a kernel is defined, so the interpreter's
cases run in a child pytest process started with TRITON_INTERPRET=1 as soon as collection ends
(`interpreter_run`): it works beside the rest of the suite, and each of its cases reports here
under its own name.
"""

import os

import pytest
import torch

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def _id(v) -> str:
    if isinstance(v, torch.dtype):
        return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(v, str(v).removeprefix("torch."))
    if isinstance(v, (list, tuple)):
        return "_".join(_id(x) for x in v) or "none"
    return "default" if v is None else str(v)


def targets(argnames: str, cuda: list, interpreter: list):
    """parametrize ("device", *argnames): each of `cuda`'s cases on "cuda", each of
    `interpreter`'s on "cpu" through Triton's interpreter."""
    names = ["device", *(n.strip() for n in argnames.split(",") if n.strip())]

    def param(device: str, target: str, case, mark):
        case = case if isinstance(case, tuple) else (case,)
        assert len(case) == len(names) - 1, (names, case)
        return pytest.param(device, *case, marks=mark, id="-".join([target, *map(_id, case)]))

    params = [param("cuda", "cuda", c, pytest.mark.cuda) for c in cuda]
    params += [param("cpu", "interpreter", c, pytest.mark.interpreter) for c in interpreter]
    return pytest.mark.parametrize(names, params)
