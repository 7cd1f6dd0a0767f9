"""sonar-train on a checkpoint the user has: --model PATH, --save DIR, and the memory estimate that refuses
a run which cannot fit before anything is allocated. Tiny checkpoints made here stand in for real ones
(no hub access)."""

import json
import subprocess
import sys

import pytest
import torch

from sonar_kernels import train
from sonar_kernels.train import checkpoint, cli

transformers = pytest.importorskip("transformers", minversion="5.13")


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    """Each test runs in its own folder: a run without --out writes runs/ there, never in the checkout."""
    monkeypatch.chdir(tmp_path)


# Tiny configs of two families the integration accepts: hidden 32, 2 layers, 4 experts, top-2. OLMoE's
# vocabulary is the 256 bytes; Qwen3-MoE's is larger (ids 256 and up are never seen).
FAMILIES = {
    "olmoe": lambda: transformers.OlmoeConfig(
        vocab_size=256, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, bos_token_id=None, eos_token_id=None,
        pad_token_id=None,
    ),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        vocab_size=320, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, head_dim=16,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    ),
}  # fmt: skip


def _save_tiny_checkpoint(family: str, path, seed: int = 0):
    """A randomly initialised tiny model of ``family``, saved with save_pretrained to ``path``."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family]())
    model.save_pretrained(path)
    return model


# Run in a fresh interpreter in which importing sonar_kernels fails: the saved checkpoint must load with
# plain transformers and its default experts implementation.
PLAIN_LOAD = """
import sys
sys.modules["sonar_kernels"] = None  # any import of sonar_kernels raises ImportError
import torch, transformers
saved, inputs, out = sys.argv[1:4]
model = transformers.AutoModelForCausalLM.from_pretrained(saved, local_files_only=True)
model.eval()
with torch.no_grad():
    logits = model(input_ids=torch.load(inputs)).logits
