"""The public Python API (docs/API.md): its example runs as written, and importing the package stays light."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_api__the_documented_example_runs(tmp_path):
    text = (REPO / "docs" / "API.md").read_text()
    (example,) = re.findall(r"```python\n(.*?)```", text, re.S)
    script = tmp_path / "example.py"
    script.write_text(example)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(2, 512) 512" in proc.stdout and "48 items; green/05.png looks green" in proc.stdout


def test_api__import_loads_no_heavy_library_until_used():
    code = (
        "import json, sys, moco_retrieval as mr\n"
        "names = [mr.Encoder, mr.Index, mr.build_index, mr.train, mr.export, mr.TrainConfig]\n"
        "print(json.dumps(sorted(m for m in ('torch', 'onnxruntime', 'faiss', 'lmdb') if m in sys.modules)))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []
