"""Mesa's parameter gradients next to the exact ones on one training step.

The measures (``relative_error`` of the whole gradient vector, per-parameter ``cosines``) and
the steps they compare: the exact gradient of a reference model and, per MesaConfig, the mean
Mesa gradient over stochastic-rounding draws. ``tools/gradient_fidelity.py`` is the command line
over them, with the minibatch noise as the yardstick; the ViT and zoo tests use the same
measures.
"""
from __future__ import annotations

import copy
from typing import Any

import torch

from .models import build_model, build_segmentor, load_weights, loss_of, mesa_config_of

Gradients = dict[str, torch.Tensor]
SIGNIFICANT = 1e-3  # parameters below this fraction of the largest gradient norm are not ranked


def losses_and_gradients(model: torch.nn.Module, batch: tuple) -> tuple[dict, Gradients]:
    """The detached losses (mmseg's dict) and the parameter gradients of one training step."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the same drop-path / dropout masks in every run
    losses = model(*batch, mode='loss')
    loss_of(losses).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return {k: [t.detach() for t in v] if isinstance(v, (list, tuple)) else v.detach()
            for k, v in losses.items()}, grads


def gradients(model: torch.nn.Module, batch: tuple) -> Gradients:
    return losses_and_gradients(model, batch)[1]


def relative_error(got: Gradients, exact: Gradients) -> float:
    """``||got - exact|| / ||exact||`` over the whole gradient vector (a missing entry is 0)."""
    error = sum((got[n] - g if n in got else g).double().pow(2).sum() for n, g in exact.items())
    return float((error / sum(g.double().pow(2).sum() for g in exact.values())).sqrt())


def cosines(got: Gradients, exact: Gradients) -> dict[str, float]:
    """Cosine per parameter whose exact gradient is at least ``SIGNIFICANT`` of the largest."""
    largest = max(g.norm() for g in exact.values())
    return {n: torch.nn.functional.cosine_similarity(got[n].flatten().double(),
                                                     g.flatten().double(), dim=0).item()
            for n, g in exact.items() if g.norm() >= SIGNIFICANT * largest}


def worst_cosine(got: Gradients, exact: Gradients) -> float:
    return min(cosines(got, exact).values())


def error_coherence(sum_of_errors: Gradients, sum_of_squares: float) -> float:
    """``||sum_k d_k|| / sqrt(sum_k ||d_k||^2)`` of the gradient errors ``d_k`` of K independent
    batches, from their sum and their summed squared norms: about 1 when they are independent
    and unbiased, ``sqrt(K)`` when every batch's error is the same vector (a bias, which
    training would accumulate step after step)."""
    total = sum(d.double().pow(2).sum() for d in sum_of_errors.values())
    return float((total / sum_of_squares).sqrt()) if sum_of_squares else 0.0


def measure_batches(reference: torch.nn.Module, batches: list[tuple], config: Any) -> dict:
    """Mesa's error on each of several independent batches (one step, one draw each), and how
    coherent those errors are (``error_coherence``): what ``--draws`` cannot show for
    deterministic (round-to-nearest) codes."""
    from mmseg_mesa import convert_to_mesa
    model = copy.deepcopy(reference)
    convert_to_mesa(model, config=config)
    errors: list[float] = []
    summed: Gradients = {}
    squares = 0.0
    for batch in batches:
        exact = gradients(copy.deepcopy(reference), batch)
        got = gradients(model, batch)
        errors.append(relative_error(got, exact))
        for name, g in exact.items():
            d = (got[name] - g if name in got else -g).double()
            squares += float(d.pow(2).sum())
            summed[name] = summed[name] + d if name in summed else d
    return dict(relative_errors=errors, coherence=error_coherence(summed, squares))


def build_reference(cfg: Any, init_weights: bool) -> torch.nn.Module:
    """The config's model on CPU in training mode; ``init_weights=False`` keeps the modules'
    construction-time values (zero position embeddings and class tokens in mmseg's ViTs)."""
    if init_weights:
        return build_model(cfg, 'cpu')
    return build_segmentor(cfg, init_weights=False).train()


def sharpen_attention(model: torch.nn.Module, factor: float) -> int:
    """Multiply the query and key projections of every attention in ``model`` by ``factor``
    (its logits by ``factor ** 2``), as training sharpens maps that start nearly flat at
    initialization; returns how many attentions it changed. It knows ``nn.MultiheadAttention``
    (mmseg's ViT) and attention with one ``qkv`` Linear (Swin's, BEiT's, timm's, mmpretrain's,
    BEiT's separate ``q_bias`` too)."""
    changed = 0
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.MultiheadAttention) and module._qkv_same_embed_dim:
                rows = slice(0, 2 * module.embed_dim)
                params = [module.in_proj_weight, module.in_proj_bias]
            elif isinstance(getattr(module, 'qkv', None), torch.nn.Linear) \
                    and module.qkv.out_features % 3 == 0:
                rows = slice(0, 2 * module.qkv.out_features // 3)
                params = [module.qkv.weight, module.qkv.bias]
                params.append(getattr(module, 'q_bias', None))
            else:
                continue
            for i, param in enumerate(params):
                if param is not None:
                    (param if i == 2 else param[rows]).mul_(factor)
            changed += 1
    if not changed:
        raise ValueError('sharpen_attention: no nn.MultiheadAttention or attention with a qkv '
                         'Linear in the model')
    return changed


def add_weight_options(parser: Any) -> None:
    """``--checkpoint``, ``--sharpen F`` and ``--data-root DIR``: which weights and images a
    measurement takes (``tools/gradient_fidelity.py``, ``tools/benchmark_memory.py``)."""
    parser.add_argument('--checkpoint', help='weights to load (an mmengine checkpoint)')
    parser.add_argument('--sharpen', type=float, default=1.0, metavar='F',
                        help="multiply every attention's query and key projections by F "
                             "(logits by F**2: maps as sharp as training makes them)")
    parser.add_argument('--data-root', metavar='DIR',
                        help="batches of the config's training set under DIR (its pipeline) "
                             'instead of random images')


def apply_weight_options(model: torch.nn.Module, args: Any) -> None:
    """``add_weight_options``' ``--checkpoint`` into ``model``, then its ``--sharpen``."""
    if args.checkpoint:
        load_weights(model, args.checkpoint)
    if args.sharpen != 1.0:
        sharpen_attention(model, args.sharpen)


def split(batch: tuple, n: int) -> tuple[tuple, tuple]:
    inputs, samples = batch
    return (inputs[:n], samples[:n]), (inputs[n:], samples[n:])


def mesa_config_for(name: str, cfg: Any) -> Any:
    from mmseg_mesa import MesaConfig
    if name == 'config':
        return mesa_config_of(cfg)
    return MesaConfig.preset(name)


def measure(reference: torch.nn.Module, batch: tuple, exact: Gradients, config: Any,
            draws: int) -> dict:
    """Mesa's error on ``batch`` for one MesaConfig, after each of ``draws`` steps: of their
    mean (``relative_error``) and of that step alone (``draw_error``)."""
    from mmseg_mesa import convert_to_mesa
    model = copy.deepcopy(reference)
    convert_to_mesa(model, config=config)
    total: Gradients | None = None
    rows = []
    for draw in range(1, draws + 1):
        grads = gradients(model, batch)
        total = grads if total is None else {n: total[n] + grads[n] for n in grads}
        mean = {n: g / draw for n, g in total.items()}
        per_param = cosines(mean, exact)
        worst = min(per_param, key=per_param.get)
        rows.append(dict(draws=draw, relative_error=relative_error(mean, exact),
                         draw_error=relative_error(grads, exact),
                         worst_cosine=per_param[worst], worst_parameter=worst,
                         cosines=per_param))
    return dict(config=str(config), rows=rows)
