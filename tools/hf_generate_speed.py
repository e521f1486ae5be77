"""Tokens/s of ``LM.generate`` against the Hugging Face ``generate`` of the same model (the
demo-sized vq and softmax models of ``linattn bench decode``, prompt 1024, 64 new greedy
tokens, prefill included, second of two runs): ``python tools/hf_generate_speed.py``."""

import time

import torch

import linattn.hf as H
from linattn import LM
from linattn.bench.decode import model_config


def main() -> None:
    torch.manual_seed(0)
    for name in ("vq", "softmax"):
        lm = LM(model_config(name)).eval()
        hf = H.LinattnForCausalLM.from_lm(lm).eval()
        for batch in (1, 8):
            ids = torch.randint(1, 256, (batch, 1024))
            runs = (("LM.generate", lambda: list(lm.generate(ids, 64, temperature=0))),
                    ("HF generate", lambda: hf.generate(ids, max_new_tokens=64, do_sample=False)))
            for label, run in runs:
                run()
                start = time.perf_counter()
                run()
                seconds = time.perf_counter() - start
                print(f"{name} batch {batch} {label}: {batch * 64 / seconds:.0f} tokens/s")


if __name__ == "__main__":
    main()
