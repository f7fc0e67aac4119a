"""Every piece of process-wide state in mmseg-mesa, in one place.

How a model is compressed is never process-wide: a ``MesaConfig`` is passed explicitly to each
conversion and lives on the converted modules. What is process-wide is what a Python process
holds once for all models, and it is all here:

- ``LAYER_TYPES``: the declared layer types (``layer_types.declare_layer_type``), filled when the
  layer modules are imported.
- ``HANDLERS``, ``ALIASES``, ``HANDLER_TABLES``, ``LAYER_CLASSES``: the handler table
  (``registry``): which module type converts to which Mesa module, filled by the
  ``registry.mesa_layer`` decorators at import and by ``register_handler`` calls.
- ``SWAPPED_CLASSES``: the classes ``MesaModule.convert`` builds for subclasses of a handled
  type (``Mesa<Base>[<Subclass>]``), made once per pair so that ``type(a) is type(b)`` holds
  for two converted modules of one type.
- ``ROUNDING_STREAMS``: per device, the seed and counter of stochastic rounding's random stream
  (``rounding``), separate from torch's generators so that compressing never shifts them.
- ``REUSE_COUNTERS``: the ``reuse.count_reuse`` blocks currently open.
- ``KERNEL_CHECKS``: per device and backend, the result of holding the compiled kernels to the
  reference before their first use there (``selfcheck.verify_first_use``), so it runs once.
- ``CONSTANTS``: per value, dtype and device, a buffer of that value (``constants``): constant
  moments backward formulas hand torch's kernels, a zero to select with, filled once rather
  than at every call.

Two more live beside their types because they are of them: the extension's load state
(``_backend.EXTENSION``: loaded once, with the reason when it cannot be) and the hand-off maps
(``handoff``: per tensor, each entry dies with its tensor).
"""
from __future__ import annotations

from typing import Any

LAYER_TYPES: dict[str, Any] = {}  # name -> layer_types.LayerType
HANDLERS: dict[type, Any] = {}  # module type -> registry.Handler
ALIASES: dict[type, type] = {}  # module type -> the handled type whose handler it uses
HANDLER_TABLES: set[str] = set()  # built-in tables registered so far (registry.register_once)
LAYER_CLASSES: dict[str, type] = {}  # Mesa layer classes by name (exported by mmseg_mesa.layers)
SWAPPED_CLASSES: dict[tuple[type, type], type] = {}  # (Mesa class, subclass) -> built class
ROUNDING_STREAMS: dict[Any, Any] = {}  # torch.device -> rounding stream
REUSE_COUNTERS: list[Any] = []  # open count_reuse blocks: (counts, quantizer owners)
KERNEL_CHECKS: dict[Any, Any] = {}  # (torch.device, backend name) -> selfcheck results
CONSTANTS: dict[Any, Any] = {}  # (value, dtype, torch.device) -> constants buffer
