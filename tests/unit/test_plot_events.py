"""scripts/plot_events.py: a run's event log drawn as a PNG, every event kind marked, bad input refused."""

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = str(REPO / "scripts" / "plot_events.py")

pytest.importorskip("matplotlib", reason="plot_events.py draws with matplotlib (python -m pip install matplotlib)")


def _events() -> list[dict]:
    """A job as the executor logs it: rank 7 slowed at 6, suspected, probed, judged, re-planned and
    adapted after iteration 9, a suspicion elsewhere cleared, the fault ending, then after the last
    iteration a standby, a kill, every survivor's dead verdict and a fallback. Iteration lines come
    from the last rank, a fault's from its rank, the rest from rank 0, each logged when the
    executor logs it (a re-plan after its iteration's step, before its iteration line)."""
    t, out = 1_000.0, []

    def emit(event, iteration, rank=0, **fields):
        out.append({"event": event, "iteration": iteration, "time": t, "rank": rank, **fields})

    emit("start", 0, world_size=8, layers_per_stage=[2, 2])
    for i in range(1, 21):
        slow = 6 <= i <= 9
        if i == 6:
            emit("inject", 6, rank=7, fault="slow:rank=7,factor=2.0,at=6,until=16")
        if i == 16:
            emit("inject_end", 16, rank=7, fault="slow:rank=7,factor=2.0,at=6,until=16")
        t += 3.9 if slow else 2.1
        if i == 9:
            emit("suspicion", 7, kind="compute", onset_iteration=6, replica=1, stage=1, ranks=[6, 7], links=[],
                 ratio=1.8, reason="stage (1, 1) 1.8x its prediction")
            emit("verdict", 6, kind="compute", ranks=[7], factor=1.96, reason="probe", evidence={})
            emit("plan", 9, action="adapt", policy="resihp", reason="repartition", quotas=[9, 7],
                 predicted_iteration_s_before=3.95, predicted_iteration_s_after=2.36)
            emit("adapted", 9, world_size=8, quotas=[9, 7], duration_s=0.29)
        if i == 12:
            emit("suspicion", 12, kind="link", onset_iteration=12, replica=0, stage=0, ranks=[0], links=[[0, 4]],
                 ratio=1.3, reason="link 0->4")
            emit("cleared", 12, ranks=[0], reason="probes found nothing", evidence={})
        t += 0.01
        emit("iteration", i, rank=7, lm_loss=6.0 - 0.1 * i, grad_norm=1.0, elapsed_s=3.9 if slow else 2.1,
             consumed_samples=32 * i, lr=1e-3)
    t += 1.0
    emit("standby", 17, rank=6, launch_rank=6, reference_probe_s=0.01)
    emit("inject", 18, rank=5, fault="kill:rank=5,at=18")
    for rank in (0, 1, 2):  # every survivor logs the same dead verdict
        emit("verdict", 18, rank=rank, kind="dead", ranks=[5], factor=None, reason="heartbeat", evidence={})
    emit("fallback_checkpoint", 18, reason="no stage group left for stage 1", resume_command="...", path="ck")
    return out


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_every_event_kind_is_marked_once_in_a_png_of_sensible_size(tmp_path):
    log = _write(tmp_path / "events.jsonl", _events())
    out = tmp_path / "run.png"
    done = subprocess.run([sys.executable, SCRIPT, str(log), "-o", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    width, height = _png_size(out)
    assert 600 <= width <= 3000 and 300 <= height <= 2000, (width, height)
    lines = [line.split() for line in done.stdout.splitlines() if not line.startswith("wrote")]
    drawn = [(words[0], int(words[2])) for words in lines]
    # Detection's marks stand where they were logged (9), the verdict's onset in its label.
    assert drawn == [("inject", 6), ("suspicion", 9), ("verdict", 9), ("plan", 9), ("adapted", 9),
                     ("suspicion", 12), ("cleared", 12), ("inject_end", 16), ("standby", 17), ("inject", 18),
                     ("verdict", 18), ("fallback_checkpoint", 18)], done.stdout
    assert "compute ranks 7 x1.96 since 6" in done.stdout and "dead ranks 5 since 18" in done.stdout
    assert done.stdout.strip().endswith("12 markers)")


@pytest.mark.parametrize("content, expected", [
    (None, "cannot read"),
    ("{\"event\": \"iteration\"\nnot json\n", "not a JSONL event log"),
    ("[1, 2]\n", "not an event"),
    (json.dumps({"event": "start", "iteration": 0, "time": 1.0, "rank": 0}) + "\n", "no iteration event"),
    (json.dumps({"event": "iteration", "iteration": "one", "time": 1.0, "rank": 0, "elapsed_s": 1.0}) + "\n",
     "malformed field"),
])
def test_bad_logs_are_refused_with_one_message_and_nothing_written(tmp_path, content, expected):
    log = tmp_path / "events.jsonl"
    if content is not None:
        log.write_text(content)
    out = tmp_path / "run.png"
    done = subprocess.run([sys.executable, SCRIPT, str(log), "-o", str(out)], capture_output=True, text=True)
    assert done.returncode == 2 and expected in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not out.exists()


def test_an_output_that_is_not_a_png_in_an_existing_folder_is_refused(tmp_path):
    log = _write(tmp_path / "events.jsonl", _events())
    for out, expected in ((tmp_path / "run.jpg", "ending in .png"), (tmp_path / "no" / "run.png", "does not exist")):
        done = subprocess.run([sys.executable, SCRIPT, str(log), "-o", str(out)], capture_output=True, text=True)
        assert done.returncode == 2 and expected in done.stderr, done.stderr
        assert not out.exists()
