"""The read probe's grid-sized streaming sum (kernels/triton/bw_probe.py `stream_grid`, the projections'
`stream_grid` peer) under TRITON_INTERPRET=1: every value summed once, whatever the size against its tiles (sizes
that leave a partial tile, fewer values than one tile, more tiles than programs); bad arguments refused by name."""
import pytest
import torch

from k3lab_kernels.triton import bw_probe as bw


@pytest.mark.parametrize("n", [1, 1000, 2048 * 4 * 3 + 17, 50_000])
@pytest.mark.parametrize("config", [bw.GRID_CONFIG, (256, 2, 2, 1)])
def test_stream_grid_sums_every_value_once(n, config):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
    part = torch.full((bw.grid_programs(n, 3, config),), float("nan"))
    bw.stream_grid(x, part, config)
    assert part.numel() <= 3 * config[2] and part.numel() <= -(-n // config[0])
    assert abs(float(part.double().sum()) - float(x.double().sum())) <= 1e-5 * float(x.double().abs().sum())


def test_stream_grid_refuses_by_name():
    with pytest.raises(ValueError, match="stream_grid: x must be a contiguous 1-D bf16"):
        bw.stream_grid(torch.ones(8), torch.zeros(1))
    with pytest.raises(ValueError, match="stream_grid: part must be a non-empty fp32"):
        bw.stream_grid(torch.ones(8, dtype=torch.bfloat16), torch.zeros(0))


def test_fit_config_takes_the_largest_tile_that_divides():
    assert bw.fit_config(8 * 4096 * 3) == (8, 4096, 8)
    assert bw.fit_config(1024 * 5) == (1, 1024, 4)
    assert bw.fit_config(16 * 7) == (1, 16, 1)
    assert bw.fit_config(17) is None
