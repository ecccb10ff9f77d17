"""The built wheel, not just the editable install, must carry every part."""

import pathlib
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODULES = ["kvfs", "kvfs.proto.chunk_pb2", "kvfs.proto.meta_pb2_grpc", "kvfs.chunkserver.main",
           "kvfs.chunkserver.store", "kvfs.client", "kvfs.metaserver", "kvfs.engine", "kvfs.cli",
           "kvfs.bench.main", "kvfs.cli.launcher", "kvfs.cli.demo"]


def test_wheel_installs_every_part_and_imports_from_itself(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(dist), str(ROOT)], check=True)
    (wheel,) = dist.glob("kvfs-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    scripts = zipfile.ZipFile(wheel).read(entry_points).decode()
    for script in ("kvfs = kvfs.cli.main:main", "kvfs-chunkserver = kvfs.chunkserver.main:main",
                   "kvfs-bench = kvfs.bench.main:main"):
        assert script in scripts
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                    str(wheel)], check=True)
    code = "import importlib, sys\n" + "\n".join(
        f"print(importlib.import_module({m!r}).__file__)" for m in MODULES)
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True, capture_output=True,
                         text=True, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}).stdout
    files = out.split()
    assert len(files) == len(MODULES)
    assert all(pathlib.Path(f).is_relative_to(site) for f in files), files
