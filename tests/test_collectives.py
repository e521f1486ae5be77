"""Every tensor the trainer, the evaluator and the codebooks hand to a torch.distributed
collective lives on the device the run trains on (NCCL rejects CPU tensors).

On a GPU run a tensor created without ``device=`` lands on the CPU, off the run's device. A
CPU-only test cannot see that difference, so it makes one: ``UnplacedToMeta`` sends the
tensors that the code talking to the process group (``linattn.train``, ``nn/codebook.py``,
``nn/quantizer.py``) creates without naming a device to the ``meta`` device instead of the
CPU, while the run trains on the CPU. Two ranks are simulated in one process (the other rank
mirrors this one: a sum over ranks doubles), and each collective asserts its tensor's device.
"""

from __future__ import annotations

import copy
import sys
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from linattn.models import LMConfig
from linattn.train import TrainConfig, distributed, evaluate_bpb, parallel, startup, train
from linattn.train import trainer as trainer_module
from linattn.train.distributed import Context
from _helpers import english_like, mirrored_exchange

torch.set_num_threads(1)

PLACED_MODULES = ("linattn.train", "linattn.nn.codebook", "linattn.nn.quantizer")
FACTORIES = {torch.tensor, torch.zeros, torch.ones, torch.full, torch.empty, torch.arange, torch.rand, torch.randn,
             torch.randint, torch.randperm, torch.eye, torch.linspace}


def _caller_module() -> str:
    """The module of the first frame outside torch and this file (who called the factory)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name == __name__ or name == "torch" or name.startswith("torch.")):
            return name
        frame = frame.f_back
    return ""


class UnplacedToMeta(TorchFunctionMode):
    """Factory calls from ``PLACED_MODULES`` without a device create their tensor on ``meta``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in FACTORIES and kwargs.get("device") is None and _caller_module().startswith(PLACED_MODULES):
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


class CheckedCollectives:
    """torch.distributed's collectives for a mirrored second rank, asserting each tensor's device."""

    def __init__(self, device: torch.device):
        self.device, self.calls = device, Counter()

    def _check(self, what: str, tensor: torch.Tensor) -> None:
        self.calls[(what, _caller_module())] += 1
        assert tensor.device == self.device, (f"{what} from {_caller_module()} got a tensor on {tensor.device}, "
                                              f"the run trains on {self.device}")

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        self._check("all_reduce", tensor)
        tensor.mul_(2)

    def broadcast(self, tensor, src=0, group=None, async_op=False):
        self._check("broadcast", tensor)

    def all_gather(self, tensor_list, tensor, group=None, async_op=False):
        self._check("all_gather", tensor)
        for out in tensor_list:
            out.copy_(tensor)

    def install(self, monkeypatch) -> None:
        for name in ("all_reduce", "broadcast", "all_gather"):
            monkeypatch.setattr(dist, name, getattr(self, name))
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "barrier", lambda *args, **kwargs: None)
        monkeypatch.setattr(dist, "gather_object", lambda obj, gathered=None, dst=0, group=None: gathered.__setitem__(
            slice(None), [copy.deepcopy(obj) for _ in gathered]))
        monkeypatch.setattr(dist, "all_gather_object", lambda gathered, obj, group=None: gathered.__setitem__(
            slice(None), [copy.deepcopy(obj) for _ in gathered]))


@pytest.fixture
def two_mirrored_ranks(monkeypatch):
    device = torch.device("cpu")
    collectives = CheckedCollectives(device)
    collectives.install(monkeypatch)
    monkeypatch.setattr(distributed, "setup", lambda context, name="cpu", collective_timeout=None: Context(
        rank=0, world_size=2, device=device))
    monkeypatch.setattr(startup, "exchange", mirrored_exchange)
    monkeypatch.setattr(parallel, "wrap", lambda model, strategy, context: model)
    return collectives


