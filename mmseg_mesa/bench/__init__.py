"""Measurements behind the tools: memory, speed, gradient fidelity, coverage and kernels.

``tools/benchmark_memory.py``, ``tools/benchmark_speed.py``, ``tools/gradient_fidelity.py``,
``tools/coverage.py`` and ``tools/benchmark_kernels.py`` are command lines over these modules,
and the tests measure through them too. They need mmengine and mmseg (``kernels`` excepted), so
nothing else in ``mmseg_mesa`` imports this package, and this ``__init__`` imports none of them:
``models`` (a config's model and a random batch), ``memory`` (step peaks, saved bytes and the
batch planner), ``speed`` (interleaved step times), ``fidelity`` (Mesa's gradient against the
exact one), ``coverage`` (what Mesa leaves uncompressed), ``kernels`` (the compiled kernels'
throughput), ``sweep`` (one training step of a model and of its conversion, a process per model:
``tools/benchmark_zoo.py`` and ``tools/benchmark_backbones.py``) and ``backbones`` (UPerNet
around any backbone mmpretrain builds).
"""
