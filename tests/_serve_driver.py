"""Run vLLM engines on linattn exports and write the tokens they generate (tests/test_serve.py).

Run with the serving environment's python (``.venv-serve/bin/python``), which has vLLM:
``python tests/_serve_driver.py JOBS.json OUT.json``. ``JOBS.json`` is a list of engines,
each ``{"name", "model", "engine": {LLM keyword arguments}, "requests": [{"prompt_token_ids",
"max_tokens", "temperature", "seed"}]}``; the engines run one after another in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), each request list through one ``LLM.generate`` call.
``OUT.json`` maps each name to the generated token lists, in request order, or to
``{"error": text}`` when the engine failed to start or to generate.
"""

import gc
import json
import os
import sys
import traceback


def _run(job: dict):
    """The job's token lists, or ``{"error": traceback}``. The engine is released only after
    the exception is gone (its traceback holds the engine's frames), so the next engine of
    this process starts clean."""
    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm = None
    try:
        llm = LLM(model=job["model"], **job["engine"])
        prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in job["requests"]]
        params = [SamplingParams(max_tokens=r["max_tokens"], temperature=r.get("temperature", 0.0),
                                 seed=r.get("seed"), ignore_eos=True) for r in job["requests"]]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        result = [list(output.outputs[0].token_ids) for output in outputs]
    except Exception:  # the test reports it beside the engine's name
        result = {"error": traceback.format_exc()}
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()  # the next engine of this process sets its groups up again
    return result


def main() -> int:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    jobs = json.loads(open(sys.argv[1], encoding="utf-8").read())
    results = {}
    for job in jobs:
        results[job["name"]] = _run(job)
    with open(sys.argv[2], "w", encoding="utf-8") as out:
        json.dump(results, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
