"""A DTensor (torch.distributed's sharded tensor) given to fusedhead.torch without a fusedhead.distributed context
that takes it as its vocabulary shard is refused with a TypeError that names the argument, its placements and what
to do, never taken as a whole tensor (its local shard would be the whole head). One process: a gloo group of one rank
on an in-memory store. (Taken as a shard: python/tests/parallel_ranks.py under torchrun.)"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
tensor_api = pytest.importorskip("torch.distributed.tensor", reason="DTensor needs torch >= 2.4")

import fusedhead.torch as ft  # noqa: E402


@pytest.fixture(scope="module")
def mesh():
    if not dist.is_available():
        pytest.skip("this torch is built without torch.distributed")
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


@pytest.mark.parametrize("placement", ["shard", "replicate"])
def test_dtensor_weight_is_refused(mesh, placement: str):
    place = tensor_api.Shard(0) if placement == "shard" else tensor_api.Replicate()
    weight = tensor_api.distribute_tensor(torch.randn(10, 4), mesh, [place])
    x, targets = torch.randn(3, 4), torch.tensor([1, 2, 3])
    with pytest.raises(TypeError, match=r"weight: a DTensor \(placements .*Shard\(0\).*fusedhead\.distributed"
                                        r".*weight\.full_tensor\(\)"):
        ft.fused_linear_cross_entropy(x, weight, targets)
    with pytest.raises(TypeError, match=r"hidden: a DTensor"):
        ft.fused_linear_logprobs(tensor_api.distribute_tensor(x, mesh, [place]), weight.full_tensor(), targets)
    # the whole tensor is taken
    loss = ft.fused_linear_cross_entropy(x, weight.full_tensor(), targets)
    assert torch.isfinite(loss)
