"""bench/memory_model: a memory model of one training step: the per-rank peak, predicted from the model's dimensions.

What it predicts: the peak bytes per rank of one step (forward, backward, optimizer step) of sonar-train's
transformers models (``sonar_kernels.train.data.PRESETS``: OLMoE, Granite MoE, Qwen3-MoE), split as torch's
MemTracker splits it (parameters, buffers, gradients, optimizer state, the optimizer step's temporaries,
activations and temporaries), for three methods:

- ``standard``: torch.optim.AdamW over every parameter, global-norm clipping (sonar-train's ``standard``
  arm): every gradient is kept until the step; with ``Setup.fp32_masters`` sonar-train's
  ``mixed-precision`` arm (fp32 master copies and moments of a bf16 model).
- ``paper``: the Sonar-MoE paper's method: each expert tensor's gradient is computed as a tensor and
  applied by AdamW in the backward, then released (one expert gradient alive at a time; sonar-train's
  ``sonar`` arm on the torch backend, its ``paper`` arm on the Triton one: ``SonarAdamW(fused_epilogue=False)``
  under ``split_scratch(fraction=1)``, the split path with the whole gradient).
- ``sonar``: the AdamW update fused into the Triton wgrad epilogue: no expert gradient tensor (the
  ``sonar`` arm on the Triton backend); with ``Setup.fused_epilogue`` False or None the split path at
  its default bound instead: one chunk of experts' gradient at a time (at most 1/8 of the tensor's
  gradient or 64 MiB), per expert tensor, while it is updated.

and these layouts (:class:`Layout`): one rank, data parallel (DDP for the dense parameters; the experts
replicated, their gradients averaged by SonarAdamW's data-parallel group), expert parallel (each rank
E / ep experts, tokens by all-to-all), expert parallel x data parallel, FSDP2 (``fully_shard`` of every
experts module, every decoder layer and the model: docs/distributed.md's recipe), and expert parallelism with
the dense layers on FSDP2 over the same ranks (``Layout(ep=P, fsdp=P)``: docs/distributed.md, "Expert
parallel with the dense layers on FSDP2"; checked against bench/memory_real.py's traces).

How: an analytic account of what is alive at each candidate moment of the step (the end of the forward,
the loss's backward, the expert backward of every layer, FSDP2's reduce-scatters, the embedding's backward,
the optimizer step), derived from the code that runs (transformers' modeling files, ``sonar_kernels/ops/torch_backend/mlp.py``,
``sonar_kernels/ops/triton_backend/backward.py``, ``sonar_kernels/ops/triton_backend/wgrad.py``, ``sonar_kernels/autograd/formula.py``,
``sonar_kernels/optim/distributed.py``, torch's AdamW, DDP and FSDP2, and autograd's rules: which tensors
each op saves for its backward); the peak is the largest moment. No coefficient is fitted to measurements; one term was found
by measuring and is marked so (FSDP2: down_proj's gradient output alive during the experts'
reduce-scatter). ``--validate`` measures the tiny presets with MemTracker on gloo ranks and compares;
``bench/memory_real.py`` traces the real presets at full size (the model agrees with every row).

Command line::

    python bench/memory_model                  # the predicted table for the real presets (a model)
    python bench/memory_model --validate       # measure the tiny presets, write bench/results/...json

The package, by part (each term's docstring names the code it accounts for):

- inputs.py: what a prediction takes (:class:`Setup`, :class:`Layout`) and gives (:class:`Prediction`);
- the terms: parameters.py (parameters, and the parameter-shaped gradients and AdamW moments),
  activations.py (what each op saves for its backward), expert_backward.py (one layer's expert backward:
  gradients, temporaries, the in-backward update's);
- layouts.py: the step on one rank, DP, EP, EP x DP and FSDP2: its candidate moments and the peak
  (:func:`predict`);
- validation.py: MemTracker on gloo ranks, compared with the prediction;
- report.py: the real presets' table and the command line.
"""

from memory_model.activations import layer_saved, logits_dtype_bytes, rms_norm_saved, shared_saved
from memory_model.expert_backward import (
    Tape,
    adamw_temporaries,
    torch_expert_backward,
    triton_expert_backward,
)
from memory_model.inputs import ADAMW, CATEGORIES, METHODS, Layout, Prediction, Setup, with_layers
from memory_model.layouts import gradient_order, predict
from memory_model.parameters import layer_of, local_shape, numel, parameter_tensors
from memory_model.report import (
    PRECISIONS,
    REAL_LAYOUTS,
    REAL_PRESETS,
    main,
    real_setup,
    real_table,
    real_table_8bit,
    real_table_master,
    validation_summary,
)
from memory_model.validation import (
    VALIDATION_LAYOUTS,
    Case,
    compare,
    measure,
    presets,
    run_cases,
    validate,
    validation_cases,
)

__all__ = [
    "ADAMW", "CATEGORIES", "METHODS", "PRECISIONS", "REAL_LAYOUTS", "REAL_PRESETS", "VALIDATION_LAYOUTS", "Case",
    "Layout", "Prediction", "Setup", "Tape", "adamw_temporaries", "compare", "gradient_order", "layer_of",
    "layer_saved", "local_shape", "logits_dtype_bytes", "main", "measure", "numel", "parameter_tensors", "predict",
    "presets", "real_setup", "real_table", "real_table_8bit", "real_table_master", "rms_norm_saved", "run_cases", "shared_saved", "torch_expert_backward",
    "triton_expert_backward", "validate", "validation_cases", "validation_summary", "with_layers",
]  # fmt: skip