def test_the_policy_moves_unplaced_tensors_of_those_modules_only():
    """The fake device policy itself: code of linattn.train that creates a tensor without a
    device gets a meta tensor; with the run's device, or from another module, a CPU tensor."""
    in_train = {"__name__": "linattn.train.somewhere", "torch": torch}
    elsewhere = {"__name__": "linattn.data.somewhere", "torch": torch}
    with UnplacedToMeta():
        exec("unplaced = torch.zeros(2); placed = torch.tensor([1.0], device='cpu')", in_train)
        exec("unplaced = torch.zeros(2)", elsewhere)
        here = torch.ones(1)
    assert in_train["unplaced"].device.type == "meta" and in_train["placed"].device.type == "cpu"
    assert elsewhere["unplaced"].device.type == "cpu" and here.device.type == "cpu"


def test_training_and_evaluation_reduce_on_the_run_device(tmp_path, monkeypatch, two_mirrored_ranks):
    data = tmp_path / "corpus.txt"
    data.write_text(english_like(3000, seed=6))
    model_config = LMConfig(d_model=16, n_layers=2, attention="vq,linear:elu", n_heads=2, gau_d_k=8,
                            codebook_size=16, block_size=4, chunk_size=4, ffn_hidden=32, kmeans_init=True,
                            dead_code_threshold=1.0)
    run_config = TrainConfig(data=str(data), out=str(tmp_path / "run"), steps=2, batch_size=2, grad_accum_steps=2,
                             context=16, eval_every=2, eval_tokens=200, eval_batch_size=2, log_every=1,
                             checkpoint_every=2, threads=1)
    # the model is built before the policy applies (its buffers are made on the default device
    # and then moved, as on a GPU run)
    torch.manual_seed(run_config.seed)
    built = trainer_module.LM(model_config)
    monkeypatch.setattr(trainer_module, "LM", lambda config: copy.deepcopy(built))
    with UnplacedToMeta():
        summary = train(model_config, run_config, progress=False, echo=lambda *a: None)
    assert summary["step"] == 2 and summary["final_bpb"] is not None
    calls = two_mirrored_ranks.calls
    # each kind of call site was exercised: the loss log, the code histogram, the divergence guard,
    # the stop flag, the evaluation, the codebook EMA sums, k-means and dead-code restarts: at each
    # (logged) step the guard's verdict on the step, the code histogram, the losses, the guard's
    # check and the stop flag, and 2 evaluations (the start-up verdicts on the run folder, the
    # settings and the data go through the rendezvous store, no tensor)
    assert calls[("all_reduce", "linattn.train.distributed")] == 2 + 2 + 2 + 2 + 2 + 2
    assert calls[("all_reduce", "linattn.nn.codebook")] == 2 * 2 * 2  # 2 quantizers x 2 tensors x 2 steps
    assert calls[("broadcast", "linattn.nn.codebook")] >= 2 * 2  # k-means: values and mask per quantizer


def test_evaluate_bpb_alone_reduces_on_the_run_device(two_mirrored_ranks):
    torch.manual_seed(0)
    model = trainer_module.LM(LMConfig(d_model=16, n_layers=1, n_heads=2, attention="delta", chunk_size=4))
    tokens = torch.randint(0, 256, (120,), generator=torch.Generator().manual_seed(1))
    context = Context(rank=0, world_size=2, device=torch.device("cpu"))
    with UnplacedToMeta():
        result = evaluate_bpb(model, tokens, context=16, batch_size=2, dist_context=context)
    alone = evaluate_bpb(model, tokens[:60], context=16)  # rank 0's share: the first of the 2 streams
    assert result["tokens"] == 2 * alone["tokens"]  # the mirrored rank doubles the count...
    assert result["bpb"] == pytest.approx(alone["bpb"], rel=1e-12)  # ...and the sum: the same mean
    assert two_mirrored_ranks.calls[("all_reduce", "linattn.train.distributed")] == 1


def test_all_reduce_sum_refuses_a_tensor_off_the_run_device():
    context = Context(rank=0, world_size=2, device=torch.device("meta"))
    with pytest.raises(ValueError, match=r"all_reduce_sum: the tensor lives on cpu, but the process group reduces "
                                         r"on the run's device meta; create it with device=context.device"):
        distributed.all_reduce_sum(torch.zeros(2), context)
