"""SegFormer's head with its fusion conv a sample at a time (``MesaSegformerHead``)."""
import copy

import pytest
import torch
from mmseg.models.decode_heads.segformer_head import SegformerHead
from torch import nn

from mmseg_mesa import MesaConfig, convert_to_mesa
from mmseg_mesa.integrations.modules import MesaDecodeHead
from mmseg_mesa.integrations.segformer_head import MesaSegformerHead
from mmseg_mesa.layers import chunking, level_fusion
from mmseg_mesa.registry import handler_for_type


def head_and_inputs(size=64):
    torch.manual_seed(0)
    head = SegformerHead(in_channels=[8, 16, 32, 64], in_index=[0, 1, 2, 3], channels=16,
                         num_classes=5, dropout_ratio=0.1).train()
    inputs = [torch.randn(2, c, size >> i, size >> i, requires_grad=True)
              for i, c in enumerate([8, 16, 32, 64])]
    return head, inputs


@pytest.mark.parametrize('layers', [None, ['loss']])
def test_forward_is_bit_identical_and_the_fusion_goes_a_sample_at_a_time(monkeypatch, layers):
    """Every layer converted (the fused path, a sample at a time) or only the head (mmseg's
    concatenation): the forward is mmseg's bit for bit, gradients within the codes' error."""
    monkeypatch.setattr(chunking, 'DECODE_CHUNK_BYTES', 1024)
    reference, inputs = head_and_inputs()
    head = copy.deepcopy(reference)
    config = MesaConfig() if layers is None else MesaConfig(layers=layers)
    convert_to_mesa(nn.ModuleList([head]), config=config)
    assert isinstance(head, MesaSegformerHead)
    calls = []
    concatenated = level_fusion.concatenated
    monkeypatch.setattr(level_fusion, 'concatenated',
                        lambda *args: calls.append(args[2]) or concatenated(*args))
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    torch.manual_seed(1)  # the same Dropout2d mask in both
    got = head(xs)
    torch.manual_seed(1)
    want = reference(inputs)
    assert calls == ([slice(0, 1), slice(1, 2)] if layers is None else [])
    assert torch.equal(got, want)
    grad = torch.randn_like(got)
    got.backward(grad)
    want.backward(grad)
    for x, y in zip(xs, inputs):
        if layers is None:
            assert torch.nn.functional.cosine_similarity(
                x.grad.flatten(), y.grad.flatten(), dim=0) > 0.99
        else:
            assert torch.equal(x.grad, y.grad)


def test_saves_the_levels_codes_before_upsampling():
    """The fusion conv's input is saved as each level's codes at its own resolution: less than
    the codes of the upsampled concatenation (the mmseg head converted layer by layer)."""
    from mmseg_mesa.memory import count_saved_tensors
    reference, inputs = head_and_inputs(128)
    fused = copy.deepcopy(reference)
    convert_to_mesa(nn.ModuleList([fused]), config=MesaConfig())
    plain = copy.deepcopy(reference)
    convert_to_mesa(nn.ModuleList([plain]), config=MesaConfig(
        layers=[t for t in MesaConfig().layers if t != 'loss']))
    assert not isinstance(plain, MesaDecodeHead)
    sizes = []
    for head in (fused, plain):
        with count_saved_tensors(head) as report:
            head([x.detach().requires_grad_() for x in inputs])
        sizes.append(report.total_bytes)
    concat = 2 * 4 * 16 * 128 * 128  # one byte per value of the concatenation
    assert sizes[1] - sizes[0] >= 0.6 * concat, (sizes[1] - sizes[0]) / concat


class OwnForwardHead(SegformerHead):
    def forward(self, inputs):
        return super().forward(inputs) * 2


def test_a_subclass_with_its_own_forward_keeps_it():
    handler, reason = handler_for_type(OwnForwardHead)
    assert reason is None and handler.replaces == ('loss_by_feat',)  # BaseDecodeHead's