torch.save({"logits": logits, "experts": model.config._experts_implementation, "dtype": str(model.dtype)}, out)
"""


# The memory pass (MemTracker, 3 s here) on one family only: the suite runs on 2 CPU cores.
@pytest.mark.parametrize("family, memory", [("olmoe", True), ("qwen3_moe", False)])
def test_model_and_save_fine_tune_a_checkpoint_that_loads_in_plain_transformers(
    family, memory, tmp_path, monkeypatch
):
    from numerics import assert_close

    initial = _save_tiny_checkpoint(family, tmp_path / "ckpt")
    trained = {}  # the training arms (not the memory pass's), by name

    def build_arm(name, initial_model, args, steps, count_updates=False):
        arm = train.build_arm(name, initial_model, args, steps, count_updates)
        if count_updates:
            trained[name] = arm
        return arm

    monkeypatch.setattr(cli, "build_arm", build_arm)
    argv = ["--model", str(tmp_path / "ckpt"), "--save", str(tmp_path / "saved"), "--steps", "3", "--seeds", "1",
            "--batch-size", "2", "--seq-len", "32", "--heldout-batches", "2", "--backend", "torch",
            "--out", str(tmp_path / "runs"), "--quiet", "--timing-rounds", "0",
            *([] if memory else ["--no-memory"])]  # fmt: skip
    assert train.main(argv) == 0
    run = tmp_path / "runs" / "ckpt"  # the run's name: the checkpoint folder's
    report = json.loads((run / "report.json").read_text())
    assert (run / "report.png").is_file()
    assert report["model"] == str((tmp_path / "ckpt").resolve()) and report["model_type"] == family
    assert report["preset"] is None and report["source"].startswith("model ")
    assert report["parameters"] == sum(p.numel() for p in initial.parameters())
    assert (
        "not the checkpoint's tokenizer" in report["tokens"]
        and str(initial.config.vocab_size) in report["tokens"]
    )
    assert set(report["arms"]) == {"standard", "sonar", "standard-dense-clip"}
    assert report["sonar_equals_control_bitwise"] is True
    assert report["saved"] == {"path": str((tmp_path / "saved").resolve()), "arm": "sonar", "seed": 0}
    estimate = report["memory_estimate"]
    assert estimate["parameters"] == report["parameters"] and estimate["available_host_bytes"] > 0
    if memory:  # the estimate is an upper estimate of the step the memory pass measured
        assert (
            sum(estimate["arm"].values()) >= max(a["peak_memory_bytes"] for a in report["arms"].values()) > 0
        )

    # Every arm started from the checkpoint's weights: standard and sonar differ only in their optimizer.
    model = trained["sonar"].model
    for (name, p), q in zip(model.named_parameters(), initial.parameters(), strict=True):
        assert not torch.equal(p, q), f"{name} was not trained"
    # The saved weights are the sonar arm's, bit for bit (transformers writes the experts in its legacy
    # per-expert layout and converts them back when loading); the config is the checkpoint's (no "sonar").
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", local_files_only=True)
    assert reloaded.config._experts_implementation != "sonar"
    saved = dict(reloaded.named_parameters())
    assert set(saved) == set(dict(model.named_parameters()))
    for name, p in model.named_parameters():
        assert torch.equal(saved[name], p), name
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert not any(k in config for k in checkpoint.EXPERTS_KEYS) and "sonar" not in json.dumps(config)
    assert config["use_cache"] is True and config["output_router_logits"] is False  # as in the checkpoint
    assert model.config.use_cache is False  # the trained model's own config is left as it trained

    # Plain transformers, in a process that cannot import sonar_kernels, gives the trained model's logits.
    tokens = train.ByteData(train.default_text(), 32, 2, seed=5).batch(0)
    torch.save(tokens, tmp_path / "inputs.pt")
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=tokens).logits
    done = subprocess.run(
        [sys.executable, "-c", PLAIN_LOAD, str(tmp_path / "saved"), str(tmp_path / "inputs.pt"),
         str(tmp_path / "plain.pt")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    plain = torch.load(tmp_path / "plain.pt")
    assert plain["experts"] != "sonar" and plain["dtype"] == "torch.float32"
    assert_close(plain["logits"], expected, torch.float32, what=f"{family} logits, plain transformers")


def test_a_preset_that_cannot_fit_is_refused_before_the_model_is_allocated(tmp_path, capsys, monkeypatch):
    # The real OLMoE-1B-7B preset (6.92 B parameters, fp32 on the CPU) against a 24 GiB machine.
    devices = []

    def build_model(preset, layers, seed, dtype, device):
        devices.append(device.type)
        return train.build_model(preset, layers, seed, dtype, device)

    monkeypatch.setattr(cli, "build_model", build_model)
    monkeypatch.setattr(cli, "available_memory", lambda device: {"host": 24 * 2**30, "device": None})
    code = train.main(
        ["--preset", "olmoe-1b-7b", "--device", "cpu", "--out", str(tmp_path / "runs"), "--quiet"]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert "--preset olmoe-1b-7b does not fit" in err and "6.92 B parameters" in err
    assert "GiB of host memory" in err and "24.0 GiB available" in err and "--no-memory-check" in err
    need = float(err.split("needs about ")[1].split(" GiB")[0])
    assert 6 * 6.92e9 * 4 / 2**30 <= need < 200  # initial + kept copy + parameters, gradients, 2 moments
    assert devices == ["meta"]  # the shapes only: nothing allocated, no run folder reserved
    assert not (tmp_path / "runs").exists()
    # With the chunked loss, one chunk's logits (the dtype, their fp32 cast and its fp32 gradient) replace
    # the T tokens' (train/loss.py), and the message says so in the arm's activations.
    code = train.main(
        ["--preset", "olmoe-1b-7b", "--device", "cpu", "--out", str(tmp_path / "runs"), "--quiet",
         "--loss-chunk-tokens", "256"]
    )  # fmt: skip
    chunked = capsys.readouterr().err
    assert code == 2, chunked
    activations = [float(e.split("activations ")[1].split(")")[0].split(",")[0]) for e in (err, chunked)]
    p = train.PRESETS["olmoe-1b-7b"]
    T, V = p.batch_size * p.sequence_length, 50304  # OLMoE-1B-7B's vocabulary
    assert T > 256
    assert activations[0] - activations[1] == pytest.approx((T - 256) * V * (4 + 4 + 4) / 2**30, abs=0.1)
    # bf16 halves it; two layers fit in 24 GiB only in bf16.
    estimate = _estimate("olmoe-1b-7b", None, torch.bfloat16)
    assert estimate["host_bytes"] == pytest.approx(need * 2**30 / 2, rel=0.05)
    assert _estimate("olmoe-1b-7b", 2, torch.bfloat16)["host_bytes"] < 24 * 2**30


def _estimate(preset, layers, dtype):
    from sonar_kernels.integrations import transformers as hf
    from sonar_kernels.train.memory import estimate_training_memory

    hf.register()
    p = train.PRESETS[preset]
    shapes = train.build_model(p, layers, 0, dtype, torch.device("meta"))
    return estimate_training_memory(
        shapes, dtype=dtype, batch_size=p.batch_size, sequence_length=p.sequence_length, arms=train.ARMS,
        checkpointing=True, device=torch.device("cpu"),
    )  # fmt: skip


def test_a_checkpoint_that_cannot_fit_is_refused_before_it_is_loaded(tmp_path, capsys, monkeypatch):
    _save_tiny_checkpoint("olmoe", tmp_path / "ckpt")

    def from_pretrained(*args, **kwargs):
        raise AssertionError("the checkpoint was loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setattr(cli, "available_memory", lambda device: {"host": 2**20, "device": None})
    code = train.main(["--model", str(tmp_path / "ckpt"), "--out", str(tmp_path / "runs"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"--model {tmp_path / 'ckpt'} does not fit" in err and "0.0 GiB available" in err
    assert not (tmp_path / "runs").exists()


def test_checkpoints_sonar_train_cannot_use_and_bad_flags_exit_2(tmp_path, capsys):
    # A vocabulary below the 256 byte values: refused from its config, before any weight is read.
    small = FAMILIES["olmoe"]()
    small.vocab_size = 100
    small.save_pretrained(tmp_path / "small")
    # A dense model: no experts module for the sonar kernels.
    transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2
    ).save_pretrained(tmp_path / "dense")
    (tmp_path / "empty").mkdir()
    for path, words in (
        (tmp_path / "small", "a vocabulary of 100 tokens"),
        (tmp_path / "dense", "has no transformers experts module"),
        (tmp_path / "empty", "no config.json"),
        (tmp_path / "nowhere", "no such folder"),
    ):
        code = train.main(["--model", str(path), "--out", str(tmp_path / "runs"), "--quiet"])
        assert code == 2 and words in capsys.readouterr().err, path
    assert not (tmp_path / "runs").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    for argv, words in (
        (["--model", str(tmp_path / "small"), "--layers", "1"], "--layers does not apply to --model"),
        (["--save", str(tmp_path / "full")], "exists and is not an empty folder"),
        (["--save", str(tmp_path / "new"), "--arms", "standard"], "add sonar to --arms"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            train.main(argv)
        assert exit_info.value.code == 2 and words in capsys.readouterr().err


def test_help_describes_model_save_and_the_memory_check(capsys):
    with pytest.raises(SystemExit):
        train.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--model PATH a local transformers checkpoint" in out and "at least 256 ids" in out
    assert (
        "--save DIR save the sonar arm's trained model (first seed)" in out
        and "loads without sonar_kernels" in out
    )
    assert "--no-memory-check" in out and "refused with exit code 2" in out
