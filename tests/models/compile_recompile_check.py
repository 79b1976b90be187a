"""Run by tests/models/test_compile.py in a FRESH interpreter: a compiled MHLA transformer called twice with the
same input must not recompile (``torch._dynamo.config.error_on_recompile``).

A fresh interpreter matters: state that MHLA creates on first use (the thread-local frame list was
one) exists in a long-lived test process already, so there the bug would not show. Each case also
runs in a new thread, whose thread-local state is as fresh as the first thread's.

Usage: ``python compile_recompile_check.py CASE [CASE ...]`` with ``CASE = family:mode``, family in
dit / sana / wan, mode in all / hybrid / materialized (the bare one-liner + ``materialize_mhla``) /
checkpointed (all, then gradient checkpointing enabled; training: forward and backward). Prints one line
per case, ``CASE ok`` or ``CASE FAIL <error>``; exits 1 if any failed.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import torch
import torch._dynamo as dynamo

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/helpers*.py

import mhla_diffusers  # noqa: E402
from mhla_diffusers import MHLAProcessor  # noqa: E402


def _model_and_call(family: str):
    """``(tiny transformer, call(model) -> sample)`` of ``family``."""
    if family == "dit":
        from helpers import dit_inputs, tiny_dit

        model = tiny_dit(num_layers=2)
        latent, t, y = dit_inputs()
        return model, lambda m: m(latent, timestep=t, class_labels=y).sample
    if family == "sana":
        from helpers_sana import sana_inputs, tiny_sana

        model = tiny_sana(num_layers=2, sample_size=8)
        latent, text, timestep, mask = sana_inputs(size=8)
        return model, lambda m: m(latent, encoder_hidden_states=text, timestep=timestep, encoder_attention_mask=mask).sample
    from helpers_wan import tiny_wan, wan_inputs

    model = tiny_wan(num_layers=2)
    inputs = wan_inputs()
    return model, lambda m: m(**inputs).sample


def _install(model, mode: str) -> None:
    if mode == "materialized":  # the bare one-liner: diffusers' own calls (DiT has no set_attn_processor)
        if hasattr(model, "set_attn_processor"):
            model.set_attn_processor(MHLAProcessor())
        else:
            for attn in mhla_diffusers.attention_modules(model).values():
                attn.set_processor(MHLAProcessor())
        assert mhla_diffusers.materialize_mhla(model)
    else:
        mhla_diffusers.apply_mhla(model, layers="hybrid" if mode == "hybrid" else "all")


def run_case(case: str) -> None:
    """Compile one model (``fullgraph=True``, backend ``eager``) and call it twice; raises on a recompile."""
    family, mode = case.split(":")
    model, call = _model_and_call(family)
    _install(model, mode)
    if mode == "checkpointed":  # enabled after MHLA: the wrapper of the checkpointing function comes later
        model.train().enable_gradient_checkpointing()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    dynamo.reset()
    with dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            if mode == "checkpointed":
                call(compiled).square().mean().backward()
            else:
                with torch.no_grad():
                    call(compiled)


def main(cases: list[str]) -> int:
    failed = 0
    for case in cases:
        errors: list[BaseException] = []

        def target(case=case):
            try:
                run_case(case)
            except BaseException as error:  # reported below, one line per case
                errors.append(error)

        thread = threading.Thread(target=target)
        thread.start()
        thread.join()
        if errors:
            failed += 1
            message = " ".join(str(errors[0]).split())[:600]
            print(f"{case} FAIL {type(errors[0]).__name__}: {message}", flush=True)
        else:
            print(f"{case} ok", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
