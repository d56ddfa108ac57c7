"""What is specified: the training step, the parallel layout and a GPU calibration, validated and frozen."""
