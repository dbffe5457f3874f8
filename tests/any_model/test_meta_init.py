"""hybrid.wrap.MetaInit on small torch modules, in one process: a slice of a parameter is
what the module's own init makes of those elements (a padding row zero wherever the slice
cuts it, a truncated normal within its bounds), and an init that cannot be replayed on a
slice is refused with the parameter's name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybrid.wrap import MetaInit

CPU = torch.device("cpu")


def test_a_slice_through_an_embeddings_padding_row_has_it_zero() -> None:
    with torch.device("meta"):
        model = nn.Embedding(10, 4, padding_idx=3)  # reset_parameters: normal_, then row 3 = 0
    init = MetaInit(model, CPU)
    part = init.initial_values("weight", 10, 18)  # rows 2.5 to 4.5: cuts row 3 whole
    assert torch.equal(part[2:6], torch.zeros(4)), part
    assert bool((part[:2] != 0).all() and (part[6:] != 0).all()), part
    assert init.initial_value("weight").shape == (10, 4)


def test_a_truncated_normal_is_replayed_within_its_bounds() -> None:
    class Tokens(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cls = nn.Parameter(torch.empty(1000))

        def reset_parameters(self) -> None:
            nn.init.trunc_normal_(self.cls, std=1.0, a=-0.5, b=0.5)

    with torch.device("meta"):
        model = Tokens()
    part = MetaInit(model, CPU).initial_values("cls", 100, 600)
    assert part.numel() == 500 and part.abs().max() <= 0.5 and part.std() > 0.2


def test_an_init_that_cannot_be_drawn_a_slice_at_a_time_is_refused() -> None:
    with torch.device("meta"):
        orthogonal = nn.Linear(4, 4)
    orthogonal.reset_parameters = lambda: nn.init.orthogonal_(orthogonal.weight)  # no-op on meta
    with pytest.raises(ValueError, match="parameter weight is on the meta device"):
        MetaInit(orthogonal, CPU)

    class Reads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(8))

        def reset_parameters(self) -> None:
            self.w.normal_()
            self.w.div_(self.w.norm())  # needs every element: not elementwise

    with torch.device("meta"):
        model = Reads()
    with pytest.raises(NotImplementedError, match="the init of w on the meta device runs"):
        MetaInit(model, CPU)
