"""The distribution as a user installs it: `python -m build` makes an sdist and a wheel, the wheel installs
into a clean virtual environment and imports, its metadata carries the extras README.md relies on, and the
Makefile's pinned versions satisfy pyproject.toml's bounds.

No download: the clean environment gets torch, triton and numpy from this test environment's
site-packages through a .pth line (which does not run this checkout's editable-install hook), the wheel is
installed with --no-deps --no-index, and the build runs without isolation (setuptools from this
environment)."""

import re
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _run(*args, cwd):
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"{' '.join(map(str, args))}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_the_wheel_builds_installs_into_a_clean_venv_and_imports(tmp_path):
    pytest.importorskip("build", reason="`build` is not installed: pip install -e '.[test]'")
    # A copy of what the distribution is made of, so the build writes nothing into the checkout.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    for package in ("sonar_kernels", "sonar_kernels_cli"):  # the library, sonar-train's torch-free launcher
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path / "dist"
    # `python -m build`: the sdist, then the wheel built from the sdist.
    _run(sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(src), cwd=tmp_path)
    (wheel,) = dist.glob("sonar_kernels-*.whl")
    assert len(list(dist.glob("sonar_kernels-*.tar.gz"))) == 1

    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (metadata_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = Parser().parsestr(zf.read(metadata_name).decode())
        entry_points = zf.read(metadata_name.replace("METADATA", "entry_points.txt")).decode()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    # No tests/, bench/ or a top-level package that shadows another; sonar_kernels_cli parses sonar-train's
    # command line before torch loads (importing anything under sonar_kernels imports torch).
    assert top == {"sonar_kernels", "sonar_kernels_cli"}, top
    assert "sonar_kernels/kernels/__init__.py" in names
    assert (
        "sonar_kernels/ops/torch_backend/cpu_update.c" in names
    )  # compiled at first use (ops/torch_backend/cpu_update.py)
    requires = metadata.get_all("Requires-Dist")
    from packaging.requirements import Requirement

    base = {Requirement(r).name: Requirement(r).specifier for r in requires if not Requirement(r).marker}
    for dep in map(Requirement, PYPROJECT["project"]["dependencies"]):
        assert base.get(dep.name) == dep.specifier, (dep, requires)
    assert {"transformers", "train", "test"} <= set(metadata.get_all("Provides-Extra"))
    assert any(r.startswith("accelerate") and 'extra == "train"' in r for r in requires), requires
    assert "sonar-train = sonar_kernels_cli:main" in entry_points

    # A clean venv that sees this environment's torch, triton and numpy but not this checkout.
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    purelib = Path(
        _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path).strip()
    )
    (purelib / "test_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run(
        sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", str(wheel),
        cwd=tmp_path,
    )  # fmt: skip
    out = _run(
        python, "-c",
        "import importlib.metadata, sonar_kernels; "
        "print(sonar_kernels.__file__); print(importlib.metadata.version('sonar-kernels')); "
        "print(hasattr(sonar_kernels, 'moe_mlp'))",
        cwd=tmp_path,
    ).split()  # fmt: skip
    assert Path(out[0]).is_relative_to(purelib), f"imported {out[0]}, not the installed wheel"
    assert out[1:] == [PYPROJECT["project"]["version"], "True"]
    assert (env_dir / "bin" / "sonar-train").exists()


def _spec(requirements: list[str], name: str) -> str:
    (spec,) = [r[len(name) :] for r in requirements if re.match(rf"{name}\b", r)]
    return spec


def test_makefile_versions_satisfy_pyproject_bounds():
    from packaging.specifiers import SpecifierSet

    makefile = (ROOT / "Makefile").read_text()
    deps = PYPROJECT["project"]["dependencies"]
    for var, name in (("TORCH_SPEC", "torch"), ("TRITON_SPEC", "triton")):
        pinned = re.search(rf"^{var} \?= {name}==(\S+)$", makefile, re.M).group(1)
        assert pinned in SpecifierSet(_spec(deps, name)), (var, pinned, deps)
    numpy = re.search(r"^NUMPY_SPEC \?= (\S+)$", makefile, re.M).group(1)
    assert numpy == "numpy" + _spec(deps, "numpy")
    extras = PYPROJECT["project"]["optional-dependencies"]
    # The test extra holds what sonar-train and Trainer need, so `make install-test` ([test,train]) and
    # `pip install .[train]` agree on them.
    assert set(extras["train"]) <= set(extras["test"])
    assert "accelerate" in {re.split(r"[<>=!~]", r)[0] for r in extras["train"]}


# torchtitan's own imports, installed --no-deps beside it: versions the README need not name.
TORCHTITAN_DEPENDENCIES = {"spmd_types", "tyro", "docstring_parser", "typeguard"}


def _constraints() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[name] = version
    return pins


def _tested_with() -> str:
    readme = (ROOT / "README.md").read_text()
    start = readme.index("Tested with")
    return " ".join(readme[start : readme.index("\n\n", start)].split())


def test_the_tested_versions_live_in_one_place_and_the_readme_names_them():
    pins = _constraints()
    makefile = (ROOT / "Makefile").read_text()
    line = _tested_with()
    named = dict(re.findall(r"\b([a-z][a-z_-]*) (\d+\.\d+\.\d+)\b", line))
    for name, version in pins.items():
        if name not in TORCHTITAN_DEPENDENCIES:
            assert named.get(name) == version, (name, version, line)
    for var, name in (("TORCH_SPEC", "torch"), ("TRITON_SPEC", "triton")):
        assert named[name] == re.search(rf"^{var} \?= {name}==(\S+)$", makefile, re.M).group(1), line
    # The GPU lane's versions: the H200's torch, and the transformers wheel bench/gpu_run.sh installs.
    gpu_wheels = (ROOT / "bench" / "gpu_wheels.txt").read_text()
    gpu_transformers = re.search(r"^transformers==(\S+)$", gpu_wheels, re.M).group(1)
    assert f"2.11.0 (CUDA, on the H200, with transformers {gpu_transformers})" in line, line
    # Every exact pin of pyproject.toml's extras is constraints.txt's, and constraints.txt satisfies every
    # bound (so `make` installs what pip would accept).
    from packaging.requirements import Requirement

    for extra in PYPROJECT["project"]["optional-dependencies"].values():
        for requirement in map(Requirement, extra):
            name = requirement.name.lower()
            if name in pins:
                assert requirement.specifier.contains(pins[name]), (str(requirement), pins[name])
    # The Makefile installs with these constraints, in both environments.
    assert makefile.count("-c constraints.txt") >= 3


def test_this_environment_runs_the_tested_versions():
    import importlib.metadata

    import torch

    if torch.version.cuda is not None:
        pytest.skip("the GPU lane runs the GPU machine's own versions (bench/results/ records them)")
    checked = []
    for name, version in _constraints().items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # an environment without that stack skips its tests too
        assert installed == version, f"{name} {installed} installed, constraints.txt tests {version}"
        checked.append(name)
    assert "transformers" in checked and "accelerate" in checked, checked
