"""sonar-train's launcher (sonar_kernels_cli): --help and argument errors answer before torch is imported,
and the names its parser offers agree with the training package's."""

import subprocess
import sys

import pytest

# The launcher's main with torch made unimportable (an ImportError on `import torch`): whatever answers
# here answered without torch.
WITHOUT_TORCH = (
    "import sys; sys.modules['torch'] = None; from sonar_kernels_cli import main; sys.exit(main())"
)


def _without_torch(*argv):
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH, *argv], capture_output=True, text=True, timeout=60, check=False
    )


def test_help_and_argument_errors_answer_without_torch():
    done = _without_torch("--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: sonar-train") and "--resume DIR" in done.stdout
    assert "standard-dense-clip (its control, which must equal sonar bit for bit)" in " ".join(
        done.stdout.split()
    )
    for argv, words in (
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--preset", "gpt-5"], "invalid choice: 'gpt-5'"),
        (["--device", "tpu"], "--device 'tpu'"),
        (["--steps", "3", "--warmup-steps", "5"], "--warmup-steps 5 is more than the 3 training steps"),
        (["--resume", "no-such-run"], "--resume no-such-run: no resume/options.json there"),
    ):
        done = _without_torch(*argv)
        assert done.returncode == 2, (argv, done.stderr)
        assert done.stderr.startswith("usage: sonar-train") and words in done.stderr, (argv, done.stderr)
    # A good command line goes on to import the trainer, and so torch: here, the ImportError.
    done = _without_torch("--steps", "1")
    assert done.returncode != 0 and "import of torch halted" in done.stderr


def test_the_training_package_builds_every_preset_the_launcher_offers():
    # The launcher holds the names and default steps (torch-free); the training package holds the models.
    from sonar_kernels.train import data
    from sonar_kernels_cli import options

    assert {name: preset.steps for name, preset in data.PRESETS.items()} == options.PRESET_STEPS


@pytest.mark.parametrize("module", ["sonar_kernels.train", "sonar_kernels_cli"])
def test_both_entry_points_parse_the_same_options(module):
    # `python -m sonar_kernels.train` (torch imported first) and the console script's launcher.
    flag = "-m" if module == "sonar_kernels.train" else "-c"
    code = module if flag == "-m" else "import sys; from sonar_kernels_cli import main; sys.exit(main())"
    done = subprocess.run(
        [sys.executable, flag, code, "--seeds", "0"], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 2 and "--seeds must be >= 1" in done.stderr
