"""The model description: families, the validated `ModelSpec`, its parameter inventory, config readers and presets."""
