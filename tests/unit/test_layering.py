"""The house's floors, enforced: each package imports only the packages below it, and no library
module imports a program (`<package>/bench/`). Every import counts, also one inside a function.

    echo/                        the ground floor: config, protocol, wire, tasks; imports no plane
    netem/, broadcast/, scheduler/   -> echo/ only
    worker/                      -> echo/, broadcast/ (never learner/)
    learner/                     -> echo/, broadcast/, scheduler/
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ALLOWED = {
    "echo": set(),
    "netem": {"echo"},
    "broadcast": {"echo"},
    "scheduler": {"echo"},
    "worker": {"echo", "broadcast"},
    "learner": {"echo", "broadcast", "scheduler"},
}


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every absolute import in the file, wherever it stands."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def library_files(package: str) -> list[Path]:
    return [p for p in sorted((ROOT / package).rglob("*.py")) if "bench" not in p.relative_to(ROOT).parts]


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_each_package_imports_only_the_floors_below_it(package: str) -> None:
    others = set(ALLOWED) - {package}
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {module}"
             for path in library_files(package) for line, module in imports(path)
             if module.split(".")[0] in others - ALLOWED[package]]
    assert not wrong, f"{package}/ may import only {sorted(ALLOWED[package]) or 'nothing of ours'}:\n" + "\n".join(wrong)


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_the_library_never_imports_a_benchmark(package: str) -> None:
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {module}"
             for path in library_files(package) for line, module in imports(path)
             if "bench" in module.split(".")[1:2]]
    assert not wrong, "benchmarks are programs: " + "\n".join(wrong)


def test_the_rule_sees_an_upward_import_inside_a_function(tmp_path: Path) -> None:
    bad = tmp_path / "m.py"
    bad.write_text("def f():\n    from learner.config import LearnerConfig\n")
    assert (2, "learner.config") in imports(bad)
