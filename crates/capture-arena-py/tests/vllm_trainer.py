"""speculators' side of test_vllm.py, in a process of its own: reads requests through
capture-arena's hs_connectors backend (as speculators' dataloader does: get_generated, check,
delete) and checks every row against the hidden states the same model computes in transformers.

Commands, one JSON line each on stdin, each answered with one JSON line:
- ``{"read": kv_transfer_params, "prompt": [ids], "by_token": bool, "ready_wait_s": s}`` -> ``{"ok": true,
  "max_err": e, "s": t}`` or ``{"error": "...", "s": t}`` (``by_token``: the reference computed token by token,
  see ``reference``; ``ready_wait_s``: read through a transfer of its own whose reader waits that long for
  bytes still being written, ``SGLANG_SPEC_CAPTURE_READY_WAIT_S``; ``s``: how long the read took)
- ``{"delete": handle}`` -> ``{"ok": true}``; ``{"flush": true}`` -> ``{"ok": true}`` once every free is delivered
- ``{"speculators": base_url, "prompts": [[ids], ...], "dir": path, "fail_reads": k}`` ->
  ``{"ok": true, "read": n, "failed_reads": k, "unavailable": [reason, ...]}``: speculators' own
  trainer dataset (``speculators.train.data.ArrowDataset``, speculators 0.9.0) over a dataset of
  those prompts saved at ``path``, with this backend as its transfer: each item is generated
  through vLLM's OpenAI server by speculators' client, read with ``get_generated``, checked by
  speculators and deleted, then compared with transformers; the first ``k`` reads fail (as at a
  read deadline); an item speculators gives up on (``SampleUnavailable``) reports its reason

Usage: python vllm_trainer.py MODEL_DIR LAYER_IDS_JSON
"""

import argparse
import json
import os
import sys
import time

import torch
from transformers import LlamaForCausalLM

import capture_arena.speculators  # noqa: F401  (registers the backend)
from hs_connectors import HiddenStatesBackend

model_dir, layers = sys.argv[1], json.loads(sys.argv[2])
model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
n_layers = model.config.num_hidden_layers
backend = HiddenStatesBackend.registry["capture-arena"]
parser = argparse.ArgumentParser()
backend.add_train_args(parser)
transfer = backend.from_train_args(parser.parse_args([]), "/nonexistent")
transfer.setup()


def reference(prompt, by_token=False):
    """[n, k, H]: transformers' hidden states at the layer ids, the last layer's before the final
    norm (as vLLM captures it: the residual stream after that many decoder layers). ``by_token``:
    each token alone (a batch of n one-token sequences), for a model whose attention output is
    zero, so that row i depends on token i only (a long prompt's rows, checked cheaply)."""
    pre_norm = {}
    hook = model.model.layers[-1].register_forward_hook(lambda m, i, o: pre_norm.setdefault("h", o[0] if isinstance(o, tuple) else o))
    ids = torch.tensor(prompt).view(-1, 1) if by_token else torch.tensor([prompt])
    try:
        with torch.no_grad():
            hs = model(ids, output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    take = (lambda t: t[:, 0]) if by_token else (lambda t: t[0])
    rows = [take(pre_norm["h"]) if i == n_layers else take(hs[i]) for i in sorted(set(layers))]
    return torch.stack(rows, dim=1)


waiters = {}


def waiting(s):
    """A transfer of its own whose reader waits ``s`` seconds for bytes still being written (the
    variable is read when the reader is made), kept as a trainer keeps its transfer: one let go
    frees what it read and never deleted."""
    if s in waiters:
        return waiters[s]
    os.environ["SGLANG_SPEC_CAPTURE_READY_WAIT_S"] = str(s)
    try:
        t = backend.from_train_args(parser.parse_args([]), "/nonexistent")
        t.setup()
        waiters[s] = t
        return t
    finally:
        del os.environ["SGLANG_SPEC_CAPTURE_READY_WAIT_S"]


for line in sys.stdin:
    cmd = json.loads(line)
    t0 = time.monotonic()
    try:
        if "read" in cmd:
            got = (waiting(cmd["ready_wait_s"]) if "ready_wait_s" in cmd else transfer).get_generated(cmd["read"])
            want = reference(cmd["prompt"], by_token=cmd.get("by_token", False))
            assert got["token_ids"].dtype == torch.int64 and got["token_ids"].tolist() == cmd["prompt"], "token ids"
            assert got["hidden_states"].shape == want.shape, (tuple(got["hidden_states"].shape), tuple(want.shape))
            assert got["hidden_states"].dtype == torch.bfloat16
            err = (got["hidden_states"].float() - want.float()).abs()
            # bf16 (8 significant bits): within 2 ulps of each layer's largest value; the two
            # engines' kernels round differently. A row from another position is off by ~100 ulps.
            scale = want.float().abs().amax(dim=(0, 2), keepdim=True)
            assert bool((err <= 2 * 2.0**-7 * scale).all()), f"max err {err.max().item()} (layer scales {scale.flatten().tolist()})"
            answer = {"ok": True, "max_err": err.max().item()}
        elif "speculators" in cmd:
            from datasets import Dataset
            from speculators.train.data import ArrowDataset
            from speculators.train.recovery import SampleUnavailable

            prompts = cmd["prompts"]
            Dataset.from_dict(
                {"input_ids": prompts, "seq_len": [len(p) for p in prompts], "loss_mask": [[1] * len(p) for p in prompts]}
            ).with_format("torch").save_to_disk(cmd["dir"])
            ds = ArrowDataset(max_len=512, datapath=cmd["dir"], transfer=transfer, vllm_endpoint=cmd["speculators"], on_missing="generate")
            store, failed = transfer._store, []
            real_get = store.get

            def get(*args, **kwargs):  # the first `fail_reads` reads fail, as at a read deadline
                if len(failed) < cmd.get("fail_reads", 0):
                    failed.append(1)
                    raise TimeoutError("simulated: the read's deadline passed")
                return real_get(*args, **kwargs)

            store.get = get
            unavailable, read = [], 0
            for i, p in enumerate(prompts):
                item = ds[i]
                if isinstance(item, SampleUnavailable):  # speculators gave up after its retries
                    unavailable.append(item.reason)
                    continue
                read += 1
                want = reference(p)
                assert item["input_ids"].tolist() == p, "input ids"
                # speculators splits the captured layers: all but the last as the draft's input,
                # the last as the verifier's hidden state.
                for got, ref in ((item["hidden_states"], want[:, :-1].flatten(1)), (item["verifier_last_hidden_states"], want[:, -1])):
                    assert got.shape == ref.shape, (tuple(got.shape), tuple(ref.shape))
                    err = (got.float() - ref.float()).abs()
                    assert bool((err <= 2 * 2.0**-7 * ref.float().abs().amax()).all()), f"item {i}: max err {err.max().item()}"
            store.get = real_get
            answer = {"ok": True, "read": read, "failed_reads": len(failed), "unavailable": unavailable}
        elif "delete" in cmd:
            transfer.delete(cmd["delete"])
            answer = {"ok": True}
        elif "flush" in cmd:
            transfer.flush(10.0)
            answer = {"ok": True}
        else:
            answer = {"error": f"unknown command {cmd}"}
    except Exception as e:
        answer = {"error": f"{type(e).__name__}: {e}"}
    if "read" in cmd:
        answer["s"] = time.monotonic() - t0
    print(json.dumps(answer), flush=True)
