"""A command line of ``tools/`` run as a user runs it (``python tools/NAME.py ARGS`` from the
repository root), with this checkout's ``mmseg_mesa`` first on the path."""
from __future__ import annotations

import os
import os.path as osp
import subprocess
import sys

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))


def run_tool(name: str, *args: object, timeout: float = 600,
             **env: str) -> subprocess.CompletedProcess:
    """``tools/NAME.py`` with ``args`` (and ``env`` added to the environment), its output
    captured."""
    environ = dict(os.environ, **env)
    environ['PYTHONPATH'] = os.pathsep.join(p for p in (ROOT, environ.get('PYTHONPATH')) if p)
    return subprocess.run([sys.executable, osp.join(ROOT, 'tools', f'{name}.py'),
                           *map(str, args)], cwd=ROOT, env=environ, capture_output=True,
                          text=True, timeout=timeout)
