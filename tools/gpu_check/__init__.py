"""The pieces of ``tools/gpu_check.py``, the GPU run in one command (its docstring says what runs).

- ``cli``: the options and the entry point.
- ``settings``: everything specific to the lent machine and the device tool (paths, versions,
  limits, cores, timeouts) and the sizes of the GPU run and of the CPU dry run.
- ``runner``: child processes, the log and summary.json, the time budget.
- ``steps`` and ``mmcv_setup``: the steps, each a function of the runner.
- ``results``: reading what the steps' tools wrote (JSON, JUnit, training logs).
- ``probes``: what the steps run in a child Python (``--report-env``, ``--load-check``).
- ``plugin``: the pytest plugin that sets torch's default device.

Nothing here imports torch or mmseg at import time: the run starts on a machine that may lack them.
"""
