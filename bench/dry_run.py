"""A GPU run without a GPU: the benchmark's own code at the real shapes, on the CPU, computing nothing.

Inside :func:`dry_run`:

- tensors are torch's fake tensors (``FakeTensorMode``: shapes, dtypes and strides, no storage), so an
  OLMoE-1B-7B layer at 16384 routed tokens costs no memory and no time;
- every Triton launch is recorded as the compilation Triton's JIT would make of it for an H100/H200
  (sm_90a): the JIT's own binder turns the arguments into its cache key (pointer dtypes and 16-byte
  alignment, integers divisible by 16 or equal to 1, the constexprs, the launch options), and no kernel
  runs. Two launches with one key are one compilation;
- the library takes the Triton backend on the CPU, as it would on CUDA (its device check and its "auto"
  choice are told so; the launchers already pass ``INTERPRET=False`` outside the interpreter), and runs its
  eager path: the autograd.Function, its custom ops called as the Python functions they wrap (their
  launchers and allocations), never their fake implementations;
- a host read of a fake value (``.item()``, ``torch.equal``: the benchmark's comparisons and logs) returns a
  placeholder (0, True), so the run goes on; one made by the library's kernel path (which promises none)
  is recorded with its file and line (``Launches.library_reads``).

What it answers before a GPU is ever lent: how many kernels ``bench/gpu_bench.py`` compiles, in which unit
(``gpu_bench.py --dry-run``, the budget in bench/README.md), what each costs to compile for sm_90a
(:meth:`Launches.compile`), and whether ``make kernel-report`` builds every one of them
(tests/test_gpu_bench.py). Its limits: a pointer's alignment is read from the view's offset (a real
allocation is 512-byte aligned, as assumed); and what the library decides from the device type (the AdamW
arithmetic, torch's fused AdamW) follows the CPU, so the ``ARITHMETIC`` constexpr is the CPU's "fp64"
unless ``arithmetic`` names the GPU's.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from unittest import mock

import torch
from torch._library.custom_ops import CustomOpDef
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only
from triton.backends.compiler import GPUTarget
from triton.runtime import jit

SM90A = GPUTarget("cuda", 90, 32)
aten = torch.ops.aten


@dataclass
class Variant:
    """One compilation: a kernel at one specialisation, as the JIT would build it."""

    kernel: jit.JITFunction
    signature: dict  # argument -> Triton type ("*bf16", "i32", "constexpr", ...)
    constexprs: dict  # argument path -> value (the JIT's: BLOCK_* and the integers equal to 1 included)
    attrs: dict  # argument path -> [["tt.divisibility", 16]] (aligned pointers, integers divisible by 16)
    options: object  # the backend's parsed options (num_warps, num_stages, enable_fp_fusion, ...)
    launches: int = 0
    units: list = field(default_factory=list)  # where it was launched (gpu_bench's unit names)

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__

    def named_constexprs(self) -> dict[str, object]:
        """The constexprs by argument name (the JIT keys them by position)."""
        names = list(self.signature)
        return {names[path[0]]: value for path, value in self.constexprs.items()}

    def identity(self) -> dict:
        """What makes this build this build, as JSON: argument types, constexpr values, the arguments known
        divisible by 16, the launch options that change the code."""
        names = list(self.signature)
        return {
            "signature": {k: v for k, v in self.signature.items() if v != "constexpr"},
            "constexprs": {k: str(v) for k, v in sorted(self.named_constexprs().items())},
            "divisible": sorted(names[path[0]] for path, attr in self.attrs.items() if attr),
            "options": {k: getattr(self.options, k) for k in ("num_warps", "num_stages", "enable_fp_fusion")},
        }


class Launches:
    """The distinct compilations of a dry run, in the order of their first launch."""

    def __init__(self, target: GPUTarget):
        self.target = target
        self.variants: dict[tuple, Variant] = {}
        self.unit = ""
        self.library_reads: list[str] = []  # host reads by the library (file:line), filled by dry_run()
        self._binders: dict[int, tuple] = {}
        from triton.compiler.compiler import make_backend

        self._backend = make_backend(target)

    @property
    def target_name(self) -> str:
        """ "sm_90a" for capability 9.0 (Triton builds the arch-specific target there), else "sm_XY"."""
        arch = self.target.arch
        return f"sm_{arch}{'a' if arch == 90 else ''}"

    def record(self, kernel: jit.JITFunction, args: tuple, kwargs: dict) -> None:
        """What ``kernel[grid](*args, **kwargs)`` would compile (JITFunction.run's first half)."""
        kwargs = {"debug": kernel.debug, **kwargs}
        binder = self._binders.get(id(kernel))
        if binder is None:
            binder = jit.create_function_from_signature(kernel.signature, kernel.params, self._backend)
            self._binders[id(kernel)] = binder
        bound, specialization, options = binder(*(_Pointer.of(a) for a in args), **kwargs)
        key = (kernel.fn.__name__, jit.compute_cache_key({}, specialization, options))
        variant = self.variants.get(key)
        if variant is None:
            parsed, signature, constexprs, attrs = kernel._pack_args(
                self._backend, kwargs, bound, specialization, options
            )
            variant = self.variants[key] = Variant(kernel, signature, constexprs, attrs, parsed)
        variant.launches += 1
        if self.unit and self.unit not in variant.units:
            variant.units.append(self.unit)

    def by_unit(self) -> dict[str, int]:
        """{unit: compilations first launched there}."""
        out: dict[str, int] = {}
        for v in self.variants.values():
            first = v.units[0] if v.units else ""
            out[first] = out.get(first, 0) + 1
        return out

    def compile(self, variant: Variant) -> dict:
        """Compile ``variant`` for the target as the JIT would, cold (an empty cache): the seconds it took on
        this machine's CPU, and ptxas's registers and spills (bytes)."""
        import triton
        from triton import knobs
        from triton.compiler import ASTSource

        source = ASTSource(variant.kernel, variant.signature, variant.constexprs, variant.attrs)
        log = io.StringIO()
        with tempfile.TemporaryDirectory() as cache, knobs.cache.scope(), knobs.nvidia.scope():
            knobs.cache.dir = cache
            knobs.nvidia.dump_ptxas_log = True  # ptxas -v's report, printed
            start = time.perf_counter()
            with contextlib.redirect_stdout(log):
                compiled = triton.compile(source, target=self.target, options=variant.options.__dict__)
            seconds = time.perf_counter() - start
        return {"compile_s": seconds, **_ptxas_stats(compiled.asm["ptx"], self.target_name, log.getvalue())}


def _ptxas_stats(ptx: str, arch: str, log: str) -> dict:
    """tools/kernel_report.py's reading of ``ptxas -v``: registers, spill stores and loads (bytes)."""
    import sys
    from pathlib import Path

    tools = str(Path(__file__).resolve().parents[1] / "tools")
    if tools not in sys.path:
        sys.path.append(tools)
    import kernel_report

    return kernel_report._ptxas_stats(ptx, arch, log)


class _Pointer:
    """A tensor argument as the JIT's binder sees it: a dtype and an address (the view's byte offset into
    an allocation assumed 512-byte aligned, as CUDA's allocator's are)."""

    def __init__(self, tensor: torch.Tensor):
        self.dtype = tensor.dtype
        self._address = 512 + tensor.storage_offset() * tensor.element_size()

    def data_ptr(self) -> int:
        return self._address

    @staticmethod
    def of(arg):
        return _Pointer(arg) if isinstance(arg, torch.Tensor) else arg


class _HostReads(FakeTensorMode):
    """FakeTensorMode whose host reads return placeholders (see the module docstring). A host read made by
    the library's kernels' path (sonar_kernels outside its training CLI) is recorded in ``library_reads``:
    the hot path promises none."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.library_reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (aten._local_scalar_dense.default, aten.equal.default):
            package = f"{os.sep}sonar_kernels{os.sep}"
            for frame in reversed(traceback.extract_stack()):
                if package in frame.filename and f"{package}train{os.sep}" not in frame.filename:
                    self.library_reads.append(f"{frame.filename.rsplit(package, 1)[1]}:{frame.lineno}")
                    break
            if func is aten.equal.default:
                return True
            return 0.0 if args[0].dtype.is_floating_point else 0
        return super().__torch_dispatch__(func, types, args, kwargs)


class _UncomputedProducts(TorchDispatchMode):
    """Real tensors (``dry_run(fake=False)``): torch's matrix products and CPU attention allocate their
    outputs as the op would (its meta kernel's shapes, strides and dtypes), zero-filled, and compute
    nothing. An OLMoE-1B-7B layer's step is some 3 TFLOP, hours in bf16 on this CPU, and the allocations
    are what is checked."""

    PRODUCTS = (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
                aten._grouped_mm.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
                aten._scaled_dot_product_flash_attention_for_cpu_backward.default)  # fmt: skip

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self.PRODUCTS:
            return func(*args, **kwargs)
        meta_args, meta_kwargs = tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
        meta = func(*meta_args, **meta_kwargs)
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        return tree_map_only(
            torch.Tensor,
            lambda m: torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device=device).zero_(),
            meta,
        )


def _deepcopy(tensor, memo):
    """copy.deepcopy of a fake tensor (the training arms copy their initial model): a fake clone with the
    parameter and buffer marks. torch 2.13's Tensor.__deepcopy__ copies a subclass's ``__dict__``, here the
    FakeTensorMode itself, which corrupts the heap (a crash some allocations later)."""
    out = tensor.detach().clone().requires_grad_(tensor.requires_grad)
    for mark in ("_is_param", "_is_buffer", "persistent"):
        if mark in vars(tensor):
            setattr(out, mark, vars(tensor)[mark])
    memo[id(tensor)] = out
    return out


_SWAP_TENSORS = torch.utils.swap_tensors
_CALL = CustomOpDef.__call__


def _swap_tensors(t1, t2):
    """Module.to() swaps every fake parameter with its conversion, which fake tensors refuse (their weak
    references); a conversion that changed nothing (a model built in its dtype, on its device) is left
    undone instead, and one that the swap refuses sets the data in place."""
    if (t1.dtype, t1.device, t1.shape, t1.stride()) == (t2.dtype, t2.device, t2.shape, t2.stride()):
        return
    try:
        _SWAP_TENSORS(t1, t2)
    except RuntimeError:
        if not isinstance(t1, FakeTensor):
            raise
        # A fake parameter held by a weak reference (a module built under the mode, then converted: the
        # layer section's transformers experts) takes its conversion's data in place, as Module._apply does
        # for a plain tensor.
        t1.data = t2.detach()


@contextlib.contextmanager
def dry_run(target: GPUTarget = SM90A, arithmetic: str | None = None, fake: bool = True):
    """Within the block, the benchmark's code runs as described in the module docstring; yields the
    :class:`Launches` it records. ``arithmetic``: the in-backward AdamW arithmetic of the GPU's torch
    ("fp32" or "fp64", ``sonar_kernels.ops.arithmetic.torch_fused_adamw_arithmetic`` there); None keeps the CPU's.
    ``fake`` False: real CPU tensors instead of fake ones (every allocation real; the kernels still not run,
    what they write left uninitialised; torch's matrix products not computed, their outputs zeros:
    :class:`_UncomputedProducts`), the check of a fake trace against real allocations."""
    from sonar_kernels.autograd import formula
    from sonar_kernels.ops import validation
    from sonar_kernels.ops.triton_backend import wgrad_update

    launches = Launches(target)

    def run(kernel, *args, grid, warmup, **kwargs):
        launches.record(kernel, args, kwargs)

    def resolve_backend(backend, device):
        return "triton" if backend == "auto" else backend

    def call(op, *args, **kwargs):
        if op._namespace == "sonar_kernels":
            return op._init_fn(*args, **kwargs)
        return _CALL(op, *args, **kwargs)

    patches = [
        mock.patch.object(jit.JITFunction, "run", run),
        # The library's custom ops run their implementation as plain Python (the launchers and what they
        # allocate), in eager mode's autograd.Function, not through the dispatcher to their fake
        # implementation: a tracker entered inside the block (MemTracker) sees every allocation.
        mock.patch.object(formula, "plain_eager", lambda inputs: True),
        mock.patch.object(CustomOpDef, "__call__", call),
        mock.patch.object(torch.utils, "swap_tensors", _swap_tensors),
        mock.patch.object(FakeTensor, "__deepcopy__", _deepcopy, create=True),
        mock.patch.object(validation, "triton_interpreting", lambda: True),
        mock.patch.object(validation, "resolve_backend", resolve_backend),
    ]
    if fake:
        # transformers asks whether the position ids pack several sequences in a row by reading them
        # (masking_utils.find_packed_sequence_indices); it cannot read a fake tensor, so it assumes they
        # do and builds a [B, 1, S, S] mask the real step never has (every layer's attention saves it).
        # The steps run here use transformers' default position ids, one sequence a row: no packing.
        from transformers import masking_utils

        patches.append(mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda ids: None))
    if arithmetic is not None:
        patches.append(mock.patch.object(wgrad_update, "adamw_arithmetic", lambda device: arithmetic))
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        if fake:
            mode = stack.enter_context(_HostReads(allow_non_fake_inputs=True))
            launches.library_reads = mode.library_reads
        else:
            stack.enter_context(_UncomputedProducts())
        yield launches
