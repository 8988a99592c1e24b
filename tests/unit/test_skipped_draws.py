"""`model.init.SkippedDraws`: a build on the meta device, its default-generator draws replayed, leaves torch's default
generator exactly where the same build on the CPU leaves it; draws from a generator the build gives are not replayed."""

from __future__ import annotations

import torch
from torch import nn

from megatron_ds.model.init import SkippedDraws, draw_normal, init_generator


def build() -> list[object]:
    """Initialisers that draw from the default generator (nn.Linear's kaiming and bias uniforms, a factory `rand`, a
    non-contiguous in-place draw) between ones that draw from their own generator."""
    own = draw_normal((5, 7), 0.02, init_generator(3))
    layers = [nn.Linear(7, 5), nn.Linear(5, 2, bias=False)]
    noise = torch.rand(3, 17)
    strided = torch.empty(6, 4).t().normal_(0.0, 1.0)
    return [own, *layers, noise, strided, draw_normal((2,), 1.0, init_generator(4))]


def test_replayed_draws_leave_the_default_generator_where_the_cpu_build_does() -> None:
    torch.manual_seed(11)
    build()
    on_cpu = torch.get_rng_state()
    torch.manual_seed(11)
    with torch.device("meta"), SkippedDraws() as skipped:
        built = build()
    assert all(t.is_meta for t in [built[0], built[1].weight, built[3], built[4]])
    assert torch.equal(torch.get_rng_state(), torch.Generator().manual_seed(11).get_state())  # nothing drawn yet
    # kaiming + bias of the first Linear, kaiming of the second, rand, normal_; not the two draws of own generators
    names = [func.__name__ for func, _, _ in skipped.draws]
    assert names == ["uniform_.default"] * 3 + ["rand.default", "normal_.default"]
    skipped.replay()
    assert torch.equal(torch.get_rng_state(), on_cpu)
    assert skipped.draws == []
