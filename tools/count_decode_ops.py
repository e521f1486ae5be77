"""ATen operator calls per generated token of the demo-sized vq and softmax models of
``linattn bench decode`` (chained steps after a 1,000-token prompt, mean of 10), and per step of one
VQ GAU through its one-token path and through the general layer:
``python tools/count_decode_ops.py``."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from linattn import LM
from linattn.bench.decode import model_config
from linattn.nn import gau


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _count(step, state, repeats: int = 10) -> float:
    """Mean operator calls of ``state = step(state)`` over ``repeats`` chained steps (after
    one uncounted step, which moves a VQ state into its decoding buffers)."""
    state = step(state)
    with _Count() as counter:
        for _ in range(repeats):
            state = step(state)
    return counter.calls / repeats


def main() -> None:
    torch.set_num_threads(1)
    for name in ("vq", "softmax"):
        torch.manual_seed(0)
        model = LM(model_config(name)).eval()
        ids = torch.randint(0, 256, (1, 1001))
        with torch.no_grad():
            _, state, _ = model(ids[:, :-1])
            calls = _count(lambda s: model._run(ids[:, -1:], s, with_aux=False)[1], state)
            print(f"{name} model: {calls:.0f} calls per token")
            if name != "vq":
                continue
            unit, unit_state = model.layers[0].units[0], state.layers[0][0]
            x = torch.randn(1, 1, model.config.d_model)
            print(f"  one GAU, one-token path: {_count(lambda s: unit(x, s)[1], unit_state):.0f} calls")
            fast_path = gau.can_decode_token
            gau.can_decode_token = lambda *args: False  # the general layer, same no-grad eval step
            try:
                print(f"  one GAU, general layer: {_count(lambda s: unit(x, s)[1], unit_state):.0f} calls")
            finally:
                gau.can_decode_token = fast_path


if __name__ == "__main__":
    main()
