"""VectorQuantizer under torch.distributed (gloo, 2 processes on this machine): the EMA
statistics are all-reduced, so every rank ends with the codebook that one process would
compute from all ranks' keys."""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from linattn import VectorQuantizer


def _keys(rank: int) -> torch.Tensor:
    return torch.randn(2, 2, 16, 4, generator=torch.Generator().manual_seed(100 + rank))


def _make() -> VectorQuantizer:
    torch.manual_seed(0)
    return VectorQuantizer(2, 4, 8, ema_decay=0.5)


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        vq = _make().train()
        vq(_keys(rank))
        vq.update()
        torch.save(vq.codebook, f"{out_dir}/codebook{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_update_all_reduces_statistics(tmp_path):
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    rank0 = torch.load(tmp_path / "codebook0.pt")
    rank1 = torch.load(tmp_path / "codebook1.pt")
    assert torch.equal(rank0, rank1)
    single = _make().train()
    single(torch.cat([_keys(0), _keys(1)], dim=0))  # one process seeing both ranks' keys
    single.update()
    torch.testing.assert_close(rank0, single.codebook, rtol=1e-6, atol=1e-6)
    alone = _make().train()
    alone(_keys(0))
    alone.update()
    assert not torch.allclose(rank0, alone.codebook)  # rank 0's own keys alone give another codebook
