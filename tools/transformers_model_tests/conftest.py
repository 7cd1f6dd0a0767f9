"""Run transformers' own model tests with "sonar" as the default experts implementation.

A pytest plugin (also usable as a conftest.py): at configure time it calls
``sonar_kernels.integrations.transformers.register()`` and wraps
``PreTrainedModel.get_correct_experts_implementation`` (what model ``__init__`` and
``set_experts_implementation`` use to resolve ``config._experts_implementation``) so that an unset (None)
request resolves to "sonar" instead of transformers' default ("grouped_mm", falling back to "eager").
An explicit request (``experts_implementation="eager"``, ``set_experts_implementation("batched_mm")`` ...)
is kept. The sonar backend is the module default "auto": the torch backend on CPU, Triton on CUDA.
Everything is restored at unconfigure.

Usage (README.md next to this file has the recipe): from the root of a transformers test tree of the
installed version, with ``REPO`` this repository's root,

    PYTHONPATH=$REPO/tools $REPO/.venv-test/bin/python -m pytest -p transformers_model_tests.conftest tests/models/olmoe

(``transformers_model_tests`` is a namespace package once ``$REPO/tools`` is on sys.path.) Without
``-p transformers_model_tests.conftest`` the same command runs transformers' default. Set SONAR_DEFAULT=0
to load the plugin but leave the default.
"""

from __future__ import annotations

import functools
import os

_restore = []


def pytest_configure(config):
    if _restore or os.environ.get("SONAR_DEFAULT", "1") == "0":
        return
    from transformers.integrations.moe import ExpertsInterface
    from transformers.modeling_utils import PreTrainedModel

    from sonar_kernels.integrations.transformers import IMPLEMENTATION, register

    had_key = IMPLEMENTATION in ExpertsInterface._global_mapping
    register()
    original = PreTrainedModel.__dict__["get_correct_experts_implementation"]

    @functools.wraps(original)
    def get_correct_experts_implementation(self, requested_experts):
        return original(self, IMPLEMENTATION if requested_experts is None else requested_experts)

    PreTrainedModel.get_correct_experts_implementation = get_correct_experts_implementation

    def restore():
        PreTrainedModel.get_correct_experts_implementation = original
        if not had_key:
            ExpertsInterface._global_mapping.pop(IMPLEMENTATION, None)

    _restore.append(restore)


def pytest_report_header(config):
    if _restore:
        return "sonar_kernels: default experts implementation = 'sonar' (backend 'auto')"
    return None


def pytest_unconfigure(config):
    while _restore:
        _restore.pop()()
