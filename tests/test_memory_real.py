"""bench/memory_real.py (make memory-real): the fake-tensor trace of a training step's peak memory agrees
with the same step's real allocations, arm by arm, on the tiny presets (the full-size rows cannot be
allocated here; docs/distributed.md)."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("memory_real", ROOT / "bench" / "memory_real.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["memory_real"] = module  # its traces run in spawned processes, which import it by name
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(900)
def test_the_fake_trace_equals_the_real_allocations_within_one_percent():
    memory_real = _module()
    cases = [("tiny-olmoe", arm, None, True, 1) for arm in memory_real.ARMS]
    cases += [
        ("tiny-granitemoe", arm, 2, False, 1) for arm in ("standard bf16", "sonar", "sonar remainder 8-bit")
    ]
    # FSDP2 over 4 ranks of a fake process group (one rank traced; real tensors allocate what it would)
    cases += [
        ("tiny-olmoe", arm, 2, True, 4)
        for arm in ("standard mixed precision", "standard bf16", "paper", "sonar", "sonar stochastic 8-bit")
    ]
    tasks = [(p, a, layers, ck, fake, world) for p, a, layers, ck, world in cases for fake in (True, False)]
    rows = memory_real.run(tasks, jobs=2)
    assert all("error" not in row for row in rows), [row for row in rows if "error" in row]
    by_case = {(r["preset"], r["arm"], r["checkpointing"], r["world_size"], r["mode"]): r for r in rows}
    for preset, arm, _, checkpointing, world in cases:
        fake, real = (by_case[(preset, arm, checkpointing, world, mode)] for mode in ("fake", "real"))
        assert abs(fake["peak_bytes"] / real["peak_bytes"] - 1) < 0.01, (preset, arm, fake, real)
        assert fake["parameters"] == real["parameters"] and fake["phase"] == real["phase"], (preset, arm)
        assert fake["library_host_reads"] == [], (preset, arm)
    # The arms differ where they should (one rank, checkpointing on): the fused update keeps no expert
    # gradient, the paper's method one at a time, standard all of them.
    peak = {
        r["arm"]: r["peak_bytes"]
        for r in rows
        if r["preset"] == "tiny-olmoe" and r["mode"] == "fake" and r["world_size"] == 1
    }
    assert peak["sonar"] < peak["paper"] < peak["standard bf16"] < peak["standard mixed precision"]
    assert peak["sonar 8-bit"] < peak["sonar"]
    # The split path's chunk is at least 64 MiB: at tiny-olmoe, the whole gradient, as the paper's.
    assert peak["sonar split"] == peak["paper"]


@pytest.mark.timeout(300)
def test_the_split_paths_scratch_is_the_models_where_the_update_sets_the_peak():
    # Experts large against the rest of the step (2 layers of H 1024, I 4096, 16 experts, 64 tokens): the
    # in-backward update's moment is the peak, so the paper's whole W1 gradient (256 MiB in bf16), the
    # split path's chunk (64 MiB: 4 experts, sonar_kernels.ops.triton_backend.wgrad_update.split_chunk) and the fused
    # update (none) part the arms. The fake trace against the memory model.
    from sonar_kernels.train import Preset

    memory_real = _module()
    big = Preset("olmoe", 1024, 4096, 16, 2, 2, 8, 8, 256, batch_size=1, sequence_length=64)
    arms = ("paper", "sonar split", "sonar")
    rows = memory_real.run([("tiny-olmoe", arm, None, True, True, 1, big) for arm in arms], jobs=1)
    assert all("error" not in row for row in rows), rows
    for row in rows:
        assert abs(row["model_peak_bytes"] / row["peak_bytes"] - 1) < 1e-3, row
    peak = {row["arm"]: row["peak_bytes"] for row in rows}
    assert abs(peak["paper"] - peak["sonar split"] - (256 - 64) * 2**20) < 2**20, peak
    assert peak["sonar"] < peak["sonar split"], peak


@pytest.mark.timeout(600)
def test_an_expert_parallel_row_traces_balanced_counts_fake_as_real_and_as_the_model():
    # EP over 4 ranks of a fake process group with the dense layers on FSDP2 over the same ranks
    # (memory_real.ep_fsdp2_arm), 2 layers of tiny-olmoe (T = 4 x 128 tokens per rank, top-2, 32 experts:
    # 8 per rank), checkpointing on.
    from sonar_kernels.nn import expert_parallel

    memory_real = _module()
    original = expert_parallel.exchange_counts
    arms = ("standard bf16", "sonar")
    tasks = [
        ("tiny-olmoe", arm, 2, True, fake, 4, None, "ep fsdp2") for arm in arms for fake in (True, False)
    ]
    rows = memory_real.run(tasks, jobs=2)
    assert all("error" not in row for row in rows), [row for row in rows if "error" in row]
    assert expert_parallel.exchange_counts is original  # the library's path outside the trace
    slots = 4 * 128 * 2
    for row in rows:
        assert row["layout"] == "ep fsdp2" and row["world_size"] == 4
        # Balanced routing: each rank sends S / P rows to every rank and receives as many, in every
        # exchange (2 layers x (forward + recomputation) x 2 steps), and its experts get S rows a layer.
        assert row["dispatch"]["splits"] == [((slots // 4,) * 4, (slots // 4,) * 4)], row["dispatch"]
        assert row["dispatch"]["expert_rows"] == [slots] and row["dispatch"]["exchanges"] == 8
        assert row["library_host_reads"] == []  # the counts' host read is the seam's, replaced
        # 8 local experts of gate_up_proj [2I, H] and down_proj [H, I], 2 layers, bf16
        assert row["expert_gradient_bytes"] == 2 * 8 * (2 * 256 * 128 + 128 * 256) * 2
    by = {(r["arm"], r["mode"]): r for r in rows}
    for arm in arms:
        fake, real = by[(arm, "fake")], by[(arm, "real")]
        assert fake["peak_bytes"] == real["peak_bytes"] and fake["phase"] == real["phase"], (fake, real)
        assert abs(fake["model_peak_bytes"] / fake["peak_bytes"] - 1) < 1e-3, fake
    standard, sonar = by[("standard bf16", "fake")], by[("sonar", "fake")]
    # No expert gradient in sonar's peak: its gradients are the dense shards' (FSDP2's reduce-scattered),
    # standard's hold the experts' besides.
    assert sonar["breakdown"]["gradients"] < standard["breakdown"]["gradients"] - 2**20, (sonar, standard)
    assert sonar["peak_bytes"] < standard["peak_bytes"]


def test_the_committed_expert_parallel_rows_are_the_models_and_balanced():
    # docs/distributed.md, "Traced at full size": the newest committed EP x FSDP2-dense report (OLMoE-1B-7B
    # and Qwen3-30B-A3B at full depth, 4 and 8 ranks, checkpointing on and off): the memory model within
    # 1e-3 of every traced row, each rank's counts the balanced ones (4 x 1024 tokens, top-8: S / P rows to
    # every rank), and the savings table's numbers from the rows.
    import json

    memory_real = _module()
    reports = sorted((ROOT / "bench" / "results" / "memory").glob("*-cpu-memory-real-ep.json"))
    assert reports, "no committed expert-parallel memory-real report under bench/results/memory/"
    rows = json.loads(reports[-1].read_text())["rows"]
    assert all("error" not in r for r in rows) and len(rows) == 32
    assert {(r["preset"], r["world_size"]) for r in rows} == {
        (p, w) for p in ("olmoe-1b-7b", "qwen3-30b-a3b") for w in (4, 8)
    }
    for r in rows:
        model = memory_real.model_prediction(
            r["preset"], r["arm"], r["layers"], r["checkpointing"], r["world_size"], r["layout"]
        )
        assert abs(model.total / r["peak_bytes"] - 1) < 1e-3, (
            r["preset"],
            r["arm"],
            model.total,
            r["peak_bytes"],
        )
        assert r["model_expert_gradients_at_peak"] == memory_real.model_expert_gradients(model)
        rows_per_rank = 4 * 1024 * 8 // r["world_size"]
        assert r["dispatch"]["splits"] == [[[rows_per_rank] * r["world_size"]] * 2], r[
            "dispatch"
        ]  # JSON lists
        assert r["dispatch"]["expert_rows"] == [4 * 1024 * 8], r["dispatch"]
        assert r["library_host_reads"] == []
    for e in memory_real.ep_savings(rows):
        if e["checkpointing"]:  # standard's peak holds every layer's expert gradients but the first's
            assert e["standard_expert_gradients_at_peak"] > 0.9 * e["expert_gradient_bytes"], e
        assert e["sonar_expert_gradients_at_peak"] == 0 and e["sonar_bytes"] <= e["standard_bytes"], e


def test_the_qwen3_preset_is_qwen3_30b_a3b_as_published():
    """The preset against Qwen3-30B-A3B's published configuration (its model card: 30.5 B parameters, 48
    layers, 128 experts of which 8 active, 32 query and 4 key-value heads of 128 dimensions), built on the
    meta device."""
    import torch

    from sonar_kernels import train
    from sonar_kernels.integrations import transformers as hf

    hf.register()
    model = train.build_model(train.PRESETS["qwen3-30b-a3b"], None, 0, torch.bfloat16, torch.device("meta"))
    config = model.config
    assert (config.num_hidden_layers, config.num_experts, config.num_experts_per_tok) == (48, 128, 8)
    assert (config.hidden_size, config.moe_intermediate_size, config.vocab_size) == (2048, 768, 151936)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (32, 4, 128)
    assert config.norm_topk_prob and not config.tie_word_embeddings and config.mlp_only_layers == []
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (32 * 128, 2048)
    assert type(model.model.layers[0].mlp.experts).__name__ == "Qwen3MoeExperts"
    assert config._experts_implementation == "sonar"
    assert abs(sum(p.numel() for p in model.parameters()) / 30.5e9 - 1) < 0.005


def test_the_smallest_gpu_is_the_first_whose_usable_share_holds_the_peak():
    memory_real = _module()
    assert memory_real.smallest_gpu(int(0.9 * 24e9)) == "24 GB"
    assert memory_real.smallest_gpu(int(0.9 * 24e9) + 1) == "48 GB"
    assert memory_real.smallest_gpu(int(0.9 * 80e9)) == "80 GB"
    assert memory_real.smallest_gpu(int(0.9 * 141e9) + 1) == "none"


@pytest.mark.timeout(900)
def test_the_chunked_loss_is_the_models_where_it_sets_the_peak():
    # A vocabulary large against the rest of the step (2 layers of H 128, 8 experts of I 64, V 32768, 2 x 256
    # tokens): transformers' loss (three fp32 [T, V] of 64 MiB) and the chunked loss (128 tokens a chunk, its
    # fp32 [128, V] of 16 MiB) set the peaks. The fake trace against the memory model, one rank and EP x
    # FSDP2-dense over 4 ranks, standard and sonar; fake against real allocations on one rank; the chunked
    # peak far below the unchunked.
    from sonar_kernels.train import Preset

    memory_real = _module()
    wide = Preset("olmoe", 128, 64, 8, 2, 2, 4, 4, 32768, batch_size=2, sequence_length=256)
    tasks = [("tiny-olmoe", arm, None, True, True, 1, wide, "1 gpu", chunk) for arm in ("standard bf16", "sonar")
             for chunk in (None, 128)]  # fmt: skip
    tasks += [("tiny-olmoe", "sonar", None, True, False, 1, wide, "1 gpu", 128)]
    tasks += [
        ("tiny-olmoe", arm, None, True, True, 4, wide, "ep fsdp2", 128) for arm in ("standard bf16", "sonar")
    ]
    rows = memory_real.run(tasks, jobs=2)
    assert all("error" not in row for row in rows), [row for row in rows if "error" in row]
    by = {(r["arm"], r["layout"], r.get("loss_chunk_tokens"), r["mode"]): r for r in rows}
    for row in rows:
        assert abs(row["model_peak_bytes"] / row["peak_bytes"] - 1) < 1e-3, row
    for arm in ("standard bf16", "sonar"):
        chunked, whole = by[(arm, "1 gpu", 128, "fake")], by[(arm, "1 gpu", None, "fake")]
        assert chunked["peak_bytes"] < whole["peak_bytes"] - 2 * 256 * 2 * 32768 * 4, (chunked, whole)
    fake, real = by[("sonar", "1 gpu", 128, "fake")], by[("sonar", "1 gpu", 128, "real")]
    assert abs(fake["peak_bytes"] / real["peak_bytes"] - 1) < 0.01 and fake["phase"] == real["phase"]


def test_the_committed_chunked_loss_rows_are_the_models():
    # docs/distributed.md, "With the chunked loss": the newest committed EP x FSDP2-dense report traced with
    # sonar-train's --loss-chunk-tokens (OLMoE-1B-7B and Qwen3-30B-A3B, 4 and 8 ranks): every row the
    # memory model's within 1e-3 with the same chunk, its expert gradients at the peak the model's; sonar
    # holds none at its peak and is below standard.
    import json

    memory_real = _module()
    reports = sorted((ROOT / "bench" / "results" / "memory").glob("*-cpu-memory-real-ep-chunked-loss.json"))
    assert reports, "no committed chunked-loss memory-real report under bench/results/memory/"
    rows = json.loads(reports[-1].read_text())["rows"]
    assert rows and all("error" not in r for r in rows)
    assert {(r["preset"], r["world_size"]) for r in rows} == {
        (p, w) for p in ("olmoe-1b-7b", "qwen3-30b-a3b") for w in (4, 8)
    }
    for r in rows:
        assert r["layout"] == "ep fsdp2" and r["loss_chunk_tokens"] == 1024, r
        model = memory_real.model_prediction(r["preset"], r["arm"], r["layers"], r["checkpointing"],
                                             r["world_size"], r["layout"], r["loss_chunk_tokens"])  # fmt: skip
        assert r["model_expert_gradients_at_peak"] == memory_real.model_expert_gradients(model)
        if r["preset"] == "olmoe-1b-7b" and not r["checkpointing"]:
            # The known gap (docs/distributed.md, "With the chunked loss"): with the loss no longer the peak,
            # OLMoE's step without checkpointing peaks in its last layer's backward at a moment the model
            # lacks; the model is 211 MiB (0.9 % to 1 %) below the trace there.
            gap = r["peak_bytes"] - model.total
            assert 0 < gap < 0.01 * r["peak_bytes"], (r["arm"], model.total, r["peak_bytes"])
            continue
        assert abs(model.total / r["peak_bytes"] - 1) < 1e-3, (
            r["preset"],
            r["arm"],
            model.total,
            r["peak_bytes"],
        )
    savings = memory_real.ep_savings(rows)
    assert {(e["preset"], e["ranks"]) for e in savings if e["checkpointing"]} == {
        (p, w) for p in ("olmoe-1b-7b", "qwen3-30b-a3b") for w in (4, 8)
    }
    for e in savings:
        assert e["sonar_expert_gradients_at_peak"] == 0 and e["sonar_bytes"] <= e["standard_bytes"], e
        if e["checkpointing"]:  # without it the saved activations set both peaks, alike (a tie)
            assert e["sonar_bytes"] < e["standard_bytes"] - 0.85 * e["standard_expert_gradients_at_peak"], e
