"""``tm.explore()``: an interactive memory explorer for notebooks and Voila.

One `Explorer` object owns its controls, its callbacks and its output, and displays itself. Every
change re-estimates the step (about a millisecond) and redraws, in place, a stacked breakdown bar
against the target GPU's usable memory (with the 10–15 % headroom band) and the step's timeline
with the peak marked, plus a one-line verdict ("fits H100 SXM 80GB with 22 % to spare; largest
micro-batch 6"). An invalid combination shows its message and keeps the last good chart.

All state lives in the kernel: the chart is an ``Image`` widget's PNG bytes and the texts are
``HTML`` widget values (no ``with out:`` blocks, no ``interact``), so notebook tests, Voila and
JupyterLab see the same thing, and the callbacks run in plain Python without a kernel:

>>> import trainmem_nb as tm
>>> app = tm.explore("llama-3-8b", gpu="h100-80gb", micro_batch=1, seq_len=2048)  # doctest: +SKIP
>>> app.set(micro_batch=4)  # doctest: +SKIP
>>> app.verdict  # doctest: +SKIP
'does not fit H100 SXM 80GB: ...'
"""

from __future__ import annotations

import html
import math
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from ..errors import SpecError
from ..estimator.api import estimate
from ..estimator.result import MemoryEstimate
from ..model.families import Family
from ..model.presets import list_presets, resolve_model
from ..model.spec import ModelSpec
from ..spec.choices import (
    CHECKPOINTING_HELP,
    Attention,
    Checkpointing,
    Fp8Recipe,
    LossImpl,
    Method,
    OptimizerName,
    Precision,
)
from ..spec.stack import list_stacks, resolve_stack
from ..units import format_count
from .explorer_text import legend_html, summary_html, verdict_text

__all__ = ["Explorer", "explore"]

#: Sequence lengths offered by the slider (powers of two, 128 to 128K tokens).
SEQ_LENS: tuple[int, ...] = tuple(2**k for k in range(7, 18))
#: LoRA ranks offered.
LORA_RANKS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: GPU counts offered (powers of two up to 1024).
GPU_COUNTS: tuple[int, ...] = tuple(2**k for k in range(11))
#: Tensor / pipeline parallel degrees offered.
TP_DEGREES: tuple[int, ...] = (1, 2, 4, 8)
PP_DEGREES: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
EP_DEGREES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # expert parallelism (MoE models; DeepSeek-V3 trained with 64)
#: The model-size slider spans ~100M to ~400B parameters (log scale).
PARAMS_RANGE: tuple[float, float] = (1e8, 4e11)
#: Families `ModelSpec.from_params` can scale (llama-shaped).
SIZE_FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2")
#: Short button labels for checkpointing policies whose names do not fit a button.
CHECKPOINT_LABELS: dict[str, str] = {"selective-op": "sel. op"}
#: Engines offered (DeepSpeed first: it supports every ZeRO stage).
ENGINES: tuple[str, ...] = ("deepspeed", "fsdp", "ddp", "megatron")

#: The controls and the option each one sets (model controls are handled apart).
TRAINING_CONTROLS: tuple[str, ...] = (
    "micro_batch", "seq_len", "stack", "grad_accum", "precision", "fp8", "optimizer", "checkpointing", "attention",
    "loss_impl", "method", "lora_rank", "alloc_conf", "fp8_all_gather",
)
#: The caching allocator's settings offered (``PYTORCH_CUDA_ALLOC_CONF``): its default and expandable segments.
ALLOC_CONFS: tuple[tuple[str, str], ...] = (("default", ""), ("expandable", "expandable_segments:True"))
PARALLEL_CONTROLS: tuple[str, ...] = ("gpus", "zero", "engine", "tp", "pp", "ep")
#: The dimensions the custom model source edits.
CUSTOM_DIMS: tuple[str, ...] = ("n_layers", "hidden", "n_heads", "n_kv_heads", "ffn", "vocab")
MODEL_CONTROLS: tuple[str, ...] = (
    "source", "preset", "params", "size_family", "family", "n_layers", "hidden", "n_heads", "n_kv_heads", "ffn",
    "vocab", "upload",
)


