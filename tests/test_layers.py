"""The package's layers import only downward, the optimizers' in-backward modules only those below them,
the two backend rooms of ops/ nothing of each other, and no layer runs the reference (import-linter's
contracts in pyproject.toml; also `make lint`)."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    lint_imports = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint_imports is not None, "import-linter is a test dependency (pip install -e '.[test]')"
    result = subprocess.run([lint_imports], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    contracts = (ROOT / "pyproject.toml").read_text().count("[[tool.importlinter.contracts]]")
    assert contracts >= 5 and f"{contracts} kept, 0 broken" in result.stdout  # every contract ran


def test_no_module_of_the_package_is_over_500_lines():
    """A room a newcomer can hold in mind: split a module by concern before it grows past 500 lines."""
    sizes = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for path in (ROOT / "sonar_kernels").rglob("*.py")
    }
    assert len(sizes) > 40, sizes  # the package was found
    assert {path: n for path, n in sizes.items() if n > 500} == {}
    # The optimizers and the ops, where the state and the launchers meet, stay smaller still.
    busy = ("sonar_kernels/optim/", "sonar_kernels/ops/")
    assert {path: n for path, n in sizes.items() if path.startswith(busy) and n > 450} == {}


def test_the_two_backend_rooms_import_nothing_of_each_other():
    """ops/triton_backend and ops/torch_backend are independent (the shared helpers lie below them, the
    custom ops and the .grad path's update above): a backend can be read, changed or left out alone."""
    import grimp

    graph = grimp.build_graph("sonar_kernels")
    rooms = ("sonar_kernels.ops.triton_backend", "sonar_kernels.ops.torch_backend")
    for room in rooms:
        assert len(graph.find_descendants(room)) >= 6, room  # the room was found
    assert not graph.chain_exists(rooms[0], rooms[1], as_packages=True)
    assert not graph.chain_exists(rooms[1], rooms[0], as_packages=True)


def test_no_import_circle_between_the_packages_modules():
    """No module imports (at its top or inside a function) one that imports it back, directly or through
    others: every room can be read from the ones it imports."""
    import grimp  # import-linter's import graph

    graph = grimp.build_graph("sonar_kernels", "sonar_kernels_cli")
    assert len(graph.modules) > 80, len(graph.modules)  # the packages were found
    circles = [
        (module, chain)
        for module in sorted(graph.modules)
        for imported in graph.find_modules_directly_imported_by(module)
        if (chain := graph.find_shortest_chain(importer=imported, imported=module)) is not None
    ]
    assert circles == [], circles[:3]
