"""The independent measurement harness's results (``../shared/harness``), as our specs and categories.

The harness (a separate checking tool, not part of this package) measured 46 real PyTorch steps of
GPT-2 and Llama shapes. `import_results` copies their key numbers, with provenance, into
``trainmem_nb/data/measured/harness_cases.json``; `harness_specs` maps a harness configuration onto our
`ModelSpec` / `TrainingSpec`; `compare` checks one of our measurements against a harness result.
Nothing here imports torch.

Option mapping (harness README, "Configuration"): its ``dropout`` defaults to 0; ``optim_impl``
defaults to foreach (``forloop`` is our ``for-loop``); ``precision='bf16'`` is our ``bf16-true``;
``optim='sgd'`` is SGD with momentum 0.9 (our ``sgd-momentum``); LoRA uses alpha = 2r, targets
``qv`` (gpt2: the fused ``c_attn``) or ``all`` (llama: peft's all-linear; gpt2: c_attn, c_proj, c_fc);
``--ckpt`` is full checkpointing with ``use_reentrant=False``; positions are ``max(seq_len, 1024)``.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..model.spec import ModelSpec
from ..spec.training import TrainingSpec

__all__ = [
    "DEFAULT_RESULTS",
    "HARNESS_TOP",
    "PHASES",
    "compare",
    "harness_specs",
    "import_results",
    "load_harness_cases",
]

#: Where the harness's results live beside a checkout of this repository.
DEFAULT_RESULTS = Path(__file__).resolve().parents[3] / "shared" / "harness" / "results"

#: The harness's phase names → ours.
PHASES = {"fwd": "forward", "bwd": "backward", "opt": "optimizer", "init": "init", "zero": "zero", "end": "end"}

#: The harness's categories → our top-level `TOP_KEYS` (its README, "Output").
HARNESS_TOP = {
    "param": "weights", "buffer": "weights", "grad": "gradients", "opt_state": "optimizer_states",
    "input": "activations", "act_saved": "activations", "act_weight_cast": "activations", "act_other": "activations",
    "recompute": "activations", "opt_temp": "transient", "fwd_temp": "transient", "bwd_temp": "transient",
}

_PRECISION = {"fp32": "fp32", "bf16": "bf16-true", "bf16-mixed": "bf16-mixed"}
_OPTIM = {"adamw": "adamw", "sgd": "sgd-momentum", "none": "none"}
_IMPL = {"foreach": "foreach", "forloop": "for-loop", "fused": "fused"}


def harness_specs(config: Mapping[str, Any]) -> tuple[ModelSpec, TrainingSpec, str, bool]:
    """Our ``(model, training, mode, steady_state)`` for a harness run's ``config`` block."""
    fam = config["family"]
    seq = int(config["seq_len"])
    model: dict[str, Any] = {
        "name": str(config.get("name", fam)).split("_")[0], "family": fam, "n_layers": config["n_layers"],
        "hidden": config["hidden"], "n_heads": config["n_heads"], "vocab": config["vocab"],
        "max_positions": max(seq, 1024),
    }
    tie = config.get("tie_embeddings")
    if fam == "llama":
        model.update(n_kv_heads=config.get("n_kv_heads") or config["n_heads"], ffn=config["ffn"],
                     tie_embeddings=bool(tie or False))
    elif fam == "gpt2":
        model.update(ffn=config.get("ffn") or 4 * config["hidden"], tie_embeddings=True if tie is None else bool(tie),
                     attn_dropout=0.0, hidden_dropout=0.0, embd_dropout=0.0)
    else:
        raise ValueError(f"harness family {fam!r} is not one the harness measures (llama, gpt2)")
    training: dict[str, Any] = {
        "micro_batch": config["batch"], "seq_len": seq, "precision": _PRECISION[config["precision"]],
        "optimizer": _OPTIM[config["optim"]], "optimizer_impl": _IMPL[config.get("optim_impl", "foreach")],
        "checkpointing": "full" if config.get("grad_ckpt") else "none", "attention": config.get("attn", "sdpa"),
        "dropout": float(config.get("dropout", 0.0)), "device": "cpu",
        "first_step": not config.get("prime_optimizer", True),
    }
    if config["optim"] == "none":
        training["optimizer_impl"] = None
    rank = int(config.get("lora_r") or 0)
    if rank:
        targets = config.get("lora_targets", "qv")
        if targets == "all":
            targets = "c_attn,c_proj,c_fc" if fam == "gpt2" else "all-linear"
        training.update(method="lora", lora_rank=rank, lora_alpha=2 * rank, lora_targets=targets,
                        lora_dropout=float(config.get("lora_dropout", 0.0)))
    mode = "fake" if config.get("mode") == "fake" else "cpu"
    return (ModelSpec.model_validate(model), TrainingSpec.model_validate(training), mode,
            bool(config.get("prime_optimizer", True)))


