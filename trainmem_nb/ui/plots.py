"""Charts of training memory: what a step is made of, when it peaks, and where it stops fitting.

Every function takes ``ax=None`` (a new figure's axes when omitted, never pyplot's global state),
draws, and returns the artists it drew as a small named tuple, so tests can read bar widths and a
widget can redraw into the same axes. Nothing calls ``plt.show()``; matplotlib is imported only when
a chart is drawn. Byte axes use `trainmem_nb.units.format_bytes` (GiB = 2**30 bytes).

>>> import trainmem_nb as tm
>>> from trainmem_nb import plots
>>> est = tm.estimate("gpt2", micro_batch=4, seq_len=512)
>>> art = plots.breakdown(est)
>>> sum(bar.get_width() for bar in art.bars.values()) == est.device_total_bytes
True

A GPU is a catalog name or alias (``"H100"``, ``"a100-40gb"``: `trainmem_nb.planning.gpus.get_gpu`) or a
`trainmem_nb.planning.gpus.GPU`, your own included; its ``memory_bytes`` is the usable memory (nvidia-smi's total).
Verdicts (fits / tight / OOM) are `trainmem_nb.planning.fit.fit`'s.
"""

from .chart_parts import CATEGORY_COLORS, HEADROOM_BAND, VERDICT_COLORS, resolve_gpu, to_png
from .comparison_charts import compare, compare_gpus, fit_grid, fit_map, sweep_lines
from .plan_chart import plan_options
from .step_charts import BreakdownChart, TimelineChart, breakdown, timeline

__all__ = [
    "CATEGORY_COLORS",
    "HEADROOM_BAND",
    "VERDICT_COLORS",
    "BreakdownChart",
    "TimelineChart",
    "breakdown",
    "compare",
    "compare_gpus",
    "fit_grid",
    "fit_map",
    "plan_options",
    "resolve_gpu",
    "sweep_lines",
    "timeline",
    "to_png",
]
