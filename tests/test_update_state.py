"""One expert tensor's update state (sonar_kernels/update_state.py): the ops' list of each kind read back as
the tensors it was made of, the optimizer's state of each kind read as the same tensors, and the lists no
kind has refused by name."""

import pytest
import torch

from sonar_kernels.optim.expert_state import expert_state
from sonar_kernels.update_state import MASTERS, MOMENTS, StateKind, UpdateState

SHAPE = (2, 8, 32)


def _counters():
    return [
        torch.zeros(()),
        torch.zeros(()),
        torch.zeros((), dtype=torch.int64),
        torch.zeros((), dtype=torch.int64),
    ]


@pytest.mark.parametrize("master", MASTERS)
@pytest.mark.parametrize("moments", MOMENTS)
def test_each_kind_is_the_optimizers_state_and_its_list_reads_back(moments, master):
    # The optimizer's own state of a bf16 expert tensor (optim/expert_state.py makes it for SonarAdamW and
    # ExpertAdamW), with its telemetry tensors.
    p = torch.zeros(SHAPE, dtype=torch.bfloat16)
    state = expert_state(
        p,
        {},
        "8bit" if moments == "8bit" else torch.float32,
        master=None if master == "none" else master,
        seed=7,
    )
    step, norm, skipped, clipped = _counters()
    state["step"] = step
    update = UpdateState.of_optimizer(state, norm, skipped, clipped)
    assert update.kind == StateKind(moments, master)
    codes = moments == "8bit"
    expected = [
        state["exp_avg_codes" if codes else "exp_avg"], state["exp_avg_sq_codes" if codes else "exp_avg_sq"],
        step, norm, skipped, clipped,
        *([state["exp_avg_scales"], state["exp_avg_sq_scales"]] if codes else []),
        *([state[master if master == "remainder" else "seed"]] if master != "none" else []),
    ]  # fmt: skip
    listed = update.tensors()
    assert len(listed) == len(expected) == len(update.kind.fields)
    assert all(a is b for a, b in zip(listed, expected, strict=True))
    back = UpdateState.of(listed)
    assert back.kind == update.kind
    assert all(getattr(back, f) is getattr(update, f) for f in UpdateState._fields)


def test_lists_no_kind_has_are_refused_by_name():
    moments = [torch.zeros(SHAPE), torch.zeros(SHAPE), *_counters()]
    with pytest.raises(ValueError, match=r"down_proj: an update's state has \[6, 8\] tensors.*got 5"):
        UpdateState.of(moments[:5], "down_proj")
    with pytest.raises(ValueError, match="down_proj: the state's last tensor must be an int16 remainder"):
        UpdateState.of([*moments, torch.zeros(SHAPE)], "down_proj")
    with pytest.raises(ValueError, match=r"0-dim int64 seed, got torch\.int64 of shape"):
        UpdateState.of([*moments, torch.zeros(2, dtype=torch.int64)])
