# Mesa: `bits`-bit saved activations (8 by default) (see mmseg_mesa.MesaConfig for every field).
# `mesa = True` uses the defaults; a dict overrides fields; a bad key or value fails at start-up.
# A preset: `mesa = 'paper'` or `mesa = dict(preset='paper', ...)` (see README).
mesa = dict(bits=8, group_size=1, ema_decay=0.9, stochastic_rounding=True, backend='auto')
custom_imports = dict(imports=['mmseg_mesa.integrations'], allow_failed_imports=False)
custom_hooks = [dict(type='MesaHook')]
