"""Planning on top of estimates: fit and headroom, step time, cost, the layout search, GPUs, launch files, sweeps."""
