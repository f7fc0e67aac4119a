"""Command lines over ``mmseg_mesa``, run as scripts (``python tools/train.py``). A package so
that tests import the GPU check's code as ``tools.gpu_check`` from the repository root, which
pytest puts on the path (``pythonpath`` in pyproject.toml)."""
