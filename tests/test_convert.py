import copy

import pytest
import torch
from conftest import cosine
from torch import nn

from mmseg_mesa import MesaConfig, MesaModule, convert_to_mesa, register_handler
from mmseg_mesa.layers import MatMul, MesaAdaptiveAvgPool2d, MesaLinear
from mmseg_mesa.memory import count_saved_tensors


class Block(nn.Module):
    """A small pre-norm transformer block built from plain torch modules."""

    def __init__(self, dim=48, heads=3):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, dim * 3)
        self.qk = MatMul()
        self.softmax = nn.Softmax(dim=-1)
        self.av = MatMul()
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, dim * 4)
        self.act = nn.GELU()
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(dim * 4, dim)
        self.head = nn.Sequential(nn.Conv2d(dim, 16, 1), nn.BatchNorm2d(16), nn.ReLU(inplace=True))
        self.pool = nn.AdaptiveMaxPool2d(1)  # a type without a handler

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attn = self.softmax(self.qk(q * (c // self.heads) ** -0.5, k.transpose(-2, -1)))
        x = x + self.proj(self.av(attn, v).transpose(1, 2).reshape(b, n, c))
        x = x + self.fc2(self.drop(self.act(self.fc1(self.norm2(x)))))
        side = int(n ** 0.5)
        # the residual stream is an output too: behind BatchNorm alone, per-channel biases
        # would have (analytically) zero gradients and comparing them would compare noise.
        return self.head(x.transpose(1, 2).reshape(b, c, side, side)), x


def loss_of(outputs):
    return sum(o.square().mean() for o in outputs)


def test_conversion_keeps_identity_names_and_parameters():
    model = Block()
    reference = copy.deepcopy(model)
    params = {name: p for name, p in model.named_parameters()}
    buffers = {name: b for name, b in model.named_buffers()}
    report = convert_to_mesa(model)
    assert model.state_dict().keys() == reference.state_dict().keys()
    assert {n: p for n, p in model.named_parameters()} == params
    assert all(dict(model.named_buffers())[n] is b for n, b in buffers.items())
    assert all(p is params[n] for n, p in model.named_parameters())
    assert model.training
    assert isinstance(model.qkv, MesaLinear) and isinstance(model.qkv, nn.Linear)
    assert set(report.converted) == {'norm1', 'qkv', 'qk', 'softmax', 'av', 'proj', 'norm2',
                                     'fc1', 'act', 'drop', 'fc2', 'head.0', 'head.1', 'head.2'}
    # no handler: its own forward goes through the generic path
    assert 'pool' in report.generic and 'pool' not in report.left
    assert 'Linear' in report.format() and 'Generic path' in report.format()
    # loading the original state dict needs no key mapping.
    model.load_state_dict(reference.state_dict(), strict=True)


def test_converted_block_is_exact_forward_and_close_backward():
    model = Block()
    reference = copy.deepcopy(model)
    convert_to_mesa(model)
    x = torch.randn(2, 16, 48)
    torch.manual_seed(1)
    y_ref = reference(x)
    torch.manual_seed(1)
    y = model(x)
    assert all(torch.equal(a, b) for a, b in zip(y, y_ref))
    loss_of(y).backward()
    loss_of(y_ref).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad.norm() < 1e-6:  # analytically zero (a bias in front of BatchNorm)
            assert p.grad.norm() < 1e-6, name
        else:
            assert cosine(p.grad, q.grad) >= 0.99, name


def test_converted_block_saves_less_than_a_third():
    model = Block()
    reference = copy.deepcopy(model)
    convert_to_mesa(model)
    x = torch.randn(4, 64, 48)
    with count_saved_tensors(reference) as base:
        reference(x)
    with count_saved_tensors(model) as mesa:
        model(x)
    assert mesa.total_bytes < 0.27 * base.total_bytes


def test_optimizer_built_before_conversion_still_trains():
    torch.manual_seed(0)
    model = Block()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    convert_to_mesa(model)
    x = torch.randn(8, 16, 48)
    target = torch.randn(8, 16, 4, 4)
    losses = []
    for _ in range(15):
        optimizer.zero_grad()
        loss = (model(x)[0] - target).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
    # quantizer estimates never reach the optimizer.
    optimized = {id(p) for group in optimizer.param_groups for p in group['params']}
    assert optimized == {id(p) for p in model.parameters()}


def test_filter_skip_and_layer_switches():
    model = Block()
    report = convert_to_mesa(
        model, config=MesaConfig(layers={'linear', 'layernorm'}, skip=('fc*',)),
        module_filter_fn=lambda module, name: name != 'proj')
    assert set(report.converted) == {'norm1', 'qkv', 'norm2'}
    assert report.left['fc1'][1] == "skipped by pattern 'fc*'"
    assert report.left['proj'][1] == 'excluded by module_filter_fn'
    assert report.left['act'][1] == "layer type 'gelu' not in config.layers"
    assert not isinstance(model.act, MesaModule)


def without_generic() -> MesaConfig:
    return MesaConfig(layers=MesaConfig().layers - {'generic'})


def test_nothing_to_convert_is_an_error():
    with pytest.raises(ValueError, match='nothing to convert in Sequential'):
        convert_to_mesa(nn.Sequential(nn.Identity(), nn.AdaptiveMaxPool2d(1)),
                        config=without_generic())
    # the generic path takes modules without a handler
    report = convert_to_mesa(nn.Sequential(nn.Identity(), nn.AdaptiveMaxPool2d(1)))
    assert set(report.generic) == {'0', '1'}


def test_converting_twice_is_harmless():
    model = Block()
    convert_to_mesa(model)
    report = convert_to_mesa(model)
    assert report.converted == {}


def test_subclass_keeps_its_type():
    class MyLinear(nn.Linear):
        pass

    model = nn.Sequential(MyLinear(4, 4))
    convert_to_mesa(model)
    assert isinstance(model[0], MyLinear) and isinstance(model[0], MesaLinear)
    copy.deepcopy(model)(torch.randn(2, 4, requires_grad=True)).sum().backward()


def test_report_lists_leaves_without_handler_once():
    report = convert_to_mesa(Block(), config=without_generic())
    assert report.left == {'pool': ('AdaptiveMaxPool2d', 'no Mesa handler for AdaptiveMaxPool2d')}
    assert 'AdaptiveMaxPool2d' in report.format()
    report = convert_to_mesa(Block())
    assert report.left == {} and 'pool' in report.generic


@pytest.fixture
def tables(monkeypatch):
    """``mmseg_mesa.registry`` with copies of its tables, restored after the test."""
    from mmseg_mesa import registry
    monkeypatch.setattr(registry, '_HANDLERS', dict(registry._HANDLERS))
    monkeypatch.setattr(registry, '_ALIASES', dict(registry._ALIASES))
    monkeypatch.setattr(registry, '_TABLES', set(registry._TABLES))
    return registry


def test_a_second_handler_for_a_type_needs_force(tables):
    from mmseg_mesa.registry import handler_for_type, register_alias, swap_to
    with pytest.raises(KeyError, match='Linear already has a handler.*force=True'):
        register_handler(nn.Linear, 'linear', swap_to(MesaLinear))
    class Pool(nn.AdaptiveAvgPool2d):
        pass

    first, second = swap_to(MesaAdaptiveAvgPool2d), swap_to(MesaAdaptiveAvgPool2d)
    register_handler(Pool, 'pooling', first)
    with pytest.raises(KeyError, match='Pool already has a handler'):
        register_handler(Pool, 'pooling', second)
    assert handler_for_type(Pool)[0].convert is first
    register_handler(Pool, 'pooling', second, force=True)
    assert handler_for_type(Pool)[0].convert is second

    class Wrapped(nn.Linear):
        def forward(self, x):
            return super().forward(x)

    register_alias(Wrapped, nn.Linear)
    with pytest.raises(KeyError, match='Wrapped is already an alias of Linear'):
        register_alias(Wrapped, nn.Linear)
    register_alias(Wrapped, nn.Linear, force=True)


OPENMMLAB = ('mmcv', 'mmengine', 'mmseg', 'mmdet', 'mmpretrain')


def test_builtin_tables_register_each_type_once(tables):
    expected = set(tables._HANDLERS), set(tables._ALIASES)
    if 'openmmlab' in tables._TABLES:
        from mmseg_mesa.integrations.mmseg_handlers import register_openmmlab_handlers
        for module_type in [*tables._HANDLERS]:
            if module_type.__module__.split('.')[0] in OPENMMLAB:
                del tables._HANDLERS[module_type]
        tables._ALIASES.clear()
        register_openmmlab_handlers()  # a type registered twice would raise
    assert (set(tables._HANDLERS), set(tables._ALIASES)) == expected


def test_reimporting_registers_nothing_twice(tables):
    import importlib

    import mmseg_mesa
    import mmseg_mesa.handlers
    before = dict(tables._HANDLERS), dict(tables._ALIASES)
    importlib.reload(mmseg_mesa.handlers)
    importlib.reload(mmseg_mesa)  # which registers the OpenMMLab ones, when installed
    mmseg_mesa.handlers.register_openmmlab_handlers_if_installed()
    assert (tables._HANDLERS, tables._ALIASES) == before


def test_a_layer_registers_itself_beside_its_code(tables, monkeypatch):
    """``mesa_layer`` on a class is its whole registration: handler, layer type, export, and
    the type's settings for a layer built directly; running the same definition again (a
    reload) replaces it, another class for the same module type needs ``force``."""
    from mmseg_mesa import state
    from mmseg_mesa.layer_types import layer_types
    from mmseg_mesa.registry import find_handler, layer_classes, mesa_layer
    monkeypatch.setattr(tables, '_LAYER_CLASSES', dict(tables._LAYER_CLASSES))
    monkeypatch.setattr(state, 'LAYER_TYPES', dict(state.LAYER_TYPES))
    import mmseg_mesa.layer_types as types_module
    monkeypatch.setattr(types_module, '_DECLARED', state.LAYER_TYPES)

    class Twice(nn.Module):
        def forward(self, x):
            return 2 * x

    def define():
        @mesa_layer(Twice, 'twice_test')
        class MesaTwice(MesaModule, Twice):
            pass
        return MesaTwice

    first = define()
    assert 'twice_test' in layer_types()
    assert first.mesa_layer_type == 'twice_test'
    assert layer_classes()['MesaTwice'] is first
    module = nn.Sequential(Twice())
    report = convert_to_mesa(module, config=MesaConfig(layers={'twice_test'}))
    assert type(module[0]) is first and report.converted['0'] == ('Twice', 'MesaTwice')
    second = define()  # the same statement once more
    assert find_handler(Twice())[0].convert.mesa_class is second

    class Other(MesaModule, Twice):
        pass
    with pytest.raises(KeyError, match='Twice already has a handler'):
        mesa_layer(Twice, 'twice_test')(Other)


def test_a_layer_type_keeps_one_set_of_properties(monkeypatch):
    from mmseg_mesa import state
    from mmseg_mesa.layer_types import declare_layer_type, division_layer_types
    monkeypatch.setattr(state, 'LAYER_TYPES', dict(state.LAYER_TYPES))
    import mmseg_mesa.layer_types as types_module
    monkeypatch.setattr(types_module, '_DECLARED', state.LAYER_TYPES)
    declare_layer_type('props_test')  # as register_handler declares it
    declare_layer_type('props_test', division=True)  # the declaration with its properties
    declare_layer_type('props_test')  # changes nothing
    assert 'props_test' in division_layer_types()
    with pytest.raises(ValueError, match="'props_test' is declared twice, differently"):
        declare_layer_type('props_test', nearest_rounding=True)


def test_info_lists_what_each_registered_layer_converts():
    """``python -m mmseg_mesa.info`` reads the handler table: every class registered with
    ``mesa_layer`` shows under its layer type."""
    from mmseg_mesa.info import collect, converted_types
    from mmseg_mesa.registry import handled_types, layer_classes
    listed = converted_types()
    for cls in layer_classes().values():
        bases = [t for t in handled_types()
                 if getattr(_handler_convert(t), 'mesa_class', None) is cls]
        assert bases, cls.__name__
        assert all(t.__name__ in listed[cls.mesa_layer_type] for t in bases), cls.__name__
    assert 'converts (activation)' in collect()


def _handler_convert(module_type):
    from mmseg_mesa.registry import handler_for_type
    handler, _ = handler_for_type(module_type)
    return handler.convert if handler is not None else None


def test_a_type_registered_as_left_is_not_taken_by_the_generic_path(tables):
    from mmseg_mesa.registry import register_left

    class Decomposition(nn.Module):
        def forward(self, x):
            return torch.tanh(x) @ x.transpose(-1, -2)

    register_left(Decomposition, 'measured: packing it keeps more')
    model = nn.Sequential(nn.Linear(4, 4), Decomposition())
    report = convert_to_mesa(model)
    assert report.left['1'] == ('Decomposition', 'measured: packing it keeps more')
    assert '1' not in report.generic and type(model[1]) is Decomposition
