"""The run lives in ``RunState``, and layouts are installed by the life cycle alone.

Read from the source (nothing is imported): after start-up no code under ``megatron/resihp``
writes the run onto the argparse Namespace, and outside start-up and ``reconfigure.py`` nothing
installs process groups or builds them for a layout.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "megatron" / "resihp"
# What a layout change replaces: it belongs to the run, not to the flags.
RUN_FIELDS = {"layout", "groups", "rank", "world_size", "replica_index", "data_parallel_size", "identity",
              "generation", "quotas", "launch_rank", "sync"}
# Start-up: parsing the flags (world size, DP size from them) and forming the first world.
START_UP = {"arguments.py", "initialize.py"}
# Megatron-LM's own global arguments, which its training loop reads for the world's size: after a
# re-form the one hand-over to Megatron's loop tells them (and keeps no run of its own there); the
# data-parallel size it is told is the one its arithmetic can split the batch by.
MEGATRON_GLOBALS = {("megatron_loop_resilience.py", "rank"), ("megatron_loop_resilience.py", "world_size"),
                    ("megatron_loop_replicas.py", "data_parallel_size")}


def _sources():
    return sorted(p for p in PACKAGE.rglob("*.py"))


def _targets(node: ast.AST):
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            yield from (t for t in ast.walk(target) if isinstance(t, ast.Attribute))
    elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and len(node.args) >= 2:
        if isinstance(node.args[1], ast.Constant):
            yield ast.Attribute(value=node.args[0], attr=node.args[1].value)


def _is_args(node: ast.AST) -> bool:
    """``args`` or ``<anything>.args``: the argparse Namespace by the project's naming."""
    return (isinstance(node, ast.Name) and node.id == "args") or (isinstance(node, ast.Attribute) and node.attr == "args")


def run_writes_on_args(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [f"{path.name}:{node.lineno}: args.{target.attr} = ..." for node in ast.walk(tree)
            for target in _targets(node) if target.attr in RUN_FIELDS and _is_args(target.value)
            and (path.name, target.attr) not in MEGATRON_GLOBALS]


def test_no_code_writes_the_run_onto_args_after_start_up():
    found = [w for path in _sources() if path.name not in START_UP for w in run_writes_on_args(path)]
    assert not found, "run state written onto args (keep it in RunState):\n" + "\n".join(found)


def test_the_check_sees_such_a_write(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(self, args, layout):\n    args.layout = layout\n    self.args.replica_index = 1\n"
                   "    setattr(args, 'groups', None)\n    args.seed = 3\n")
    assert len(run_writes_on_args(bad)) == 3


def _calls(path: Path, names: set[str]) -> list[str]:
    """Calls of ``names``: imported by name, or through ``dist`` / ``parallel_state_patch`` (another
    module's ``install``, such as ``training_compat.install``, is not the group builder's)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name):
            name = func.id
        elif isinstance(func, ast.Attribute) and getattr(func.value, "id", None) in ("dist", "parallel_state_patch"):
            name = func.attr
        else:
            continue
        if name in names:
            found.append(f"{path.name}:{node.lineno}: {name}(...)")
    return found


@pytest.mark.parametrize("names,allowed", [
    # Installing a layout's groups: start-up installs the first (in place of Megatron's
    # initialize_model_parallel), the life cycle every later one.
    ({"install", "build_groups"}, {"megatron_loop_resilience.py", "reconfigure.py",
                                   "parallel_state_patch.py"}),
    # Creating a process group: only the group builder does.
    ({"new_group"}, {"parallel_state_patch.py"}),
])
def test_only_the_life_cycle_installs_a_layout_and_only_the_builder_makes_groups(names, allowed):
    found = [c for path in _sources() if path.name not in allowed for c in _calls(path, names)]
    assert not found, "\n".join(found)
