"""Packed CPU linear layers of the hf engine: same products as F.linear, never a stale weight."""

import pytest
import torch
import torch.nn.functional as F

from flashreinforce.engines.hf.packed_linear import pack_linears, packed_linear_available, refresh_packed, unpack_linears

pytestmark = pytest.mark.skipif(not packed_linear_available(torch.float32),
                                reason="this PyTorch build has no oneDNN linear ops")


def small_net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.SiLU(), torch.nn.Linear(20, 7, bias=False))


def test_packed_forward_matches_f_linear_for_any_rows_and_leaves_the_parameters_alone():
    net = small_net()
    names = [n for n, _ in net.named_parameters()]
    x = torch.randn(3, 5, 12)
    with torch.no_grad():
        want = net(x)
    assert pack_linears(net, rows_hint=4) == 2
    assert [n for n, _ in net.named_parameters()] == names and list(net.state_dict()) == names
    with torch.inference_mode():
        for rows in (1, 4, 33):
            xs = torch.randn(rows, 12)
            ref = F.linear(F.silu(F.linear(xs, net[0].weight, net[0].bias)), net[2].weight)
            torch.testing.assert_close(net(xs), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(net(x), want, rtol=1e-5, atol=1e-5)
    assert net[0]._fr_packed[2] is not None  # the packed copy exists and is used


def test_a_changed_or_replaced_weight_is_packed_again_never_used_stale():
    net = small_net()
    pack_linears(net)
    x = torch.randn(4, 12)
    with torch.inference_mode():
        net(x)
    first = net[0]._fr_packed[2]
    with torch.no_grad():  # as load_state_dict does: a copy into the parameter
        net.load_state_dict(small_net(seed=1).state_dict())
    assert refresh_packed(net) == 2 and net[0]._fr_packed[2] is not first
    assert refresh_packed(net) == 0  # nothing changed since
    with torch.inference_mode():
        torch.testing.assert_close(net(x), small_net(seed=1)(x).detach(), rtol=1e-5, atol=1e-5)
    net[2].weight = torch.nn.Parameter(torch.zeros(7, 20))  # a replaced parameter, no refresh call
    with torch.inference_mode():
        assert torch.count_nonzero(net(x)) == 0


def test_training_calls_take_f_linear_and_unpack_restores_the_module():
    net = small_net()
    pack_linears(net)
    x = torch.randn(2, 12, requires_grad=True)
    net(x).sum().backward()  # autograd on: the module's own product, with gradients
    assert x.grad is not None and net[0].weight.grad is not None
    assert unpack_linears(net) == 2 and "forward" not in vars(net[0]) and not hasattr(net[0], "_fr_packed")


def test_bf16_weights_are_packed_only_where_the_cpu_computes_them():
    net = small_net().to(torch.bfloat16)
    assert pack_linears(net) == (2 if packed_linear_available(torch.bfloat16) else 0)
    with torch.inference_mode():
        out = net(torch.randn(3, 12, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and out.shape == (3, 7)
