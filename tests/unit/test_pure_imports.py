"""The pure side stays pure: ``resihp_ext`` and the tests in ``tests/unit`` import neither torch nor
megatron (single-process tests of the executor live in ``tests/executor``)."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FORBIDDEN = ("torch", "megatron")


def _imported(path: Path) -> set[str]:
    """Top-level names of every module ``path`` imports, wherever in the file."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("folder", ["resihp_ext", "tests/unit"])
def test_no_module_of_the_pure_side_imports_torch_or_megatron(folder):
    offenders = {str(path.relative_to(REPO)): sorted(_imported(path) & set(FORBIDDEN))
                 for path in sorted((REPO / folder).rglob("*.py"))}
    assert not {path: names for path, names in offenders.items() if names}