def _gpu_names() -> list[str]:
    from ..planning.gpus import list_gpus

    return [g.name for g in list_gpus()]


class Explorer:
    """An interactive memory explorer: controls on the left, verdict and charts on the right.

    `model` is anything `tm.estimate` accepts (a preset name selects the preset; a `ModelSpec` or a
    parameter count starts in the custom-dimensions or size mode); `gpu` a catalog name
    (`trainmem_nb.planning.gpus.get_gpu`); `options` are training and parallel options (micro_batch, seq_len,
    precision, gpus, zero, …). ``controls`` maps each option to its widget; ``set(**values)`` moves
    several at once with one redraw. ``verdict`` is the verdict of the current combination ("" while it
    is invalid, when ``message`` holds its error, "" otherwise); ``estimate``, ``fit`` and
    ``last_verdict`` describe the last valid one, which the (greyed) chart keeps showing. Custom
    dimensions you type are kept through visits to other model sources, and a bad upload keeps the
    last good one.
    """

    def __init__(
        self,
        model: Any = "llama-3-8b",
        gpu: str = "h100-80gb",
        *,
        headroom: float = 0.10,
        dpi: int = 72,
        **options: Any,
    ) -> None:
        import ipywidgets as w

        from ..planning.assumptions import check_count, check_headroom
        from ..planning.gpus import get_gpu

        self.headroom = check_headroom(headroom)  # refused here: no control could clear a bad one later
        self.dpi = check_count(dpi, "dpi", 10, 600)
        self.estimate: MemoryEstimate | None = None
        self.fit: Any = None
        self.max_micro_batch: int | None = None
        self.verdict = ""
        self.last_verdict = ""
        self.message = ""
        self.redraws = 0
        self.last_refresh_s = 0.0
        self._hold = 0
        self._pending = False
        self._upload_spec: ModelSpec | None = None
        self._custom_touched = False  # the user edited the custom dimensions: never overwrite them
        self._filling = False
        self._mmb_cache: dict[Any, int] = {}
        self._figure: Any = None
        self._charts: tuple[Any, Any] | None = None

        start_gpu = get_gpu(gpu).name
        spec = resolve_model(model)
        presets = [p.name for p in list_presets()]
        source = "preset" if isinstance(model, str) and spec.name in presets else (
            "size" if isinstance(model, (int, float)) and not isinstance(model, bool) else "custom")
        t = _defaults(options)
        self._custom_base: ModelSpec | None = spec if source == "custom" else None
        self._shown_model: ModelSpec | None = None  # the model of the last chart drawn
        lo, hi = (math.log10(x) for x in PARAMS_RANGE)
        slow = {"continuous_update": False}  # each redraw costs tens of ms: redraw on release
        c: dict[str, Any] = {
            "source": w.ToggleButtons(options=[("preset", "preset"), ("size", "size"), ("custom", "custom"),
                                               ("config.json", "upload")], value=source, description="model",
                                      style={"button_width": "6.4em"}),
            "preset": w.Dropdown(options=_preset_options(), value=spec.name if source == "preset" else "llama-3-8b",
                                 description="preset"),
            "params": w.FloatLogSlider(value=min(max(float(spec.n_params), PARAMS_RANGE[0]), PARAMS_RANGE[1]),
                                       base=10, min=lo, max=hi, step=0.01, readout=False, description="size",
                                       **slow),
            "size_family": w.Dropdown(options=list(SIZE_FAMILIES), description="family",
                                      value=spec.family.value if spec.family.value in SIZE_FAMILIES else "llama"),
            "family": w.Dropdown(options=[f.value for f in Family], value=spec.family.value, description="family"),
            "n_layers": w.BoundedIntText(value=spec.n_layers, min=1, max=10_000, description="layers"),
            "hidden": w.BoundedIntText(value=spec.hidden, min=1, max=1 << 20, description="hidden"),
            "n_heads": w.BoundedIntText(value=spec.n_heads, min=1, max=1 << 20, description="heads"),
            "n_kv_heads": w.BoundedIntText(value=spec.n_kv_heads, min=1, max=1 << 20, description="kv heads"),
            "ffn": w.BoundedIntText(value=spec.ffn, min=1, max=1 << 23, description="ffn"),
            "vocab": w.BoundedIntText(value=spec.vocab, min=1, max=1 << 24, description="vocab"),
            "upload": w.FileUpload(accept=".json", multiple=False, description="config.json"),
            "micro_batch": w.IntSlider(value=t["micro_batch"], min=1, max=max(64, t["micro_batch"]),
                                       description="micro-batch", **slow),
            "seq_len": w.SelectionSlider(options=_with(SEQ_LENS, t["seq_len"]), value=t["seq_len"],
                                         description="sequence", **slow),
            "grad_accum": w.IntSlider(value=t["grad_accum"], min=1, max=max(64, t["grad_accum"]),
                                      description="grad accum", **slow),
            "stack": w.Dropdown(options=_with(tuple(list_stacks()), t["stack"] or "default"),
                                value=t["stack"] or "default", description="stack"),
            "precision": w.Dropdown(options=[p.value for p in Precision], value=t["precision"],
                                    description="precision"),
            "fp8": w.ToggleButtons(options=[x.value for x in Fp8Recipe], value=t["fp8"], description="fp8",
                                   style={"button_width": "6.5em"},
                                   tooltips=["16-bit matmuls", "torchao Float8Linear, one scale per tensor (engine "
                                             "megatron: Transformer Engine's current scaling)",
                                             "torchao Float8Linear, one scale per row",
                                             "Transformer Engine's delayed scaling (engine megatron)"]),
            "optimizer": w.Dropdown(options=[o.value for o in OptimizerName], value=t["optimizer"],
                                    description="optimizer"),
            "checkpointing": w.ToggleButtons(options=[(CHECKPOINT_LABELS.get(c.value, c.value), c.value)
                                                      for c in Checkpointing], value=t["checkpointing"],
                                             tooltips=[CHECKPOINTING_HELP[c] for c in Checkpointing],
                                             description="checkpoint", style={"button_width": "6.5em"}),
            "attention": w.ToggleButtons(options=[a.value for a in Attention], value=t["attention"],
                                         description="attention", style={"button_width": "5.5em"}),
            "loss_impl": w.ToggleButtons(options=[x.value for x in LossImpl], value=t["loss_impl"], description="loss",
                                         style={"button_width": "5.5em"},
                                         tooltips=["transformers' loss: all logits, upcast to fp32",
                                                   "torchtune's chunked loss (8 chunks)",
                                                   "Liger's fused linear cross-entropy (CUDA)",
                                                   "Apple's Cut Cross-Entropy (CUDA)"]),
            "method": w.ToggleButtons(options=[m.value for m in Method], value=t["method"], description="method",
                                      style={"button_width": "5.5em"}),
            "lora_rank": w.SelectionSlider(options=_with(LORA_RANKS, t["lora_rank"]), value=t["lora_rank"],
                                           description="LoRA rank", **slow),
            "alloc_conf": w.ToggleButtons(
                options=[*ALLOC_CONFS, *(((t["alloc_conf"], t["alloc_conf"]),)
                                         if t["alloc_conf"] not in dict(ALLOC_CONFS).values() else ())],
                value=t["alloc_conf"], description="allocator", style={"button_width": "6.5em"},
                tooltips=["PyTorch's default caching allocator", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"]),
            "fp8_all_gather": w.Checkbox(value=t["fp8_all_gather"], description="fp8 all-gather", indent=False,
                                         tooltip="FSDP2 gathers the fp8 layers' weights in fp8 (torchao)"),
            "gpus": w.SelectionSlider(options=_with(GPU_COUNTS, t["gpus"]), value=t["gpus"], description="GPUs",
                                      **slow),
            "zero": w.ToggleButtons(options=[0, 1, 2, 3], value=t["zero"], description="ZeRO",
                                    style={"button_width": "3em"}),
            "engine": w.Dropdown(options=_with(ENGINES, t["engine"]), value=t["engine"], description="engine"),
            "tp": w.Dropdown(options=_with(TP_DEGREES, t["tp"]), value=t["tp"], description="TP"),
            "pp": w.Dropdown(options=_with(PP_DEGREES, t["pp"]), value=t["pp"], description="PP"),
            "ep": w.Dropdown(options=_with(EP_DEGREES, t["ep"]), value=t["ep"], description="EP (MoE)"),
            "gpu": w.Dropdown(options=_with(tuple(_gpu_names()), start_gpu), value=start_gpu,
                              description="target GPU"),
        }
        self.controls = c
        self._size_label = w.HTML()
        self._upload_label = w.HTML("upload a Hugging Face config.json")
        # outputs: kernel-side state only
        self.verdict_html = w.HTML(layout=w.Layout(min_height="1.6em"))
        self.message_html = w.HTML(layout=w.Layout(min_height="1.4em"))
        self.summary_html = w.HTML()
        self.chart = w.Image(format="png", layout=w.Layout(width="100%", max_width="820px"))
        legend = w.HTML(legend_html())
        for widget, cls in ((self.verdict_html, "trainmem-verdict"), (self.message_html, "trainmem-message"),
                            (self.summary_html, "trainmem-summary"), (self.chart, "trainmem-chart"),
                            (c["micro_batch"], "trainmem-micro-batch"), (c["seq_len"], "trainmem-seq-len"),
                            (c["gpu"], "trainmem-gpu"), (c["params"], "trainmem-params")):
            widget.add_class(cls)
        for widget in c.values():
            widget.style.description_width = "6.5em"
        self._model_boxes = {
            "preset": w.VBox([c["preset"]]),
            "size": w.VBox([w.HBox([c["params"], self._size_label]), c["size_family"]]),
            "custom": w.VBox([c["family"], c["n_layers"], c["hidden"], c["n_heads"], c["n_kv_heads"], c["ffn"],
                              c["vocab"]]),
            "upload": w.VBox([c["upload"], self._upload_label]),
        }
        # what a workshop moves most is always in view; the rest is one tab away
        tabs = w.Tab(
            children=[
                w.VBox([c[k] for k in TRAINING_CONTROLS if k not in ("micro_batch", "seq_len", "fp8_all_gather")]),
                w.VBox([*(c[k] for k in PARALLEL_CONTROLS), c["fp8_all_gather"]]),
            ],
            titles=["Training", "Parallel"],
        )
        left = w.VBox([c["source"], *self._model_boxes.values(), c["micro_batch"], c["seq_len"], c["gpu"], tabs],
                      layout=w.Layout(width="460px", min_width="460px"))
        right = w.VBox([self.verdict_html, self.message_html, self.chart, legend, self.summary_html],
                       layout=w.Layout(flex="1 1 520px", min_width="420px"))
        # side by side on a dashboard, the charts below the controls in a narrow notebook
        self.ui = w.HBox([left, right], layout=w.Layout(width="100%", flex_flow="row wrap"))
        self.ui.add_class("trainmem-explorer")
        self._show_model_box()
        self._sync_lora()
        for widget in c.values():
            widget.observe(self._on_change, names="value")
        self.refresh()

    # -- public ------------------------------------------------------------------------------------------

    def set(self, **values: Any) -> Explorer:
        """Move several controls at once (one redraw); names are the keys of ``controls``.

        A ``model`` value selects a preset (a name), a size (a number) or custom dimensions (a spec).
        Returns the explorer, so a notebook cell can end with it.
        """
        unknown = sorted(set(values) - set(self.controls) - {"model"})
        if unknown:
            raise KeyError(f"unknown control {unknown[0]!r}; controls: {', '.join(self.controls)}")
        with self.hold():
            if "model" in values:
                self._set_model(values.pop("model"))
            if "source" in values:  # first: choosing "custom" fills the dimensions, which may follow
                self.controls["source"].value = values.pop("source")
            for name, value in values.items():
                self.controls[name].value = value
        return self

    @contextmanager
    def hold(self) -> Iterator[None]:
        """Change controls inside the block and redraw once at the end."""
        self._hold += 1
        try:
            yield
        finally:
            self._hold -= 1
            if not self._hold and self._pending:
                self.refresh()

    def model_spec(self, source: str | None = None) -> ModelSpec:
        """The model the controls describe (raises `SpecError` when they describe none); `source`
        overrides the model-source control (preset, size, custom, upload)."""
        c = self.controls
        source = source or c["source"].value
        if source == "preset":
            return resolve_model(c["preset"].value)
        if source == "size":
            return ModelSpec.from_params(c["params"].value, family=c["size_family"].value)
        if source == "custom":
            dims = {k: c[k].value for k in CUSTOM_DIMS}
            base = self._custom_base
            if base is None or base.family.value != c["family"].value:
                return resolve_model({"family": c["family"].value, "name": "custom", **dims})
            # the model shown before, with new dimensions (its ties, biases, positions... kept)
            data = base.model_dump()
            if base.head_dim * base.n_heads == base.hidden:
                data["head_dim"] = 0  # derived from hidden / n_heads again
            data.update(name="custom", **dims)
            return resolve_model(data)
        if self._upload_spec is None:
            raise SpecError("upload a Hugging Face config.json (or pick another model source)")
        return self._upload_spec

    def options(self) -> dict[str, Any]:
        """The training and parallel options the controls describe (keywords of `tm.estimate`)."""
        c = self.controls
        opts = {k: c[k].value for k in (*TRAINING_CONTROLS, *PARALLEL_CONTROLS)}
        if opts["method"] == Method.FULL.value:
            del opts["lora_rank"]
        return opts

    @property
    def gpu(self) -> Any:
        """The target GPU (`trainmem_nb.planning.gpus.GPU`)."""
        from ..planning.gpus import get_gpu

        return get_gpu(self.controls["gpu"].value)

    def refresh(self) -> None:
        """Re-estimate and redraw from the controls (the callback of every control)."""
        if self._hold:
            self._pending = True
            return
        self._pending = False
        t0 = time.perf_counter()
        try:
            model = self.model_spec()
            opts = self.options()
            est = estimate(model, **opts)
            gpu = self.gpu
            fit, mmb = self._fit(model, est, gpu, opts)
        except SpecError as exc:
            self._show_error(str(exc))
        except Exception as exc:  # never let a callback die: say what happened, keep the last chart
            self._show_error(f"unexpected {type(exc).__name__}: {exc} (please report this combination)")
        else:
            self._shown_model = model  # what a switch to the custom source starts from if its source is gone
            try:
                self._show(est, fit, mmb, gpu)
            except Exception as exc:  # a drawing failure too is a message, never a dead callback
                self._show_error(f"unexpected {type(exc).__name__}: {exc} (please report this combination)")
        self.last_refresh_s = time.perf_counter() - t0

    def _show(self, est: MemoryEstimate, fit: Any, mmb: int, gpu: Any) -> None:
        """Draw a valid combination: the chart first, then the verdict and numbers that describe it."""
        self._draw(est, gpu)
        self.estimate, self.fit, self.max_micro_batch = est, fit, mmb
        self.message = ""
        self.message_html.value = ""
        self.chart.remove_class("trainmem-stale")
        self.verdict = self.last_verdict = verdict_text(fit, mmb, est.parallel.gpus, self._mmb_limit)
        color = {"fits": "#2d7a3e", "tight": "#a86b00", "oom": "#b2182b"}.get(fit.verdict, "#333333")
        notes = "".join(f"<div style='color:#666;font-size:0.9em'>{html.escape(n)}</div>" for n in fit.notes)
        self.verdict_html.value = (f"<div style='font-size:1.15em;color:{color}'><b>"
                                   f"{html.escape(self.verdict)}</b></div>{notes}")
        self.summary_html.value = summary_html(est)

    # -- display -----------------------------------------------------------------------------------------

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        bundle = dict(self.ui._repr_mimebundle_(**kwargs) or {})
        bundle["text/plain"] = repr(self)
        return bundle

    def __repr__(self) -> str:
        try:
            name = self.model_spec().name
        except SpecError:
            name = "?"
        opts = ", ".join(f"{k}={v!r}" if isinstance(v, str) and not v else f"{k}={v}" for k, v in self.options().items())
        state = f"error: {self.message}" if self.message else self.verdict
        return f"Explorer({name}, {opts}, gpu={self.controls['gpu'].value!r}): {state}"

    # -- callbacks -----------------------------------------------------------------------------------------

    def _on_change(self, change: Mapping[str, Any]) -> None:
        try:
            self._handle(change)
        except Exception as exc:  # never let a callback die: a widget observer's exception is lost in a kernel
            self._show_error(f"unexpected {type(exc).__name__}: {exc} (please report this change)")

    def _handle(self, change: Mapping[str, Any]) -> None:
        owner = change.get("owner")
        c = self.controls
        with self.hold():  # whatever the handlers below change, redraw once
            if owner is c["source"]:
                self._show_model_box()
                if change["new"] == "custom" and not self._custom_touched:
                    self._fill_custom(change.get("old"))  # start from the model shown, until you edit it
            elif owner is c["method"]:
                self._sync_lora()
            elif owner is c["fp8"] and change["new"] != Fp8Recipe.NONE.value:
                if change["new"] == Fp8Recipe.DELAYED.value:  # Transformer Engine's recipe: Megatron's
                    c["engine"].value = "megatron"
                # fp8 is modelled over a bf16 model, or over fp32 shards FSDP2 gathers in bf16 (bf16-mixed), or
                # under Megatron over its 16-bit model (bf16-mixed: fp32 main parameters)
                mixed_ok = c["engine"].value == "megatron" or (c["engine"].value == "fsdp" and c["zero"].value >= 2)
                if not (c["precision"].value == Precision.BF16_MIXED.value and mixed_ok):
                    c["precision"].value = Precision.BF16_TRUE.value
                c["method"].value = Method.FULL.value
            elif owner is c["fp8_all_gather"] and change["new"]:  # FSDP2's, with tensorwise fp8
                c["fp8"].value = Fp8Recipe.TENSORWISE.value
                c["engine"].value = "fsdp"
                if c["zero"].value < 2:
                    c["zero"].value = 3
            elif owner is c["engine"]:  # the nearest ZeRO stage the engine has (by hand or by another control)
                zero = c["zero"].value
                if change["new"] == "fsdp" and zero < 2:
                    c["zero"].value = 3  # FSDP shards fully unless told otherwise, as in the API
                elif change["new"] == "megatron" and zero > 1:
                    c["zero"].value = 1  # its distributed optimizer shards the optimizer states only
                elif change["new"] == "ddp" and zero > 1:
                    c["zero"].value = 0  # plain PyTorch
            elif owner is c["zero"] and change["new"] > 1 and c["engine"].value == "ddp":
                c["engine"].value = "deepspeed"  # ZeRO-2/3 are DeepSpeed's (or FSDP's), as without an engine
            elif owner is c["stack"]:  # the loss control follows the stack (it passes loss_impl explicitly)
                c["loss_impl"].value = _stack_loss(str(change["new"]))
            elif owner is c["upload"]:
                self._read_upload()
            elif owner in (c["params"], c["size_family"]) and c["source"].value == "size":
                self._update_size_label()
            elif (owner in [c[k] for k in ("family", *CUSTOM_DIMS)] and not self._filling
                  and c["source"].value == "custom"):
                self._custom_touched = True  # yours now: a visit to a preset and back keeps it
            self._pending = True

    def _set_model(self, model: Any) -> None:
        c = self.controls
        if isinstance(model, str):
            c["preset"].value = resolve_model(model).name
            c["source"].value = "preset"
        elif isinstance(model, (int, float)) and not isinstance(model, bool):
            c["params"].value = float(model)
            c["source"].value = "size"
        else:
            spec = resolve_model(model)
            self._custom_touched = False
            c["source"].value = "custom"
            self._custom_base = spec
            self._filling = True
            try:
                c["family"].value = spec.family.value
                for k in CUSTOM_DIMS:
                    c[k].value = getattr(spec, k)
            finally:
                self._filling = False
            self._custom_touched = True  # the spec you gave is the custom model now

    def _fill_custom(self, old_source: Any) -> None:
        """The custom fields start from the model of the source left, or, where that source holds none (a
        config.json not uploaded yet), from the model last drawn: the fields shown are the model estimated."""
        c = self.controls
        try:
            spec = self.model_spec(old_source)
        except SpecError:
            if self._shown_model is None:
                return
            spec = self._shown_model
        with self.hold():
            self._filling = True
            try:
                self._custom_base = spec
                c["family"].value = spec.family.value
                for k in CUSTOM_DIMS:
                    c[k].value = getattr(spec, k)
            finally:
                self._filling = False

    def _show_model_box(self) -> None:
        source = self.controls["source"].value
        for key, box in self._model_boxes.items():
            box.layout.display = None if key == source else "none"
        if source == "size":
            self._update_size_label()

    def _update_size_label(self) -> None:
        try:
            m = ModelSpec.from_params(self.controls["params"].value, family=self.controls["size_family"].value)
        except SpecError as exc:
            self._size_label.value = html.escape(str(exc))
            return
        self._size_label.value = (f"{format_count(m.n_params)} parameters: {m.n_layers} layers × {m.hidden} "
                                  f"hidden")

    def _sync_lora(self) -> None:
        self.controls["lora_rank"].disabled = self.controls["method"].value == Method.FULL.value

    def _read_upload(self) -> None:
        """Read an uploaded config.json; a bad file says why and keeps the last good model."""
        from ..errors import parse_json

        files = self.controls["upload"].value
        if not files:
            return
        f = files[0]
        name = str(f.get("name", "config.json"))
        try:
            data = parse_json(bytes(f["content"]), name)
            if not isinstance(data, dict):
                raise SpecError(f"{name} must hold a JSON object, got {type(data).__name__}")
            spec = ModelSpec.from_hf_config(data, name=str(data.get("_name_or_path") or name))
        except Exception as exc:  # SpecError, and anything else a file can provoke: say it, keep the old model
            text = str(exc) if isinstance(exc, SpecError) else f"unexpected {type(exc).__name__}: {exc}"
            kept = self._upload_spec
            still = (f"; still using {kept.name} ({kept.family.value}, {format_count(kept.n_params)} parameters)"
                     if kept is not None else "")
            self._upload_label.value = html.escape(f"{name}: {text}{still}")
            return
        self._upload_spec = m = spec
        self._upload_label.value = html.escape(f"{m.name}: {m.family.value}, {format_count(m.n_params)} parameters, "
                                               f"{m.n_layers} layers × {m.hidden} hidden")
        self.controls["source"].value = "upload"

    @property
    def _mmb_limit(self) -> int:
        """How far the largest micro-batch is searched: the micro-batch slider's end."""
        return int(self.controls["micro_batch"].max)

    def _fit(self, model: ModelSpec, est: MemoryEstimate, gpu: Any, opts: dict[str, Any]) -> tuple[Any, int]:
        from ..planning.fit import fit, max_micro_batch

        f = fit(est, gpu, headroom=self.headroom)
        rest = {k: v for k, v in opts.items() if k != "micro_batch"}
        key = (model, tuple(sorted(rest.items())), gpu.name, self.headroom)
        if key not in self._mmb_cache:  # independent of the micro-batch slider: computed once per setup
            if len(self._mmb_cache) > 256:
                self._mmb_cache.clear()
            # the largest micro-batch: a screened search whose answer is confirmed with `fit` (the replay on the
            # card), so the verdict names the micro-batch that fits when the slider is set to it
            # searched up to the slider's end (a larger answer is "or more"): each micro-batch may need a program of
            # its own (Liger's chunks), and a search to 470 took 1.6 s where one to 64 takes 0.4 s
            self._mmb_cache[key] = int(max_micro_batch(model, gpu, self.headroom, limit=self._mmb_limit, **rest))
        return f, self._mmb_cache[key]

    def _show_error(self, text: str) -> None:
        """An invalid combination: its message replaces the verdict (a stale green "fits" must never read as
        current), and the last valid chart stays, greyed and labelled as such."""
        self.message = text
        self.verdict = ""
        self.verdict_html.value = ("<div style='font-size:1.15em;color:#666666'><b>no verdict: this combination is "
                                   "not valid (see below)</b></div>")
        self.chart.add_class("trainmem-stale")
        self.message_html.value = (f"<div style='color:#b2182b'>&#9888; {html.escape(text)}</div>"
                                   "<div style='color:#666;font-size:0.9em'>the chart shows the last valid "
                                   "combination</div>"
                                   if self.estimate is not None else
                                   f"<div style='color:#b2182b'>&#9888; {html.escape(text)}</div>")

    def _draw(self, est: MemoryEstimate, gpu: Any) -> None:
        from . import plots
        from .chart_parts import bytes_axis

        if self._figure is None:
            from matplotlib.figure import Figure

            fig = Figure(figsize=(8.0, 4.4))
            fig.subplots_adjust(left=0.1, right=0.98, top=0.96, bottom=0.07, hspace=0.3)
            ax_bar, ax_time = fig.subplots(2, 1, height_ratios=[1, 3.2])
            self._figure = fig
            # no title and few ticks: text is most of a redraw's cost, and the verdict is shown above
            self._charts = (plots.breakdown(est, gpu, ax=ax_bar, legend=False, title=""),
                            plots.timeline(est, gpu, ax=ax_time, legend=False, max_points=400))
            bytes_axis(ax_bar.xaxis, nbins=4)
            bytes_axis(ax_time.yaxis, nbins=4)
            ax_time.set_xlabel("")
        else:
            assert self._charts is not None
            for chart in self._charts:
                chart.update(est, gpu)
        self.chart.value = plots.to_png(self._figure, dpi=self.dpi)
        self.redraws += 1


def explore(model: Any = "llama-3-8b", gpu: str = "h100-80gb", **options: Any) -> Explorer:
    """An `Explorer` for `model` on `gpu` starting from `options`; a notebook displays it.

    >>> app = explore("mistral-7b", gpu="a100-80gb", micro_batch=2, seq_len=4096)  # doctest: +SKIP
    """
    return Explorer(model, gpu, **options)


# -- helpers -------------------------------------------------------------------------------------------------


def _defaults(options: Mapping[str, Any]) -> dict[str, Any]:
    """Start values of the training and parallel controls: the given options over the explorer's defaults."""
    from ..spec.parallel import build_parallel
    from ..spec.training import build_training

    known = set(TRAINING_CONTROLS) | set(PARALLEL_CONTROLS)
    unknown = sorted(set(options) - known)
    if unknown:
        raise SpecError(f"explore() has no control for {unknown[0]!r}; controls: {', '.join(sorted(known))}")
    t = build_training(**{k: v for k, v in options.items() if k in TRAINING_CONTROLS})
    # without an engine, build_parallel's rule: plain PyTorch (DDP beyond one GPU), DeepSpeed for ZeRO stages
    p = build_parallel(**{k: v for k, v in options.items() if k in PARALLEL_CONTROLS})
    return {
        "micro_batch": t.micro_batch, "seq_len": t.seq_len, "grad_accum": t.grad_accum,
        "precision": t.precision.value, "fp8": t.fp8.value, "fp8_all_gather": t.fp8_all_gather,
        "optimizer": t.optimizer.value, "checkpointing": t.checkpointing.value,
        "attention": t.attention.value, "loss_impl": t.loss_impl.value, "method": t.method.value, "stack": t.stack,
        "lora_rank": t.lora_rank,
        "alloc_conf": t.alloc_conf, "gpus": p.gpus, "zero": p.zero, "engine": p.engine.value, "tp": p.tp, "pp": p.pp,
        "ep": p.ep,
    }


def _stack_loss(stack: str) -> str:
    """The loss a stack runs (`loss_impl`), for the explorer's loss control."""
    applied = resolve_stack(stack).options.get("loss_impl")
    return str(applied.value) if applied is not None else LossImpl.STANDARD.value


def _preset_options() -> list[tuple[str, str]]:
    """The presets as (label, name), grouped by family in `Family` order (a dropdown has no option
    groups: each label starts with its family), in the data file's order within a family."""
    from ..model.families import Family
    from ..model.presets import get_model

    order = {f: i for i, f in enumerate(Family)}
    rows = [(order[get_model(p.name).family], i, p.name, get_model(p.name).family.value)
            for i, p in enumerate(list_presets())]
    return [(f"{family} · {name}", name) for _o, _i, name, family in sorted(rows)]


def _with(options: tuple[Any, ...], value: Any) -> list[Any]:
    """`options` with `value` added in order (a start value outside the usual choices stays selectable)."""
    return sorted({*options, value}) if all(isinstance(o, (int, float)) for o in (*options, value)) else (
        list(options) if value in options else [*options, value])
