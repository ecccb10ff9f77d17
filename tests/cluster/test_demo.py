"""The README's main job, as users run it."""

import pathlib
import subprocess
import sys


def test_demo_round_trips_chunks_through_a_real_chunkserver(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kvfs.cli", "demo", "--chunks", "12",
                           "--data-dir", str(tmp_path / "demo")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "read back 12/12 chunks byte-exact" in proc.stdout
    assert "created=False" in proc.stdout
    assert "chunkserver stopped" in proc.stdout
    # it left data behind in the folder it was given, in slot files
    assert list(pathlib.Path(tmp_path / "demo" / "cs-1" / "slots").glob("*/*.slots"))