def _top(breakdown: Mapping[str, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for key, value in breakdown.items():
        top = HARNESS_TOP[key]
        out[top] = out.get(top, 0) + int(value)
    return out


def import_results(results_dir: str | Path = DEFAULT_RESULTS) -> dict[str, Any]:
    """The harness's runs as one JSON-able document: key numbers, our specs, and where they came from."""
    results = Path(results_dir)
    files = sorted(p for p in results.glob("*.json") if p.name != "crosscheck.json")
    if not files:
        raise FileNotFoundError(f"no harness results (*.json) in {results}")
    cases = []
    envs: set[tuple[tuple[str, str], ...]] = set()
    for path in files:
        data = json.loads(path.read_text())
        live, config = data["live"], data["config"]
        model, training, mode, steady = harness_specs(config)
        env = {k: str(v) for k, v in data.get("env", {}).items()}
        envs.add(tuple(sorted((k, v) for k, v in env.items() if k != "peft")))
        cases.append({
            "id": f"harness/{path.stem}",
            "source": f"shared/harness/results/{path.name}",
            "harness_config": config,
            "env": env,
            "mode": mode,
            "steady_state": steady,
            "model_spec": model.model_dump(mode="json"),
            "training": training.model_dump(mode="json"),
            "n_params": data["params"]["total"],
            "n_trainable_params": data["params"]["trainable"],
            "peak_live_bytes": live["peak"],
            "peak_cuda512_bytes": live["peak_cuda512"],
            "peak_phase": PHASES[live["peak_phase"]],
            "peak_op_module": live.get("peak_op_module", ""),
            "peak_breakdown": live["peak_breakdown"],
            "peak_cuda512_breakdown": live["peak_cuda512_breakdown"],
            "peak_cuda512_top": _top(live["peak_cuda512_breakdown"]),
            "phase_peaks_live_bytes": {PHASES[k]: v for k, v in live["phase_peaks"].items()},
            "at_step_start": live.get("at_step_start", {}),
            "activations_at_fwd_end": live.get("activations_at_fwd_end"),
            "wall_s": data.get("timing", {}).get("wall_s"),
        })
    return {
        "about": (
            "Key numbers of the independent measurement harness's runs (../shared/harness), copied with the "
            "mapping of each run's options onto trainmem_nb specs. peak_cuda512_bytes is the number to compare "
            "with peak_allocated_bytes (device='cpu' semantics). Real-tensor *_ckpt runs were measured before a "
            "harness tracker fix: their recompute/bwd_temp split is unreliable (peaks, phases, other categories "
            "are right). Regenerate: python -m trainmem_nb.measure.dataset --import-harness"
        ),
        "source": "shared/harness/results/*.json",
        "harness_versions": [dict(e) for e in sorted(envs)],
        "copied_on": datetime.date.today().isoformat(),
        "n_cases": len(cases),
        "cases": cases,
    }


def load_harness_cases(path: str | Path | None = None) -> list[dict[str, Any]]:
    """The cases of ``trainmem_nb/data/measured/harness_cases.json`` (no torch needed)."""
    from .paths import HARNESS_FILE

    file = Path(path) if path is not None else HARNESS_FILE
    return list(json.loads(file.read_text())["cases"])


def compare(measured: Mapping[str, Any], case: Mapping[str, Any]) -> dict[str, Any]:
    """Our measurement (a ``to_dict()``) against one harness case: relative errors and agreements.

    Top-level categories are compared at the peak; for checkpointed real-tensor runs measured before
    the harness's fix, activations and transient are compared as their sum (see the README caveat).
    """
    ours = int(measured["peak_allocated_bytes"])
    theirs = int(case["peak_cuda512_bytes"])
    live_ours = int(measured.get("peak_live_bytes", 0))
    cats_ours = dict(measured["breakdown_bytes"])
    cats_theirs = {k: case["peak_cuda512_top"].get(k, 0) for k in ("weights", "gradients", "optimizer_states",
                                                                   "activations", "transient")}
    split_unreliable = case["mode"] == "cpu" and case["harness_config"].get("grad_ckpt")
    if split_unreliable:
        for side in (cats_ours, cats_theirs):
            side["activations+transient"] = side.pop("activations", 0) + side.pop("transient", 0)
    cat_err = {}
    for key, value in cats_theirs.items():
        mine = int(cats_ours.get(key, 0))
        cat_err[key] = (mine - value) / value if value else (0.0 if mine == 0 else float("inf"))
    return {
        "id": case["id"],
        "peak_ours": ours,
        "peak_harness": theirs,
        "peak_rel_err": (ours - theirs) / theirs,
        "live_peak_ours": live_ours,
        "live_peak_harness": int(case["peak_live_bytes"]),
        "phase_ours": measured["peak_phase"],
        "phase_harness": case["peak_phase"],
        "category_rel_err": cat_err,
        "categories_compared_as_sum": bool(split_unreliable),
    }
