"""A real vLLM engine (the CPU build) with capture-arena's connector, driven over stdin/stdout
by test_vllm.py: each input line is a JSON list of prompts (token id lists); the answer is one
JSON line, the list of each request's ``kv_transfer_params``.

Usage: python vllm_engine.py MODEL_DIR ARENA_BYTES LAYER_IDS_JSON
"""

import json
import sys

if __name__ == "__main__":  # vLLM's worker is spawned: it imports this file as __mp_main__
    import os

    # Answers go to the original stdout; everything vLLM and its processes print, to stderr.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    import argparse

    from hs_connectors import HiddenStatesBackend
    from vllm import LLM, SamplingParams

    import capture_arena.speculators  # noqa: F401  (registers the backend)

    model, arena_bytes, layers = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    # The connector's flags come from the backend's launch hooks, as speculators' launcher takes them.
    backend = HiddenStatesBackend.registry["capture-arena"]
    parser = argparse.ArgumentParser()
    backend.add_launch_args(parser)
    kv_transfer_config = backend.build_kv_transfer_config(
        parser.parse_args(["--capture-arena-bytes", arena_bytes, "--capture-arena-store-id", "vllm-test"])
    )
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        gpu_memory_utilization=0.05,
        max_model_len=512,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers}},
        },
        kv_transfer_config=kv_transfer_config,
    )
    print(json.dumps({"ready": True}), file=answers, flush=True)
    for line in sys.stdin:
        prompts = json.loads(line)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)
        print(json.dumps([o.kv_transfer_params for o in outs]), file=answers, flush=True)
