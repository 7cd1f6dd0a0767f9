"""sonar-train: train an MoE model on real text with standard and sonar training side by side: an OLMoE or
Granite MoE preset from random initialization, or a transformers checkpoint the user has (``--model``).

Three arms start from the same initial weights and see the same batches; all run the experts with the
sonar kernels (transformers' experts_implementation "sonar"), so only the optimizer differs:

- ``standard``: torch.optim.AdamW on all parameters, ``clip_grad_norm_`` over all parameters;
- ``sonar``: :class:`sonar_kernels.SonarAdamW`, expert tensors updated in the backward (no expert
  gradient kept), dense parameters clipped by their own global norm;
- ``standard-dense-clip``: torch.optim.AdamW, ``clip_grad_norm_`` over the dense parameters only: the
  same math as ``sonar`` with standard machinery, so the two must agree bit for bit.

``--arms all-in-backward`` adds the paper's other comparison (not run by default): every parameter
updated in the backward and no clipping anywhere (:class:`AllInBackward`); ``--arms paper`` the paper's
method itself: SonarAdamW's split path with the whole gradient (``fused_epilogue=False``, the backward under
``split_scratch(fraction=1)``: each expert gradient written as a tensor, applied in the backward, released;
the same bits as ``sonar``, more memory on the Triton backend); ``--arms paper-inbwd per-expert-inbwd`` the
paper's method with torch's AdamW stepping each batched expert tensor, or each expert slice (the paper's
ablation), from its gradient hook (``in_backward.TorchExpertsInBackward``; the dense parameters clipped by
their own norm: the same bits as ``standard-dense-clip``).

``--expert-clipping spike lagged`` adds SonarAdamW's expert clipping: ``sonar-spike`` (SPAM's spike rule
inside the in-backward update, ``--spike-threshold``) and ``sonar-lagged`` (the expert gradients scaled by
the previous step's global clipping coefficient), each with a bitwise control on the first seed
(``spike-control``, ``lagged-control``: materialized gradients, the rule applied by hand), and verdicts
against standard and sonar. ``--inject-spike STEP:SCALE`` multiplies one step's loss in every arm.

``--model PATH`` loads a local transformers checkpoint (a folder saved by ``save_pretrained``) of any MoE
family the sonar experts run, with ``from_pretrained`` (local files only), and every arm and seed starts
from its weights (the seeds then differ in batch order only). The token ids stay the text's bytes
(:mod:`checkpoint`: a vocabulary below 256 is refused). ``--save DIR`` writes the sonar arm's trained model
(first seed) with ``save_pretrained``: it loads in plain transformers, without sonar_kernels.

Before any model is built or loaded, the run's memory is estimated from the model's shapes on the meta
device (parameters, gradients, AdamW state, activations, and what the run keeps on the host) against the
memory available (``/proc/meminfo``, the cgroup limit, ``torch.cuda.mem_get_info``); a run that cannot
fit is refused with exit code 2 and the estimate (``--no-memory-check`` starts it anyway).

Data: by default the Python reference documentation that ships with every CPython (the module
``pydoc_data.topics``, about 465 KB of English), tokenized as bytes (vocabulary 256); ``--data`` takes a
UTF-8 text file or JSONL with a "text" field. The last tenth is the held-out split.

Seeds (``--seeds N``, 3 by default): ``standard`` and ``sonar`` run once per seed (each seed another
initialization and batch order), ``standard-dense-clip`` on the first; the held-out difference
sonar - standard is judged over the seeds, paired (mean, standard error, a verdict in words:
:func:`report.heldout_statistics`).

Output, under ``runs/<name>/`` (``<name>-2``, ... when that exists; created when the run starts): ``report.json``
(per arm and seed: ``heldout_losses``, ``train_losses``, step times; per arm: ``peak_memory_bytes``,
``peak_memory``, ``step_time``; top level: ``heldout``, ``sonar_equals_control_bitwise``, the counted
expert updates), ``report.png`` (title with what ran and the verdicts; loss curves, the held-out loss
per seed, memory bars) and the printed summary. Step times come from a timing pass after training (the
arms side by side on the first seed's model, one step of each per round, order rotated; ``--timing-rounds``,
docs/sonar-train.md), else from the training runs, each run's first 5 steps left out; no time ratio is
given below 10 timed steps per arm. Peak memory is measured in a separate short pass per arm
(first seed, after two warm-up steps, so that the optimizer state exists), with torch's MemTracker, which
splits it into parameters, gradients, optimizer state and activations and tells whether the peak falls
in the forward, the backward or the optimizer step; on CUDA the allocator's peak is reported as well.

On several processes (``torchrun --nproc-per-node N -m sonar_kernels.train``) the run is data parallel:
each rank trains on its own batches, DDP reduces the dense gradients and SonarAdamW averages each
expert gradient over the ranks before its update; the report names the ranks and the layout and gives
a checksum of the expert weights per rank and arm (``distributed``).

The package: ``data`` (text, presets), ``arms`` (models, optimizers, the training step), ``clipping`` (the
expert-clipping arms' controls, telemetry and summary lines), ``verdicts`` (their verdicts and the spike's
effect against ``--spike-baseline``), ``checkpoint`` (``--model`` and ``--save``), ``memory`` (the estimate
before the run, the MemTracker pass), ``stats`` (step times, the held-out statistics and verdicts, the note
on alike peaks), ``report`` (table and figure), ``results`` (the report from the finished runs' records),
``resume`` (the run folder's records: Ctrl-C's partial report, ``--resume``), ``distributed`` (torchrun: the
process group, the ranks' batches, DDP, the checksums), ``options`` (the command line: the parser itself
lives in the torch-free launcher ``sonar_kernels_cli``, which ``sonar-train`` runs), ``cli`` (the run;
``python -m sonar_kernels.train``).
"""

from sonar_kernels.train.arms import (
    EXPERT_PARAMS,
    AllInBackward,
    Arm,
    build_arm,
    build_model,
    dense_parameters,
    enable_checkpointing,
    heldout_loss,
    run_arm,
    sync,
    train_step,
)
from sonar_kernels.train.cli import main
from sonar_kernels.train.data import PRESETS, ByteData, Preset, UsageError, default_text, load_text
from sonar_kernels.train.loss import chunked_causal_lm_loss
from sonar_kernels.train.memory import LABELS, measure_memory
from sonar_kernels.train.options import parse_args
from sonar_kernels.train.report import plot, summary_table
from sonar_kernels_cli.options import ARMS, OTHER_ARMS

__all__ = [
    "ARMS", "EXPERT_PARAMS", "LABELS", "OTHER_ARMS", "PRESETS", "AllInBackward", "Arm", "ByteData", "Preset",
    "UsageError", "build_arm", "build_model", "chunked_causal_lm_loss", "default_text", "dense_parameters", "enable_checkpointing",
    "heldout_loss", "load_text", "main", "measure_memory", "parse_args", "plot", "run_arm", "summary_table",
    "sync", "train_step",
]  # fmt: skip
